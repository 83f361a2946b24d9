"""Scheduler basics: one step's budgets and order, chunked prefill, prefix hits, stop conditions, rejection."""
import random

import pytest

from fake_runner import EOS, Arrival, FakeRunner, assert_pool_whole, drive, expected_outputs, sample
from kvpage.core import BlockManager, FinishReason, RequestStatus, Scheduler, SchedulerConfig, check_block_manager
from kvpage.core.block_manager import CacheConfig


def _scheduler(num_blocks=256, block_size=4, **kwargs):
    return Scheduler(BlockManager(num_blocks, block_size, num_host_blocks=kwargs.pop("num_host_blocks", 0)),
                     **kwargs)


def _step(scheduler, runner):
    out = scheduler.schedule()
    scheduler.update_from_output(out, runner.execute(out))
    return out


def test_one_request_runs_prefill_then_decodes_to_max_tokens():
    s = _scheduler()
    prompt = [5, 6, 7, 8, 9, 10]
    request = s.add_request("a", prompt, max_tokens=4)
    runner = FakeRunner(4)
    first = _step(s, runner)
    (seq,) = first.scheduled
    assert (seq.start, seq.num_scheduled_tokens, seq.is_prefill, seq.do_sample) == (0, 6, True, True)
    assert seq.slot_mapping == [seq.block_table[p // 4] * 4 + p % 4 for p in range(6)]
    while s.has_unfinished_requests():
        out = _step(s, runner)
        assert [(x.num_scheduled_tokens, x.is_prefill) for x in out.scheduled] == [(1, False)]
    assert request.status is RequestStatus.FINISHED_LENGTH
    assert request.seqs[0].output_token_ids == expected_outputs(prompt, 4, eos=None)[0]
    assert s.schedule().finished_request_ids == ["a"]
    assert_pool_whole(s.bm)


def test_eos_and_stop_token_ids_stop_a_sequence_unless_eos_is_ignored():
    prompt = [1, 2, 3]
    first = sample(prompt)
    for kwargs, status, length in (({"eos_token_id": first}, RequestStatus.FINISHED_STOPPED, 1),
                                   ({"stop_token_ids": [first]}, RequestStatus.FINISHED_STOPPED, 1),
                                   ({"eos_token_id": first, "ignore_eos": True}, RequestStatus.FINISHED_LENGTH, 3)):
        s = _scheduler()
        request = s.add_request("a", prompt, max_tokens=3, **kwargs)
        runner = FakeRunner(4)
        while s.has_unfinished_requests():
            _step(s, runner)
        assert request.status is status and len(request.seqs[0].output_token_ids) == length
        assert request.finish_reasons[request.seqs[0].seq_id].value == status.value


def test_budgets_hold_and_token_accounting_is_exact_without_pressure():
    rng = random.Random(1)
    arrivals = [Arrival(rng.randrange(30), f"r{i}", [rng.randrange(1, 64) for _ in range(rng.randint(1, 90))],
                        rng.randint(1, 20)) for i in range(40)]
    bm = BlockManager(4096, 4, enable_prefix_caching=False)
    s = Scheduler(bm, max_num_batched_tokens=48, max_num_seqs=6)
    result = drive(s, arrivals)  # drive() checks both budgets on every step
    for a in arrivals:
        assert result.outputs[a.request_id] == expected_outputs(a.prompt, a.max_tokens)
    # Every prompt token once, every output token but the last once (its K/V is never needed).
    assert result.total_scheduled_tokens == sum(len(a.prompt) + len(result.outputs[a.request_id][0]) - 1
                                                for a in arrivals)
    assert s.stats().num_preemptions == 0
    assert_pool_whole(bm)


def test_decodes_go_first_and_a_long_prompt_is_chunked_around_them():
    s = _scheduler(num_blocks=2048, max_num_batched_tokens=512)
    runner = FakeRunner(4)
    for i in range(4):
        s.add_request(f"short{i}", [i + 1] * 8, max_tokens=200, eos_token_id=None)
    _step(s, runner)  # the four short prompts
    long_prompt = [random.Random(2).randrange(1, 64) for _ in range(4096)]
    s.add_request("long", long_prompt, max_tokens=4, eos_token_id=None)
    chunks = []
    while True:
        out = _step(s, runner)
        per_request = out.num_scheduled_tokens
        # Every running decode advances in every step the long prefill is in flight: no stall at all.
        assert all(per_request[f"short{i}"] == 1 for i in range(4))
        chunks.append(per_request["long"])
        if sum(chunks) == len(long_prompt):
            break
    assert chunks == [508] * 8 + [4096 - 8 * 508]


def test_a_partially_prefilled_request_continues_after_new_decodes_start():
    s = _scheduler(max_num_batched_tokens=16)
    runner = FakeRunner(4)
    s.add_request("a", list(range(1, 41)), max_tokens=2, eos_token_id=None)
    s.add_request("b", [7, 7, 7], max_tokens=50, eos_token_id=None)
    assert _step(s, runner).num_scheduled_tokens == {"a": 16}
    assert _step(s, runner).num_scheduled_tokens == {"a": 16}
    out = _step(s, runner)
    assert out.num_scheduled_tokens == {"a": 8, "b": 3}
    assert [x.do_sample for x in out.scheduled] == [True, True]


def test_prefix_cache_hits_are_not_charged_to_the_budget():
    s = _scheduler(max_num_batched_tokens=64)
    runner = FakeRunner(4)
    shared = list(range(1, 33))
    s.add_request("a", shared + [40, 41], max_tokens=1)
    _step(s, runner)
    s.add_request("b", shared + [50, 51, 52], max_tokens=1)
    (seq,) = _step(s, runner).scheduled
    assert (seq.start, seq.num_scheduled_tokens) == (32, 3)
    assert s.bm.stats().prefix_cache_hit_tokens == 32


def test_max_num_seqs_caps_a_step_and_admission_is_in_arrival_order():
    s = _scheduler(max_num_seqs=2)
    runner = FakeRunner(4)
    for name in "abc":
        s.add_request(name, [1, 2, 3], max_tokens=5, eos_token_id=None)
    assert [x.request_id for x in _step(s, runner).scheduled] == ["a", "b"]
    assert [x.request_id for x in _step(s, runner).scheduled] == ["a", "b"]


def test_n_samples_share_the_prompt_and_fork_when_it_completes():
    s = _scheduler()
    runner = FakeRunner(4)
    prompt = [3, 1, 4, 1, 5, 9]
    request = s.add_request("a", prompt, max_tokens=6, n=3, eos_token_id=None)
    (first,) = _step(s, runner).scheduled
    assert first.num_samples == 3 and len(request.seqs) == 3
    assert len({seq.block_table[0] for seq in request.seqs}) == 1  # the full prompt block is shared
    while s.has_unfinished_requests():
        _step(s, runner)
    assert [seq.output_token_ids for seq in request.seqs] == expected_outputs(prompt, 6, 3, eos=None)
    assert_pool_whole(s.bm)


def test_a_request_that_can_never_fit_is_rejected_and_the_rest_keep_running():
    bm = BlockManager(16, 4)
    s = Scheduler(bm, max_model_len=100)
    s.add_request("ok", [1, 2, 3], max_tokens=8)
    with pytest.raises(ValueError, match=r"request 'big'.*num_kv_blocks"):
        s.add_request("big", list(range(1, 60)), max_tokens=8)
    with pytest.raises(ValueError, match=r"request 'long': prompt of 101 tokens exceeds max_model_len=100"):
        s.add_request("long", [1] * 101, max_tokens=1)
    with pytest.raises(ValueError, match="max_tokens"):
        s.add_request("zero", [1], max_tokens=0)
    with pytest.raises(ValueError, match="already in use"):
        s.add_request("ok", [1], max_tokens=1)
    result = drive(s, [Arrival(0, "later", [4, 5], 3)])
    assert result.outputs["later"] == expected_outputs([4, 5], 3)
    assert not s.has_unfinished_requests()
    assert_pool_whole(bm)


@pytest.mark.parametrize("prompt_len, max_tokens, outputs", [(6, 4, 4), (6, 9, 4), (10, 3, 1)])
def test_a_sequence_reaching_max_model_len_finishes_with_length(prompt_len, max_tokens, outputs):
    """As in vLLM's LLM: max_tokens past max_model_len is accepted and the sequence stops there (a
    prompt of exactly max_model_len still samples its one token)."""
    s = _scheduler(max_model_len=10)
    request = s.add_request("a", [1] * prompt_len, max_tokens=max_tokens, eos_token_id=None)
    runner = FakeRunner(4)
    while s.has_unfinished_requests():
        _step(s, runner)
    assert request.status is RequestStatus.FINISHED_LENGTH and len(request.seqs[0].output_token_ids) == outputs


def test_misuse_raises_clear_errors():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="preemption_mode"):
        SchedulerConfig(preemption_mode="drop")
    with pytest.raises(ValueError, match="policy"):
        _scheduler(policy="random")
    s = _scheduler()
    s.add_request("a", [1, 2], max_tokens=2)
    out = s.schedule()
    with pytest.raises(RuntimeError, match="update_from_output"):
        s.schedule()
    with pytest.raises(ValueError, match="seq 0"):
        s.update_from_output(out, {})
    with pytest.raises(ValueError, match=r"sampled\[0\]"):
        s.update_from_output(out, {0: [1, 2]})
    s.update_from_output(out, {0: EOS})
    with pytest.raises(ValueError, match="latest schedule"):
        s.update_from_output(out, {0: 1})


@pytest.mark.parametrize("caching", [True, False])
def test_a_request_hits_the_shared_prefix_another_prefill_computes_in_the_same_step(caching):
    """Two arrivals sharing 3 full blocks, both admitted in step 1: with prefix caching the second
    points at the first's 3 blocks (which that step writes before anyone attends) and computes only
    its own 2 tokens; without, it computes all 14. The fake runner reads every context back."""
    s = Scheduler(BlockManager(64, 4, enable_prefix_caching=caching))
    shared = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]
    a = s.add_request("a", shared + [1, 2], max_tokens=3)
    b = s.add_request("b", shared + [3, 4], max_tokens=3)
    s.add_request("c", [40, 41, 42, 43, 44, 45], max_tokens=3)
    runner = FakeRunner(4)
    first = _step(s, runner)
    assert [x.request_id for x in first.scheduled] == ["a", "b", "c"]
    xa, xb, _ = first.scheduled
    if caching:
        assert (xb.start, xb.num_scheduled_tokens) == (12, 2)
        assert xb.block_table[:3] == xa.block_table[:3] and b.num_cached_tokens == 12
        assert s.bm.stats().prefix_cache_hit_tokens == 12
    else:
        assert (xb.start, xb.num_scheduled_tokens) == (0, 14)
        assert not set(xb.block_table) & set(xa.block_table)
    assert all(x.do_sample for x in first.scheduled)  # everyone's first token in step 1
    while s.has_unfinished_requests():
        _step(s, runner)
    for request, prompt in ((a, shared + [1, 2]), (b, shared + [3, 4])):
        assert request.seqs[0].output_token_ids == expected_outputs(prompt, 3)[0][:len(request.seqs[0].output_token_ids)]
    assert_pool_whole(s.bm)


