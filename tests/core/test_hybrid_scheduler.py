"""The scheduler on a hybrid KV cache (kv_cache_groups): sequences many windows long run in a pool that
could not hold their full tables, preemption by swap and by recompute, prefix hits (also in-step),
n > 1, all against the fake runner, which reads each window group exactly where the step's queries
look (fake_runner.py), so a block freed too early or a wrong table changes the outputs."""
import random

import pytest

from fake_runner import LAYOUTS, Arrival, assert_pool_whole, drive, expected_outputs
from kvpage.core import BlockManager, Scheduler, kv_cache_layout, num_blocks_per_seq

GEMMA_LIKE = kv_cache_layout(([8] * 5 + [None]) * 2)  # five window layers of 8 per full layer
MISTRAL_LIKE = kv_cache_layout([8, 8])  # every layer windowed


def _long_workload(seed, num_requests, prompt_len, max_tokens, n=1, shared_prefix=()):
    rng = random.Random(seed)
    return [Arrival(0, f"r{i}", list(shared_prefix) + [rng.randrange(1, 64) for _ in range(prompt_len)], max_tokens,
                    n=n) for i in range(num_requests)]


def _check_outputs(result, arrivals, eos=0):
    for a in arrivals:
        assert result.outputs[a.request_id] == expected_outputs(a.prompt, a.max_tokens, a.n, eos), a.request_id
        assert result.statuses[a.request_id].is_finished


@pytest.mark.parametrize("layout", [GEMMA_LIKE, MISTRAL_LIKE])
def test_sequences_many_windows_long_fit_where_full_tables_could_not(layout):
    arrivals = _long_workload(1, num_requests=8, prompt_len=60, max_tokens=80)
    block_size, total = 4, 140
    all_full = kv_cache_layout([None] * layout.num_layers)
    # Bytes in layer-blocks (one layer's block of block_size tokens): a block id holds group_size of them.
    full_need = num_blocks_per_seq(all_full, total, block_size) * all_full.group_size
    pool = 8 * num_blocks_per_seq(layout, total, block_size, max_step_tokens=16) + 8
    assert 8 * full_need > 2 * pool * layout.group_size  # those bytes could not hold half of them all-full
    bm = BlockManager(pool, block_size, enable_prefix_caching=False, kv_cache_layout=layout)
    s = Scheduler(bm, max_num_batched_tokens=16, max_num_seqs=8)
    peak = []
    orig = s.schedule

    def schedule():
        out = orig()
        peak.append(len(s.running))
        return out
    s.schedule = schedule
    result = drive(s, arrivals, eos=None)  # every request runs its full length
    _check_outputs(result, arrivals, eos=None)
    assert max(peak) == 8 and s.stats().num_preemptions == 0
    assert_pool_whole(bm)


@pytest.mark.parametrize("layout", [GEMMA_LIKE, MISTRAL_LIKE, LAYOUTS[2]])
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_in_both_modes(layout, mode):
    arrivals = _long_workload(2, num_requests=10, prompt_len=30, max_tokens=30, n=1)
    arrivals += _long_workload(3, num_requests=3, prompt_len=13, max_tokens=20, n=2)  # forks share a partial block
    arrivals = [Arrival(i % 5, f"q{i}", a.prompt, a.max_tokens, a.n) for i, a in enumerate(arrivals)]
    # Room for two of the longest at their peak, while eight may run: growing decodes must preempt.
    bm = BlockManager(2 * num_blocks_per_seq(layout, 60, 4, 24), 4, num_host_blocks=1000, kv_cache_layout=layout)
    s = Scheduler(bm, max_num_batched_tokens=24, max_num_seqs=8, preemption_mode=mode)
    result = drive(s, arrivals, eos=None)
    _check_outputs(result, arrivals, eos=None)
    stats = s.stats()
    assert stats.num_preemptions > 0
    if mode == "swap":
        assert stats.num_recompute_preemptions == 0 and stats.blocks.num_swapped_in_blocks > 0
    else:
        assert stats.num_swap_preemptions == 0
    assert_pool_whole(bm)


@pytest.mark.parametrize("layout", [GEMMA_LIKE, MISTRAL_LIKE])
def test_a_shared_prompt_is_computed_once_and_hit_in_every_group(layout):
    """Requests sharing a long system prompt, arriving together (in-step hits) and later (cached hits):
    the window groups take only the window at the hit's end."""
    prefix = [7] * 37
    arrivals = _long_workload(4, num_requests=4, prompt_len=5, max_tokens=12, shared_prefix=prefix)
    arrivals += [Arrival(30, f"late{i}", prefix + [i + 1, 2, 3], 10) for i in range(3)]
    bm = BlockManager(200, 4, kv_cache_layout=layout)
    s = Scheduler(bm, max_num_batched_tokens=256, max_num_seqs=8)
    result = drive(s, arrivals)
    _check_outputs(result, arrivals)
    stats = bm.stats()
    assert stats.prefix_cache_hit_tokens >= 6 * 36
    assert_pool_whole(bm)


def test_llm_stats_report_blocks_per_group():
    bm = BlockManager(100, 4, kv_cache_layout=GEMMA_LIKE)
    s = Scheduler(bm, max_num_batched_tokens=64)
    s.add_request("a", list(range(1, 41)), max_tokens=4)
    out = s.schedule()
    s.update_from_output(out, {out.scheduled[0].seq_id: 5})
    per_group = s.stats().blocks.num_used_blocks_per_group
    assert len(per_group) == GEMMA_LIKE.num_groups and sum(per_group) == bm.stats().num_used_blocks
    full = [n for n, w in zip(per_group, GEMMA_LIKE.sliding_windows) if w is None]
    window = [n for n, w in zip(per_group, GEMMA_LIKE.sliding_windows) if w is not None]
    # 40 computed tokens in 10 blocks; a window of 8 from the next query (at 40) keeps 33..39: blocks 8, 9.
    assert full == [10] * len(full) and window == [2] * len(window)


def test_a_request_longer_than_a_full_pool_is_admitted_on_a_window_layout_and_refused_on_a_full_one():
    bm = BlockManager(40, 4, kv_cache_layout=MISTRAL_LIKE)
    s = Scheduler(bm, max_num_batched_tokens=16)
    s.add_request("long", list(range(1, 200)), max_tokens=50)  # 249 tokens: 63 blocks per full table
    with pytest.raises(ValueError, match="num_kv_blocks"):
        Scheduler(BlockManager(40, 4), max_num_batched_tokens=16).add_request("long", list(range(1, 200)),
                                                                              max_tokens=50)
    result = drive(s, [])
    assert s.num_finished == 1 and not result.rejected
    assert_pool_whole(bm)
