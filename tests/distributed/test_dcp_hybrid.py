"""Decode context parallelism per KV-cache group (CPU, gloo): a model with sliding-window layers at TP=2 / DCP=2,
each rank keeping every other position (or pair of positions) of both groups and attending within window / 2
of its own keys. Greedy tokens equal TP=1's and HF generate's with prompts and outputs several windows long,
under chunked prefill, prefix-cache hits and preemption with a small pool; a window DCP cannot split and
attention sinks are refused by name before any worker starts."""
from __future__ import annotations

import pytest
import torch
from transformers import (GptOssConfig, GptOssForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM)

import kvpage
from kvpage import SamplingParams

from test_dcp_engine import hf_outputs
from tp_helpers import VOCAB, assert_same_greedy, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)  # 2.5 windows of output
# One KV head, so TP=2 replicates it and DCP=2 splits it; large weights make attention sharp, so a key read
# outside its window (or missed inside it) changes the greedy tokens.
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=1,
            head_dim=16, max_position_embeddings=512, initializer_range=0.3, tie_word_embeddings=False)


def tiny_qwen2_sliding(window: int = 16):
    """Qwen2 with use_sliding_window: layer 0 full attention, layers 1-2 a window (two KV-cache groups)."""
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=3, use_sliding_window=True, sliding_window=window,
                                        max_window_layers=1, **TINY)).eval()


def tiny_mistral():
    """Mistral: a window of 16 on every layer (one window group)."""
    torch.manual_seed(1)
    return MistralForCausalLM(MistralConfig(num_hidden_layers=2, sliding_window=16, **TINY)).eval()


def prompts_and_hits():
    """Several windows long; the last two share 48 and 32 tokens (three and two 16-token blocks) with others."""
    prompts = random_prompts([70, 9, 57, 33, 17], seed=4)
    return prompts + [prompts[0][:48] + [5, 6, 7, 8], prompts[2][:32] + [9] * 20]


# Pools of 2 x 8-token block ids too small for the batch (preemption): Qwen2's longest sequence (110 tokens)
# needs 7 of its full group's plus its window group's (admission counts up to 15); Mistral's only its window's.
@pytest.mark.parametrize("build,num_kv_blocks,mode,interleave", [(tiny_qwen2_sliding, 24, "swap", 1),
                                                                 (tiny_qwen2_sliding, 24, "recompute", 2),
                                                                 (tiny_mistral, 8, "recompute", 1)])
def test_window_groups_split_over_dcp_ranks(build, num_kv_blocks, mode, interleave):
    model = build()
    prompts = prompts_and_hits()
    tp1 = kvpage.LLM(model=model, num_kv_blocks=256, block_size=8)
    want = tp1.generate(prompts, GREEDY, use_tqdm=False)
    # 24-token steps chunk the prompts.
    dcp = kvpage.LLM(model=model, block_size=8, num_kv_blocks=num_kv_blocks, max_num_batched_tokens=24,
                     preemption_mode=mode, tensor_parallel_size=2, decode_context_parallel_size=2,
                     dcp_kv_cache_interleave_size=interleave)
    try:
        # One at a time first: the second finds the first's 48-token prefix cached, in both groups (later, the
        # small pool's churn evicts the window blocks a hit would need).
        alone = [dcp.generate([prompts[k]], GREEDY, use_tqdm=False)[0] for k in (0, 5)]
        hits = dcp.stats()["prefix_cache_hit_tokens"]
        got = dcp.generate(prompts, GREEDY, use_tqdm=False)
        stats = dcp.stats()
    finally:
        dcp.shutdown()
    assert dcp.kv_cache_layout.is_hybrid
    assert_same_greedy(model, prompts, want, got)
    assert_same_greedy(model, [prompts[0], prompts[5]], [want[0], want[5]], alone)
    assert_same_greedy(model, prompts[:3], hf_outputs(model, prompts[:3], GREEDY.max_tokens), got[:3])
    assert stats["decode_context_parallel_size"] == 2 and stats["block_size"] == 16
    assert stats[f"num_{mode}_preemptions"] > 0
    assert hits > 0


def tiny_gpt_oss():
    torch.manual_seed(2)
    return GptOssForCausalLM(GptOssConfig(num_hidden_layers=2, sliding_window=16, num_local_experts=4,
                                          num_experts_per_tok=2, rope_parameters={"rope_type": "default",
                                                                                  "rope_theta": 10000.0},
                                          **TINY)).eval()


@pytest.mark.parametrize("build,kwargs,match", [
    # I * D = 8 does not divide the window of 12: a window would hold 5 or 7 positions of a rank
    (lambda: tiny_qwen2_sliding(window=12), dict(dcp_kv_cache_interleave_size=4),
     "sliding_window=12 must be a multiple"),
    (tiny_gpt_oss, {}, "attention sinks"),  # the LSE merge would count the sink once per rank
])
def test_refused_by_name_before_any_worker_starts(build, kwargs, match):
    with pytest.raises(ValueError, match=match):
        kvpage.LLM(model=build(), block_size=8, num_kv_blocks=16, tensor_parallel_size=2,
                   decode_context_parallel_size=2, **kwargs)
