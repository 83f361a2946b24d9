"""Tiny seeded random models of two families, and prompts for them."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM)

from kvpage import ops
from kvpage.model import cpu_layout

VOCAB = 128

# kvpage's fused CPU decoder layer runs on the slab GEMM kernels, which only AVX-512 and AVX2 have;
# elsewhere (or with KVPAGE_CPU_ISA=generic) the owned forward composes torch ops, which other tests cover.
needs_slab_kernels = pytest.mark.skipif(not cpu_layout.slab_kernel_available(),
                                        reason=f"no slab kernels on CPU ISA {ops.cpu_isa()!r} (AVX-512 / AVX2 only)")


def tiny_config(family: str, **overrides):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=False)
    if family == "llama":
        return LlamaConfig(**{**common, "head_dim": 16, **overrides})
    if family == "mistral":  # Llama's layers with a sliding window (4096: no test sequence outgrows it)
        return MistralConfig(**{**common, "head_dim": 16, **overrides})
    if family == "qwen2":
        # head_dim 32 from hidden 128 / 4 heads; Qwen2 adds q/k/v biases, so both paths differ.
        return Qwen2Config(**{**common, "hidden_size": 128, **overrides})
    raise ValueError(family)


def tiny_model(family: str, seed: int = 0, **overrides):
    """A random fp32 model with a non-trivial init scale, so greedy paths are not all one token."""
    torch.manual_seed(seed)
    config = tiny_config(family, initializer_range=0.2, **overrides)
    cls = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "mistral": MistralForCausalLM}[family]
    return cls(config).eval()


def model_pair(family: str, seed: int = 0):
    """(reference on sdpa, same weights for kvpage): ModelRunner switches its model's attention."""
    reference = tiny_model(family, seed)
    reference.set_attn_implementation("sdpa")
    return reference, copy.deepcopy(reference)


def random_prompts(lengths, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]
