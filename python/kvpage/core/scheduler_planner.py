"""The decision of one step (the Scheduler's StepPlanner): who runs, with how many tokens, in which slots.

Each `schedule()` fills one step's token and sequence budgets in this order:
  1. running decodes, one token per sequence (preempting others when a block is missing),
  2. running prefills carried over from an earlier step (chunked to the budget left),
  3. swapped requests back in, first out first in, while blocks allow,
  4. waiting requests in arrival order (preempted-by-recompute ones at the front), chunked; a prefix
     hit may be a block this very step computes for an earlier request (the block manager's
     in-step hits), so requests sharing a system prompt all start in the step that computes it.
Steps 3 and 4 are skipped in a step that preempted (the memory that just ran out is not there to
give), and 4 while anything is swapped (swapped requests would starve behind new ones).
Every request is logged in the open step (transaction.OpenStep) before the plan changes it.
"""
from __future__ import annotations

from dataclasses import dataclass

from .request import Request, RequestStatus
from .scheduler_output import ScheduledSequence, SchedulerOutput
from .sequence import Sequence


@dataclass
class Budget:
    """What a step has left to give: tokens (max_num_batched_tokens) and sequences (max_num_seqs)."""

    tokens: int
    seqs: int

    def fits(self, num_tokens: int, num_seqs: int) -> bool:
        return num_tokens <= self.tokens and num_seqs <= self.seqs


class StepPlanner:
    """Scheduler mixin. Reads and changes the Scheduler's queues (waiting, running, swapped), its block
    manager `bm`, the open step `_open` and the step's `_scheduled` / `_scheduled_seqs`; preemption
    (`_make_room`) and speculative plans (`_spec_plan`) come from their own mixins."""

    def _schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(self.step, finished_request_ids=self._finished_ids)
        self._scheduled, self._scheduled_seqs = set(), set()
        self._external_hits: list[tuple[Request, int]] = []  # [kv tier] first admissions' tier hits this step
        self.bm.begin_step()
        if self.kv_connector is not None:  # [kv tier]
            self.kv_connector.begin_step()
        budget = Budget(self.config.max_num_batched_tokens, self.config.max_num_seqs)
        self._schedule_decodes(out, budget)
        self._schedule_running_prefills(out, budget)
        if not out.preempted:
            self._schedule_swapped(out, budget)
            if not self.swapped:
                self._schedule_waiting(out, budget)
        if self.kv_connector is not None:  # [kv tier]
            out.kv_connector_meta = self.kv_connector.build_connector_meta()
        return out

    def _schedule_decodes(self, out: SchedulerOutput, budget: Budget) -> None:
        proposals = self._spec_proposals(budget)  # [spec decode] {} without a proposer
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            seqs = self._decode_seqs(request)
            if not seqs or not budget.fits(len(seqs), len(seqs)):
                continue
            plan = self._spec_plan(seqs, proposals, budget)  # [spec decode] [(s, 1)] without proposals
            if self._make_room(request, plan, out, preempt_self=True):
                for seq, n in plan:
                    self._append(request, seq, n, out, budget)

    @staticmethod
    def _decode_seqs(request: Request) -> list[Sequence]:
        """The sequences with one token left to compute. A beam request's decode together, once every
        beam has computed all but its last token (after a recompute, say), or not at all."""
        live = request.live_seqs()
        seqs = [s for s in live if s.block_table and s.num_uncomputed_tokens == 1]
        return [] if request.is_beam_search and len(seqs) < len(live) else seqs

    def _schedule_running_prefills(self, out: SchedulerOutput, budget: Budget) -> None:
        for request in list(self.running):
            if request.status is RequestStatus.RUNNING:
                self._schedule_prefills(request, out, budget, may_preempt=True)

    def _schedule_prefills(self, request: Request, out: SchedulerOutput, budget: Budget,
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

    def _schedule_swapped(self, out: SchedulerOutput, budget: Budget) -> None:
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

    def _schedule_waiting(self, out: SchedulerOutput, budget: Budget) -> None:
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

    # -- blocks and the step's record ----------------------------------------------------------

    def _allocate(self, request: Request, seq: Sequence, out: SchedulerOutput, budget: Budget) -> bool:
        """Admit a block-less sequence with a chunk of the budget, past its prefix-cache hits."""
        self._open.touch(request)
        use_cache = not request.prompt_logits_pending
        hit = self.bm.lookup_prefix(seq, use_cache)
        ext = 0
        if self.kv_connector is not None and use_cache and not out.preempted:  # [kv tier]
            ext = self.kv_connector.get_num_new_matched_tokens(seq, hit)
        n = min(seq.num_tokens - request.holds_back_last_token(seq) - hit - ext, budget.tokens)
        # [kv tier] num_external_tokens: a window group gets no block for loaded positions outside its window
        if not self.bm.can_allocate(seq, ext + n, use_cache, num_external_tokens=ext):
            return False
        cached = self.bm.allocate(seq, ext + n, use_cache, count_hits=_is_first_admission(request),
                                  num_external_tokens=ext)
        if ext:  # [kv tier]
            cached += self._load_external(request, seq, cached, ext)
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = cached
        if n:  # 0: a beam whose cached prefix is all it lacks but its last token (the next decode's)
            self._record(request, seq, n, out, budget)
        return True

    def _load_external(self, request: Request, seq: Sequence, start: int, ext: int) -> int:
        """[kv tier] The connector's `ext` tokens after `start` load into the blocks just allocated for them,
        and count as computed (the full blocks indexed now, as swap_in indexes its blocks; the step loads them
        before its forward pass, and discard_step distrusts them as it does swap-in destinations). A partial
        last block's tokens count too; its block is indexed once this sequence's prefill fills it."""
        bs = self.bm.block_size
        blocks = seq.block_table[start // bs:-(-(start + ext) // bs)]  # a partial last block's too
        self.kv_connector.update_state_after_alloc(seq, blocks, is_recompute=request.num_cached_tokens >= 0)
        if request.num_cached_tokens < 0:  # counted as cached tokens below, until the load fails
            self._external_hits.append((request, ext))
        self.bm.mark_computed(seq, ext)
        return ext

    def undo_external_hits(self) -> None:
        """[kv tier] The step's tier load failed (KVLoadError; the engine recovers the step): the tokens its
        first admissions counted as loaded from the tier were never loaded, so they leave num_cached_tokens
        (their usage cached_tokens; the connector drops its own count, OffloadingConnector.on_load_failed). The
        retry is no first admission (_is_first_admission) and counts nothing more."""
        for request, ext in self._external_hits:
            request.num_cached_tokens -= ext
        self._external_hits = []

    def _append(self, request: Request, seq: Sequence, n: int, out: SchedulerOutput, budget: Budget) -> None:
        self._open.touch(request)
        out.blocks_to_copy.extend(self.bm.append_slots(seq, n))
        self._record(request, seq, n, out, budget)

    def _to_running(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        i = len(self.running)
        while i and self.running[i - 1].admit_order > request.admit_order:
            i -= 1
        self.running.insert(i, request)

    def _record(self, request: Request, seq: Sequence, n: int, out: SchedulerOutput, budget: Budget) -> None:
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


def _is_first_admission(request: Request) -> bool:
    """Whether this admission queries the prefix cache for the statistics: only a request's first. A re-admission
    after recompute preemption, or after a step that failed (Scheduler.recover requeues its requests; a KV tier
    load that failed, KVLoadError, among them) is no new query: num_cached_tokens, set at the first, stays."""
    return request.num_cached_tokens < 0
