"""Random workloads, pool sizes, budgets, policies and modes: the invariants hold on every step.

drive() checks per step: both budgets, each scheduled sequence against the scheduler's state, no
swap-in in a step that preempted, the block manager's consistency, and every sequence's context as
read back from the fake KV cache. Here, at the end: everyone not aborted finishes with exactly the
output an unpressured run produces, aborted requests hold a prefix of it, and the pools are whole.
"""
import os

from hypothesis import HealthCheck, given, settings, strategies as st

from fake_runner import LAYOUTS, Arrival, assert_pool_whole, drive, expected_outputs
from kvpage.core import BlockManager, RequestStatus, Scheduler, num_blocks_per_seq

_PROFILE = os.environ.get("KVPAGE_HYPOTHESIS_PROFILE", "ci")
_EXAMPLES = {"ci": 60, "deep": 3000}.get(_PROFILE, 60)

# Shared prefixes over a small vocabulary: prefix-cache hits and revived blocks are common.
PREFIXES = ([], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9], [5] * 24)

arrival = st.builds(
    lambda step, prefix, suffix, max_tokens, n, abort_at: (step, prefix + suffix, max_tokens, n, abort_at),
    st.integers(0, 12), st.sampled_from(PREFIXES), st.lists(st.integers(1, 9), max_size=20),
    st.integers(1, 24), st.sampled_from([1, 1, 1, 2, 3]), st.none() | st.integers(0, 40))


@settings(max_examples=_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arrivals=st.lists(arrival, min_size=1, max_size=12),
       block_size=st.sampled_from([1, 2, 4, 8]), num_blocks=st.integers(8, 80), num_host_blocks=st.integers(0, 40),
       prefix_caching=st.booleans(), watermark=st.sampled_from([0.0, 0.01, 0.1]),
       max_num_batched_tokens=st.integers(1, 64), max_num_seqs=st.integers(1, 8),
       policy=st.sampled_from(["recent", "least_progress"]), mode=st.sampled_from([None, "swap", "recompute"]),
       layout=st.sampled_from(LAYOUTS))
def test_random_workloads_keep_every_invariant(arrivals, block_size, num_blocks, num_host_blocks, prefix_caching,
                                               watermark, max_num_batched_tokens, max_num_seqs, policy, mode, layout):
    arrivals = [Arrival(step, f"r{i}", [p % 10 for p in prompt] or [1], max_tokens, n, abort_at)
                for i, (step, prompt, max_tokens, n, abort_at) in enumerate(arrivals)]
    bm = BlockManager(num_blocks, block_size, num_host_blocks, prefix_caching, watermark, kv_cache_layout=layout)
    s = Scheduler(bm, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                  policy=policy, preemption_mode=mode)
    result = drive(s, arrivals, max_steps=20_000, allow_rejects=True)
    for a in arrivals:
        if a.request_id in result.rejected:
            total = len(a.prompt) + a.max_tokens
            need = a.n * num_blocks_per_seq(bm.kv_cache_layout, total, block_size, min(total, max_num_batched_tokens))
            assert need > num_blocks - bm.watermark_blocks or a.n > min(max_num_seqs, max_num_batched_tokens)
            continue
        expected = expected_outputs(a.prompt, a.max_tokens, a.n)
        got = result.outputs[a.request_id]
        if result.statuses[a.request_id] is RequestStatus.FINISHED_ABORTED:
            assert all(out == exp[:len(out)] for out, exp in zip(got, expected))
        else:
            assert got == expected
    assert_pool_whole(bm)
