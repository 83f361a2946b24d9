"""Beam requests inside the scheduler: batched in the same steps as sampling requests, their beams
decoding together, forked onto shared blocks (copy-on-write) and freed by the selection, under
preemption by recompute and by swap, with prefix caching.

The fake runner (fake_runner.py) reads every context back through the block tables, and a fake
beam selection picks children from what it read: a wrong copy-on-write, swap or recompute changes
the beams, which must equal those of a plain simulation over token lists (`expected_beams`).
"""
from __future__ import annotations

import random

import pytest

from fake_runner import VOCAB, FakeRunner, assert_pool_whole, check_output, expected_outputs, sample
from kvpage.core import BeamStep, BlockManager, Scheduler, check_block_manager, kv_cache_layout
from test_scheduler_transaction import Faults, Injected


def _children(contexts: list[list[int]], k: int) -> list[tuple[int, int]]:
    """The fake selection: (parent index, token) for k children, two per parent (so they share its
    last block and copy it on write), each token a function of the parent's context."""
    picks = []
    for i in range(k):
        b = (i // 2) % len(contexts)
        picks.append((b, (sample(contexts[b]) + i) % VOCAB))
    return picks


def expected_beams(prompt: list[int], k: int, max_tokens: int) -> list[list[int]]:
    beams = [list(prompt)]
    for _ in range(max_tokens):
        beams = [beams[b] + [t] for b, t in _children(beams, k)]
    return [b[len(prompt):] for b in beams]


def drive(scheduler: Scheduler, requests: list[tuple], max_tokens: int, faults: Faults | None = None,
          where: str = "schedule") -> tuple[dict, list]:
    """Run (request_id, prompt, beam_width or 1) requests to the end; returns the outputs (beam
    requests: their last beams) and every step's SchedulerOutput. With `faults`, schedule() and
    update_from_output() may raise inside the block manager: a failed schedule() requeues its requests, a
    failed update_from_output() aborts the requests of its step (their output is then None)."""
    runner = FakeRunner(scheduler.bm.block_size, scheduler.bm.sliding_windows)
    beam_width = {}
    for rid, prompt, k in requests:
        scheduler.add_request(rid, prompt, max_tokens=max_tokens, eos_token_id=None, beam_width=k)
        beam_width[rid] = k
    outputs, steps = {}, []
    seqs_of = {rid: scheduler.requests[rid].seqs for rid, _, _ in requests}
    while scheduler.has_unfinished_requests():
        assert len(steps) < 1000, "the workload did not finish"
        try:
            out = _armed(faults if where == "schedule" else None, scheduler.schedule)
        except Injected:
            assert scheduler.pending is None
            continue
        check_output(scheduler, out)
        steps.append(out)
        sampled = runner.execute(out, lambda seq_id: scheduler._seqs[seq_id].token_ids)
        beams = {}
        for rid in {s.request_id for s in out.scheduled if s.do_sample and beam_width[s.request_id] > 1}:
            request = scheduler.requests[rid]
            live = request.live_seqs()
            picks = _children([seq.token_ids for seq in live], beam_width[rid])
            children = [(live[b].seq_id, t) for b, t in picks]
            if len(live[0].output_token_ids) + 1 == max_tokens:
                outputs[rid] = [live[b].output_token_ids + [t] for b, t in picks]
                beams[rid] = BeamStep(finish_reason="length")
            else:
                beams[rid] = BeamStep(tuple(children))
        try:
            _armed(faults if where != "schedule" else None, scheduler.update_from_output, out, sampled, beams)
        except Injected:
            assert scheduler.pending is None
            for rid in {s.request_id for s in out.scheduled}:
                assert rid not in scheduler.requests
                outputs[rid] = None
        check_block_manager(scheduler.bm, [s for r in scheduler.requests.values() for s in r.live_seqs()])
    for rid, _, k in requests:
        if k == 1 and rid not in outputs:
            outputs[rid] = [seq.output_token_ids for seq in seqs_of[rid]]
    return outputs, steps


def _armed(faults: Faults | None, fn, *args):
    if faults is None:
        return fn(*args)
    faults.armed = True
    try:
        return fn(*args)
    finally:
        faults.armed = False


PROMPTS = [[(7 * i + j) % VOCAB for j in range(13 + 5 * i)] for i in range(6)]
SHARED = [3] * 20  # a prefix two beam requests share through the prefix cache


# Hybrid: a window of 20 frees the beams' early blocks; twice the pool for its two groups still preempts.
@pytest.mark.parametrize("layout,scale", [(None, 1), (kv_cache_layout([None, 20]), 2)])
@pytest.mark.parametrize("num_blocks,mode", [(200, None), (48, "recompute"), (48, "swap")])
def test_beam_requests_share_steps_with_sampling_and_keep_their_beams(num_blocks, mode, layout, scale):
    """Also on hybrid layouts (scale: a pool as tight for their extra groups)."""
    bm = BlockManager(int(num_blocks * scale), block_size=4, num_host_blocks=400 if mode == "swap" else 0,
                      watermark=0.0, kv_cache_layout=layout)
    scheduler = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=16, preemption_mode=mode)
    # The beam requests arrive last, so the victim policy preempts them (the most recently admitted).
    requests = [("s0", PROMPTS[1], 1), ("s1", PROMPTS[3], 1), ("beam2", PROMPTS[5], 2), ("s2", PROMPTS[4], 1),
                ("beam1", SHARED + PROMPTS[2], 3), ("beam0", SHARED + PROMPTS[0], 4)]
    max_tokens = 9
    outputs, steps = drive(scheduler, requests, max_tokens)
    for rid, prompt, k in requests:
        want = expected_beams(prompt, k, max_tokens) if k > 1 else expected_outputs(prompt, max_tokens, eos=None)
        assert outputs[rid] == want, rid
    # Beam decodes and sampling decodes go in the same steps, and a beam request's beams all together.
    assert any({"beam0", "s0"} <= {s.request_id for s in out.scheduled} for out in steps)
    prompts, widths = {r: p for r, p, _ in requests}, {r: k for r, _, k in requests}
    for out in steps:
        for rid in ("beam0", "beam1", "beam2"):
            rows = [s for s in out.scheduled if s.request_id == rid and s.do_sample]
            if rows and rows[0].context_len > len(prompts[rid]):  # past the prompt: every beam, one token each
                assert len(rows) == widths[rid] and all(s.num_scheduled_tokens == 1 for s in rows), (rid, rows)
    assert bm.stats().num_copy_on_write > 0
    if mode is not None:  # beam groups preempted mid-search, whole
        assert any(rid.startswith("beam") for out in steps for rid in out.preempted)
    assert not scheduler.has_unfinished_requests()
    assert_pool_whole(bm)


