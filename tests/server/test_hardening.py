"""The server under hostile and clumsy clients (issue 49): the body-size limit (413 before the body is
read, with or without a Content-Length), the API key on every route but /health (401 before any
parsing), tokenizing off the event loop (/health answers while a large prompt tokenizes), OpenAI's
error JSON for 404 / 405, HEAD /health, max_tokens filled in to what fits (chat with n >= 3), a prompt of
exactly max_model_len tokens served as LLM.generate serves it, and a broken chat template a 400."""
from __future__ import annotations

import copy
import http.client
import json
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from kvpage import SamplingParams
from server_helpers import MODEL_NAME, make_llm, post, running_server

MAX_MODEL_LEN = 256  # the tiny Llama's max_position_embeddings


def _request(url: str, path: str, method: str = "GET", body: bytes | None = None,
             headers: dict | None = None) -> tuple[int, dict | None, dict]:
    """(status, JSON body or None, headers) of any request."""
    request = urllib.request.Request(url + path, body, {"Content-Type": "application/json", **(headers or {})},
                                     method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status, data, got = response.status, response.read(), dict(response.headers)
    except urllib.error.HTTPError as e:
        status, data, got = e.code, e.read(), dict(e.headers)
    return status, (json.loads(data) if data and got.get("content-type") == "application/json" else None), got


def _chunked_post(url: str, path: str, chunks, headers: dict | None = None) -> tuple[int, dict]:
    """A POST whose body goes out chunked (Transfer-Encoding: chunked, no Content-Length)."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        connection.request("POST", path, body=iter(chunks), headers={"Content-Type": "application/json",
                                                                     **(headers or {})}, encode_chunked=True)
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


@pytest.fixture(scope="module")
def small_llm(model, tok):
    llm = make_llm(model, tok, num_kv_blocks=40)
    yield llm
    llm.shutdown()


# -- the body-size limit ---------------------------------------------------------------------------


def test_a_body_over_the_limit_is_413_before_it_is_read(small_llm):
    with running_server(small_llm, max_request_body_bytes=100_000) as (url, _):
        big = json.dumps({"prompt": "word " * 2_000_000}).encode()  # 10 MB
        started = time.monotonic()
        status, body, _ = _request(url, "/v1/completions", "POST", big)
        assert status == 413 and body["error"]["code"] == "request_too_large", body
        assert "100000" in body["error"]["message"] and body["error"]["type"] == "invalid_request_error"
        assert time.monotonic() - started < 10  # sent and refused, never parsed or tokenized
        # Chunked (no Content-Length): counted as the bytes arrive.
        status, body = _chunked_post(url, "/v1/completions", [b'{"prompt": "', *[b"word " * 10_000] * 10, b'"}'])
        assert status == 413 and body["error"]["code"] == "request_too_large"
        # Under the limit, chunked or not, the request is served.
        small = [b'{"prompt": "Hi", ', b'"max_tokens": 2}']
        status, body = _chunked_post(url, "/v1/completions", small)
        assert status == 200 and body["usage"]["completion_tokens"] == 2
        status, body = post(url + "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        assert status == 200


def test_the_default_limit_fits_a_full_context(server, tok):
    """The default: 256 bytes per token of max_model_len, at least 1 MiB; a prompt of max_model_len
    token ids fits it by far."""
    url = server[0]
    status, body = post(url + "/v1/completions", {"prompt": [10**6] * MAX_MODEL_LEN})
    assert status == 400 and body["error"]["param"] == "prompt"  # read and parsed: refused for its ids
    status, body, _ = _request(url, "/v1/completions", "POST", b" " * ((1 << 20) + 1))
    assert status == 413


# -- the API key ---------------------------------------------------------------------------------


ROUTES = [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
          ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/metrics"), ("GET", "/docs"),
          ("GET", "/openapi.json"), ("GET", "/no-such-route")]


def test_the_api_key_guards_every_route_but_health(small_llm):
    key = {"Authorization": "Bearer sesame"}
    with running_server(small_llm, api_key="sesame") as (url, _):
        for method, path in ROUTES:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
                # Malformed JSON too: the 401 comes before any parsing.
                status, body, _ = _request(url, path, method, b'{"prompt": ' if method == "POST" else None, headers)
                assert status == 401 and body["error"]["code"] == "invalid_api_key", (method, path, headers)
        # Before reading the body: an unauthenticated 10 MB /tokenize is refused as fast as an empty one.
        status, body, _ = _request(url, "/tokenize", "POST", b"x" * 10_000_000)
        assert status == 401
        for method in ("GET", "HEAD"):
            assert _request(url, "/health", method)[0] == 200
        assert _request(url, "/metrics", headers=key)[0] == 200
        assert _request(url, "/tokenize", "POST", json.dumps({"prompt": "Hi"}).encode(), key)[0] == 200
        client = openai.OpenAI(base_url=url + "/v1", api_key="sesame", max_retries=0)
        assert client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2).usage.completion_tokens == 2
    with running_server(small_llm, api_key="sesame", metrics_without_auth=True) as (url, _):
        assert _request(url, "/metrics")[0] == 200
        assert _request(url, "/v1/models")[0] == 401


# -- OpenAI's error JSON everywhere; HEAD /health ------------------------------------------------


def test_not_found_and_wrong_method_are_openai_errors(server):
    url = server[0]
    status, body, _ = _request(url, "/v1/nothing-here")
    assert status == 404 and body["error"]["type"] == "invalid_request_error" and "/v1/nothing-here" in \
        body["error"]["message"]
    status, body, headers = _request(url, "/v1/completions")  # GET on a POST route
    assert status == 405 and "GET" in body["error"]["message"] and headers.get("allow") == "POST"
    status, body, headers = _request(url, "/health", "HEAD")
    assert status == 200 and body is None


# -- tokenizing off the event loop ---------------------------------------------------------------


class _HeldTokenizer:
    """The tokenizer, but `method` waits until released (a long prompt's tokenizing, made deterministic)."""

    def __init__(self, tok, method: str) -> None:
        self._tok, self._method = tok, method
        self.entered, self.release = threading.Event(), threading.Event()

    def __getattr__(self, name):
        real = getattr(self._tok, name)
        if name != self._method:
            return real

        def held(*args, **kwargs):
            self.entered.set()
            self.release.wait(timeout=30)
            return real(*args, **kwargs)
        return held


@pytest.mark.parametrize("method,path,body", [
    ("encode", "/v1/completions", {"prompt": "Hi", "max_tokens": 1}),
    ("apply_chat_template", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}),
    ("encode", "/tokenize", {"prompt": "Hi"}),
    ("decode", "/detokenize", {"tokens": [10, 11]}),
])
def test_health_answers_while_a_request_tokenizes(server, tok, method, path, body):
    """Tokenizing, templating and detokenizing run on the pool: while one is held (as a 10 MB prompt's
    would take seconds), /health and other requests are answered."""
    url, app = server
    ctx = app.state.ctx
    held = _HeldTokenizer(tok, method)
    ctx.tokenizer = held
    result = {}
    thread = threading.Thread(target=lambda: result.update(answer=post(url + path, body)))
    try:
        thread.start()
        assert held.entered.wait(timeout=30)
        request = urllib.request.Request(url + "/health")
        with urllib.request.urlopen(request, timeout=5) as response:  # the event loop is free
            assert response.status == 200
        status, models, _ = _request(url, "/v1/models")
        assert status == 200 and models["data"][0]["id"] == MODEL_NAME
    finally:
        held.release.set()
        thread.join(timeout=60)
        ctx.tokenizer = tok
    assert result["answer"][0] == 200, result


# -- max_tokens the client did not send ----------------------------------------------------------


def test_chat_with_n_3_and_no_max_tokens_is_filled_to_what_fits(small_llm):
    """40 blocks of 16 tokens: 3 samples of the whole 256-token context cannot all fit. The server
    fills in max_tokens so that they do (vLLM's default is the room left), rather than refusing the
    client over a max_tokens it never sent."""
    with running_server(small_llm) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        user = [{"role": "user", "content": "Hi"}]
        answer = client.chat.completions.create(model=MODEL_NAME, messages=user, n=3, temperature=1.0, seed=1,
                                                extra_body={"ignore_eos": True})
        assert len(answer.choices) == 3 and {c.finish_reason for c in answer.choices} == {"length"}
        longest = max(answer.usage.completion_tokens // 3, 1)
        assert longest < MAX_MODEL_LEN - answer.usage.prompt_tokens  # less than the room: the cache's bound
        # What the client did send is what a refusal names: n, never a max_tokens it did not send.
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=MODEL_NAME, messages=user, n=64)
        assert refused.value.body["param"] == "n" and "max_tokens" not in refused.value.body["message"]
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=MODEL_NAME, messages=user, n=3, max_tokens=200)
        assert "max_tokens=200" in refused.value.body["message"]
        # Completions: OpenAI's default of 16 is lowered for a long prompt, not refused.
        prompt = list(range(10, 10 + MAX_MODEL_LEN - 4))
        done = client.completions.create(model=MODEL_NAME, prompt=prompt, extra_body={"ignore_eos": True})
        assert done.usage.completion_tokens == 4 and done.choices[0].finish_reason == "length"


def test_a_prompt_of_exactly_max_model_len_is_served_as_llm_generate_serves_it(server, offline):
    prompt = list(range(10, 10 + MAX_MODEL_LEN))
    want = offline.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=16,
                                                                         ignore_eos=True), use_tqdm=False)[0]
    status, body = post(server[0] + "/v1/completions", {"prompt": prompt, "temperature": 0, "ignore_eos": True})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["finish_reason"] == want.outputs[0].finish_reason == "length"
    assert body["usage"]["completion_tokens"] == len(want.outputs[0].token_ids) == 1
    assert choice["text"] == want.outputs[0].text
    status, body = post(server[0] + "/v1/completions", {"prompt": prompt + [10]})
    assert status == 400 and body["error"]["param"] == "prompt"


# -- a broken chat template ----------------------------------------------------------------------


def test_a_broken_chat_template_is_a_400(server, tok):
    url, app = server
    ctx = app.state.ctx
    broken = copy.copy(tok)
    broken.chat_template = "{% for message in messages %}{{ message.content }"  # unclosed
    ctx.tokenizer = broken
    try:
        status, body = post(url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})
    finally:
        ctx.tokenizer = tok
    assert status == 400 and body["error"]["param"] == "messages" and "chat_template" in body["error"]["message"]
