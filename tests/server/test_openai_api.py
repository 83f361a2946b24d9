"""The server through the real `openai` client, sync and async: text identical to kvpage.LLM on the
same prompts, n, logprobs against HF's own forward pass, echo, stop strings, usage, the side routes."""
from __future__ import annotations

import asyncio
import json
import urllib.request

import openai
import pytest
import torch

from kvpage import SamplingParams
from kvpage.server.serving import json_str
from server_helpers import MODEL_NAME, post, scrape

PROMPTS = ["Hello world", "The capital of France is", "Once upon a time, in a land far away,", "1 2 3 4",
           "def add(a, b):", "Water is made of"]
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
# Two fp32 forward passes (kvpage's paged one, HF's sdpa) summing in different orders.
LOGPROB_ATOL = 5e-4


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def expected(offline):
    return offline.generate(PROMPTS, GREEDY, use_tqdm=False)


def test_completions_greedy_batch_matches_llm_generate(client, expected, tok):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    assert [c.index for c in r.choices] == list(range(len(PROMPTS)))
    assert [c.text for c in r.choices] == [e.outputs[0].text for e in expected]
    assert [c.finish_reason for c in r.choices] == [e.outputs[0].finish_reason for e in expected]
    assert r.usage.prompt_tokens == sum(len(tok.encode(p)) for p in PROMPTS)
    assert r.usage.completion_tokens == sum(len(e.outputs[0].token_ids) for e in expected)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completions_streams_concurrently_match_llm_generate(server, expected):
    async def one(client, prompt):
        stream = await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True, stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        return "".join(c.choices[0].text for c in chunks if c.choices), chunks

    async def main():
        async with openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0) as client:
            return await asyncio.gather(*(one(client, p) for p in PROMPTS))

    for (text, chunks), e in zip(asyncio.run(main()), expected):
        assert text == e.outputs[0].text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == e.outputs[0].finish_reason
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(e.outputs[0].token_ids)
        assert chunks[-1].usage.prompt_tokens == len(e.prompt_token_ids)


def test_chat_matches_llm_chat_whole_and_streamed(client, server, offline):
    want = offline.chat(CHAT, GREEDY, use_tqdm=False)[0]
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.outputs[0].text
    assert r.choices[0].finish_reason == want.outputs[0].finish_reason
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)

    async def streamed():
        async with openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0) as c:
            stream = await c.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_completion_tokens=MAX_TOKENS,
                                                     temperature=0, stream=True)
            return [chunk async for chunk in stream]

    chunks = asyncio.run(streamed())
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == want.outputs[0].finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_n2_seeded_sampling_matches_llm_generate(client, offline, stream):
    prompts = PROMPTS[:2]
    want = offline.generate(prompts, SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=8), use_tqdm=False)
    r = client.completions.create(model=MODEL_NAME, prompt=prompts, n=2, temperature=1.0, seed=7, max_tokens=8,
                                  stream=stream)
    texts = {}
    for chunk in (r if stream else [r]):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {2 * i + k: want[i].outputs[k].text for i in range(2) for k in range(2)}


@torch.inference_mode()
def _hf_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """Row p: the log-distribution of token p + 1, from HF's own forward pass."""
    return model(torch.tensor([token_ids])).logits[0].float().log_softmax(-1)


def test_completion_logprobs_with_echo_match_hf(client, offline, model, tok):
    prompt, k = PROMPTS[2], 3
    want = offline.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)[0]
    ids = want.prompt_token_ids + want.outputs[0].token_ids
    logp = _hf_logprobs(model, ids)
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6, temperature=0, logprobs=k, echo=True)
    choice, lp = r.choices[0], r.choices[0].logprobs
    assert choice.text == prompt + want.outputs[0].text
    assert lp.tokens == [tok.decode([t]) for t in ids]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes the first token
    got = torch.tensor(lp.token_logprobs[1:])
    torch.testing.assert_close(got, logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])], atol=LOGPROB_ATOL,
                               rtol=0)
    for p in range(1, len(ids)):
        top = lp.top_logprobs[p]
        best = logp[p - 1].topk(k)
        assert set(top) >= {tok.decode([t]) for t in best.indices.tolist()}  # top k, plus the token itself
        assert len(top) <= k + 1 and top[lp.tokens[p]] == pytest.approx(lp.token_logprobs[p])


