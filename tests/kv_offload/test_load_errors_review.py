"""Review of the disk tier's load-time payload checks (0bdf87a: KVLoadError after allocation, the step recovered
and recomputed): a disk tier's payload that passes its header and key checks at match time but fails its checksum
when read into the cache. Through kvpage.LLM on the tiny random Llama of test_engine_tier.py: the same tokens as
with the tier off, in every mode sharing the step with a failed load (n > 1, beam search, swap and recompute
preemption); after each recovery the pools are consistent and no failed block is a prefix-cache entry or held."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from integrity_helpers import tiny_llm  # noqa: E402
from test_engine_tier import BEAM, GREEDY, PROMPTS, SAMPLED, tokens  # noqa: E402

import kvpage  # noqa: E402
from kvpage.core.invariants import check_block_manager  # noqa: E402
from kvpage.kv_offload.connector_api import KVLoadError  # noqa: E402

PARAMS = {"greedy": GREEDY, "sampled": SAMPLED, "beam": BEAM}


@pytest.fixture(scope="module")
def base():
    return tiny_llm(num_kv_blocks=48)


def engine(base, **kwargs):
    kwargs.setdefault("num_kv_blocks", 48)
    llm = kvpage.LLM(model=base.model, tokenizer=base.tokenizer, block_size=4, swap_space_gib=0.001,
                     max_num_batched_tokens=64, **kwargs)
    if llm.llm_engine.kv_connector is not None:
        llm.llm_engine.kv_connector.recompute_seconds = None  # load every hit (no pricing on a loaded machine)
    return llm


def corrupt_payloads(llm) -> None:
    """A flipped bit in every block file's payload of llm's disk tier: its header and key still pass the
    match-time checks, so each tier hit fails when loaded."""
    connector = llm.llm_engine.kv_connector
    connector.tier.flush()
    for path in Path(connector.tier.directory).rglob("*.kvb"):
        data = bytearray(path.read_bytes())
        data[-3] ^= 0x04
        path.write_bytes(bytes(data))


def two_waves(llm, params) -> list:
    """The prompts twice, every payload in the tier damaged in between (with the tier off, just twice)."""
    first = tokens(llm.generate(PROMPTS, params, use_tqdm=False))
    if llm.llm_engine.kv_connector is not None:
        corrupt_payloads(llm)
    return [first, tokens(llm.generate(PROMPTS, params, use_tqdm=False))]


def watch_recoveries(llm) -> list[list[int]]:
    """Each KVLoadError's device blocks; after the engine recovered that step, the pools are checked against the
    surviving tables, and no failed block is held or a prefix-cache entry (it holds partly written bytes)."""
    e = llm.llm_engine
    worker, failures = e.runner, []
    wait_for_load, recompute = worker.wait_for_load, e._recompute_failed_load

    def recording_wait():
        try:
            wait_for_load()
        except KVLoadError as error:
            failures.append(error.block_ids)
            raise

    def checked_recompute(error):
        recompute(error)
        bm = e.scheduler.bm
        check_block_manager(bm, e.scheduler.sequences())
        for block_id in failures[-1]:
            assert bm.device.ref_counts[block_id] == 0
            assert bm.device.cache.hash_of(block_id) is None

    worker.wait_for_load, e._recompute_failed_load = recording_wait, checked_recompute
    return failures


@pytest.fixture(scope="module")
def reference(base):
    """Tier off, the same pool; per pool size and kind."""
    cache = {}

    def get(kind, **kwargs):
        key = (kind, tuple(sorted(kwargs.items())))
        if key not in cache:
            cache[key] = two_waves(engine(base, **kwargs), PARAMS[kind])
        return cache[key]

    return get


@pytest.mark.parametrize("kind", ["greedy", "sampled", "beam"])
def test_failed_loads_never_change_a_token(base, reference, tmp_path, kind):
    """n > 1 (forks sharing the prompt's blocks) and beam search, requests decoding in the step of another's
    failed load (requeued: their output kept, recomputed)."""
    llm = engine(base, kv_offloading_dir=str(tmp_path))
    failures = watch_recoveries(llm)
    assert two_waves(llm, PARAMS[kind]) == reference(kind)
    assert failures


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_failed_loads_under_preemption(base, reference, tmp_path, mode):
    """A 24-block pool: preemption (swap or recompute) in the steps around, or in, a failed load's step."""
    llm = engine(base, num_kv_blocks=24, preemption_mode=mode, kv_offloading_dir=str(tmp_path))
    failures = watch_recoveries(llm)
    assert two_waves(llm, GREEDY) == reference("greedy", num_kv_blocks=24, preemption_mode=mode)
    assert failures and llm.stats()["num_preemptions"] > 0


def test_failed_loads_with_spec_decode(base, reference, tmp_path):
    """[spec decode] n-gram proposals scheduled in a step whose load fails: the decodes are requeued with their
    proposals unverified, and the greedy tokens are the tier-off run's with the same proposer."""
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = engine(base, kv_offloading_dir=str(tmp_path), speculative_config=ngram)
    failures = watch_recoveries(llm)
    assert two_waves(llm, GREEDY) == two_waves(engine(base, speculative_config=ngram), GREEDY)
    assert failures


def test_tp2_a_failed_load_on_the_driver(tmp_path):
    """Tensor parallelism: rank 0 (the driver) loads its disk tier's payloads lazily; the other rank loads what
    its probe verified, before rank 0's load fails. Only the driver decides: the step never reaches any rank's
    forward pass, the next schedule recomputes, and the tokens are TP=2's with the tier off."""
    from hybrid_helpers import engine as hybrid_engine
    from hybrid_helpers import generate, qwen2_sliding

    model = qwen2_sliding()

    def run(llm, fn):
        try:
            return fn(llm)
        finally:
            llm.shutdown()

    expected = run(hybrid_engine(model, tensor_parallel_size=2), generate)
    run(hybrid_engine(model, tensor_parallel_size=2, kv_offloading_dir=str(tmp_path)), generate)
    llm = hybrid_engine(model, tensor_parallel_size=2, kv_offloading_dir=str(tmp_path), num_kv_blocks=256)
    tier = llm.llm_engine.kv_connector.tier
    for path in Path(tier.directory).rglob("*.kvb"):  # rank 0's files only
        data = bytearray(path.read_bytes())
        data[-3] ^= 0x04
        path.write_bytes(bytes(data))
    failures = watch_recoveries(llm)
    assert run(llm, generate) == expected
    assert failures


def test_prefix_cache_counts_each_request_once_across_failed_loads(base, tmp_path):
    """As test_engine_tier.test_cache_hits_count_first_admissions_only, with failed loads: a request requeued by
    the recovered step is re-admitted, which is no new prefix-cache query (scheduler_planner._is_first_admission),
    so queried tokens are each request's prompt once and hits agree with the requests' num_cached_tokens; the
    tier counts only what it loaded into a step that ran (OffloadingConnector.on_load_failed)."""
    llm = engine(base, kv_offloading_dir=str(tmp_path))
    failures = watch_recoveries(llm)
    outputs = list(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    corrupt_payloads(llm)
    outputs += llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    stats = llm.stats()
    assert failures
    assert stats["prefix_cache_queried_tokens"] == sum(len(o.prompt_token_ids) for o in outputs)
    assert stats["prefix_cache_hit_tokens"] == sum(o.num_cached_tokens for o in outputs)
    read = llm.llm_engine.kv_connector.tier.stats.read_blocks  # blocks whose load succeeded, in any step
    assert stats["kv_offload_loaded_blocks"] <= read and stats["kv_offload_hit_tokens"] <= read * 4  # block_size 4


def test_failed_loads_behind_a_device_pool(base, reference, tmp_path):
    """The worker's path for a pool that is not CPU memory (no host views): a DiskBlock is read whole and verified
    at load time (DiskTier.read), a failing one raising KVLoadError as load_into's does."""
    llm = engine(base, kv_offloading_dir=str(tmp_path))
    llm.llm_engine.runner._host_views = None
    read, reads = llm.llm_engine.kv_connector.tier.read, []
    llm.llm_engine.kv_connector.tier.read = lambda block: (reads.append(block), read(block))[1]
    failures = watch_recoveries(llm)
    assert two_waves(llm, GREEDY) == reference("greedy")
    assert failures and reads
