"""No module of ours takes the name of an installed package.

`python bench/X.py` puts bench/ first on sys.path, so a bench/kernels.py was imported in place of the
`kernels` package transformers imports (transformers.integrations.hub_kernels), and every benchmark that
loaded a model died before measuring anything (issue 38). The same holds for every directory whose
scripts we run, for the test directories (pytest puts each on sys.path to import its helpers, and some
hold scripts: tests/distributed/torchrun_script.py, tests/cuda/sanitize_ops.py), and for the standard
library's names.
"""
from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Directories whose scripts are run (python DIR/X.py), so each lands first on sys.path.
SCRIPT_DIRS = ("bench", "bench/peers", "bench/mathlab", "examples")
TEST_DIRS = tuple(sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").iterdir()
                         if p.is_dir() and any(p.glob("*.py"))))
ON_SYS_PATH = SCRIPT_DIRS + TEST_DIRS


def module_names(directory: Path) -> set[str]:
    """What `import NAME` can find in directory: its .py modules and its subdirectories holding Python
    (packages, and namespace packages such as bench/peers)."""
    modules = {p.stem for p in directory.glob("*.py")}
    packages = {p.name for p in directory.iterdir() if p.is_dir() and any(p.glob("*.py"))}
    return modules | packages


def test_every_script_directory_exists():
    assert all((ROOT / d).is_dir() for d in SCRIPT_DIRS) and "tests/bench" in TEST_DIRS


@pytest.mark.parametrize("directory", ON_SYS_PATH)
def test_no_module_shadows_an_installed_package(directory):
    installed = importlib.metadata.packages_distributions()  # top-level import name -> distributions
    clashes = {name: installed[name] for name in module_names(ROOT / directory) if name in installed}
    assert not clashes, f"{directory}/ modules named like installed packages (rename them): {clashes}"


@pytest.mark.parametrize("directory", ON_SYS_PATH)
def test_no_module_shadows_the_standard_library(directory):
    clashes = module_names(ROOT / directory) & set(sys.stdlib_module_names)
    assert not clashes, f"{directory}/ modules named like standard-library modules: {sorted(clashes)}"


def test_transformers_hub_kernels_imports_beside_our_scripts():
    """What failed in issue 38, as our scripts see it: their directories first on sys.path (all at once,
    one interpreter start), then transformers' hub-kernels integration, which imports the `kernels`
    package when it is installed."""
    code = (f"import sys; sys.path[:0] = {[str(ROOT / d) for d in ON_SYS_PATH]!r}; "
            "import transformers.integrations.hub_kernels")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
