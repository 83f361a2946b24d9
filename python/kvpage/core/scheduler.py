"""Iteration-level scheduler: one decision per forward pass, chunked prefill, preemption by swap or recompute.

Each `schedule()` fills one step's token and sequence budgets in this order:
  1. running decodes, one token per sequence (preempting others when a block is missing),
  2. running prefills carried over from an earlier step (chunked to the budget left),
  3. swapped requests back in, first out first in, while blocks allow,
  4. waiting requests in arrival order (preempted-by-recompute ones at the front), chunked; a prefix
     hit may be a block this very step computes for an earlier request (the block manager's
     in-step hits), so requests sharing a system prompt all start in the step that computes it.
Steps 3 and 4 are skipped in a step that preempted (the memory that just ran out is not there to
give), and 4 while anything is swapped (swapped requests would starve behind new ones).
After the runner executes the step, `update_from_output` records what was computed and sampled.
A step that fails (in schedule(), executing it, or recording it) is ended by `recover()`: see there.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterable, Mapping

from .block_manager import BlockManager, CacheConfig
from .block_moves import num_unique_blocks
from .interrupts import deferred_interrupts
from .kv_cache_groups import num_blocks_per_seq
from .policies import get_policy
from .request import FinishReason, Request, RequestStatus
from .scheduler_config import SchedulerConfig, SchedulerStats, check_max_model_len
from .scheduler_output import BeamStep, ScheduledSequence, SchedulerOutput
from .sequence import Sequence, SequenceGroup
from .transaction import OpenStep

__all__ = ["Scheduler", "SchedulerConfig", "SchedulerStats", "check_max_model_len"]


@dataclass
class _Budget:
    tokens: int
    seqs: int

    def fits(self, num_tokens: int, num_seqs: int) -> bool:
        return num_tokens <= self.tokens and num_seqs <= self.seqs


class Scheduler:
    """Owns the KV cache's block manager: `cache` is the CacheConfig it builds it from (or a BlockManager
    already built, to inspect in tests). Nothing outside the scheduler changes its blocks."""

    def __init__(self, cache: CacheConfig | BlockManager, config: SchedulerConfig | None = None, **kwargs) -> None:
        if config is not None and kwargs:
            raise TypeError("pass either a SchedulerConfig or keyword arguments, not both")
        self.config = config if config is not None else SchedulerConfig(**kwargs)
        self.bm = cache if isinstance(cache, BlockManager) else cache.build()
        self.policy = get_policy(self.config.policy)
        # Precedence: an explicit preemption_mode, then the policy's own, then the cost model per victim.
        self.preemption_mode = self.config.preemption_mode or getattr(self.policy, "preemption_mode", None)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # ordered by admit_order: oldest decodes first
        self.swapped: deque[Request] = deque()
        self.requests: dict[str, Request] = {}
        self._seqs: dict[int, Sequence] = {}
        self._finished_ids: list[str] = []
        self._open: OpenStep | None = None  # the step from schedule() until it is recorded or recovered
        self._scheduled: set[str] = set()  # request ids with tokens in the step being built
        self._scheduled_seqs: set[int] = set()
        self.step = 0
        self._next_seq_id = 0
        self._next_arrival = 0
        self._next_admit = 0
        self.num_finished = 0
        self.num_swap_preemptions = 0
        self.num_recompute_preemptions = 0
        # [kv tier] a KV connector (kvpage.kv_offload; the engine sets it where a tier is configured): prompt
        # blocks past the prefix cache's hit that it holds are loaded into fresh blocks instead of computed.
        self.kv_connector = None
        # [spec decode] proposer(request, seq) -> the decode's proposed tokens (kvpage.spec_decode; the engine
        # sets it where speculative_config is given): they run as extra query tokens in lookahead slots.
        self.spec_proposer = None

    # -- requests in and out -------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: Iterable[int], *, max_tokens: int = 16, n: int = 1,
                    eos_token_id: int | None = None, stop_token_ids: Iterable[int] = (),
                    ignore_eos: bool = False, extra_keys: tuple = (), prompt_logits: bool = False,
                    beam_width: int = 1) -> Request:
        """Queue a request, or raise ValueError naming it if it could never run (nothing is queued then).
        prompt_logits: each prompt position's logits (but the last's, which samples) come back once, in
        some step's prompt_logit_positions (prompt_logprobs); the prompt is then not read from the prefix
        cache, as in vLLM, though its blocks are cached for others. beam_width > 1: beam search (see
        Request.beam_width); update_from_output then takes the beams' selection instead of sampled tokens."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        for name, value in (("max_tokens", max_tokens), ("n", n), ("beam_width", beam_width)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"request {request_id!r}: {name} must be a positive int, got {value!r}")
        seq = Sequence(self._next_seq_id, list(prompt_token_ids), extra_keys)
        if not all(isinstance(t, int) and t >= 0 for t in seq.token_ids):
            raise ValueError(f"request {request_id!r}: prompt_token_ids must be non-negative ints")
        if n > 1 and beam_width > 1:
            raise ValueError(f"request {request_id!r}: n={n} with beam_width={beam_width}; beam search returns"
                             " beam_width beams")
        self.check_fits(request_id, seq.num_tokens, max_tokens, max(n, beam_width))
        self._next_seq_id += 1
        request = Request(request_id, SequenceGroup(request_id, [seq]), max_tokens, n, beam_width, eos_token_id,
                          frozenset(stop_token_ids), ignore_eos, arrival_order=self._next_arrival,
                          arrival_step=self.step, wants_prompt_logits=bool(prompt_logits))
        with deferred_interrupts():  # registered in all three places or in none
            self._next_arrival += 1
            self.requests[request_id] = request
            self._seqs[seq.seq_id] = seq
            self.waiting.append(request)
        return request

    def check_fits(self, request_id: str, num_prompt: int, max_tokens: int, n: int) -> None:
        """Reject up front what no amount of waiting or preemption could ever run."""
        cfg = self.config
        if n > min(cfg.max_num_seqs, cfg.max_num_batched_tokens):
            # A group's decodes go in one step, one token per sequence.
            raise ValueError(f"request {request_id!r}: n={n} exceeds max_num_seqs={cfg.max_num_seqs}"
                             f" or max_num_batched_tokens={cfg.max_num_batched_tokens}")
        total = check_max_model_len(num_prompt, max_tokens, cfg.max_model_len, f"request {request_id!r}: ")
        # Worst case: n private copies of the whole sequence (recompute undoes fork sharing), and
        # admission keeps the watermark free, so only the rest of the cache is ever usable. A window
        # group holds its window plus the largest chunk a step may compute.
        bm = self.bm
        need = n * num_blocks_per_seq(bm.kv_cache_layout, total, bm.block_size,
                                      min(total, cfg.max_num_batched_tokens))
        usable = bm.num_usable_blocks
        if need > usable:
            raise ValueError(f"request {request_id!r}: prompt of {num_prompt} tokens + max_tokens={max_tokens}"
                             f" (n={n}) needs {need} KV blocks of {bm.block_size} tokens, but only {usable}"
                             f" of the cache's {bm.num_blocks} (num_kv_blocks) are usable")

    def finish_requests(self, request_ids: str | Iterable[str], reason: FinishReason) -> list[str]:
        """End requests wherever they are (each live sequence with `reason`), freeing their device or
        host blocks; returns the ids it ended (unknown or finished ones are skipped)."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        ended = []
        for request_id in ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            with deferred_interrupts():
                for seq in request.live_seqs():
                    request.finish_reasons[seq.seq_id] = reason
                self._finish_request(request)
            ended.append(request_id)
        return ended

    def finish_sequences(self, request_id: str, seq_ids: Iterable[int], reason: FinishReason) -> None:
        """End single sequences of a request (a stop string in one of its n samples), freeing their
        blocks; the request finishes once none of its sequences is live."""
        request = self.requests.get(request_id)
        if request is None:
            return
        with deferred_interrupts():
            live = {seq.seq_id: seq for seq in request.live_seqs()}
            for seq_id in seq_ids:
                if seq_id in live:
                    request.finish_reasons[seq_id] = reason
                    self.bm.free(live[seq_id])
            if not request.live_seqs():
                self._finish_request(request)

    def abort_request(self, request_id: str) -> bool:
        """finish_requests(request_id, ABORT); False if unknown or done."""
        return bool(self.finish_requests(request_id, FinishReason.ABORT))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def sequences(self) -> list[Sequence]:
        """Every sequence of the unfinished requests: together their tables hold every used block."""
        return list(self._seqs.values())

    # -- one step ------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Decide the next step. If this raises, the step has been recovered (see recover())."""
        if self._open is not None:
            if self._open.out is not None and not self._open.committing:
                raise RuntimeError(f"schedule() called again before update_from_output() for step {self._open.out.step}")
            self.recover()  # a failed step whose clean-up an interrupt cut short
        self._open = OpenStep()
        try:
            out = self._schedule()
        except BaseException:
            self.recover()
            raise
        with deferred_interrupts():  # the runner hears of the finished requests once, with this step
            self._finished_ids = []
            self._open.out = out
            self.step += 1
        return out

    @property
    def pending(self) -> SchedulerOutput | None:
        """The step schedule() returned that neither update_from_output nor recover() has ended."""
        return self._open.out if self._open is not None and not self._open.committing else None

    def recover(self) -> list[str] | None:
        """End a step that did not complete; the scheduler can then schedule again. Returns the ids of
        the requests it requeued or finished, or None if no step was open.

        If schedule() raised, or executing its step failed, every request the step touched (admitted,
        scheduled, preempted, swapped in) is requeued as by recompute preemption: its blocks dropped,
        its computed tokens 0, waiting at the front of the queue (oldest admitted first); its tokens
        stay, so a deterministic request ends with the output it would have had. If recording the step
        (update_from_output) raised, which its checked inputs leave to bugs, every request the step
        scheduled is finished (aborted), keeping the tokens appended so far. Either way the block pools
        are rebuilt from the remaining block tables, and blocks indexed during the step are no prefix
        hits any more (a swap-in or a KV-tier load indexes blocks before the step fills them).
        """
        step = self._open
        if step is None:
            return None
        with deferred_interrupts():
            if step.committing:
                ids, dropped = self._finish_failed(step.out)
            else:
                ids, dropped = self._requeue_failed(step)
            self._seqs = {seq.seq_id: seq for request in self.requests.values() for seq in request.seqs}
            self.bm.recover(self.sequences(), dropped)
            self._open = None
        return ids

    def discard_step(self, out: SchedulerOutput) -> bool:
        """recover() from a step whose execution failed (the runner may have carried out any part of
        `out`, or none); False (and nothing changes) if `out` is not the pending step."""
        if out is not self.pending:
            return False
        self.recover()
        return True

    def _requeue_failed(self, step: OpenStep) -> tuple[list[str], list]:
        requests = [r for r in step.touched.values() if not r.status.is_finished]
        if step.out is not None:  # the runner may never have seen them
            self._finished_ids = step.out.finished_request_ids + self._finished_ids
        self._remove_from_queues({id(r) for r in requests})
        front = sorted(requests, key=lambda r: (r.admit_order < 0, r.admit_order, r.arrival_order))
        for request in front:
            request.status = RequestStatus.WAITING
        self.waiting.extendleft(reversed(front))
        return [r.request_id for r in requests], [seq for r in requests for seq in r.seqs]

    def _finish_failed(self, out: SchedulerOutput) -> tuple[list[str], list]:
        ids = list(dict.fromkeys(s.request_id for s in out.scheduled))
        requests = [self.requests[rid] for rid in ids if rid in self.requests]
        for request in requests:
            for seq in request.seqs:
                request.finish_reasons.setdefault(seq.seq_id, FinishReason.ABORT)
            request.status = request.final_status()
            request.finished_step = self.step
            del self.requests[request.request_id]
            self._finished_ids.append(request.request_id)
            self.num_finished += 1
        self._remove_from_queues({id(r) for r in requests})
        return ids, [seq for r in requests for seq in r.seqs]

    def _remove_from_queues(self, gone: set[int]) -> None:
        """Take the requests whose id() is in `gone` out of every queue, wherever a failure left them."""
        self.running = [r for r in self.running if id(r) not in gone]
        self.swapped = deque(r for r in self.swapped if id(r) not in gone)
        self.waiting = deque(r for r in self.waiting if id(r) not in gone)

    def _schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(self.step, finished_request_ids=self._finished_ids)
        self._scheduled, self._scheduled_seqs = set(), set()
        self.bm.begin_step()
        if self.kv_connector is not None:  # [kv tier]
            self.kv_connector.begin_step()
        budget = _Budget(self.config.max_num_batched_tokens, self.config.max_num_seqs)
        self._schedule_decodes(out, budget)
        self._schedule_running_prefills(out, budget)
        if not out.preempted:
            self._schedule_swapped(out, budget)
            if not self.swapped:
                self._schedule_waiting(out, budget)
        if self.kv_connector is not None:  # [kv tier]
            out.kv_connector_meta = self.kv_connector.build_connector_meta()
        return out

    def _schedule_decodes(self, out: SchedulerOutput, budget: _Budget) -> None:
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            seqs = self._decode_seqs(request)
            if not seqs or not budget.fits(len(seqs), len(seqs)):
                continue
            plan = self._spec_plan(request, seqs, budget)  # [spec decode] [(s, 1)] without proposals
            if self._make_room(request, plan, out, preempt_self=True):
                for seq, n in plan:
                    self._append(request, seq, n, out, budget)

    def _spec_plan(self, request: Request, seqs: list[Sequence], budget: _Budget) -> list[tuple[Sequence, int]]:
        """[spec decode] Each decode's tokens: 1, plus its proposed tokens where a proposer gives some and
        they fit the budget and the free blocks as they are (lookahead never preempts anyone)."""
        if self.spec_proposer is None:
            return [(seq, 1) for seq in seqs]
        for seq in seqs:
            seq.spec_token_ids = self.spec_proposer(request, seq)
        plan = [(seq, 1 + len(seq.spec_token_ids)) for seq in seqs]
        if len(plan) != sum(n for _, n in plan) and not (
                budget.fits(sum(n for _, n in plan), len(plan))
                and self.bm.num_blocks_to_append(plan) <= self.bm.num_free_blocks):
            for seq in seqs:
                seq.spec_token_ids = []
            plan = [(seq, 1) for seq in seqs]
        return plan

    @staticmethod
    def _decode_seqs(request: Request) -> list[Sequence]:
        """The sequences with one token left to compute. A beam request's decode together, once every
        beam has computed all but its last token (after a recompute, say), or not at all."""
        live = request.live_seqs()
        seqs = [s for s in live if s.block_table and s.num_uncomputed_tokens == 1]
        return [] if request.is_beam_search and len(seqs) < len(live) else seqs

    def _schedule_running_prefills(self, out: SchedulerOutput, budget: _Budget) -> None:
        for request in list(self.running):
            if request.status is RequestStatus.RUNNING:
                self._schedule_prefills(request, out, budget, may_preempt=True)

    def _schedule_prefills(self, request: Request, out: SchedulerOutput, budget: _Budget,
                           may_preempt: bool) -> None:
        """Carry on (or start) each sequence's prefill with a chunk of what the budget has left."""
        for seq in request.live_seqs():
            if not budget.fits(1, 1):
                return
            if seq.seq_id in self._scheduled_seqs:
                continue  # admitted a moment ago: its tokens count as computed only after the step
            if not seq.block_table:
                if not self._allocate(request, seq, out, budget):
                    return
            elif seq.num_uncomputed_tokens > 1 + request.holds_back_last_token(seq):
                n = min(seq.num_uncomputed_tokens - request.holds_back_last_token(seq), budget.tokens)
                # Never preempt yourself to continue a prefill: the decodes already taken this step
                # are newer work, and the request would just come back to the same spot.
                if not self._make_room(request, [(seq, n)], out, preempt_self=False, may_preempt=may_preempt):
                    return
                self._append(request, seq, n, out, budget)

    def _schedule_swapped(self, out: SchedulerOutput, budget: _Budget) -> None:
        while self.swapped:
            request = self.swapped[0]
            seqs = request.live_seqs()
            if not budget.fits(len(seqs), len(seqs)) or not self.bm.can_swap_in(seqs):
                return
            self._open.touch(request)
            self.swapped.popleft()
            out.blocks_to_swap_in.extend(self.bm.swap_in(seqs))
            self._to_running(request)
            decodes = self._decode_seqs(request)
            if self._make_room(request, [(s, 1) for s in decodes], out, preempt_self=False, may_preempt=False):
                for seq in decodes:
                    self._append(request, seq, 1, out, budget)
            self._schedule_prefills(request, out, budget, may_preempt=False)

    def _schedule_waiting(self, out: SchedulerOutput, budget: _Budget) -> None:
        while self.waiting and budget.fits(1, 1):
            request = self.waiting[0]
            head = request.live_seqs()[0]
            # Strict arrival order: skipping a head that does not fit would let small requests starve it.
            if not self._allocate(request, head, out, budget):
                return
            self.waiting.popleft()
            if request.admit_order < 0:
                request.admit_order = self._next_admit
                self._next_admit += 1
            self._to_running(request)
            self._schedule_prefills(request, out, budget, may_preempt=False)

    # -- blocks --------------------------------------------------------------------------------

    def _allocate(self, request: Request, seq: Sequence, out: SchedulerOutput, budget: _Budget) -> bool:
        """Admit a block-less sequence with a chunk of the budget, past its prefix-cache hits."""
        self._open.touch(request)
        use_cache = not request.prompt_logits_pending
        hit = self.bm.lookup_prefix(seq, use_cache)
        ext = 0
        if self.kv_connector is not None and use_cache and not out.preempted:  # [kv tier]
            ext = self.kv_connector.get_num_new_matched_tokens(seq, hit)
        n = min(seq.num_tokens - request.holds_back_last_token(seq) - hit - ext, budget.tokens)
        if not self.bm.can_allocate(seq, ext + n, use_cache):
            return False
        # [kv tier] a re-admission after preemption is no new prefix-cache query
        cached = self.bm.allocate(seq, ext + n, use_cache, count_hits=request.num_preemptions == 0)
        if ext:  # [kv tier]
            cached += self._load_external(request, seq, cached, ext)
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = cached
        if n:  # 0: a beam whose cached prefix is all it lacks but its last token (the next decode's)
            self._record(request, seq, n, out, budget)
        return True

    def _load_external(self, request: Request, seq: Sequence, start: int, ext: int) -> int:
        """[kv tier] The connector's `ext` tokens after `start` load into the blocks just allocated for them,
        and count as computed (indexed now, as swap_in indexes its blocks; the step loads them before its
        forward pass, and discard_step distrusts them as it does swap-in destinations)."""
        bs = self.bm.block_size
        blocks = seq.block_table[start // bs:(start + ext) // bs]
        self.kv_connector.update_state_after_alloc(seq, blocks, is_recompute=request.num_cached_tokens >= 0)
        self.bm.mark_computed(seq, ext)
        return ext

    def _append(self, request: Request, seq: Sequence, n: int, out: SchedulerOutput, budget: _Budget) -> None:
        self._open.touch(request)
        out.blocks_to_copy.extend(self.bm.append_slots(seq, n))
        self._record(request, seq, n, out, budget)

    def _make_room(self, request: Request, plan: list[tuple[Sequence, int]], out: SchedulerOutput,
                   preempt_self: bool, may_preempt: bool = True) -> bool:
        """Preempt victims until `plan` fits; False (after preempting `request` if allowed) if it cannot."""
        while self.bm.num_blocks_to_append(plan) > self.bm.num_free_blocks:
            if not may_preempt:
                return False
            candidates = [r for r in self.running if r is not request and r.request_id not in self._scheduled]
            if not candidates:
                if preempt_self and request.request_id not in self._scheduled:
                    self._preempt(request, out)
                return False
            self._preempt(self.policy.select(candidates), out)
        return True

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self._open.touch(request)
        seqs = request.live_seqs()
        self.running.remove(request)
        request.num_preemptions += 1
        out.preempted.append(request.request_id)
        if self._preemption_mode(seqs) == "swap" and self.bm.can_swap_out(seqs):
            out.blocks_to_swap_out.extend(self.bm.swap_out(seqs))
            request.status = RequestStatus.SWAPPED
            self.swapped.append(request)
            self.num_swap_preemptions += 1
        else:  # recompute, or swap with the host pool full
            for seq in seqs:
                self.bm.free(seq)
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)
            self.num_recompute_preemptions += 1

    def _preemption_mode(self, seqs: list[Sequence]) -> str:
        if self.preemption_mode is not None:
            return self.preemption_mode
        if self.bm.num_host_blocks == 0:
            return "recompute"
        num_blocks = num_unique_blocks(seqs)
        num_tokens = sum(s.num_computed_tokens for s in seqs)
        return self.config.cost_model.choose(num_blocks, self.bm.block_size, num_tokens)

    # -- bookkeeping ---------------------------------------------------------------------------

    def _to_running(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        i = len(self.running)
        while i and self.running[i - 1].admit_order > request.admit_order:
            i -= 1
        self.running.insert(i, request)

    def _record(self, request: Request, seq: Sequence, n: int, out: SchedulerOutput, budget: _Budget) -> None:
        start = seq.num_computed_tokens
        end = start + n
        spec = seq.spec_token_ids if end > seq.num_tokens else []  # [spec decode] a decode's proposed tokens
        do_sample = end == seq.num_tokens + len(spec)
        tables = [list(table) for table in seq.block_tables]
        slots = self.bm.slot_mappings(seq, start, end)
        out.scheduled.append(ScheduledSequence(
            request.request_id, seq.seq_id, start, n, seq.token_ids[start:end] + spec, tables[0], slots[0],
            is_prefill=n > 1 or start < seq.num_prompt_tokens,
            do_sample=do_sample, num_samples=request.n if do_sample and request.needs_fork else 1,
            prompt_logit_positions=request.prompt_logit_positions(start, end), block_tables=tables,
            slot_mappings=slots, spec_token_ids=list(spec)))
        budget.tokens -= n
        budget.seqs -= 1
        if start < seq.num_prompt_tokens:
            # After the slot mapping: sequences admitted later in this step hit these blocks (a
            # shared system prompt is computed once, and every request sharing it starts now).
            self.bm.note_computing(seq, start, end - len(spec))  # [spec decode] real tokens only
        self._scheduled.add(request.request_id)
        self._scheduled_seqs.add(seq.seq_id)
        if request.first_scheduled_step < 0:
            request.first_scheduled_step = self.step

    # -- after the step ------------------------------------------------------------------------

    def update_from_output(self, out: SchedulerOutput, sampled: Mapping[int, int | list[int]],
                           beams: Mapping[str, BeamStep] | None = None) -> list[Request]:
        """Record the step `out` described: its tokens are computed, and each sampling sequence gets
        its sampled token(s) (a list of num_samples where that is > 1); each beam request whose beams
        sampled gets its selection in `beams` instead (by request id). Returns requests that finished."""
        if out is not self.pending:
            raise ValueError("update_from_output expects the SchedulerOutput of the latest schedule()")
        # Aborted after schedule(): its blocks are already free, and nothing it sampled matters.
        live = [(s, self.requests[s.request_id]) for s in out.scheduled
                if s.request_id in self.requests and s.seq_id not in self.requests[s.request_id].finish_reasons]
        # Check all first.
        tokens = {s.seq_id: self._sampled_tokens(s, sampled) for s, r in live if s.do_sample and not r.is_beam_search}
        selections = self._beam_steps(live, beams or {})
        try:
            with deferred_interrupts():
                self._open.committing = True
                finished = self._commit(live, tokens, selections)
                self._open = None
        except BaseException:
            self.recover()  # finishes the step's requests: their tokens may be half-appended
            raise
        if self.kv_connector is not None:  # [kv tier] the blocks this step filled are now worth keeping
            self.kv_connector.on_step_computed(self.bm)
        return finished

    def _commit(self, live, tokens: dict[int, list[int]], selections: list[tuple[Request, BeamStep]]) -> list[Request]:
        finished = []
        for s, request in live:
            seq = self._seqs[s.seq_id]
            if s.spec_token_ids:  # [spec decode] computed: the first token and the accepted drafts only
                self._commit_spec(request, seq, tokens[s.seq_id])
                if not request.live_seqs():
                    self._finish_request(request)
                    finished.append(request)
                continue
            self.bm.mark_computed(seq, s.num_scheduled_tokens)
            if s.prompt_logit_positions:
                request.num_prompt_logits_done = max(request.num_prompt_logits_done, s.prompt_logit_positions.stop)
            if s.do_sample and not request.is_beam_search:
                self._append_sampled(request, seq, tokens[s.seq_id])
                if not request.live_seqs():
                    self._finish_request(request)
                    finished.append(request)
        for request, step in selections:  # after every beam of the step is marked computed
            if self._apply_beam_step(request, step):
                finished.append(request)
        return finished

    def _commit_spec(self, request: Request, seq: Sequence, tokens: list[int]) -> None:
        """[spec decode] A speculating decode's verified tokens (accepted drafts, then the target's own),
        appended one at a time up to the first stop (eos, a stop id, max_tokens, the context limit: the rest
        is dropped). Computed: every appended token but the last, whose K/V the step wrote from an accepted
        token; the rejected drafts' slots are past that count and the next step overwrites them."""
        seq.spec_token_ids = []
        reason = None
        for token in tokens:
            seq.append_token(token)
            reason = request.stop_reason(seq, self.config.max_model_len)
            if reason is not None:
                break
        self.bm.mark_computed(seq, seq.num_tokens - 1 - seq.num_computed_tokens)
        if reason is not None:
            request.finish_reasons[seq.seq_id] = reason
            self.bm.free(seq)

    def _beam_steps(self, live, beams: Mapping[str, BeamStep]) -> list[tuple[Request, BeamStep]]:
        """The selection of each beam request whose beams sampled this step, checked against them."""
        sampling: dict[str, tuple[Request, set[int]]] = {}
        for s, request in live:
            if s.do_sample and request.is_beam_search:
                sampling.setdefault(s.request_id, (request, set()))[1].add(s.seq_id)
        selections = []
        for rid, (request, seq_ids) in sampling.items():
            step = beams.get(rid)
            if not isinstance(step, BeamStep):
                raise ValueError(f"beams has no BeamStep for beam request {rid!r}, got {step!r}")
            if seq_ids != {seq.seq_id for seq in request.live_seqs()}:
                raise ValueError(f"beam request {rid!r}: its beams did not all sample in this step")
            if step.finish_reason is None:
                if not 1 <= len(step.children) <= request.beam_width or not all(
                        p in seq_ids and isinstance(t, int) and t >= 0 for p, t in step.children):
                    raise ValueError(f"beams[{rid!r}]: 1 to {request.beam_width} children (parent seq_id among"
                                     f" {sorted(seq_ids)}, token id >= 0) or a finish_reason, got {step!r}")
            elif step.finish_reason not in (FinishReason.STOP.value, FinishReason.LENGTH.value):
                raise ValueError(f"beams[{rid!r}].finish_reason must be 'stop' or 'length', got {step.finish_reason!r}")
            selections.append((request, step))
        return selections

    def _apply_beam_step(self, request: Request, step: BeamStep) -> bool:
        """Fork the next beams from their parents (blocks shared: copy-on-write when they write), free
        the old ones; or end the request. True if it finished."""
        old = request.live_seqs()
        if step.finish_reason is not None:
            for seq in old:
                request.finish_reasons[seq.seq_id] = FinishReason(step.finish_reason)
            self._finish_request(request)
            return True
        parents = {seq.seq_id: seq for seq in old}
        children = []
        for parent_id, token in step.children:
            child = self._fork(parents[parent_id])
            child.append_token(token)
            children.append(child)
        for seq in old:
            self.bm.free(seq)
            del self._seqs[seq.seq_id]
        request.group.seqs[:] = children
        return False

    @staticmethod
    def _sampled_tokens(s: ScheduledSequence, sampled: Mapping[int, int | list[int]]) -> list[int]:
        if s.seq_id not in sampled:
            raise ValueError(f"sampled has no token for seq {s.seq_id} (request {s.request_id!r})")
        tokens = sampled[s.seq_id]
        tokens = [tokens] if isinstance(tokens, int) else list(tokens)
        if s.spec_token_ids:  # [spec decode]
            return _check_spec_tokens(s, tokens)
        if len(tokens) != s.num_samples or not all(isinstance(t, int) and t >= 0 for t in tokens):
            raise ValueError(f"sampled[{s.seq_id}] must be {s.num_samples} non-negative int token id(s),"
                             f" got {sampled[s.seq_id]!r}")
        return tokens

    def _append_sampled(self, request: Request, seq: Sequence, tokens: list[int]) -> None:
        targets = [seq]
        for _ in tokens[1:]:  # the prompt just completed: fork the other samples onto its blocks
            child = self._fork(seq)
            request.group.seqs.append(child)
            targets.append(child)
        for target, token in zip(targets, tokens):
            target.append_token(token)
            reason = request.stop_reason(target, self.config.max_model_len)
            if reason is not None:
                request.finish_reasons[target.seq_id] = reason
                self.bm.free(target)

    def _fork(self, parent: Sequence) -> Sequence:
        """A new registered sequence sharing the parent's tokens and blocks (n > 1 samples, beams)."""
        child = parent.fork(self._next_seq_id)
        self._next_seq_id += 1
        self.bm.fork(parent, child)
        self._seqs[child.seq_id] = child
        return child

    def _finish_request(self, request: Request) -> None:
        for seq in request.seqs:
            self.bm.free(seq)
        self._retire(request)

    def _retire(self, request: Request) -> None:
        """Take a request whose sequences hold no blocks out of its queue: it is finished."""
        for seq in request.seqs:
            self._seqs.pop(seq.seq_id, None)
        queue = {RequestStatus.WAITING: self.waiting, RequestStatus.RUNNING: self.running,
                 RequestStatus.SWAPPED: self.swapped}[request.status]
        queue.remove(request)
        request.status = request.final_status()
        request.finished_step = self.step
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)
        self.num_finished += 1

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_waiting=len(self.waiting), num_running=len(self.running), num_swapped=len(self.swapped),
            num_finished=self.num_finished,
            num_preemptions=self.num_swap_preemptions + self.num_recompute_preemptions,
            num_swap_preemptions=self.num_swap_preemptions,
            num_recompute_preemptions=self.num_recompute_preemptions, blocks=self.bm.stats())


def _check_spec_tokens(s: ScheduledSequence, tokens: list[int]) -> list[int]:
    """[spec decode] A speculating decode's tokens: a run of its proposed tokens (only those have the K/V the
    step wrote), then one more."""
    spec = s.spec_token_ids
    if not 1 <= len(tokens) <= len(spec) + 1 or tokens[:-1] != spec[:len(tokens) - 1] or not all(
            isinstance(t, int) and t >= 0 for t in tokens):
        raise ValueError(f"sampled[{s.seq_id}] must be a prefix of the proposed tokens {spec} then one more"
                         f" token id, got {tokens!r}")
    return tokens
