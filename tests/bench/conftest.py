"""A tiny random model directory for the benchmarks' smoke runs: the default model's tokenizer and
config family (Llama, SmolLM2's vocabulary), two layers of width 64, so a script starts in seconds."""
from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

from kvpage.model.loader import default_model_dir

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    source = default_model_dir()
    dest = tmp_path_factory.mktemp("tiny-smollm2")
    base = AutoConfig.from_pretrained(source)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=base.vocab_size, max_position_embeddings=base.max_position_embeddings,
                         bos_token_id=base.bos_token_id, eos_token_id=base.eos_token_id, pad_token_id=base.pad_token_id,
                         hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, initializer_range=0.2)
    LlamaForCausalLM(config).save_pretrained(dest)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, dest / name)
    return dest
