"""Process-wide op settings: the range checks.

Range checks read the index tensors (block ids, slot mapping, seq_lens, query_start_loc) to reject
out-of-range entries with an exception naming the argument. On a GPU each copies those tensors to the
host, a device sync per op per layer, so there they are a debug switch: off unless KVPAGE_RANGE_CHECKS=1,
and the CUDA kernels mask bad indices. On a CPU they cost no sync and the kernels do not mask, so by
default they run for CPU tensors (KVPAGE_RANGE_CHECKS=0 turns them off everywhere). The test suite runs
with them on; set_range_checks / range_checks change the setting at run time. The metadata checks
(shape, dtype, device, contiguity) never sync and always run."""
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


# None: not set, so the default per device (on for CPU tensors, off for GPU tensors).
_range_checks = _env_flag(RANGE_CHECKS_ENV) if os.environ.get(RANGE_CHECKS_ENV, "").strip() else None


def range_checks_enabled(tensor=None):
    """Whether an op on `tensor`'s device checks its index ranges (True for no tensor by default)."""
    if _range_checks is None:
        return tensor is None or not tensor.is_cuda
    return _range_checks


def set_range_checks(enabled):
    """Turns the block-table / slot-mapping / seq_lens range checks on or off everywhere (None: the
    per-device default). Returns the previous setting."""
    global _range_checks
    previous, _range_checks = _range_checks, None if enabled is None else bool(enabled)
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
