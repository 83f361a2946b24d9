"""The hybrid model, prompts and engine runs the KV-tier tests share (test_hybrid_tier.py, test_tp_tier.py)."""
from __future__ import annotations

import copy

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import kvpage
from kvpage import SamplingParams

WINDOW, BLOCK = 12, 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def qwen2_sliding(seed: int = 0):
    """Qwen2 with use_sliding_window: layers 0-1 full attention, 2-3 a window of WINDOW (two KV-cache groups
    of two layers); weights large enough (initializer_range 0.3) that a token outside a window matters."""
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2, initializer_range=0.3,
                         tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = Qwen2ForCausalLM(config).eval()
    model.set_attn_implementation("eager")
    return model


def make_prompts() -> list[list[int]]:
    """Eight prompts of 40-75 tokens, pairs sharing a 24-token prefix (several windows long)."""
    g = torch.Generator().manual_seed(1)
    prefixes = [torch.randint(3, 128, (24,), generator=g).tolist() for _ in range(4)]
    return [prefixes[i // 2] + torch.randint(3, 128, (16 + 5 * i,), generator=g).tolist() for i in range(8)]


PROMPTS = make_prompts()


def engine(model, **kwargs):
    kwargs.setdefault("num_kv_blocks", 64)  # about two prompts' blocks in both groups: every wave evicts
    llm = kvpage.LLM(model=copy.deepcopy(model), block_size=BLOCK, max_num_batched_tokens=64, swap_space_gib=0.001,
                     **kwargs)
    if llm.llm_engine.kv_connector is not None:
        # Load every hit: a tiny model's measured prefill, on a loaded machine, may price some loads higher
        # than recomputing (test_scheduler_tier.py tests that pricing).
        llm.llm_engine.kv_connector.recompute_seconds = None
    return llm


def generate(llm) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def waves(llm, rounds: int = 2) -> list[list[list[int]]]:
    result = []
    for _ in range(rounds):
        result.append(generate(llm))
        if llm.llm_engine.kv_connector is not None:
            llm.llm_engine.runner.flush_tier()  # every rank's writes, under tensor parallelism
    return result


def assert_window_loads_only(stats, num_groups: int = 2) -> None:
    """Tier hits happened, and fewer blocks were loaded than every group's whole chain would take."""
    hit_blocks = stats["kv_offload_hit_tokens"] // BLOCK
    assert hit_blocks > 0
    assert hit_blocks < stats["kv_offload_loaded_blocks"] < num_groups * hit_blocks
