"""Fixtures for HF `generate` on kvpage.PagedCache: the default model once per session, and the tiny
random models of tests/model (a second family: Qwen2)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "model"))  # tiny_models.py

from kvpage.model import DefaultModelMissing, load_model  # noqa: E402


@pytest.fixture(scope="session")
def default_model():
    """(model, tokenizer) for SmolLM2-135M-Instruct; tests switch its attention between "sdpa" and "kvpage"."""
    try:
        model, tokenizer = load_model(None)
    except DefaultModelMissing as e:  # no skip: the default model is part of the product
        pytest.fail(str(e))
    tokenizer.padding_side = "left"
    return model, tokenizer