@pytest.mark.parametrize("where", ["schedule", "update_from_output"])
@pytest.mark.parametrize("seed", range(6))
def test_faults_in_the_bookkeeping_never_change_a_beam(seed, where):
    """Failed steps are recovered for beam requests too: a failed schedule() requeues them (swapped ones
    included) and they end as if undisturbed; a failure among the forks, frees and beam drops of
    update_from_output() aborts them. Either way the pools stay whole."""
    mode = ("recompute", "swap")[seed % 2]
    bm = BlockManager(48, block_size=4, num_host_blocks=200 if mode == "swap" else 0, watermark=0.0)
    scheduler = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=16, preemption_mode=mode)
    requests = [("s0", PROMPTS[1], 1), ("beam2", PROMPTS[5], 2), ("beam1", SHARED + PROMPTS[2], 3),
                ("beam0", SHARED + PROMPTS[0], 4)]
    faults = Faults(bm, random.Random(seed), 0.01)  # per call: a beam step makes dozens (a fork increfs each block)
    outputs, _ = drive(scheduler, requests, 7, faults, where)
    for rid, prompt, k in requests:
        if outputs[rid] is not None:  # None: aborted by a failed update_from_output
            assert outputs[rid] == (expected_beams(prompt, k, 7) if k > 1 else expected_outputs(prompt, 7, eos=None)), rid
    assert faults.fired > 0
    if where == "schedule":
        assert all(out is not None for out in outputs.values())
    assert_pool_whole(bm)


def test_a_beam_request_with_bad_selections_is_refused_and_nothing_changes():
    bm = BlockManager(64, block_size=4)
    scheduler = Scheduler(bm)
    scheduler.add_request("b", PROMPTS[0], max_tokens=4, beam_width=2)
    out = scheduler.schedule()
    (row,) = out.scheduled
    for beams in ({}, {"b": BeamStep(((row.seq_id + 1, 3),))}, {"b": BeamStep(((row.seq_id, 3),) * 3)},
                  {"b": BeamStep(((row.seq_id, -1),))}, {"b": BeamStep(finish_reason="abort")}):
        with pytest.raises(ValueError, match="beam"):
            scheduler.update_from_output(out, {}, beams)
    scheduler.update_from_output(out, {}, {"b": BeamStep(((row.seq_id, 3), (row.seq_id, 4)))})
    assert [s.output_token_ids for s in scheduler.requests["b"].seqs] == [[3], [4]]


def test_beam_width_is_checked_against_the_cache_and_budgets():
    scheduler = Scheduler(BlockManager(8, block_size=4), max_num_seqs=4)
    with pytest.raises(ValueError, match="beam_width"):
        scheduler.add_request("a", [1, 2], beam_width=0)
    with pytest.raises(ValueError, match="n=5"):  # beam_width counts as n: its beams decode in one step
        scheduler.add_request("b", [1, 2], beam_width=5)
    with pytest.raises(ValueError, match="num_kv_blocks"):
        scheduler.add_request("c", [1] * 10, max_tokens=6, beam_width=4)
