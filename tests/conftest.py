"""Shared test settings: the hypothesis profiles, and the ops' range checks on.

Profiles: "ci" (the default) is small and derandomized so a run is fast and repeatable; "deep"
explores far more examples. Pick "deep" with `--hypothesis-deep` or KVPAGE_HYPOTHESIS_PROFILE=deep.
"""
import os

import pytest

# The suite runs with the ops' range-check debug switch on (kvpage.ops.config; off by default), so a
# bad index anywhere fails loudly. Set before kvpage is imported, and inherited by the worker processes
# tests start (tensor parallelism, the server); a test of the switch itself turns it off locally.
os.environ["KVPAGE_RANGE_CHECKS"] = "1"

from hypothesis import HealthCheck, settings  # noqa: E402

# Examples build real tensors and run the plain-torch reference, so one can take a while on a
# loaded 2-core machine: no deadline, and no health check failing a run for being slow.
_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", max_examples=20, derandomize=True, print_blob=True, **_COMMON)
settings.register_profile("deep", max_examples=300, **_COMMON)


def pytest_addoption(parser):
    parser.addoption("--hypothesis-deep", action="store_true", default=False,
                     help='run hypothesis tests with the "deep" profile (about 300 examples each)')


def pytest_configure(config):
    profile = os.environ.get("KVPAGE_HYPOTHESIS_PROFILE", "ci")
    if config.getoption("--hypothesis-deep"):
        profile = "deep"
        # Modules that size their own runs (tests/core) read the variable at import, after this.
        os.environ["KVPAGE_HYPOTHESIS_PROFILE"] = profile
    settings.load_profile(profile)
    _range_checks_on()
    _kvpage_is_this_checkout()


def _kvpage_is_this_checkout():
    """The suite tests the code beside it: a kvpage installed from another checkout would be tested instead in
    this process, while the tests' subprocesses (PYTHONPATH=python) import this one. A staging copy whose sources
    link to this checkout's (build/stage.sh) passes."""
    from pathlib import Path

    import kvpage
    here = Path(__file__).resolve().parents[1] / "python" / "kvpage"
    if Path(kvpage.__file__).resolve() != here / "__init__.py":
        raise pytest.UsageError(f"kvpage is imported from {kvpage.__path__[0]}, not from this checkout's {here}:"
                                f" run pip install -e . here (or set PYTHONPATH={here.parent})")


def _range_checks_on():
    """In case a plugin imported kvpage before the variable above was set."""
    import sys

    if "kvpage.ops.config" in sys.modules:
        sys.modules["kvpage.ops.config"].set_range_checks(True)

