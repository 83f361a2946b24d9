"""64 concurrent streaming clients, a quarter of them hanging up midway: the others get exactly the
offline output, the abandoned requests stop costing compute, and the engine ends idle."""
from __future__ import annotations

import asyncio

import openai

from kvpage import SamplingParams
from server_helpers import MODEL_NAME, scrape, wait_idle

NUM_CLIENTS = 64
MAX_TOKENS = 16
LONG = 200  # what a client that hangs up asked for: far more than it ever reads
CHUNKS_BEFORE_HANGUP = 3


def _prompts(tok) -> list[str]:
    words = tok.decode(list(range(300, 300 + 4 * NUM_CLIENTS))).split()
    return [" ".join(words[i:i + 3 + i % 5]) or "x" for i in range(NUM_CLIENTS)]


async def _client(client, prompt: str, hang_up: bool):
    stream = await client.completions.create(model=MODEL_NAME, prompt=prompt,
                                             max_tokens=LONG if hang_up else MAX_TOKENS, temperature=0, stream=True,
                                             extra_body={"ignore_eos": True})
    text, chunks = "", 0
    async for chunk in stream:
        text += chunk.choices[0].text
        chunks += 1
        if hang_up and chunks == CHUNKS_BEFORE_HANGUP:
            await stream.close()  # closes the connection: the server sees the client go
            return None
    return text


def test_64_streams_with_a_quarter_hanging_up(server, offline, tok):
    url = server[0]
    prompts = _prompts(tok)
    hang_up = [i % 4 == 0 for i in range(NUM_CLIENTS)]
    want = offline.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                            use_tqdm=False)
    before = scrape(url)

    async def main():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(_client(c, p, h) for p, h in zip(prompts, hang_up)))

    texts = asyncio.run(main())
    for text, w, h in zip(texts, want, hang_up):
        if not h:
            assert text == w.outputs[0].text
    after = wait_idle(url)
    assert after["kvpage:num_requests_running"] == 0 and after["kvpage:num_requests_waiting"] == 0
    assert after["kvpage:kv_cache_usage_perc"] == before["kvpage:kv_cache_usage_perc"]
    delta = {name: after[name] - before[name] for name in after}
    assert delta["kvpage:prompt_tokens_total"] == sum(len(w.prompt_token_ids) for w in want)  # all were added
    finishers = NUM_CLIENTS - sum(hang_up)
    for histogram in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert delta[f"kvpage:{histogram}_count"] == finishers and delta[f"kvpage:{histogram}_sum"] > 0
    generated = delta["kvpage:generation_tokens_total"]
    # The ones that hung up were stopped long before their LONG tokens.
    assert finishers * MAX_TOKENS < generated < finishers * MAX_TOKENS + sum(hang_up) * LONG // 4
