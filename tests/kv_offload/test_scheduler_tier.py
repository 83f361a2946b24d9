"""The scheduler with a KV offload tier, on the fake runner (tests/core/fake_runner.py): its cache holds one
token id per slot, so a block stored into the tier and loaded back must hold exactly the tokens the
scheduler thinks, or the context read back (checked every step) disagrees.

Hypothesis: random workloads (shared prefixes, n > 1, both preemption modes, failed steps) through a small
pool and a small host tier give every request the output an unpressured run gives, with the pool's
invariants every step and the tier's: each stored block's bytes are its key's tokens, a block is evicted
from the pool only once no sequence holds it, one entry per hash, byte accounting exact.
"""
import os
import sys
from array import array
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))
from fake_runner import (LAYOUTS, Arrival, FakeRunner, StepFailed, all_seqs, assert_pool_whole, drive,  # noqa: E402
                         expected_outputs)

from kvpage.core import NULL_BLOCK, BlockManager, RequestStatus, Scheduler, kv_cache_layout  # noqa: E402
from kvpage.core.block_moves import live_blocks  # noqa: E402
from kvpage.kv_offload import HostMemoryTier, OffloadingConnector  # noqa: E402

_EXAMPLES = {"ci": 40, "deep": 2000}.get(os.environ.get("KVPAGE_HYPOTHESIS_PROFILE", "ci"), 40)
PREFIXES = ([], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9], [5] * 24, [3, 1] * 10)


def encode(tokens) -> bytes:
    return array("q", [-1 if t is None else t for t in tokens]).tobytes()


def decode(payload: bytes) -> list:
    return [None if t == -1 else t for t in array("q", payload)]


class TierFakeRunner(FakeRunner):
    """The fake runner plus the worker side of the seam: stores read the evicted blocks before anything
    else this step writes, loads write the tier's bytes into their fresh blocks."""

    def __init__(self, scheduler: Scheduler, tier, fail_steps=()) -> None:
        super().__init__(scheduler.bm.block_size, scheduler.bm.sliding_windows)
        self.scheduler, self.tier, self.fail_steps = scheduler, tier, set(fail_steps)
        self.num_loads = 0
        scheduler.fake_runner = self

    def save(self, stores):
        for block_hash, key, block_id in stores:
            # A partial last block (its key holds fewer tokens) keeps only those tokens, as the worker zeroes the rest.
            n = len(key.token_bytes) // 8
            contents = self._block(self.device, block_id)[:n] + [None] * (self.block_size - n)
            assert encode(contents[:n]) == key.token_bytes, "a stored block's bytes are not its key's tokens"
            self.tier.put(block_hash, key, encode(contents))

    def execute(self, out, expected_tokens=None):
        meta = out.kv_connector_meta
        if meta is not None:
            self.save(meta.stores)
            for block_id, payload in meta.loads:
                self.device[block_id] = decode(payload)
                self.num_loads += 1
        if out.step in self.fail_steps:
            raise StepFailed()
        return super().execute(out, expected_tokens)


def tiered_scheduler(num_blocks, block_size, num_host_blocks, tier_blocks, write_through=False, layout=None,
                     **kwargs):
    bm = BlockManager(num_blocks, block_size, num_host_blocks, True, 0.0, kv_cache_layout=layout)
    s = Scheduler(bm, **kwargs)
    tier = HostMemoryTier(tier_blocks * block_size * 8)
    connector = OffloadingConnector(tier, block_size, sliding_windows=bm.sliding_windows)
    s.kv_connector = connector
    if write_through:  # the runner made below saves the blocks each step filled
        connector.save_now = lambda stores: s.fake_runner.save(stores)

    def on_evict(block_hash, key, block_id):
        # Nothing is evicted from the pool while a sequence holds it.
        assert bm.device.ref_counts[block_id] == 0
        assert all(block_id not in live_blocks(seq) for seq in all_seqs(s) if not seq.swapped)
        connector.on_evict(block_hash, key, block_id)

    bm.device.cache.on_evict = on_evict
    return s, tier, connector


