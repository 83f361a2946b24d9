"""Shared fixtures: one default-model kvpage.LLM, whose weights the other engine configurations reuse,
and HF `generate` references computed once per session (the slow part of these tests)."""
from __future__ import annotations

import copy

import pytest

import kvpage
from engine_helpers import MAX_TOKENS, PROMPTS, hf_generate


@pytest.fixture(scope="session")
def llm():
    try:
        return kvpage.LLM(num_kv_blocks=1024)
    except kvpage.model.DefaultModelMissing as e:  # no skip: the default model is part of the product
        pytest.fail(str(e))


@pytest.fixture(scope="session")
def hf_model(llm):
    """The same weights with transformers' own attention, for the reference."""
    model = copy.deepcopy(llm.model)
    model.set_attn_implementation("sdpa")
    return model.eval()


@pytest.fixture(scope="session")
def prompt_ids(llm):
    return [llm.tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="session")
def hf_greedy(hf_model, prompt_ids):
    return hf_generate(hf_model, prompt_ids, MAX_TOKENS)


