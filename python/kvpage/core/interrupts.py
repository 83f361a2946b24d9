"""Commit sections that a Ctrl-C cannot split.

A failed step is recovered in one place (Scheduler.recover), but the recovery, and the few assignments
that commit a step or a request, must themselves run whole: a KeyboardInterrupt landing between two of
them would leave the engine and the scheduler out of step. Inside `deferred_interrupts()` a SIGINT is
only recorded; it is raised once the section ends. Signals reach Python only in the main thread, so
elsewhere the section just counts its depth.
"""
from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager

_local = threading.local()


def deferring() -> bool:
    """Whether this thread is inside a deferred_interrupts() section (fault-injection tests ask)."""
    return getattr(_local, "depth", 0) > 0


@contextmanager
def deferred_interrupts():
    depth = getattr(_local, "depth", 0)
    _local.depth = depth + 1
    previous, pending = None, []
    if depth == 0 and threading.current_thread() is threading.main_thread():
        try:
            previous = signal.signal(signal.SIGINT, lambda signum, frame: pending.append(frame))
        except ValueError:  # not the main interpreter: no handler of ours, no signal either
            previous = None
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
        _local.depth = depth
        if pending:
            _deliver(previous, pending[0])


def _deliver(handler, frame) -> None:
    """Hand the deferred SIGINT to the handler that was in place."""
    if callable(handler):
        handler(signal.SIGINT, frame)  # Python's default_int_handler raises KeyboardInterrupt
    elif handler == signal.SIG_DFL:
        os.kill(os.getpid(), signal.SIGINT)


def call_locked(lock, fn, *args):
    """fn(*args) holding `lock`, released whatever is raised, wherever. Written on one line on purpose:
    a with-block spread over lines revisits its `with` line after the body, before __exit__ runs, and an
    exception raised there (by a tracer; the fault tests inject at every line) would leave the lock held."""
    with lock: return fn(*args)  # noqa: E701
