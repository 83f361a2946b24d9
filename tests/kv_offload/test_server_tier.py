"""kvpage serve with a KV offload tier: usage.prompt_tokens_details.cached_tokens (non-streamed and the final
stream chunk) and kvpage:prefix_cache_hits_total count blocks loaded from the tier, the answer unchanged."""
import json
import random
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from server_helpers import MODEL_NAME, make_llm, running_server, scrape, tiny_llama, tokenizer  # noqa: E402


def _stream_usage(url: str, body: dict) -> dict:
    body = body | {"stream": True, "stream_options": {"include_usage": True}}
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    usage = None
    with urllib.request.urlopen(request, timeout=60) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
    return usage


def test_cached_tokens_count_tier_hits(tmp_path):
    from server_helpers import post

    tok = tokenizer()
    model = tiny_llama(len(tok))
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(60)] for _ in range(4)]
    # 20 blocks of 4 tokens: each prompt alone fills most of the pool, evicting the one before.
    llm = make_llm(model, tok, num_kv_blocks=20, block_size=4, swap_space_gib=0, kv_offloading_dir=str(tmp_path))
    off = make_llm(model, tok, num_kv_blocks=20, block_size=4, swap_space_gib=0)
    body = {"model": MODEL_NAME, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    # Every tier hit loaded, whatever this machine's timings say of loading vs recomputing (the test counts tokens).
    llm.llm_engine.kv_connector.recompute_seconds = None
    with running_server(llm) as (url, _):
        for p in prompts:
            post(url + "/v1/completions", body | {"prompt": p})
        llm.llm_engine.kv_connector.tier.flush()
        status, again = post(url + "/v1/completions", body | {"prompt": prompts[0]})
        assert status == 200
        # The prompt's 14 whole blocks before its last token's block come from the tier.
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 56
        streamed = _stream_usage(url + "/v1/completions", body | {"prompt": prompts[1]})
        assert streamed["prompt_tokens_details"]["cached_tokens"] == 56
        metrics = scrape(url)
        assert metrics["kvpage:prefix_cache_hits_total"] >= 112
        assert metrics["kvpage:kv_offload_hits_total"] >= 112 and metrics["kvpage:kv_offload_loads_total"] >= 28
        assert metrics["kvpage:kv_offload_stores_total"] > 0
    expected = off.generate([prompts[0]], __import__("kvpage").SamplingParams(max_tokens=4, temperature=0,
                                                                              ignore_eos=True), use_tqdm=False)
    assert again["choices"][0]["text"] == expected[0].outputs[0].text
