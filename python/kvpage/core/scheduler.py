"""Iteration-level scheduler: one decision per forward pass, chunked prefill, preemption by swap or recompute.

The Scheduler owns the requests and the KV cache's block manager. Its work is split by job:
  scheduler_planner.py     the decision of a step: its token / sequence budget, who runs and with how many tokens
  scheduler_preemption.py  making room: victims, swap or recompute
  scheduler_spec.py        [spec decode] proposed tokens in a decode's plan, and committing the verified ones
  scheduler_commit.py      after the step: recording what was computed and sampled (beams included)
  transaction.py           a step that failed (in schedule(), executing it, or recording it): recover()
This module holds the requests' way in and out, schedule() itself, and the counters.
"""
from __future__ import annotations

from collections import deque
from typing import Iterable

from .block_manager import BlockManager, CacheConfig
from .interrupts import deferred_interrupts
from .kv_cache_groups import num_blocks_per_seq
from .policies import get_policy
from .request import FinishReason, Request, RequestStatus
from .scheduler_commit import StepCommit
from .scheduler_config import SchedulerConfig, SchedulerStats, check_max_model_len
from .scheduler_output import SchedulerOutput
from .scheduler_planner import StepPlanner
from .scheduler_preemption import Preemption
from .scheduler_spec import SpecDecodeSteps
from .sequence import Sequence, SequenceGroup
from .transaction import OpenStep, StepRecovery

__all__ = ["Scheduler", "SchedulerConfig", "SchedulerStats", "check_max_model_len"]


class Scheduler(StepPlanner, Preemption, SpecDecodeSteps, StepCommit, StepRecovery):
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
        # [spec decode] proposer([(request, seq), ...]) -> each decode's proposed tokens, one call a step
        # (kvpage.spec_decode; the engine sets it where speculative_config is given): they run as extra query
        # tokens in lookahead slots.
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
                    self._free_finished(live[seq_id])
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

    # -- bookkeeping ---------------------------------------------------------------------------

    def _finish_request(self, request: Request) -> None:
        for seq in request.seqs:
            self._free_finished(seq)
        self._retire(request)

    def _free_finished(self, seq: Sequence) -> None:
        """Free a finished sequence's blocks (idempotent); [kv tier] the connector hears of it first (it stores
        the sequence's last partial block, whose bytes stay intact until the next step runs)."""
        if self.kv_connector is not None and seq.block_tables[0]:
            self.kv_connector.request_finished(seq)
        self.bm.free(seq)

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
