"""A KV tier load that fails after allocation (KVLoadError: the step recovered and recomputed) counts as no tier
hit and no cache hit (recomputed tokens are not cached ones: llm.stats(), the metrics built on it and the
requests' num_cached_tokens, i.e. usage cached_tokens, agree), and a damaged file the tier cannot delete costs one
recovered step, not one per step for ever. Tokens equal the tier-off run's. Tiny random Llama of
test_engine_tier.py, through kvpage.LLM."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_engine_tier import GREEDY, PROMPTS, tokens  # noqa: E402
from test_load_errors_review import base, corrupt_payloads, engine, watch_recoveries  # noqa: E402,F401

import kvpage.kv_offload.disk_tier as disk_tier  # noqa: E402
from kvpage.kv_offload import persist_cached_blocks  # noqa: E402


def damaged_tier(base, tmp_path, prompts):
    """A fresh engine (empty pool) on a directory holding `prompts`' blocks, every payload with a flipped bit:
    each tier hit passes its match-time checks and fails its load."""
    first = engine(base, kv_offloading_dir=str(tmp_path))
    first.generate(prompts, GREEDY, use_tqdm=False)
    e = first.llm_engine
    persist_cached_blocks(e.runner, e.kv_connector, e.block_manager)
    corrupt_payloads(first)
    first.shutdown()  # its blocks are all in the tier already: nothing more written
    return engine(base, kv_offloading_dir=str(tmp_path))


def test_a_failed_load_is_no_tier_or_cache_hit(base, tmp_path):
    """One request whose every tier block fails its load: everything is recomputed, so no tier hit, no loaded
    block, no cached token (before the fix: 36 of each, the tier's 9 blocks)."""
    llm = damaged_tier(base, tmp_path, PROMPTS[:1])
    failures = watch_recoveries(llm)
    out = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    stats = llm.stats()
    assert len(failures) == 1 and failures[0]
    assert stats["kv_offload_loaded_blocks"] == llm.llm_engine.kv_connector.tier.stats.read_blocks == 0
    assert stats["kv_offload_loaded_bytes"] == 0
    assert stats["kv_offload_hit_tokens"] == 0
    assert out[0].num_cached_tokens == 0 and stats["prefix_cache_hit_tokens"] == 0
    assert tokens(out) == tokens(engine(base).generate(PROMPTS[:1], GREEDY, use_tqdm=False))


def test_a_damaged_file_the_tier_cannot_delete_does_not_stall_the_engine(base, tmp_path, monkeypatch):
    """A rejected file the tier cannot unlink (read-only directory, another user's file) is found again by the
    next lookup and passes its match-time checks: it fails its load once, is a miss from then on, and the
    request finishes with the tier-off tokens (before the fix: a recovered step every step, for ever)."""
    monkeypatch.setattr(disk_tier, "_unlink", lambda path: None)
    llm = damaged_tier(base, tmp_path, PROMPTS[:1])
    failures = watch_recoveries(llm)
    e = llm.llm_engine
    e.add_request("r", None, GREEDY, prompt_token_ids=PROMPTS[0])
    outputs, steps = [], 0
    while e.has_unfinished_requests() and steps < 200:
        outputs += [o for o in e.step() if o.finished]
        steps += 1
    assert not e.has_unfinished_requests()
    assert len(failures) == 1
    assert len(list(tmp_path.rglob("*.kvb"))) >= len(failures[0])  # still there: nothing could delete them
    assert tokens(outputs) == tokens(engine(base).generate(PROMPTS[:1], GREEDY,
                                                                                      use_tqdm=False))


def test_a_block_recomputed_after_a_failed_load_is_a_tier_hit_again(base, tmp_path):
    """Where the tier could delete the damaged file, the recomputed block is stored afresh and loads again later
    (a failed hash is a miss only until it is stored again)."""
    llm = damaged_tier(base, tmp_path, PROMPTS[:1])
    failures = watch_recoveries(llm)
    llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)  # fails once, recomputed, stored afresh (write-through)
    llm.generate(PROMPTS[1:], GREEDY, use_tqdm=False)  # the pool's LRU evicts PROMPTS[0]'s blocks
    llm.llm_engine.kv_connector.tier.flush()
    out = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    stats = llm.stats()
    assert len(failures) == 1
    assert stats["kv_offload_hit_tokens"] > 0
