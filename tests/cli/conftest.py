"""A tiny random Llama saved with the default model's tokenizer (and so its chat template): the `kvpage`
command loads it with --model in a second or two, where the default model takes 15-30 s."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from kvpage.model.loader import default_model_dir


@pytest.fixture(scope="session")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(default_model_dir()))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                         tie_word_embeddings=True, initializer_range=0.2, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    path = tmp_path_factory.mktemp("tiny-chat-model")
    LlamaForCausalLM(config).eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
