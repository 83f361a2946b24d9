"""kvpage.LLM on a hybrid KV cache: a tiny random model with Gemma 3's layer pattern (five sliding-window
layers per full one), run end to end in a pool too small for every layer to keep full block tables. Greedy
tokens equal HF generate's (eager attention, which applies the window); llm.stats() reports blocks per group.
"""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, GenerationConfig

import kvpage
from kvpage import SamplingParams

WINDOW, BLOCK, NEW_TOKENS = 12, 8, 40
# Gemma 3's own pattern: layer l is full attention where (l + 1) % 6 == 0.
LAYER_TYPES = ["full_attention" if (l + 1) % 6 == 0 else "sliding_attention" for l in range(6)]


def gemma3_like(seed: int = 0):
    """Random weights large enough (initializer_range 0.3) that a token outside a window changes the next."""
    torch.manual_seed(seed)
    config = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                              num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=2048,
                              sliding_window=WINDOW, query_pre_attn_scalar=32, layer_types=LAYER_TYPES,
                              initializer_range=0.3, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
                              eos_token_id=2)
    model = Gemma3ForCausalLM(config).eval()
    model.set_attn_implementation("eager")
    return model


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """HF generate one prompt at a time, EOS off (the engine runs with ignore_eos)."""
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0)
    saved, model.generation_config.eos_token_id = model.generation_config.eos_token_id, None
    try:
        with torch.inference_mode():
            return [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                   generation_config=config)[0, len(p):].tolist() for p in prompts]
    finally:
        model.generation_config.eos_token_id = saved


@pytest.fixture(scope="module")
def case():
    reference = gemma3_like()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (50, 37, 64, 23)]
    return reference, prompts, hf_greedy(reference, prompts, NEW_TOKENS)


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_greedy_equals_hf_in_a_pool_too_small_for_full_tables(case, mode):
    reference, prompts, expected = case
    longest = max(map(len, prompts)) + NEW_TOKENS
    full_tables = len(LAYER_TYPES) * -(-longest // BLOCK)  # every group keeping every block of one sequence
    num_kv_blocks = 40
    assert num_kv_blocks < full_tables
    llm = kvpage.LLM(model=copy.deepcopy(reference), num_kv_blocks=num_kv_blocks, block_size=BLOCK,
                     preemption_mode=mode, enable_prefix_caching=False, max_num_batched_tokens=16)
    assert llm.kv_cache_layout.num_groups == 6 and llm.kv_cache_layout.group_size == 1
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    stats = llm.stats()
    assert stats[f"num_{mode}_preemptions"] > 0  # the four sequences did not fit at once
    assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_used_per_group"] == [0] * 6


def test_prefix_cache_hits_keep_hf_tokens(case):
    """The same prompts twice more, once the first run finished: window groups' cached blocks give hits."""
    reference, prompts, expected = case
    llm = kvpage.LLM(model=copy.deepcopy(reference), num_kv_blocks=200, block_size=BLOCK)
    for _ in range(2):
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    assert llm.stats()["prefix_cache_hit_tokens"] > 0


def test_stats_report_blocks_per_group(case):
    reference, prompts, _ = case
    llm = kvpage.LLM(model=copy.deepcopy(reference), num_kv_blocks=200, block_size=BLOCK,
                     enable_prefix_caching=False)
    assert llm.stats()["kv_cache_groups"] == ([{"sliding_window": None, "num_layers": 1}]
                                              + [{"sliding_window": WINDOW, "num_layers": 1}] * 5)
    engine = llm.llm_engine
    engine.add_request("r", None, GREEDY, prompt_token_ids=prompts[2], stream=False)
    length, window_blocks = len(prompts[2]), -(-(WINDOW - 1) // BLOCK) + 1  # W tokens span at most this many
    while engine.has_unfinished_requests():
        engine.step()
        stats = llm.stats()
        per_group = stats["kv_blocks_used_per_group"]
        if not engine.has_unfinished_requests():
            break
        length += 1
        assert sum(per_group) == stats["kv_blocks_used"]
        assert per_group[0] >= -(-(length - 1) // BLOCK)  # the full group holds the whole context
        assert all(n <= window_blocks for n in per_group[1:]), per_group  # a window group only its window
    assert llm.stats()["kv_blocks_used_per_group"] == [0] * 6
    # One block id is one layer's K and V here (group_size 1), so the pool is 200 such blocks.
    per_layer_block = 2 * 1 * BLOCK * 16 * 4
    assert llm.stats()["kv_cache_bytes_per_rank"] == [200 * per_layer_block]