def test_an_identical_prompt_in_the_same_step_computes_only_its_last_token_and_writes_nothing():
    """A full in-step hit: the second copy of a block-aligned prompt runs its last token for its
    logits, reading the blocks the first computes, and maps that token to -1: a block another
    sequence is writing this step is never written twice."""
    s = _scheduler(block_size=4)
    prompt = list(range(1, 13))
    s.add_request("a", prompt, max_tokens=2)
    s.add_request("b", prompt, max_tokens=2)
    runner = FakeRunner(4)
    first = _step(s, runner)
    xa, xb = first.scheduled
    assert (xb.start, xb.num_scheduled_tokens, xb.slot_mapping) == (11, 1, [-1])
    assert xb.block_table == xa.block_table and -1 not in xa.slot_mapping
    assert s.requests["a"].seqs[0].output_token_ids == s.requests["b"].seqs[0].output_token_ids
    while s.has_unfinished_requests():
        _step(s, runner)
    assert_pool_whole(s.bm)


def test_a_prompt_logits_request_reads_no_in_step_hit_but_its_blocks_serve_later_ones():
    s = _scheduler(block_size=4)
    prompt = list(range(1, 13))
    s.add_request("a", prompt + [50], max_tokens=2, prompt_logits=True)
    s.add_request("b", prompt + [51], max_tokens=2, prompt_logits=True)
    s.add_request("c", prompt + [52], max_tokens=2)
    first = _step(s, FakeRunner(4))
    assert [(x.request_id, x.start) for x in first.scheduled] == [("a", 0), ("b", 0), ("c", 12)]


