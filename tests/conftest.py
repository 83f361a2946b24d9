"""Shared test settings: the hypothesis profiles.

Profiles: "ci" (the default) is small and derandomized so a run is fast and repeatable; "deep"
explores far more examples. Pick "deep" with `--hypothesis-deep` or KVPAGE_HYPOTHESIS_PROFILE=deep.
"""
import os

from hypothesis import HealthCheck, settings

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

