"""A tiny random Llama with the default model's tokenizer, saved once as a directory (target and draft load it
by path), and its greedy outputs without speculation, the reference every test compares against."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from kvpage.model.loader import default_model_dir


def save_tiny_llama(path, seed: int, tokenizer) -> str:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         eos_token_id=tokenizer.eos_token_id, max_position_embeddings=512)
    LlamaForCausalLM(config).eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_model_dir())


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, tokenizer) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_target"), 0, tokenizer)


@pytest.fixture(scope="session")
def draft_dir(tmp_path_factory, tokenizer) -> str:
    """Another random model with the same tokenizer: a poor draft (few acceptances)."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_draft"), 1, tokenizer)
