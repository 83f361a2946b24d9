"""call_locked: the lock is free again after an exception raised at any line of the call, the
with-block's own exit included (where a with-block spread over lines would leave it held)."""
import sys
import threading

import pytest

from kvpage.core.interrupts import call_locked


def _work(x: int) -> int:
    y = x + 1
    return y * 2


def _raise_at(target: int):
    """A tracer raising KeyboardInterrupt at the target-th line event of call_locked and _work (0: never);
    the count seen."""
    seen, traced = [0], (call_locked.__code__, _work.__code__)

    def local(frame, event, arg):
        if event == "line":
            seen[0] += 1
            if seen[0] == target:
                raise KeyboardInterrupt(f"line {frame.f_lineno}")
        return local

    return (lambda frame, event, arg: local if frame.f_code in traced else None), seen


def test_the_lock_is_free_after_an_interrupt_at_any_line():
    lock = threading.Lock()
    tracer, seen = _raise_at(0)
    sys.settrace(tracer)
    assert call_locked(lock, _work, 1) == 4
    sys.settrace(None)
    lines = seen[0]
    assert lines >= 3  # call_locked's line and _work's two
    for target in range(1, lines + 1):
        tracer, _ = _raise_at(target)
        sys.settrace(tracer)
        try:
            with pytest.raises(KeyboardInterrupt):
                call_locked(lock, _work, 1)
        finally:
            sys.settrace(None)
        assert not lock.locked(), f"held after an interrupt at line event {target}"
