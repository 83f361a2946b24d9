"""Random-weight models of every decoder family kvpage serves, built from each family's HF config: tiny ones for
the tests, small ones for bench/families.py. The reference attention (eager: it applies sliding windows,
softcapping and sinks as each model defines them) is set on each model.

Families with sliding-window layers (WINDOW_FAMILIES) get small windows (12-20 tokens in the tiny models, some
ending mid-block) so prompts and outputs of ~60-100 tokens span several windows, and large weights
(initializer_range 0.3), so attention is sharp and a token outside a window changes the next token: run without
its window, every one of them gives other greedy tokens within a few windows (test_sliding_window_families
checks that for each family).
"""
from __future__ import annotations

import copy

import torch
import transformers

VOCAB = 128
WINDOW_FAMILIES = ("gemma2", "gemma3", "mistral", "qwen2_sliding", "gpt_oss")
FULL_FAMILIES = ("llama", "qwen2", "qwen3", "phi3", "olmo2", "mixtral", "qwen2_moe", "granite", "gpt2")
FAMILIES = FULL_FAMILIES + WINDOW_FAMILIES
NAMES = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "phi3": "Phi-3", "olmo2": "OLMo 2",
         "mixtral": "Mixtral", "qwen2_moe": "Qwen2-MoE", "granite": "Granite", "gpt2": "GPT-2", "gemma2": "Gemma 2",
         "gemma3": "Gemma 3 (text)", "mistral": "Mistral (window)", "qwen2_sliding": "Qwen2 (use_sliding_window)",
         "gpt_oss": "gpt-oss"}
# (config class, model class, family-specific settings)
_FAMILY = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2,
                                                            "moe_intermediate_size": 64,
                                                            "shared_expert_intermediate_size": 64}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"logits_scaling": 4.0, "attention_multiplier": 0.2,
                                                        "residual_multiplier": 0.5, "embedding_multiplier": 2.0}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {}),
    # alternating sliding / full layers, logit softcapping in attention and at the end
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"sliding_window": 16, "query_pre_attn_scalar": 24,
                                                     "attn_logit_softcapping": 4.0, "final_logit_softcapping": 8.0}),
    # two window layers per full one; local and global RoPE bases differ
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "sliding_window": 12, "query_pre_attn_scalar": 32,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 20}),  # every layer: the owned forward
    # the window from max_window_layers on (layers 1, 2); q/k/v biases
    "qwen2_sliding": ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 16,
                                                          "max_window_layers": 1}),
    # alternating window / full layers, attention sinks, a mixture of experts
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", {
        "num_hidden_layers": 2, "sliding_window": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
        "intermediate_size": 64, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
}
# Tiny: the tests. Small (bench/families.py): 8x the hidden size and 8x the vocabulary, windows 4x.
SIZES = {"tiny": dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16),
         "small": dict(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=2, head_dim=64)}


def family_config(family: str, size: str = "tiny", **overrides):
    config_class, _, specific = _FAMILY[family]
    base = dict(SIZES[size], max_position_embeddings=2048, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
                eos_token_id=2, initializer_range=0.3 if family in WINDOW_FAMILIES else 0.2)
    specific = dict(specific)
    if size != "tiny":
        specific = {k: v * 4 if k == "sliding_window" else v for k, v in specific.items()}
        if "layer_types" in specific:  # Gemma 3's pattern, repeated to the small model's depth
            pattern = specific["layer_types"]
            specific["layer_types"] = [pattern[i % len(pattern)] for i in range(base["num_hidden_layers"])]
        specific.pop("num_hidden_layers", None)
        for key in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
            if key in specific:
                specific[key] *= 8
    settings = {**base, **specific, **overrides}
    if family == "gpt2":  # GPT-2's own names
        settings = dict(vocab_size=settings["vocab_size"], n_embd=settings["hidden_size"],
                        n_layer=settings["num_hidden_layers"], n_head=settings["num_attention_heads"],
                        n_positions=settings["max_position_embeddings"], bos_token_id=1, eos_token_id=2,
                        initializer_range=settings["initializer_range"], tie_word_embeddings=False)
    return getattr(transformers, config_class)(**settings)


def family_model(family: str, seed: int = 0, size: str = "tiny", **overrides):
    """A random fp32 model on eager attention."""
    torch.manual_seed(seed)
    model = getattr(transformers, _FAMILY[family][1])(family_config(family, size, **overrides)).eval()
    if family == "gpt_oss":  # sinks start as small noise; larger ones make the sink term matter
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 2.0)
    model.set_attn_implementation("eager")
    return model


def family_pair(family: str, seed: int = 0, **overrides):
    """(reference on eager attention, the same weights for kvpage)."""
    reference = family_model(family, seed, **overrides)
    return reference, copy.deepcopy(reference)


def random_prompts(lengths, seed: int = 1, vocab: int = VOCAB) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
