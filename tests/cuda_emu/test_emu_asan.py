"""Memory safety of the CUDA kernels without a GPU: tests/cuda/sanitize_ops.py (every op with range
checks off and bad indices: block ids outside the cache, slots past it, seq_lens past a table row,
a broken query_start_loc, block mappings out of range) in the CPU emulator built with
AddressSanitizer, the stand-in for compute-sanitizer's memcheck. Kernels, op glue and the
emulator are instrumented; every tensor is its own malloc, so a read or write past one is caught.
A planted overrun first shows the setup does catch one."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build_emu  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
REASON = build_emu.unavailable_reason() or (None if build_emu.asan_runtime() else "no libasan.so")
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"CUDA emulator with ASan: {REASON}")


def run_under_asan(*args, timeout=900):
    env = dict(os.environ, LD_PRELOAD=build_emu.asan_runtime(),
               # Python and torch are not instrumented: their allocations are not leaks to report.
               ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=0",
               PYTHONPATH=os.pathsep.join([str(ROOT / "python"), str(ROOT / "tests" / "cuda"),
                                           os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


@pytest.fixture(scope="module")
def asan_build():
    # Build in a child process too: the ASan runtime must be loaded before anything else.
    result = run_under_asan(str(ROOT / "tests" / "cuda_emu" / "build_emu.py"), "--asan")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]


def test_asan_catches_a_planted_overrun(asan_build):
    probe = ("import sys, torch; sys.path.insert(0, 'tests/cuda_emu'); import build_emu; "
             "emu = build_emu.load(asan=True); x = torch.zeros(64); "
             "emu.probe_overrun(x, 0); print('in bounds ok', flush=True); emu.probe_overrun(x, 40)")
    result = run_under_asan("-c", probe)
    assert "in bounds ok" in result.stdout, result.stderr[-4000:]
    assert result.returncode != 0 and "heap-buffer-overflow" in result.stderr, result.stderr[-4000:]


def test_every_op_with_bad_indices_stays_in_bounds(asan_build):
    result = run_under_asan(str(ROOT / "tests" / "cuda" / "sanitize_ops.py"), "--emu-asan")
    assert "AddressSanitizer" not in result.stderr, result.stderr[-6000:]
    assert result.returncode == 0 and "every op ran" in result.stdout, result.stdout[-2000:] + result.stderr[-4000:]
