"""kvpage.LLM with a KV offload tier, on a tiny random-weight Llama (tests/engine/integrity_helpers.tiny_llm):
the same tokens with the tier on (host memory, disk) as off, across eviction and reload, swap and recompute
preemption, n > 1 and beam search; loaded blocks hold exactly the bytes stored; faults through the engine
(damaged files, another model's directory, a shared directory, a restart) never change a token."""
import logging
import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from integrity_helpers import tiny_llm  # noqa: E402

import kvpage  # noqa: E402
from kvpage import SamplingParams  # noqa: E402
from kvpage.kv_offload import persist_cached_blocks  # noqa: E402

random.seed(0)
# Eight prompts of 40-75 tokens, pairs sharing a 24-token prefix; a 48-block pool of 4 tokens holds about
# two of them, so every wave evicts the earlier prompts' blocks.
_PREFIXES = [[random.randrange(100, 40000) for _ in range(24)] for _ in range(4)]
PROMPTS = [_PREFIXES[i // 2] + [random.randrange(100, 40000) for _ in range(16 + 5 * i)] for i in range(8)]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=5, ignore_eos=True)
BEAM = SamplingParams(beam_width=2, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def base():
    return tiny_llm(num_kv_blocks=48)


def engine(base, **kwargs):
    kwargs.setdefault("num_kv_blocks", 48)
    return kvpage.LLM(model=base.model, tokenizer=base.tokenizer, block_size=4, swap_space_gib=0.001,
                      max_num_batched_tokens=64, **kwargs)


def tokens(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def waves(llm, params=GREEDY, rounds=2):
    """The prompts twice (the second wave finds the first's blocks in the tier, not the pool)."""
    result = []
    for _ in range(rounds):
        result.append(tokens(llm.generate(PROMPTS, params, use_tqdm=False)))
        connector = llm.llm_engine.kv_connector
        if connector is not None:
            connector.tier.flush()
    return result


@pytest.fixture(scope="module")
def reference(base):
    """Tier off, same pool."""
    llm = engine(base)
    return {name: waves(llm, params) for name, params in (("greedy", GREEDY), ("sampled", SAMPLED), ("beam", BEAM))}


@pytest.mark.parametrize("where", ["host", "disk"])
@pytest.mark.parametrize("kind", ["greedy", "sampled", "beam"])
def test_same_tokens_with_the_tier(base, reference, tmp_path, where, kind):
    llm = engine(base, kv_offloading_size=0.05, kv_offloading_dir=str(tmp_path) if where == "disk" else None)
    params = {"greedy": GREEDY, "sampled": SAMPLED, "beam": BEAM}[kind]
    assert waves(llm, params) == reference[kind]
    stats = llm.stats()
    assert stats["kv_offload_stored_blocks"] > 0 and stats["kv_offload_loaded_blocks"] > 0
    assert stats["prefix_cache_hit_tokens"] >= stats["kv_offload_hit_tokens"] > 0


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_same_tokens_under_preemption(base, tmp_path, mode):
    """A 24-block pool runs the prompts concurrently only by preempting; with the tier the recomputed
    ones may load their evicted blocks back (never counted as cache hits)."""
    off = engine(base, num_kv_blocks=24, preemption_mode=mode)
    on = engine(base, num_kv_blocks=24, preemption_mode=mode, kv_offloading_size=0.05, kv_offloading_dir=str(tmp_path))
    assert waves(on) == waves(off)
    stats = on.stats()
    assert stats["num_preemptions"] > 0 and stats["kv_offload_loaded_blocks"] > 0


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_cache_hits_count_first_admissions_only(base, mode):
    """prefix_cache_{queried,hit}_tokens (and so the server's kvpage:prefix_cache_*_total) count each request
    once, at its first admission: what a recompute after preemption finds in the pool or the tier is no hit.
    They then agree with the requests' own num_cached_tokens (usage.prompt_tokens_details.cached_tokens)."""
    llm = engine(base, num_kv_blocks=24, preemption_mode=mode, kv_offloading_size=0.05)
    outputs = []
    for _ in range(2):
        outputs += llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    assert stats["prefix_cache_queried_tokens"] == sum(len(o.prompt_token_ids) for o in outputs)
    assert stats["prefix_cache_hit_tokens"] == sum(o.num_cached_tokens for o in outputs)
    assert stats["kv_offload_hit_tokens"] > 0


def test_loaded_blocks_hold_exactly_the_stored_bytes(base):
    llm = engine(base, kv_offloading_size=0.05)
    worker = llm.llm_engine.runner
    tier = worker.tier
    checked = []
    load = worker.wait_for_load

    def checking_load():
        pending = list(worker._pending_loads)
        load()
        got = worker.read_blocks([b for b, _ in pending])
        assert got == [p for _, p in pending]
        checked.extend(pending)

    worker.wait_for_load = checking_load
    stored = {}
    put = tier.put

    def recording_put(block_hash, key, payload):
        stored[block_hash] = bytes(payload)
        put(block_hash, key, payload)

    tier.put = recording_put
    waves(llm)
    assert checked and set(p for _, p in checked) <= set(stored.values())
    # The payload is every cache tensor's slice of the block, as laid out in the runner's cache.
    assert worker.bytes_per_block == llm.runner.kv_cache_bytes_per_block()


def test_block_bytes_the_same_through_numpy_and_torch(base):
    """Behind a CPU pool the worker moves block bytes with numpy (no torch op per block); the torch path
    (behind a device pool) lays them out identically: every cache tensor's slice of the block, in order."""
    llm = engine(base, kv_offloading_size=0.05)
    llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    worker = llm.llm_engine.runner
    ids = [3, 0, 7]
    fast = [bytes(row) for row in worker.read_blocks(ids)]
    assert fast[0] == b"".join(t[3].contiguous().view(torch.uint8).numpy().tobytes() for t in worker._tensors)
    views = worker._host_views
    assert views is not None
    worker._host_views = None  # the torch path
    assert [bytes(row) for row in worker.read_blocks(ids)] == fast
    worker.write_blocks([10, 11, 12], fast)
    worker._host_views = views
    assert [bytes(row) for row in worker.read_blocks([10, 11, 12])] == fast
    worker.write_blocks([13, 14, 15], fast[::-1])
    worker._host_views = None
    assert [bytes(row) for row in worker.read_blocks([13, 14, 15])] == fast[::-1]
    with pytest.raises(ValueError, match="payload"):
        worker.write_blocks([1], [fast[0][:-1]])


def test_restart_with_the_same_directory_starts_warm(base, reference, tmp_path):
    first = engine(base, kv_offloading_dir=str(tmp_path))
    first.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    # Nothing was evicted, yet the blocks are on disk (write-through): a process killed now still leaves them.
    first.llm_engine.kv_connector.tier.flush()
    assert len(list(tmp_path.rglob("*.kvb"))) == first.stats()["kv_offload_stored_blocks"] > 0
    first.shutdown()  # as kvpage serve does at exit; twice is harmless
    first.shutdown()
    second = engine(base, kv_offloading_dir=str(tmp_path))
    assert tokens(second.generate(PROMPTS[:2], GREEDY, use_tqdm=False)) == reference["greedy"][0][:2]
    stats = second.stats()
    # The first prompt's blocks come from the tier; the second's shared prefix is then a pool hit.
    assert stats["prefix_cache_hit_tokens"] > stats["kv_offload_hit_tokens"] > 0


def test_damaged_files_warn_and_never_change_a_token(base, reference, tmp_path, caplog):
    first = engine(base, kv_offloading_dir=str(tmp_path))
    waves(first, rounds=1)
    e = first.llm_engine
    persist_cached_blocks(e.runner, e.kv_connector, e.block_manager)
    files = sorted(tmp_path.rglob("*.kvb"))
    for i, path in enumerate(files):
        data = bytearray(path.read_bytes())
        if i % 3 == 0:
            data[-1 - i] ^= 0x10  # a flipped bit in the K/V bytes
        elif i % 3 == 1:
            data = data[: len(data) // 2]  # truncated
        path.write_bytes(bytes(data))
    second = engine(base, kv_offloading_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="kvpage"):
        assert waves(second, rounds=1) == reference["greedy"][:1]
    rejected = second.stats()["kv_offload_rejected_blocks"]
    assert rejected > 0 and len([r for r in caplog.records if "skipping" in r.getMessage()]) == rejected


def test_a_payload_failing_its_load_is_recomputed(base, reference, tmp_path, caplog):
    """A disk tier checks a block's header and key when the scheduler matches it and its payload when the step
    reads it into the cache: a flipped payload byte passes the first and fails the second. The step is then
    recovered before its forward pass (KVLoadError: its requests requeued) and the failed blocks, gone from the
    tier, are recomputed: the same greedy tokens as with the tier off."""
    llm = engine(base, kv_offloading_dir=str(tmp_path))
    waves(llm, rounds=1)
    for path in sorted(tmp_path.rglob("*.kvb"))[::2]:
        data = bytearray(path.read_bytes())
        data[-5] ^= 0x08
        path.write_bytes(bytes(data))
    e = llm.llm_engine
    # Every hit loads (no pricing against the measured load cost, which on this tiny model can decline the retry's):
    # the good blocks then load into a step that runs and are counted (a failed step's loads count nothing).
    e.kv_connector.recompute_seconds = None
    recoveries = []
    recompute = e._recompute_failed_load
    e._recompute_failed_load = lambda error: (recoveries.append(1), recompute(error))
    with caplog.at_level(logging.WARNING, logger="kvpage"):
        second = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert second == reference["greedy"][1]
    stats = llm.stats()
    assert recoveries and stats["kv_offload_rejected_blocks"] > 0
    assert len([r for r in caplog.records if "checksum" in r.getMessage()]) == stats["kv_offload_rejected_blocks"]
    assert stats["kv_offload_loaded_blocks"] > 0


def test_another_models_directory_is_never_loaded(base, reference, tmp_path):
    first = engine(base, kv_offloading_dir=str(tmp_path))
    first.generate(PROMPTS, GREEDY, use_tqdm=False)
    e = first.llm_engine
    persist_cached_blocks(e.runner, e.kv_connector, e.block_manager)
    other_model = tiny_llm(num_kv_blocks=48)  # the same architecture, other weights (another seed below)
    with torch.no_grad():
        for p in other_model.model.parameters():
            p.add_(0.01)
    other = kvpage.LLM(model=other_model.model, tokenizer=base.tokenizer, block_size=4, num_kv_blocks=48,
                       kv_offloading_dir=str(tmp_path))
    off = kvpage.LLM(model=other_model.model, tokenizer=base.tokenizer, block_size=4, num_kv_blocks=48)
    assert tokens(other.generate(PROMPTS, GREEDY, use_tqdm=False)) == tokens(off.generate(PROMPTS, GREEDY,
                                                                                          use_tqdm=False))
    assert other.stats()["kv_offload_hit_tokens"] == 0
    assert len([d for d in tmp_path.iterdir() if d.is_dir()]) == 2  # one fingerprint directory per model


def test_two_engines_sharing_a_directory(base, reference, tmp_path):
    a = engine(base, kv_offloading_dir=str(tmp_path))
    b = engine(base, kv_offloading_dir=str(tmp_path))
    assert waves(a) == reference["greedy"]
    assert waves(b) == reference["greedy"]
    assert b.stats()["kv_offload_loaded_blocks"] > 0


def test_bad_options_are_refused_by_name(base, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="kv_offloading_dir"):
        engine(base, kv_offloading_dir=str(blocker / "sub"))
    with pytest.raises(ValueError, match="kv_offloading_size"):
        engine(base, kv_offloading_size=-1)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        engine(base, kv_offloading_size=0.01, enable_prefix_caching=False)
