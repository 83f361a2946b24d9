"""The emulator's share of tests/cuda in an ordinary run: every kernel, instantiation and code path
still runs in it, but two cross products (heads x block sizes) keep block sizes 1, 16 and 256, the
long prefill runs for one query dtype and the fp8 long prefill not at all (test_fp8_prefill's
700-token rows take the same path), which halves the emulator's time (~4 of 8 minutes on 2 cores,
before its blocks ran on both). The GPU backend always runs everything. KVPAGE_CUDA_EMU_FULL=1
gives the emulator the full set too."""
import os
import re

import pytest

from cuda_backends import BACKENDS, end_if_context_broken, get_backend

_TRIMMED = [
    re.compile(r"test_(decode|prefill)_heads_and_blocks\[emu-(8|32)-"),
    re.compile(r"test_prefill_long\[emu-dtype1\]"),
    re.compile(r"test_fp8_prefill_long\[emu-"),
]


def pytest_collection_modifyitems(config, items):
    if os.environ.get("KVPAGE_CUDA_EMU_FULL") == "1":
        return
    kept, dropped = [], []
    for item in items:
        (dropped if any(p.search(item.nodeid) for p in _TRIMMED) else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Each backend in turn (test_cuda_ops.py keeps its own, which also sets its module's B)."""
    b = get_backend(request.param)
    yield b
    if b.name == "cuda":
        end_if_context_broken(request.node.nodeid)
