"""The emulator's own checks, on planted bugs (runtime/emu_probes.cpp): a result from
tests/cuda only means something if the emulator would have exposed these."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build_emu  # noqa: E402

pytestmark = pytest.mark.skipif(build_emu.unavailable_reason() is not None,
                                reason=f"CUDA emulator: {build_emu.unavailable_reason()}")


@pytest.fixture(scope="module")
def emu():
    module = build_emu.load()
    yield module
    module.set_seed(0, True)


def test_shared_memory_read_without_a_barrier_sees_poison(emu):
    # In thread order the writer happens to run first and the bug hides; the random order shows it.
    emu.set_seed(0, False)
    assert emu.probe_missing_barrier() == 0
    emu.set_seed(0, True)
    assert emu.probe_missing_barrier() > 0


def test_barrier_that_half_the_block_skips_is_an_error(emu):
    assert "__syncthreads" in emu.probe_divergent_barrier()


def test_cp_async_lands_only_at_its_wait(emu):
    assert emu.probe_early_cp_async_read() == 64


def test_dynamic_shared_memory_needs_an_opt_in(emu):
    assert "dynamic shared memory" in emu.probe_smem_without_opt_in()


def test_fp8_unpack_matches_cudas_conversion(emu):
    # Every pair of non-NaN e4m3 codes: the Ampere bit trick the emulator runs equals the hardware
    # conversion Ada / Hopper use, so the emulated fp8 tests speak for both paths.
    assert emu.probe_fp8_conversion_mismatches() == 0


def test_ldmatrix_fragments_follow_the_ptx_layout(emu):
    # The kernels' mma operands come through ldmatrix (Q, K plain; V .trans): a lane-mapping slip
    # in the emulator would test them against the wrong fragments.
    assert emu.probe_ldmatrix_mismatches() == 0


def test_movmatrix_transposes_fragments_as_the_ptx_layout_says(emu):
    # The tensor-core decode turns S^T's accumulator into P^T's B operand with movmatrix.trans.
    assert emu.probe_movmatrix_mismatches() == 0