def check_tier(tier: HostMemoryTier, block_size: int) -> None:
    entries = tier.entries()
    assert len({h for h, _, _ in entries}) == len(entries) == len(tier)  # one entry per hash
    assert tier.used_bytes == sum(len(p) for _, _, p in entries) <= tier.capacity_bytes
    for block_hash, key, payload in entries:
        n = len(key.token_bytes) // 8  # fewer than block_size: a partial last block (the rest unwritten)
        assert key.digest() == block_hash and payload == key.token_bytes + encode([None] * (block_size - n))


arrival = st.builds(lambda step, prefix, suffix, max_tokens, n: (step, prefix + suffix, max_tokens, n),
                    st.integers(0, 30), st.sampled_from(PREFIXES), st.lists(st.integers(1, 9), max_size=20),
                    st.integers(1, 16), st.sampled_from([1, 1, 1, 2]))


@settings(max_examples=_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arrivals=st.lists(arrival, min_size=1, max_size=12), block_size=st.sampled_from([1, 2, 4]),
       num_blocks=st.integers(24, 60), num_host_blocks=st.integers(0, 30), tier_blocks=st.integers(1, 64),
       max_num_batched_tokens=st.integers(4, 48), mode=st.sampled_from([None, "swap", "recompute"]),
       fail_steps=st.sets(st.integers(0, 60), max_size=3), write_through=st.booleans(),
       layout=st.sampled_from(LAYOUTS))
def test_random_workloads_through_a_tier(arrivals, block_size, num_blocks, num_host_blocks, tier_blocks,
                                         max_num_batched_tokens, mode, fail_steps, write_through, layout):
    """Every layout of the scheduler tests (hybrid ones too: the fake runner checks each window group reads
    exactly its window's tokens, so a loaded block in the wrong place, or a window block left unloaded, fails)."""
    # Each prompt comes twice, the second time late, so its blocks were likely evicted to the tier meanwhile.
    arrivals = arrivals + [(step + 40, prompt, max_tokens, n) for step, prompt, max_tokens, n in arrivals]
    arrivals = [Arrival(step, f"r{i}", [p % 10 for p in prompt] or [1], max_tokens, n)
                for i, (step, prompt, max_tokens, n) in enumerate(arrivals)]
    s, tier, connector = tiered_scheduler(num_blocks, block_size, num_host_blocks, tier_blocks, write_through,
                                          layout, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=8,
                                          preemption_mode=mode)
    drive_and_check(s, tier, connector, arrivals, fail_steps)


def drive_and_check(s: Scheduler, tier, connector, arrivals: list[Arrival], fail_steps) -> None:
    """Run the arrivals through s on a TierFakeRunner (failing fail_steps): every request that was not rejected
    has its expected output, the tier and the pool are consistent, and every matched load was carried out."""
    runner = TierFakeRunner(s, tier, fail_steps)
    result = drive(s, arrivals, max_steps=20_000, allow_rejects=True, runner=runner)
    for a in arrivals:
        if a.request_id not in result.rejected:
            assert result.statuses[a.request_id] is RequestStatus.FINISHED_STOPPED or result.outputs[a.request_id]
            assert result.outputs[a.request_id] == expected_outputs(a.prompt, a.max_tokens, a.n)
    check_tier(tier, s.bm.block_size)
    assert_pool_whole(s.bm)
    assert connector.loaded_blocks == runner.num_loads or fail_steps


