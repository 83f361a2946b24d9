"""prompt_logits (SamplingParams.prompt_logprobs): every prompt position but the last comes back once, in
order, through chunked prefill, prefix-cache neighbours, preemption and failed steps; the prompt is
computed whole, never read from the prefix cache, while those logits are owed."""
import random

import pytest

from fake_runner import Arrival, FakeRunner, assert_pool_whole, drive, expected_outputs
from kvpage.core import BlockManager, Scheduler, ScheduledSequence
from kvpage.core.scheduler_output import logits_rows
from test_scheduler_failed_step import FlakyRunner

SHARED = list(range(1, 25))  # six blocks of 4: a prefix every request below could hit


def _workload(seed: int, num_requests: int = 20) -> list[Arrival]:
    rng = random.Random(seed)
    return [Arrival(rng.randrange(8), f"r{i}", rng.choice([SHARED, SHARED[:9], []])
                    + [rng.randrange(1, 64) for _ in range(rng.randint(1, 30))], rng.randint(1, 20),
                    n=rng.choice([1, 1, 2]), prompt_logits=rng.random() < 0.5) for i in range(num_requests)]


def _check(result, arrivals) -> None:
    for a in arrivals:
        assert result.outputs[a.request_id] == expected_outputs(a.prompt, a.max_tokens, a.n), a.request_id
        if a.prompt_logits:
            assert result.prompt_logit_positions[a.request_id] == list(range(len(a.prompt) - 1)), a.request_id
    assert any(a.prompt_logits for a in arrivals) and not all(a.prompt_logits for a in arrivals)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_prompt_position_comes_back_once_under_chunking_and_preemption(mode, seed):
    arrivals = _workload(seed)
    bm = BlockManager(40, 4, num_host_blocks=64)
    s = Scheduler(bm, max_num_batched_tokens=16, max_num_seqs=6, preemption_mode=mode)
    result = drive(s, arrivals)  # check_output: no position skipped or repeated, step by step
    _check(result, arrivals)
    assert s.stats().num_preemptions > 0
    assert bm.stats().prefix_cache_hit_tokens > 0  # the plain requests still hit
    assert_pool_whole(bm)


@pytest.mark.parametrize("part", ["nothing", "moves", "all"])
def test_failed_steps_deliver_nothing_and_the_positions_come_back_later(part):
    arrivals = _workload(7)
    bm = BlockManager(40, 4, num_host_blocks=64)
    s = Scheduler(bm, max_num_batched_tokens=16, max_num_seqs=6, preemption_mode="swap")
    rng = random.Random(3)
    result = drive(s, arrivals, runner=FlakyRunner(4, lambda step: rng.random() < 0.3, part))
    assert result.num_failed_steps > 5
    _check(result, arrivals)
    assert_pool_whole(bm)


def _run_one(s: Scheduler, runner: FakeRunner) -> list[ScheduledSequence]:
    out = s.schedule()
    s.update_from_output(out, runner.execute(out))
    return out.scheduled


def test_a_cached_prompt_is_computed_whole_for_its_logits_and_then_cached_for_others():
    bm = BlockManager(64, 4)
    s, runner = Scheduler(bm, max_num_batched_tokens=64), FakeRunner(4)
    prompt = SHARED + [40, 41]
    s.add_request("plain", prompt, max_tokens=1)
    _run_one(s, runner)
    assert not s.has_unfinished_requests() and bm.stats().num_cached_blocks == 6
    s.add_request("logits", prompt, max_tokens=1, prompt_logits=True)
    (seq,) = _run_one(s, runner)
    assert seq.start == 0 and seq.prompt_logit_positions == range(len(prompt) - 1)
    assert bm.stats().prefix_cache_hit_tokens == 0
    s.add_request("after", prompt, max_tokens=1)
    (seq,) = _run_one(s, runner)
    assert seq.start == 24 and seq.prompt_logit_positions == range(0)  # its prompt, from the cache


def test_the_positions_owed_shrink_as_steps_deliver_them():
    s = Scheduler(BlockManager(64, 4), max_num_batched_tokens=64)
    request = s.add_request("r", SHARED, max_tokens=8, prompt_logits=True)
    assert request.prompt_logits_pending and request.prompt_logit_positions(0, 24) == range(23)
    request.num_prompt_logits_done = 10  # a recompute after a chunk of 10 was delivered
    assert request.prompt_logit_positions(0, 8) == range(0) and request.prompt_logit_positions(4, 16) == range(10, 16)
    request.num_prompt_logits_done = 23
    assert not request.prompt_logits_pending and request.prompt_logit_positions(0, 24) == range(0)
    plain = s.add_request("p", SHARED, max_tokens=8)
    assert not plain.prompt_logits_pending and plain.prompt_logit_positions(0, 24) == range(0)


def test_logits_rows_put_the_sampled_rows_first_then_the_prompt_positions():
    def seq(start, n, do_sample, positions):
        return ScheduledSequence("r", 0, start, n, [1] * n, [0] * 8, [0] * n, True, do_sample, 1, positions)

    steps = [seq(0, 5, True, range(0, 4)), seq(10, 1, True, range(0)), seq(3, 4, False, range(4, 7))]
    assert logits_rows(steps) == [4, 5] + [0, 1, 2, 3] + [7, 8, 9]
    with pytest.raises(ValueError, match="prompt_logit_positions"):
        logits_rows([seq(3, 4, False, range(2, 5))])
