"""Where tests/cuda runs kvpage's CUDA backend: on a real GPU ("cuda"), and, on any x86-64
machine with the CUDA toolkit's headers, in the CPU emulator of tests/cuda_emu ("emu"), which
compiles the same kernels and op glue and runs every CUDA thread as a fiber. A backend gives the
device its tensors live on and the ops (kvpage.ops' own Python faces, checks included, bound to
that backend's kernels). KVPAGE_CUDA_TEST_BACKENDS (default "cuda,emu") narrows the list: a GPU
machine's bench/gpu_check.sh runs "cuda" alone."""
import os
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kvpage import ops
from kvpage.ops import attention, cache

BACKENDS = os.environ.get("KVPAGE_CUDA_TEST_BACKENDS", "cuda,emu").split(",")
_EMU_DIR = Path(__file__).resolve().parents[1] / "cuda_emu"
_emu_modules = {}


@dataclass
class Backend:
    name: str
    device: str
    ops: types.SimpleNamespace
    emu: object = None  # the emulator module (seed, SM count, stats), for "emu"

    def pin(self, tensor):
        """Host memory a swap can use: pinned on a GPU; any CPU tensor in the emulator."""
        return tensor.pin_memory() if self.name == "cuda" else tensor

    def synchronize(self):
        if self.name == "cuda":
            torch.cuda.synchronize()


def _bound(function, library):
    """function (a kvpage.ops face) calling `library` where it calls torch.ops.kvpage."""
    namespace = dict(function.__globals__, ops=library)
    bound = types.FunctionType(function.__code__, namespace, function.__name__, function.__defaults__,
                               function.__closure__)
    bound.__kwdefaults__ = function.__kwdefaults__
    return bound


def emu_module(asan=False):
    """The emulator build (asan=True: the AddressSanitizer one; see build_emu.load)."""
    if asan not in _emu_modules:
        if str(_EMU_DIR) not in sys.path:
            sys.path.insert(0, str(_EMU_DIR))
        import build_emu

        reason = build_emu.unavailable_reason()
        if reason:
            pytest.skip(f"CUDA emulator: {reason}")
        _emu_modules[asan] = build_emu.load(asan=asan)
    return _emu_modules[asan]


def get_backend(name, asan=False):
    """The backend, or a pytest skip saying why it cannot run here."""
    if name == "cuda":
        if not (torch.cuda.is_available() and ops.built_with_cuda):
            pytest.skip("needs a CUDA device and kvpage built with CUDA")
        return Backend("cuda", "cuda", types.SimpleNamespace(
            allocate_kv_cache=ops.allocate_kv_cache, reshape_and_cache=ops.reshape_and_cache,
            paged_attention=ops.paged_attention, paged_prefill_attention=ops.paged_prefill_attention,
            copy_blocks=ops.copy_blocks, swap_blocks=ops.swap_blocks))
    module = emu_module(asan)
    # The threads' order: seed 0 unless KVPAGE_CUDA_EMU_SEED picks another (each seed is another
    # interleaving of every block's threads).
    module.set_seed(int(os.environ.get("KVPAGE_CUDA_EMU_SEED", "0")))
    module.set_num_sms(132)  # an H100 / H200
    faces = types.SimpleNamespace(allocate_kv_cache=ops.allocate_kv_cache)
    for face in (attention.paged_attention, attention.paged_prefill_attention, cache.reshape_and_cache,
                 cache.copy_blocks, cache.swap_blocks):
        setattr(faces, face.__name__, _bound(face, module))
    return Backend("emu", "cpu", faces, module)


def end_if_context_broken(nodeid):
    """After a GPU test: a kernel fault (illegal address, device assert) leaves the process's CUDA
    context unusable, and every later test in it would fail for that reason alone. Under
    pytest-xdist the worker exits, so xdist reports this test as crashed and starts a fresh
    worker for the rest; in a plain run the session stops, naming the test."""
    try:
        torch.cuda.synchronize()
        torch.ones(1, device="cuda").add_(1).item()
    except Exception as error:  # noqa: BLE001 - any failure here means the context is gone
        message = f"CUDA context broken after {nodeid}: {str(error).strip().splitlines()[0][:300]}"
        print(message, file=sys.stderr, flush=True)
        if os.environ.get("PYTEST_XDIST_WORKER"):
            os._exit(3)
        pytest.exit(message, returncode=3)
