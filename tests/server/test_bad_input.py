"""Bad input never takes the server down: each answer is OpenAI's error JSON with the right status and
the field at fault, and a good request is served right after. Also: the API key (401), the bounded
waiting queue (503) and a failing engine step (the requests in it fail, the server goes on)."""
from __future__ import annotations

import asyncio
import json

import openai
import pytest

from server_helpers import MODEL_NAME, make_llm, post, running_server, scrape, wait_idle

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "Hi"}]

# (route, body, the field the error must name); max_position_embeddings is 256.
BAD = [
    (COMPLETIONS, b'{"model": "tiny-llama", "prompt": ', None),
    (COMPLETIONS, b'["not", "an", "object"]', None),
    (COMPLETIONS, {"prompt": "Hi", "max_tokens": "ten"}, "max_tokens"),
    (COMPLETIONS, {"prompt": "Hi", "temperature": "hot"}, "temperature"),
    (COMPLETIONS, {"prompt": "Hi", "n": True}, "n"),
    (COMPLETIONS, {"model": "gpt-9", "prompt": "Hi"}, "model"),
    (COMPLETIONS, {"prompt": "Hi", "max_tokens": -5}, "max_tokens"),
    (COMPLETIONS, {"prompt": "Hi", "max_tokens": 10**9}, "max_tokens"),
    (COMPLETIONS, {"prompt": list(range(10, 310)), "max_tokens": 1}, "prompt"),
    (COMPLETIONS, {"prompt": [10**7]}, "prompt"),
    (COMPLETIONS, {"prompt": ""}, "prompt"),
    (COMPLETIONS, {"prompt": []}, "prompt"),
    (COMPLETIONS, {"prompt": "Hi", "top_p": 0}, "top_p"),
    (COMPLETIONS, {"prompt": "Hi", "logprobs": 50}, "logprobs"),
    (COMPLETIONS, {"prompt": "Hi", "logit_bias": {"x": 1}}, "logit_bias"),
    (COMPLETIONS, {"prompt": "Hi", "use_beam_search": True}, "use_beam_search"),
    (COMPLETIONS, {"prompt": "Hi", "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "Hi"}]}, "messages.0.role"),
    (CHAT, {"messages": USER, "max_completion_tokens": 10**6}, "max_completion_tokens"),
    (CHAT, {"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens"),
    (CHAT, {"messages": USER, "top_logprobs": 2}, "top_logprobs"),
    (CHAT, {"messages": [{"role": "user", "content": "x " * 300}]}, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages.0.content"),  # a lone surrogate
    # issue 49: a lone surrogate anywhere (not UTF-8: the tokenizer's TypeError was a text/plain 500) ...
    (COMPLETIONS, {"prompt": "a\ud800b"}, "prompt"),
    (COMPLETIONS, {"prompt": ["fine", "a\udc00"]}, "prompt"),
    (COMPLETIONS, {"prompt": "Hi", "stop": ["x", "\ud800"]}, "stop"),
    (COMPLETIONS, {"prompt": "Hi", "cache_salt": "\ud800"}, "cache_salt"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
     "messages.0.content.0.text"),
    ("/tokenize", {"prompt": "a\ud800b"}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages.0.content"),
    # ... logit_bias keys in ASCII digits only (int() takes "1_0", " 7" and Arabic-Indic digits) ...
    (COMPLETIONS, {"prompt": "Hi", "logit_bias": {"1_0": 1}}, "logit_bias"),
    (COMPLETIONS, {"prompt": "Hi", "logit_bias": {"\u0663": 1}}, "logit_bias"),
    (COMPLETIONS, {"prompt": "Hi", "logit_bias": {" 7": 1}}, "logit_bias"),
    # ... a message without content, where LLM.chat refuses it too (an assistant's is taken, as OpenAI's) ...
    (CHAT, {"messages": [{"role": "user"}]}, "messages"),
    (CHAT, {"messages": [{"role": "system", "content": None}, {"role": "user", "content": "Hi"}]}, "messages"),
    # ... every allowed token banned (it emitted token 0) ...
    (COMPLETIONS, {"prompt": "Hi", "allowed_token_ids": [5], "logit_bias": {"5": -3.4e38}}, "allowed_token_ids"),
    # ... and a body FastAPI could not read (not UTF-8) in OpenAI's error JSON, not {"detail": ...}.
    (COMPLETIONS, b'{"prompt": "\xff\xfe"}', None),
]


@pytest.mark.parametrize("route,body,param", BAD, ids=[f"{i}-{p}" for i, (_, _, p) in enumerate(BAD)])
def test_bad_input_is_400_naming_the_field(server, route, body, param):
    url = server[0]
    status, answer = post(url + route, body)
    assert status == 400, answer
    error = answer["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]
    if param is not None:
        assert param.split(".")[0] in error["message"]
    assert "request '" not in error["message"] and "-0'" not in error["message"]  # no internal request ids
    status, good = post(url + COMPLETIONS, {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2})
    assert status == 200 and good["choices"][0]["finish_reason"] == "length"


@pytest.fixture(scope="module")
def small_llm(model, tok):
    llm = make_llm(model, tok, num_kv_blocks=64, max_num_seqs=1)
    yield llm
    llm.shutdown()


def test_api_key_401_without_the_right_key(small_llm):
    with running_server(small_llm, api_key="sesame") as (url, _):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            status, body = post(url + COMPLETIONS, {"prompt": "Hi", "max_tokens": 2}, headers)
            assert status == 401 and body["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=url + "/v1", api_key="sesame", max_retries=0)
        assert good.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2).usage.completion_tokens == 2


def test_full_waiting_queue_answers_503(small_llm):
    """max_num_seqs=1: one request runs, one waits, and a third finds the queue full."""
    async def main(url):
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as c:
            long = dict(model=MODEL_NAME, prompt="Hi", max_tokens=200, stream=True, extra_body={"ignore_eos": True})
            running = await c.completions.create(**long)
            await running.__anext__()  # it produced a token: it runs
            waiting = await c.completions.create(**long)  # headers back: it is queued behind
            with pytest.raises(openai.APIStatusError) as refused:
                await c.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2)
            await running.close()
            await waiting.close()
            return refused.value

    with running_server(small_llm, max_waiting_requests=1) as (url, _):
        refused = asyncio.run(main(url))
        assert refused.status_code == 503 and refused.body["code"] == "queue_full"
        wait_idle(url)  # the two closed streams' aborts
        status, good = post(url + COMPLETIONS, {"prompt": "Hi", "max_tokens": 2})
        assert status == 200 and good["usage"]["completion_tokens"] == 2


class _FailOnce:
    """The runner's execute, raising on the next call after arm()."""

    def __init__(self, execute):
        self.execute, self.armed = execute, False

    def __call__(self, scheduled):
        if self.armed:
            self.armed = False
            raise RuntimeError("injected runner failure")
        return self.execute(scheduled)


def test_failed_step_fails_its_requests_and_the_server_goes_on(small_llm):
    runner = small_llm.llm_engine.runner
    runner.execute = failing = _FailOnce(runner.execute)
    try:
        with running_server(small_llm) as (url, _):
            failing.armed = True
            status, body = post(url + COMPLETIONS, {"prompt": "Hi", "max_tokens": 4})
            assert status == 500 and "injected runner failure" in body["error"]["message"]
            failing.armed = True
            events = _sse_events(url, {"prompt": "Hi", "max_tokens": 4, "stream": True})
            assert "injected runner failure" in events[-2]["error"]["message"] and events[-1] == "[DONE]"
            status, good = post(url + COMPLETIONS, {"prompt": "Hi", "max_tokens": 4})
            assert status == 200 and good["usage"]["completion_tokens"] == 4
            metrics = scrape(url)
            assert metrics["kvpage:num_requests_running"] == 0 and metrics["kvpage:kv_cache_usage_perc"] == 0
    finally:
        del runner.execute


def test_a_failed_step_fails_only_the_requests_in_it(model, tok):
    """One sequence a step: the request that waits is not in the failing step and completes."""
    import threading

    import time

    llm = make_llm(model, tok, max_num_seqs=1)
    runner = llm.llm_engine.runner
    real = runner.execute

    def slow(batch):  # 20 ms a step: the first request cannot finish before the failure is armed
        time.sleep(0.02)
        return real(batch)

    runner.execute = failing = _FailOnce(slow)
    results = {}
    try:
        with running_server(llm) as (url, _):
            def call(name, max_tokens):
                results[name] = post(url + COMPLETIONS, {"prompt": "Hi", "max_tokens": max_tokens, "ignore_eos": True})
            first = threading.Thread(target=call, args=("first", 200))
            first.start()
            while scrape(url)["kvpage:num_requests_running"] < 1:
                pass
            second = threading.Thread(target=call, args=("second", 3))
            second.start()
            while scrape(url)["kvpage:num_requests_waiting"] < 1:
                pass
            failing.armed = True  # the next step holds the first request only
            first.join(timeout=60)
            second.join(timeout=60)
        assert results["first"][0] == 500 and "injected runner failure" in results["first"][1]["error"]["message"]
        assert results["second"][0] == 200 and results["second"][1]["usage"]["completion_tokens"] == 3
    finally:
        del runner.execute
        llm.shutdown()


def _sse_events(url: str, body: dict) -> list:
    import urllib.request
    request = urllib.request.Request(url + COMPLETIONS, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        lines = [line.decode().strip() for line in response]
    data = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


class _Slow:
    """The runner's execute, 10 ms slower a step: a long request takes seconds."""

    def __init__(self, execute):
        self.execute = execute

    def __call__(self, scheduled):
        import time
        time.sleep(0.01)
        return self.execute(scheduled)


def test_client_gone_before_a_whole_response_aborts_it(small_llm):
    runner = small_llm.llm_engine.runner
    runner.execute = _Slow(runner.execute)
    try:
        with running_server(small_llm) as (url, _):
            before = scrape(url)["kvpage:generation_tokens_total"]
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=0.5)
            with pytest.raises(openai.APITimeoutError):  # the client hangs up after 0.5 s, some 50 steps in
                client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=250,
                                          extra_body={"ignore_eos": True})
            after = wait_idle(url)
            assert after["kvpage:num_requests_running"] == 0 and after["kvpage:kv_cache_usage_perc"] == 0
            assert after["kvpage:generation_tokens_total"] - before < 200
    finally:
        del runner.execute


def test_an_unexpected_failure_is_a_500_in_openai_error_json(small_llm, monkeypatch):
    """A bug (here: the tokenizer raising something no check expects) is still answered in OpenAI's error
    JSON, not Starlette's text/plain 500."""
    with running_server(small_llm) as (url, app):
        ctx = app.state.ctx

        class _Broken:
            def __getattr__(self, name):
                raise RuntimeError("injected tokenizer bug")
        monkeypatch.setattr(ctx, "tokenizer", _Broken())
        status, body = post(url + COMPLETIONS, {"prompt": "Hi", "max_tokens": 2})
        assert status == 500 and body["error"]["code"] == "internal_error"
        assert "injected tokenizer bug" in body["error"]["message"]
        monkeypatch.undo()
        assert post(url + COMPLETIONS, {"prompt": "Hi", "max_tokens": 2})[0] == 200
