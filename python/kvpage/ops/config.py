"""Process-wide op settings: the range-check debug switch.

Range checks read the index tensors (block ids, slot mapping, seq_lens, query_start_loc) to reject
out-of-range entries with an exception naming the argument. On a GPU each copies those tensors to the
host, a device sync per op per layer, so they are off by default: the engine builds its indices itself
and the CUDA kernels mask bad ones. KVPAGE_RANGE_CHECKS=1 turns them on for a process (the test suite
does); set_range_checks / range_checks change it at run time. The metadata checks (shape, dtype,
device, contiguity) never sync and always run."""
import contextlib
import os

RANGE_CHECKS_ENV = "KVPAGE_RANGE_CHECKS"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def _env_flag(name):
    """A boolean environment variable, vLLM-style ("1" / "0"); anything else is refused by name."""
    value = os.environ.get(name, "").strip().lower()
    if value not in _TRUE + _FALSE:
        raise ValueError(f"{name} must be 1 or 0, got {os.environ[name]!r}")
    return value in _TRUE


_range_checks = _env_flag(RANGE_CHECKS_ENV)


def range_checks_enabled():
    return _range_checks


def set_range_checks(enabled):
    """Turns the block-table / slot-mapping / seq_lens range checks on or off (off unless
    KVPAGE_RANGE_CHECKS=1). Returns the previous setting."""
    global _range_checks
    previous, _range_checks = _range_checks, bool(enabled)
    return previous


@contextlib.contextmanager
def range_checks(enabled):
    previous = set_range_checks(enabled)
    try:
        yield
    finally:
        set_range_checks(previous)


def range_checks_run():
    """How many range checks the ops have run in this process (the extension's counter): a test can
    see that a step with the switch off ran none, that is, read no index tensor on the host."""
    from kvpage import _C

    return _C.range_checks_run()
