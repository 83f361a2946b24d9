"""Fixtures for the op tests: which CPU kernel ISA runs, and range checks left as found."""
import pytest

from kvpage import ops


@pytest.fixture(params=ops.available_cpu_isas())
def cpu_isa(request):
    """Runs the test once per CPU kernel ISA this machine has, restoring the original afterwards."""
    previous = ops.cpu_isa()
    ops.set_cpu_isa(request.param)
    assert ops.cpu_isa() == request.param
    try:
        yield request.param
    finally:
        ops.set_cpu_isa(previous)


@pytest.fixture(autouse=True)
def _range_checks_on():
    """Every op test starts with range checks on (as the suite runs: tests/conftest.py); none may leak
    them off."""
    previous = ops.set_range_checks(True)
    yield
    ops.set_range_checks(previous)
