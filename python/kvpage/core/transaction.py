"""The open step: what the scheduler needs to end a step that failed, instead of a snapshot to restore.

A step that fails before it is recorded requeues every request it touched, as recompute preemption
does; one that fails while being recorded finishes the requests it scheduled. Either way nothing is
put back field by field: the step only has to know which requests it touched (Scheduler.recover).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .interrupts import deferred_interrupts
from .request import FinishReason, Request, RequestStatus
from .scheduler_output import SchedulerOutput


@dataclass
class OpenStep:
    """From schedule() until update_from_output() has recorded the step."""

    # The requests the step may have changed, by id, each logged before its first change.
    touched: dict[str, Request] = field(default_factory=dict)
    out: SchedulerOutput | None = None  # set once schedule() returned it
    committing: bool = False  # update_from_output() is recording it: its requests' tokens may be half-appended

    def touch(self, request: Request) -> None:
        self.touched.setdefault(request.request_id, request)


class StepRecovery:
    """Scheduler mixin: ends the open step `_open` that failed. Requeues or finishes requests (queues,
    `requests`, `_finished_ids`), rebuilds `_seqs` and the block manager's pools from the surviving tables."""

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
