"""`import kvpage` caps libgomp's barrier spinning unless the user chose a wait policy (see kvpage/__init__.py)."""
import os
import subprocess
import sys

import pytest

_PRINT_SPINCOUNT = "import kvpage, os; print(os.environ.get('GOMP_SPINCOUNT', 'unset'))"


def _spincount_after_import(**env_overrides):
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    env.update(env_overrides)
    done = subprocess.run([sys.executable, "-c", _PRINT_SPINCOUNT], env=env, capture_output=True, text=True,
                          timeout=120, check=True)
    return done.stdout.strip()


def test_import_sets_the_default_spincount():
    import kvpage
    assert _spincount_after_import() == kvpage.GOMP_SPINCOUNT_DEFAULT


@pytest.mark.parametrize("name, value, expected", [
    ("GOMP_SPINCOUNT", "5", "5"),
    ("OMP_WAIT_POLICY", "active", "unset"),
])
def test_the_users_setting_wins(name, value, expected):
    assert _spincount_after_import(**{name: value}) == expected


def test_torch_is_not_loaded_before_the_setting():
    # The setting only reaches libgomp if torch (which loads it) is imported after it.
    code = "import sys, kvpage; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "False"
