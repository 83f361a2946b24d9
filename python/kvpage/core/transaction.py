"""A step's bookkeeping as a transaction: what a step may change, saved so it can be put back.

A step changes queues, a few counters, and the requests it touches (their sequences' block tables,
computed-token counts, swap flags and tokens). A snapshot saves exactly that: the queues whole, the
running and swapped requests up front, a waiting request the moment it is admitted. Restoring puts
those back and then rebuilds the block pools' accounting from the restored block tables, so an
exception anywhere (inside a block-pool method included) leaves no half-applied ref count behind.
Cost: a copy of each touched sequence's block tables (one per KV-cache group) per step, nothing per token.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .request import Request, RequestStatus
from .sequence import Sequence


@dataclass(frozen=True)
class _SeqState:
    seq: Sequence
    block_tables: list[list[int]]  # every KV-cache group's
    num_computed_tokens: int
    swapped: bool
    num_tokens: int
    num_hashes: int

    @classmethod
    def of(cls, seq: Sequence) -> "_SeqState":
        return cls(seq, [list(t) for t in seq.block_tables], seq.num_computed_tokens, seq.swapped, len(seq.token_ids),
                   len(seq.block_hashes))

    def restore(self) -> None:
        seq = self.seq
        seq.block_tables, seq.num_computed_tokens = [list(t) for t in self.block_tables], self.num_computed_tokens
        seq.swapped = self.swapped
        del seq.token_ids[self.num_tokens:]
        # The memoised hashes of blocks completed by tokens taken back would outlive those tokens.
        del seq.block_hashes[self.num_hashes:]


@dataclass(frozen=True)
class _RequestState:
    request: Request
    status: RequestStatus
    admit_order: int
    num_cached_tokens: int
    num_preemptions: int
    first_scheduled_step: int
    finished_step: int
    num_prompt_logits_done: int
    finish_reasons: dict
    seqs: list[_SeqState]

    @classmethod
    def of(cls, r: Request) -> "_RequestState":
        return cls(r, r.status, r.admit_order, r.num_cached_tokens, r.num_preemptions, r.first_scheduled_step,
                   r.finished_step, r.num_prompt_logits_done, dict(r.finish_reasons), [_SeqState.of(s) for s in r.seqs])

    def restore(self) -> None:
        r = self.request
        (r.status, r.admit_order, r.num_cached_tokens, r.num_preemptions, r.first_scheduled_step, r.finished_step,
         r.num_prompt_logits_done) = (self.status, self.admit_order, self.num_cached_tokens, self.num_preemptions,
                                      self.first_scheduled_step, self.finished_step, self.num_prompt_logits_done)
        r.finish_reasons.clear()
        r.finish_reasons.update(self.finish_reasons)
        # Children forked since go; beams the step's selection dropped come back.
        r.group.seqs[:] = [s.seq for s in self.seqs]
        for s in self.seqs:
            s.restore()


@dataclass
class SchedulerSnapshot:
    """The scheduler as it was before a step (the Scheduler fills and restores `state`, its own
    fields); `save` each request before the step first changes it."""

    state: dict
    manager_counters: tuple
    saved: dict = field(default_factory=dict)  # id(request) -> _RequestState

    def save(self, request: Request) -> None:
        if id(request) not in self.saved:
            self.saved[id(request)] = _RequestState.of(request)

    def restore_requests(self) -> None:
        for state in self.saved.values():
            state.restore()
