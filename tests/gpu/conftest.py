"""The engine and the HF drop-in on a GPU reuse the CPU tests' helpers: HF references and greedy
comparison (tests/engine), tiny random models (tests/model), generate on both caches (tests/hf)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

_TESTS = Path(__file__).resolve().parent.parent
for helpers in ("engine", "model", "hf"):
    sys.path.insert(0, str(_TESTS / helpers))


@pytest.fixture(autouse=True)
def no_tf32():
    """fp32 means fp32 on a GPU as well: TF32 matmuls would move logits by ~1e-3, past the fp32 tie tolerance."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)