def test_chat_logprobs_match_hf(client, offline, model, tok):
    want = offline.chat(CHAT, SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)[0]
    ids = want.prompt_token_ids + want.outputs[0].token_ids
    logp = _hf_logprobs(model, ids)[len(want.prompt_token_ids) - 1:-1]
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == [tok.decode([t]) for t in want.outputs[0].token_ids]
    for row, c, t in zip(logp, content, want.outputs[0].token_ids):
        assert c.logprob == pytest.approx(row[t].item(), abs=LOGPROB_ATOL)
        assert c.bytes == list(c.token.encode())
        best = row.topk(2)
        assert [x.token for x in c.top_logprobs] == [tok.decode([t]) for t in best.indices.tolist()]
        assert [x.logprob for x in c.top_logprobs] == pytest.approx(best.values.tolist(), abs=LOGPROB_ATOL)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_ends_the_text_before_it(client, expected, stream):
    full = expected[3].outputs[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[3], max_tokens=MAX_TOKENS, temperature=0,
                                  stop=[stop], stream=stream)
    chunks = list(r) if stream else [r]
    assert "".join(c.choices[0].text for c in chunks) == full[:full.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_echo_streamed_starts_with_the_prompt(client, expected):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0,
                                  echo=True, stream=True)
    assert "".join(c.choices[0].text for c in r) == PROMPTS[1] + expected[1].outputs[0].text


def test_cached_tokens_count_the_prefix_cache_hit(client, server):
    prompt = list(range(1000, 1040))  # 40 tokens: a repeat reads its 2 full 16-token blocks from the cache
    first = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)
    before = scrape(server[0])
    again = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)
    after = scrape(server[0])
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 32
    assert after["kvpage:prefix_cache_hits_total"] - before["kvpage:prefix_cache_hits_total"] == 32
    assert after["kvpage:prefix_cache_queries_total"] - before["kvpage:prefix_cache_queries_total"] >= 32
    assert again.choices[0].text == first.choices[0].text


def test_models_health_tokenize_detokenize(client, server, tok):
    url = server[0]
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert urllib.request.urlopen(url + "/health").status == 200
    status, body = post(url + "/tokenize", {"prompt": PROMPTS[2]})
    assert status == 200 and body["tokens"] == tok.encode(PROMPTS[2]) and body["count"] == len(body["tokens"])
    status, body = post(url + "/detokenize", {"tokens": tok.encode(PROMPTS[2])})
    assert status == 200 and body["prompt"] == PROMPTS[2]
    status, body = post(url + "/tokenize", {"messages": CHAT})
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert status == 200 and body["tokens"] == tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": PROMPTS[2], "n": 2, "stop": ["e"]}),
    ("/v1/completions", {"prompt": PROMPTS[0], "logprobs": 2, "echo": True}),
    ("/v1/chat/completions", {"messages": CHAT, "n": 2}),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 2}),
])
def test_streamed_events_are_written_as_json_dumps_writes_them(server, path, body):
    """Streams fill their chunks into templates (serving.chunk_head / sse_chunk): every event must stay the
    bytes json.dumps writes for its object, keys in order, as before the templates."""
    request = urllib.request.Request(server[0] + path, json.dumps(
        {"model": MODEL_NAME, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
         "stream_options": {"include_usage": True}, **body}).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    payloads = [e.removeprefix("data: ") for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-2]) and len(payloads) > 2
    for payload in payloads:
        assert json.dumps(json.loads(payload)) == payload
    assert json.loads(payloads[-1])["usage"]["completion_tokens"] > 0


def test_json_str_is_json_dumps_of_a_str():
    for text in ["", "plain", 'quote " backslash \\ slash /', "\n\t\r\x00\x1f\x7f", "é€😀", "\u2028\u2029", None]:
        assert json_str(text) == json.dumps(text)
