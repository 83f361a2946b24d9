"""Process-wide op settings."""
import contextlib

_range_checks = True


def range_checks_enabled():
    return _range_checks


def set_range_checks(enabled):
    """Turns the block-table / slot-mapping range checks on or off (on by default; off only for
    benchmarks that feed known-good indices). Returns the previous setting."""
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