def test_a_failed_step_sends_its_requests_back_to_be_recomputed():
    s = _scheduler(block_size=4)
    prompt = list(range(1, 13))
    s.add_request("a", prompt + [1], max_tokens=2)
    s.add_request("b", prompt + [2], max_tokens=2)
    out = s.schedule()
    assert s.discard_step(out)  # a's blocks were never written: b must not keep its hits on them
    assert [r.request_id for r in s.waiting] == ["a", "b"]
    assert all(r.seqs[0].block_table == [] and r.seqs[0].num_computed_tokens == 0 for r in s.waiting)
    assert s.bm.stats().num_cached_blocks == 0 and s.bm.stats().num_used_blocks == 0
    again = s.schedule()
    assert [(x.request_id, x.start) for x in again.scheduled] == [("a", 0), ("b", 12)]


def test_finish_requests_and_sequences_free_blocks_where_the_request_is():
    """The engine's way to end requests (aborts) and single samples (stop strings): blocks freed at once,
    the request finished once no sequence is live, unknown or finished ids skipped."""
    s = Scheduler(CacheConfig(64, 4), max_num_seqs=8)  # the scheduler builds its own block manager
    runner = FakeRunner(4)
    s.add_request("a", [1, 2, 3, 4, 5], max_tokens=8, n=2, eos_token_id=None)
    s.add_request("b", [6, 7, 8], max_tokens=8, eos_token_id=None)
    s.add_request("w", [9] * 200, max_tokens=8)  # waiting: the budget holds it back
    for _ in range(2):
        _step(s, runner)
    a = s.requests["a"]
    first, second = a.seqs
    s.finish_sequences("a", [first.seq_id], FinishReason.STOP)
    assert a.finish_reasons == {first.seq_id: FinishReason.STOP} and first.block_table == [] and second.block_table
    assert not a.status.is_finished
    assert s.finish_requests(["b", "nobody", "a"], FinishReason.ABORT) == ["b", "a"]
    assert a.status is RequestStatus.FINISHED_ABORTED and a.finish_reasons[second.seq_id] is FinishReason.ABORT
    assert s.finish_requests("b", FinishReason.ABORT) == [] and not s.abort_request("b")
    stats = s.stats().blocks
    assert stats.num_used_blocks == len(s.requests["w"].seqs[0].block_table) and stats.max_num_used_blocks > 0
    assert s.abort_request("w") and s.schedule().finished_request_ids == ["b", "a", "w"]
    assert_pool_whole(s.bm)