def test_evicted_prompt_is_loaded_from_the_tier_not_recomputed():
    """A prompt whose blocks the pool evicted comes back: its blocks load from the tier (the prompt's
    last block still runs, for its logits), the hit counts once, and the output is unchanged."""
    s, tier, connector = tiered_scheduler(12, 4, 0, 64, max_num_batched_tokens=64, max_num_seqs=4)
    first = [7, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 6, 2]  # 17 tokens: 4 full blocks
    other = [8] * 45 + [4]  # with its 2 output tokens, all 12 blocks: every block of the first prompt is evicted
    arrivals = [Arrival(0, "a", first, 2, 1), Arrival(5, "b", other, 2, 1), Arrival(10, "c", first, 2, 1)]
    runner = TierFakeRunner(s, tier)
    result = drive(s, arrivals, runner=runner)
    assert result.outputs["c"] == expected_outputs(first, 2)
    assert connector.loaded_blocks == 4 and runner.num_loads == 4
    assert connector.hit_tokens == 16
    assert len(tier) >= 4


def test_no_tier_hit_after_preemption_counts_as_a_cache_hit():
    s, tier, connector = tiered_scheduler(12, 4, 0, 64, max_num_batched_tokens=64, max_num_seqs=4)
    seq_prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    s.add_request("x", seq_prompt, max_tokens=1)
    request = s.requests["x"]
    request.num_cached_tokens = 0  # as if admitted once before (a recompute after preemption)
    connector.tier.put(*_entry(seq_prompt, 0, 4))
    out = s.schedule()
    assert out.kv_connector_meta is not None and len(out.kv_connector_meta.loads) == 1
    assert connector.loaded_blocks == 1 and connector.hit_tokens == 0


@pytest.mark.parametrize("recompute_cheaper", [True, False])
def test_the_cost_model_decides_load_or_recompute(recompute_cheaper):
    """A tier hit is loaded unless the measured load costs more than the cost model's recompute."""
    s, tier, connector = tiered_scheduler(12, 4, 0, 64, max_num_batched_tokens=64, max_num_seqs=4)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    for i in range(2):
        connector.tier.put(*_entry(prompt, i, 4))
    connector.load_cost.add_read(1, 0.010)  # loads measured at 10 ms a block
    connector.recompute_seconds = lambda num_tokens: num_tokens * (0.001 if recompute_cheaper else 0.1)
    s.add_request("x", prompt, max_tokens=1)
    out = s.schedule()
    loads = out.kv_connector_meta.loads if out.kv_connector_meta is not None else []
    assert len(loads) == (0 if recompute_cheaper else 2)
    assert connector.declined_blocks == (2 if recompute_cheaper else 0)
    assert out.num_batched_tokens == (9 if recompute_cheaper else 1)  # recomputed, or only the last token


def test_recompute_pricer_trusts_only_a_measured_prefill_rate():
    from kvpage.core.preemption_cost import MeasuredCostModel, PreemptionCostModel
    from kvpage.kv_offload import recompute_pricer

    measured = MeasuredCostModel()
    price = recompute_pricer(measured)
    assert price(16) is None  # nothing timed yet: the prior describes another machine
    measured.record_step(10, 0.1)
    measured.record_step(20, 0.2)
    assert price(16) == pytest.approx(0.16)
    fixed = PreemptionCostModel(prefill_tokens_per_s=100.0)
    assert recompute_pricer(fixed)(16) == pytest.approx(0.16)


def test_a_pickled_scheduler_copy_gets_an_inert_connector(tmp_path):
    """`kvpage serve` pickles the engine core's scheduler for its checks: the tier (a lock, a writer thread)
    stays behind, and the copy's connector and eviction hook do nothing."""
    import pickle

    from kvpage.kv_offload import DiskTier, KVConnectorBase

    s, _, connector = tiered_scheduler(12, 4, 0, 64)
    connector.tier = DiskTier(tmp_path, "0123456789abcdef" * 2, 1 << 20)
    s.bm.device.cache.on_evict = connector.on_evict
    copy = pickle.loads(pickle.dumps(s))
    assert type(copy.kv_connector) is KVConnectorBase
    assert copy.bm.device.cache.on_evict(b"h", None, 0) is None
    assert copy.check_fits is not None and s.kv_connector is connector
    connector.tier.close()


