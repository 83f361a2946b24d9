"""TP=2 on a hybrid KV cache: every rank lays its cache out in the model's KV-cache groups (derived from its
config) and runs the driver's per-group block tables from the step broadcast; greedy tokens equal TP=1's,
also under swap preemption (decode context parallelism with several groups: test_dcp_hybrid.py)."""
from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import kvpage
from kvpage import SamplingParams

from tp_helpers import VOCAB, assert_same_greedy, generate_then_shut_down, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def tiny_qwen2_sliding(seed: int = 0):
    """Qwen2 with use_sliding_window: layers 0-1 full attention, 2-3 a window of 16 (two groups of two
    layers); 8 KV heads, so each of two ranks holds four."""
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=512,
                         use_sliding_window=True, sliding_window=16, max_window_layers=2, initializer_range=0.2,
                         tie_word_embeddings=False)
    return Qwen2ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def case():
    model = tiny_qwen2_sliding()
    prompts = random_prompts([40, 9, 57, 33])
    tp1 = kvpage.LLM(model=model, num_kv_blocks=64, block_size=8)
    assert tp1.kv_cache_layout.num_groups == 2 and tp1.kv_cache_layout.is_hybrid
    return model, prompts, tp1.generate(prompts, GREEDY, use_tqdm=False), tp1.stats()


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_tp2_hybrid_greedy_under_preemption(case, mode):
    model, prompts, want, tp1_stats = case
    # 20 blocks: fewer than the longest sequence's full tables in both groups (2 x 11), so the window group
    # must free blocks as it goes, and too few for the batch at once, so requests are preempted.
    tp2 = kvpage.LLM(model=model, num_kv_blocks=20, block_size=8, tensor_parallel_size=2, preemption_mode=mode,
                     max_num_batched_tokens=32)
    got, stats = generate_then_shut_down(tp2, prompts, GREEDY)
    assert_same_greedy(model, prompts, want, got)
    assert stats[f"num_{mode}_preemptions"] > 0
    assert stats["kv_cache_groups"] == tp1_stats["kv_cache_groups"] == [{"sliding_window": None, "num_layers": 2},
                                                                        {"sliding_window": 16, "num_layers": 2}]
    # A rank holds half the KV heads (4 of head_dim 16) of group_size = 2 layers, K and V, per block id.
    per_rank = 20 * 2 * 2 * 4 * 8 * 16 * 4
    assert stats["kv_cache_bytes_per_rank"] == [per_rank, per_rank]
