"""Preemption under a tiny pool (swap, recompute, cost-model choice, host-pool fallback), abort, starvation."""
import random

import pytest

from fake_runner import Arrival, FakeRunner, assert_pool_whole, drive, expected_outputs
from test_scheduler_cost_model import measured
from kvpage.core import (BlockManager, LeastProgressLost, MostRecentlyAdmitted, PreemptionCostModel, RequestStatus,
                         Scheduler, check_block_manager)


def _workload(seed, num_requests=24, max_prompt=40, max_out=40, spread=10, n_choices=(1, 1, 1, 2)):
    rng = random.Random(seed)
    return [Arrival(rng.randrange(spread), f"r{i}", [rng.randrange(1, 64) for _ in range(rng.randint(1, max_prompt))],
                    rng.randint(1, max_out), n=rng.choice(n_choices)) for i in range(num_requests)]


def _check_outputs(result, arrivals):
    for a in arrivals:
        assert result.outputs[a.request_id] == expected_outputs(a.prompt, a.max_tokens, a.n), a.request_id
        assert result.statuses[a.request_id].is_finished


@pytest.mark.parametrize("policy", ["recent", "least_progress"])
@pytest.mark.parametrize("mode", ["swap", "recompute", None])
def test_a_tiny_pool_preempts_and_everyone_finishes_with_unpressured_outputs(policy, mode):
    arrivals = _workload(3)
    bm = BlockManager(56, 4, num_host_blocks=64)
    s = Scheduler(bm, max_num_batched_tokens=40, max_num_seqs=8, policy=policy, preemption_mode=mode)
    result = drive(s, arrivals)
    _check_outputs(result, arrivals)  # identical to what an unpressured run produces
    stats = s.stats()
    assert stats.num_preemptions > 0
    if mode == "swap":
        assert stats.num_recompute_preemptions == 0 and stats.blocks.num_swapped_in_blocks > 0
    if mode == "recompute":
        assert stats.num_swap_preemptions == 0
    assert_pool_whole(bm)


def test_the_cost_model_picks_recompute_for_short_sequences_and_swap_for_long_ones():
    model = PreemptionCostModel()  # the fixed transfer overhead puts the crossover at a few dozen tokens
    crossover = model.crossover_tokens(block_size=4)
    assert 16 < crossover < 200
    arrivals = _workload(4, max_prompt=120, max_out=30)
    s = Scheduler(BlockManager(60, 4, num_host_blocks=200), max_num_batched_tokens=64, cost_model=model)
    result = drive(s, arrivals)
    _check_outputs(result, arrivals)
    assert s.stats().num_swap_preemptions > 0 and s.stats().num_recompute_preemptions > 0


@pytest.mark.parametrize("bytes_per_s,mode", [(1e9, "swap"), (1e5, "recompute")])
def test_the_scheduler_preempts_as_the_measured_model_says(bytes_per_s, mode):
    model = measured(bytes_per_s=bytes_per_s, overhead_s=0.0, seconds_per_token=1e-4)
    arrivals = _workload(4, max_prompt=120, max_out=30)
    s = Scheduler(BlockManager(60, 4, num_host_blocks=200), max_num_batched_tokens=64, cost_model=model)
    result = drive(s, arrivals)
    _check_outputs(result, arrivals)
    stats = s.stats()
    assert stats.num_preemptions > 0
    assert stats.num_preemptions == (stats.num_swap_preemptions if mode == "swap" else stats.num_recompute_preemptions)


def test_a_full_host_pool_falls_back_to_recompute():
    arrivals = _workload(5)
    bm = BlockManager(56, 4, num_host_blocks=6)
    s = Scheduler(bm, max_num_batched_tokens=40, preemption_mode="swap")
    result = drive(s, arrivals)
    _check_outputs(result, arrivals)
    assert s.stats().num_recompute_preemptions > 0
    assert_pool_whole(bm)


def test_a_group_with_shared_blocks_swaps_as_a_unit():
    bm = BlockManager(48, 4, num_host_blocks=64)
    s = Scheduler(bm, max_num_batched_tokens=64, preemption_mode="swap")
    runner = FakeRunner(4)
    old = s.add_request("old", list(range(1, 30)), max_tokens=40, eos_token_id=None)
    group = s.add_request("group", [9] * 10, max_tokens=40, n=3, eos_token_id=None)
    while group.status is not RequestStatus.SWAPPED:
        out = s.schedule()
        s.update_from_output(out, runner.execute(out))
        assert s.has_unfinished_requests()
    assert len(group.seqs) == 3 and all(seq.swapped for seq in group.seqs)
    assert old.status is RequestStatus.RUNNING
    # The shared prompt blocks went to the host once and stay shared there.
    assert bm.host.ref_counts[group.seqs[0].block_table[0]] == 3
    check_block_manager(bm, [seq for r in (old, group) for seq in r.live_seqs()])


