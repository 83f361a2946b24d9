"""Decode context parallelism on CPU (gloo): the ranks that share KV heads split each sequence's positions.
Greedy tokens against decode_context_parallel_size=1 (the TP=1 engine) and HF generate, under prefix
caching, chunked prefill and preemption with a small cache; capacity and refusals."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

import kvpage
from kvpage import SamplingParams

from tp_helpers import assert_same_greedy, prefix_sharing_prompts, random_prompts, tiny_llama

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


@torch.inference_mode()
def hf_outputs(model, prompts, max_tokens):
    """HF generate's greedy tokens in RequestOutput's shape (for assert_same_greedy), on a copy of the model
    with transformers' own attention (a kvpage engine switched the model's to "kvpage")."""
    model = copy.deepcopy(model)
    model.set_attn_implementation("sdpa")
    outs = []
    for ids in prompts:
        x = torch.tensor([ids])
        seq = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_tokens)
        outs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=seq[0, len(ids):].tolist())]))
    return outs


def run_dcp(model, prompts, **kwargs):
    llm = kvpage.LLM(model=model, **kwargs)
    try:
        return llm.generate(prompts, GREEDY, use_tqdm=False), llm.stats()
    finally:
        llm.shutdown()


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_mqa_tp2_dcp2_prefix_chunked_preempted(mode):
    """One KV head at TP=2: without DCP both ranks hold all of it; with D=2 each holds every other position.
    14 blocks of 2 x 8 tokens cannot hold the batch (preemption), 24-token steps chunk the prompts, and two
    prompts share full blocks with others (prefix-cache hits)."""
    model = tiny_llama(seed=3, num_attention_heads=4, num_key_value_heads=1, hidden_size=64, intermediate_size=128)
    prompts = prefix_sharing_prompts()
    want = kvpage.LLM(model=model, num_kv_blocks=256).generate(prompts, GREEDY, use_tqdm=False)
    got, stats = run_dcp(model, prompts, block_size=8, num_kv_blocks=14, max_num_batched_tokens=24,
                         preemption_mode=mode, tensor_parallel_size=2, decode_context_parallel_size=2)
    assert_same_greedy(model, prompts, want, got)
    assert_same_greedy(model, prompts[:4], hf_outputs(model, prompts[:4], GREEDY.max_tokens), got[:4])
    assert stats["block_size"] == 16 and stats["decode_context_parallel_size"] == 2
    assert stats[f"num_{mode}_preemptions"] > 0
    assert stats["prefix_cache_hit_tokens"] > 0


def test_gqa_tp4_dcp2_interleaved_with_copy_on_write():
    """8 query / 2 KV heads at TP=4: two DCP groups of two ranks, one per KV head, positions 4 at a time. Beam
    search and n > 1 share blocks by copy-on-write: every rank copies its own share of a shared block. Chunked
    prefill, prefix-cache hits and preemption under a small cache too."""
    model = tiny_llama(seed=5, num_attention_heads=8, num_key_value_heads=2, hidden_size=128, intermediate_size=128)
    prompts = random_prompts([3, 8, 21, 50], seed=6)
    beam = SamplingParams(beam_width=2, max_tokens=6)
    sampled = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8)
    tp1 = kvpage.LLM(model=model, num_kv_blocks=256)
    want = [tp1.generate(prompts, p, use_tqdm=False) for p in (GREEDY, beam, sampled)]
    dcp = kvpage.LLM(model=model, block_size=8, num_kv_blocks=12, max_num_batched_tokens=32, tensor_parallel_size=4,
                     decode_context_parallel_size=2, dcp_kv_cache_interleave_size=4)
    try:
        got = [dcp.generate(prompts, p, use_tqdm=False) for p in (GREEDY, beam, sampled)]
        stats = dcp.stats()
    finally:
        dcp.shutdown()
    assert_same_greedy(model, prompts, want[0], got[0])
    for w, g in zip(want[1] + want[2], got[1] + got[2]):  # beams and seeded samples: the same tokens
        assert [o.token_ids for o in g.outputs] == [o.token_ids for o in w.outputs]
    assert stats["num_copy_on_write"] > 0 and len(stats["kv_blocks_used_per_rank"]) == 4
    # 12 blocks of 2 x 8 tokens preempt; the second and third calls find the prompts' full blocks cached.
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0


@pytest.mark.parametrize("kwargs,name", [
    (dict(tensor_parallel_size=1, decode_context_parallel_size=2), "decode_context_parallel_size"),
    (dict(tensor_parallel_size=2, decode_context_parallel_size=2), "num_kv_heads"),  # 8 KV heads: nothing replicated
    (dict(tensor_parallel_size=2, decode_context_parallel_size=0), "decode_context_parallel_size"),
    (dict(tensor_parallel_size=2, decode_context_parallel_size=2, block_size=8, dcp_kv_cache_interleave_size=16),
     "dcp_kv_cache_interleave_size"),
])
def test_refused_by_name_before_any_worker_starts(kwargs, name):
    with pytest.raises(ValueError, match=name):
        kvpage.LLM(model=tiny_llama(), **kwargs)
