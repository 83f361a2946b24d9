"""The open step: what the scheduler needs to end a step that failed, instead of a snapshot to restore.

A step that fails before it is recorded requeues every request it touched, as recompute preemption
does; one that fails while being recorded finishes the requests it scheduled. Either way nothing is
put back field by field: the step only has to know which requests it touched (Scheduler.recover).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .request import Request
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