@pytest.mark.parametrize("where", ["schedule", "update_from_output"])
def test_a_failed_step_requeues_or_finishes_its_requests_and_the_next_one_runs(where, monkeypatch):
    """schedule() failing part way requeues what it touched (as recompute preemption: no blocks, tokens
    kept); recording the step failing part way aborts the step's requests. Either way the pools are
    whole, and the other requests end with their undisturbed outputs."""
    s = _scheduler(num_blocks=12, num_host_blocks=32, max_num_batched_tokens=64, preemption_mode="swap")
    runner = FakeRunner(4)
    requests = {f"r{i}": s.add_request(f"r{i}", [i + 1] * 9, max_tokens=12, eos_token_id=None) for i in range(3)}
    while not s.swapped:
        _step(s, runner)
    swapped = [r.request_id for r in s.swapped]
    name = "append_slots" if where == "schedule" else "mark_computed"

    def fail(*args, **kwargs):
        raise KeyboardInterrupt

    if where == "schedule":
        first = s.running[0]
        tokens = list(first.seqs[0].token_ids)
        monkeypatch.setattr(s.bm, name, fail)
        with pytest.raises(KeyboardInterrupt):
            s.schedule()
        assert first.status is RequestStatus.WAITING and s.waiting[0] is first
        assert first.seqs[0].block_table == [] and first.seqs[0].num_computed_tokens == 0
        assert first.seqs[0].token_ids == tokens
        assert [r.request_id for r in s.swapped] == swapped
        aborted = set()
    else:
        out = s.schedule()
        monkeypatch.setattr(s.bm, name, fail)
        with pytest.raises(KeyboardInterrupt):
            s.update_from_output(out, runner.execute(out))
        aborted = {x.request_id for x in out.scheduled}
        assert aborted and all(requests[rid].status is RequestStatus.FINISHED_ABORTED for rid in aborted)
    monkeypatch.undo()
    assert s.pending is None
    check_block_manager(s.bm, s.sequences())
    for _ in range(200):
        if not s.has_unfinished_requests():
            break
        _step(s, runner)
    for rid, request in requests.items():
        if rid not in aborted:
            assert request.seqs[0].output_token_ids == expected_outputs([int(rid[1]) + 1] * 9, 12, eos=None)[0]
    assert_pool_whole(s.bm)