def test_policies_pick_their_victims():
    s = Scheduler(BlockManager(64, 4))
    a = s.add_request("a", [1] * 8, max_tokens=3)
    b = s.add_request("b", [1] * 20, max_tokens=30)
    c = s.add_request("c", [2] * 4, max_tokens=30)
    for r, order, computed, produced in ((a, 0, 10, 2), (b, 1, 30, 10), (c, 2, 4, 0)):
        r.admit_order = order
        r.seqs[0].num_computed_tokens = computed
        r.seqs[0].token_ids += [5] * produced
    assert MostRecentlyAdmitted().select([a, b, c]) is c
    assert LeastProgressLost().select([a, b, c]) is c
    assert LeastProgressLost().select([a, b]) is b  # a is one token from done: protected
    assert LeastProgressLost().select([a]) is a


def _run_until(s, runner, done, max_steps=500):
    for _ in range(max_steps):
        if done():
            return
        out = s.schedule()
        s.update_from_output(out, runner.execute(out))
    raise AssertionError("condition never reached")


def _abort_and_check(s, request):
    assert s.abort_request(request.request_id)
    assert request.status is RequestStatus.FINISHED_ABORTED
    assert not any(seq.block_table or seq.swapped for seq in request.seqs)
    check_block_manager(s.bm, [seq for r in s.requests.values() for seq in r.live_seqs()])


@pytest.mark.parametrize("state", ["waiting", "prefill", "decode", "swapped", "recompute-waiting"])
def test_abort_frees_everything_whatever_the_state(state):
    bm = BlockManager(40, 4, num_host_blocks=64)
    s = Scheduler(bm, max_num_batched_tokens=8, preemption_mode="recompute" if state == "recompute-waiting" else "swap")
    runner = FakeRunner(4)
    reqs = [s.add_request(f"r{i}", list(range(1 + i, 21 + i)), max_tokens=60, eos_token_id=None) for i in range(3)]
    victim = {
        "waiting": lambda: reqs[2],
        "prefill": lambda: next((r for r in reqs if 0 < r.seqs[0].num_computed_tokens < 20), None),
        "decode": lambda: next((r for r in reqs if r.seqs[0].num_computed_tokens > 24), None),
        "swapped": lambda: next((r for r in reqs if r.status is RequestStatus.SWAPPED), None),
        "recompute-waiting": lambda: next((r for r in reqs if r.num_preemptions), None),
    }[state]
    _run_until(s, runner, victim)
    target = victim()
    _abort_and_check(s, target)
    _run_until(s, runner, lambda: not s.has_unfinished_requests())
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in reqs if r is not target)
    assert_pool_whole(bm)


def test_abort_between_schedule_and_update_is_safe():
    bm = BlockManager(40, 4)
    s = Scheduler(bm)
    runner = FakeRunner(4)
    s.add_request("a", [1, 2, 3], max_tokens=5)
    out = s.schedule()
    sampled = runner.execute(out)
    s.abort_request("a")
    assert s.update_from_output(out, sampled) == []
    assert s.schedule().finished_request_ids == ["a"]
    assert_pool_whole(bm)


@pytest.mark.parametrize("policy", ["recent", "least_progress"])
def test_no_request_waits_unboundedly_in_a_long_random_workload(policy):
    # Arrivals near the pool's capacity (one every 2 steps), so preemption is frequent (~70 times).
    rng = random.Random(7)
    arrivals = [Arrival(2 * i, f"r{i}", [rng.randrange(1, 64) for _ in range(rng.randint(1, 48))],
                        rng.randint(1, 32)) for i in range(300)]
    bm = BlockManager(64, 4, num_host_blocks=32)
    s = Scheduler(bm, max_num_batched_tokens=48, max_num_seqs=8, policy=policy)
    result = drive(s, arrivals, check_every_step=False)
    _check_outputs(result, arrivals)
    assert s.stats().num_preemptions > 30
    # Bounded: latency does not grow with the length of the run (~650 steps); a starved request would.
    assert max(result.latency.values()) <= 100
    first, last = (max(result.latency[f"r{i}"] for i in part) for part in (range(100), range(200, 300)))
    assert last <= 2 * first
    assert_pool_whole(bm)
