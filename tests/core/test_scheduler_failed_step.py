"""A step whose execution fails: Scheduler.discard_step forgets it, and the run goes on as if it had
never been scheduled.

The fake runner fails chosen steps after doing part of them, leaving garbage where a transfer was
cut off. drive() then checks every later step's context as read back from the fake KV cache, so a
request that went on trusting a block the failed step was to fill would fail the run; at the end,
every request must hold exactly the output an undisturbed run produces, and the pools be whole.
"""
import os
import random
from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from fake_runner import LAYOUTS, Arrival, FakeRunner, StepFailed, assert_pool_whole, drive, expected_outputs
from kvpage.core import BlockManager, Scheduler

GARBAGE = -7  # no token id: any read of it changes the fake model's output
PARTS = ["nothing", "moves", "all"]


class FlakyRunner(FakeRunner):
    """Raises StepFailed in the steps `fail(step)` picks, after carrying out `part` of them:
    "nothing": no work, but garbage in every block the step was to fill by swap or copy (a transfer
    cut off) and in every slot its forward pass was to write (a kernel cut off); "moves": the swaps and copies, no forward pass; "all": the whole step, results lost."""

    def __init__(self, block_size: int, fail, part: str, sliding_windows: tuple = (None,)) -> None:
        super().__init__(block_size, sliding_windows)
        self.fail, self.part = fail, part
        self.failed_moves = Counter()  # what the failed steps were to move, to show the test covers it

    def execute(self, out, expected_tokens=None):
        if not self.fail(out.step):
            return super().execute(out, expected_tokens)
        self.failed_moves.update(swap_out=len(out.blocks_to_swap_out), swap_in=len(out.blocks_to_swap_in),
                                 copy=len(out.blocks_to_copy))
        if self.part == "nothing":
            for _, dst in out.blocks_to_swap_out:
                self.host[dst] = [GARBAGE] * self.block_size
            for _, dst in out.blocks_to_swap_in + out.blocks_to_copy:
                self.device[dst] = [GARBAGE] * self.block_size
            for slot in (slot for s in out.scheduled for slots in s.slot_mappings for slot in slots if slot >= 0):
                self._block(self.device, slot // self.block_size)[slot % self.block_size] = GARBAGE
        elif self.part == "moves":
            super().execute(replace(out, scheduled=[]))
        else:
            super().execute(out, expected_tokens)
        raise StepFailed(f"step {out.step}")


def _workload(seed: int) -> list[Arrival]:
    """Requests sharing prefixes (prefix-cache hits), some with n > 1 (forks, copy-on-write)."""
    rng = random.Random(seed)
    prefixes = [[], [3] * 8, list(range(1, 13))]
    return [Arrival(rng.randrange(10), f"r{i}",
                    rng.choice(prefixes) + [rng.randrange(1, 64) for _ in range(rng.randint(1, 30))],
                    rng.randint(1, 30), n=rng.choice([1, 1, 2, 3])) for i in range(24)]


def _assert_undisturbed(result, arrivals) -> None:
    for a in arrivals:
        assert result.outputs[a.request_id] == expected_outputs(a.prompt, a.max_tokens, a.n), a.request_id
        assert result.statuses[a.request_id].is_finished


@pytest.mark.parametrize("part", PARTS)
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_failed_steps_are_discarded_and_every_request_ends_undisturbed(mode, part):
    arrivals = _workload(11)
    bm = BlockManager(48, 4, num_host_blocks=64)  # small enough to swap
    s = Scheduler(bm, max_num_batched_tokens=40, max_num_seqs=8, preemption_mode=mode)
    rng = random.Random(5)
    runner = FlakyRunner(4, lambda step: rng.random() < 0.3, part)
    result = drive(s, arrivals, runner=runner)
    assert result.num_failed_steps > 10
    _assert_undisturbed(result, arrivals)
    assert_pool_whole(bm)
    # The failures hit steps that swapped and copied, the cases where a request's cache goes stale.
    assert runner.failed_moves["copy"] > 0, runner.failed_moves
    if mode == "swap":
        assert runner.failed_moves["swap_in"] > 0 and runner.failed_moves["swap_out"] > 0, runner.failed_moves


def test_discard_step_takes_only_the_pending_step():
    s = Scheduler(BlockManager(16, 4))
    s.add_request("a", [1, 2, 3, 4, 5], max_tokens=3)
    s.add_request("b", [6, 7], max_tokens=3)
    s.abort_request("b")
    out = s.schedule()
    with pytest.raises(RuntimeError, match="schedule\\(\\) called again"):
        s.schedule()
    assert s.discard_step(out)
    assert not s.discard_step(out)  # already discarded: nothing changes
    again = s.schedule()
    assert [(x.start, x.token_ids) for x in again.scheduled] == [(x.start, x.token_ids) for x in out.scheduled]
    # The runner may never have seen the failed step: the next one tells it again who finished.
    assert out.finished_request_ids == again.finished_request_ids == ["b"]
    s.update_from_output(again, {again.scheduled[0].seq_id: 9})
    assert not s.discard_step(again)  # recorded: nothing to discard
    assert s.requests["a"].seqs[0].output_token_ids == [9]


_EXAMPLES = {"ci": 40, "deep": 2000}.get(os.environ.get("KVPAGE_HYPOTHESIS_PROFILE", "ci"), 40)


@settings(max_examples=_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), part=st.sampled_from(PARTS), fail_rate=st.sampled_from([0.1, 0.3, 0.6]),
       block_size=st.sampled_from([1, 2, 4, 8]), num_blocks=st.integers(24, 80), num_host_blocks=st.integers(0, 40),
       prefix_caching=st.booleans(), max_num_batched_tokens=st.integers(8, 64),
       mode=st.sampled_from([None, "swap", "recompute"]), layout=st.sampled_from(LAYOUTS))
def test_random_failures_never_change_an_output(seed, part, fail_rate, block_size, num_blocks, num_host_blocks,
                                                prefix_caching, max_num_batched_tokens, mode, layout):
    arrivals = _workload(seed)
    bm = BlockManager(num_blocks, block_size, num_host_blocks, prefix_caching, kv_cache_layout=layout)
    s = Scheduler(bm, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=8, preemption_mode=mode)
    rng = random.Random(seed)
    result = drive(s, arrivals, max_steps=50_000, allow_rejects=True,
                   runner=FlakyRunner(block_size, lambda step: rng.random() < fail_rate, part, bm.sliding_windows))
    _assert_undisturbed(result, [a for a in arrivals if a.request_id not in result.rejected])
    assert_pool_whole(bm)