def _entry(tokens, i, bs, group=0):
    from kvpage.core import Sequence
    from kvpage.core.hashing import group_key
    from kvpage.kv_offload.connector import block_hash, block_key
    seq = Sequence(0, tokens)
    key = block_key(seq, i, bs, group)
    return group_key(block_hash(seq, i, bs), group), key, key.token_bytes


@pytest.mark.parametrize("missing", [None, 7, 3])
def test_hybrid_hit_loads_each_window_only_inside_it(missing):
    """Layout [full, window 8], blocks of 4, a 33-token prompt all in the tier: a hit of 8 blocks loads the full
    group's 8 and the window group's 2 of the window ending at token 32; the window group's other entries are
    NULL_BLOCK, drawn from nothing. Without the window entry of block 7 the hit shortens to 7 blocks (window
    [5, 7)); without block 3's (outside every window that fits) nothing changes."""
    s, tier, connector = tiered_scheduler(24, 4, 0, 64, layout=kv_cache_layout([None, 8]), max_num_batched_tokens=64)
    prompt = [(7 * i) % 9 + 1 for i in range(33)]
    for i in range(8):
        for g in (0, 1):
            if (g, i) != (1, missing):
                tier.put(*_entry(prompt, i, 4, g))
    free_before = s.bm.num_free_blocks
    s.add_request("x", prompt, max_tokens=2)
    out = s.schedule()
    hit_blocks, window_start = (7, 5) if missing == 7 else (8, 6)
    loads = out.kv_connector_meta.loads
    assert len(loads) == hit_blocks + (hit_blocks - window_start)
    seq = s.requests["x"].seqs[0]
    assert seq.block_tables[1][:window_start] == [NULL_BLOCK] * window_start
    assert NULL_BLOCK not in seq.block_tables[0] and NULL_BLOCK not in seq.block_tables[1][window_start:]
    held = sum(1 for table in seq.block_tables for b in table if b != NULL_BLOCK)
    assert free_before - s.bm.num_free_blocks == held
    assert connector.hit_tokens == 4 * hit_blocks and out.num_batched_tokens == 33 - 4 * hit_blocks
    runner = TierFakeRunner(s, tier)  # the loaded blocks hold exactly the tokens each window reads
    s.update_from_output(out, runner.execute(out, lambda seq_id: s._seqs[seq_id].token_ids))
    drive(s, [], runner=runner)
    assert [seq.output_token_ids] == expected_outputs(prompt, 2)
    assert_pool_whole(s.bm)


def test_unsupported_layouts_are_refused_by_name():
    from kvpage.kv_offload import attach_offloading

    no_cache = BlockManager(32, 4, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        attach_offloading(object(), None, no_cache, Scheduler(no_cache), 0.01, None)
    plain = BlockManager(32, 4)
    with pytest.raises(ValueError, match="decode context parallelism"):  # neither a ModelRunner nor a TP driver
        attach_offloading(object(), None, plain, Scheduler(plain), 0.01, None)


def test_num_external_tokens_must_be_whole_blocks_after_the_hit():
    from kvpage.core import Sequence

    bm = BlockManager(32, 4, kv_cache_layout=kv_cache_layout([None, 8]))
    for bad in (3, -4, 20):  # not whole blocks; negative; reaching the last token (the prompt has 20)
        with pytest.raises(ValueError, match="num_external_tokens"):
            bm.allocate(Sequence(0, list(range(1, 21))), 20 if bad == 20 else 8, num_external_tokens=bad)
    seq = Sequence(1, list(range(1, 21)))
    assert bm.can_allocate(seq, 19, num_external_tokens=16)
    bm.allocate(seq, 19, num_external_tokens=16)  # loads blocks 0-3: the window of 8 ending at 16 is blocks 2-3
    assert seq.block_tables[1][:2] == [NULL_BLOCK] * 2 and NULL_BLOCK not in seq.block_tables[1][2:]
    assert bm.stats().num_used_blocks == 5 + 3
