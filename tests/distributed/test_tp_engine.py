"""TP=2 on CPU (gloo, a driver and one spawned worker) against TP=1 computed here: greedy tokens, logits,
KV memory per rank, under prefix caching, swap and recompute preemption and beam search.

Each kvpage.LLM(tensor_parallel_size=2) starts a worker process (a few seconds: it imports torch and
transformers), so each test builds as few as it needs and shuts them down at the end.
"""
from __future__ import annotations

import copy

import pytest
import torch

import kvpage
from kvpage import SamplingParams
from kvpage.model import ModelInput, ModelRunner, SequenceInput

from tp_helpers import (LOGITS_ATOL, LOGITS_RTOL, assert_same_greedy, generate_then_shut_down, prefix_sharing_prompts,
                        random_prompts, tiny_llama)

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


def logits_step_pair(prompts, block_size=16):
    """A prefill of every prompt (each in its own blocks), then one decode step on the same cache."""
    width = max(len(p) for p in prompts) // block_size + 1
    prefill, decode = [], []
    for i, p in enumerate(prompts):
        table = list(range(i * width, (i + 1) * width))
        slots = [table[j // block_size] * block_size + j % block_size for j in range(len(p) + 1)]
        prefill.append(SequenceInput(p, 0, table, slots[:-1]))
        decode.append(SequenceInput([p[-1]], len(p), table, slots[-1:]))
    return ModelInput(prefill), ModelInput(decode)


def assert_logits_match(model, tpn: kvpage.LLM, prompts) -> None:
    """TP=N logits of a prefill and a decode step against a fresh TP=1 runner on `model`'s weights. Writes
    into tpn's cache behind its engine's back (its prefix cache may point into these blocks): call it last."""
    tp1 = ModelRunner(copy.deepcopy(model), num_kv_blocks=tpn.runner.runner.num_kv_blocks, block_size=16)
    for batch in logits_step_pair(prompts):
        want, got = tp1.execute(batch), tpn.runner.execute(batch)
        assert got.shape == want.shape == (len(prompts), tp1.vocab_size)
        torch.testing.assert_close(got, want, atol=LOGITS_ATOL, rtol=LOGITS_RTOL)


@pytest.fixture(scope="module")
def default_pair():
    tp1 = kvpage.LLM(num_kv_blocks=128)
    tp2 = kvpage.LLM(num_kv_blocks=128, tensor_parallel_size=2)
    yield tp1, tp2
    tp2.shutdown()


def test_default_model_uneven_heads_greedy_logits_and_memory(default_pair):
    """SmolLM2: 9 query / 3 KV heads cannot split evenly over 2 ranks (rank 0: 1 KV group, rank 1: 2)."""
    tp1, tp2 = default_pair
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away, there lived a",
             "The three primary colours are"]
    prompts = [tp1.tokenizer.encode(t) for t in texts]
    want = tp1.generate(prompts, GREEDY, use_tqdm=False)
    got = tp2.generate(prompts, GREEDY, use_tqdm=False)
    assert all(o.finished for o in got)
    assert_same_greedy(tp1.model, prompts, want, got)
    assert [o.outputs[0].text for o in got][:1] == [want[0].outputs[0].text]  # text from token ids, rank 0
    # Each rank's cache holds only its KV heads: 1/3 and 2/3 of TP=1's here (3 KV heads over 2 ranks).
    full = tp1.stats()["kv_cache_bytes_per_rank"][0]
    stats = tp2.stats()
    assert stats["tensor_parallel_size"] == 2 and stats["num_kv_blocks"] == tp1.stats()["num_kv_blocks"]
    assert stats["kv_cache_bytes_per_rank"] == [full // 3, 2 * full // 3]
    assert stats["kv_blocks_used"] == 0
    assert_logits_match(tp1.model, tp2, prompts)


@pytest.fixture(scope="module")
def tiny():
    """The 8-KV-head model, its prompts, and TP=1's greedy outputs for them."""
    model = tiny_llama()
    prompts = prefix_sharing_prompts()
    return model, prompts, kvpage.LLM(model=model, num_kv_blocks=256).generate(prompts, GREEDY, use_tqdm=False)


def test_8_kv_heads_prefix_caching_beam_search_logits_memory(tiny):
    model, prompts, want = tiny
    tp1 = kvpage.LLM(model=model, num_kv_blocks=256)
    tp2 = kvpage.LLM(model=model, num_kv_blocks=256, tensor_parallel_size=2)
    try:
        got = tp2.generate(prompts, GREEDY, use_tqdm=False)
        assert_same_greedy(model, prompts, want, got)
        # Asked again, every prompt's full blocks come from the (driver's) prefix cache.
        again = tp2.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in got]
        assert tp2.stats()["prefix_cache_hit_tokens"] > 0

        beam = SamplingParams(beam_width=2, max_tokens=6)
        assert ([o.outputs[0].token_ids for o in tp2.generate(prompts[:3], beam, use_tqdm=False)] ==
                [o.outputs[0].token_ids for o in tp1.generate(prompts[:3], beam, use_tqdm=False)])

        # prompt_logprobs: the prompt rows' logits come through the sharded LM head like the sampled ones.
        asked = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
        pairs = zip(tp2.generate(prompts[:3], asked, use_tqdm=False), tp1.generate(prompts[:3], asked, use_tqdm=False))
        for a, b in pairs:
            assert a.prompt_logprobs[0] is None
            assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(a.prompt_token_ids)
            for token, x, y in zip(a.prompt_token_ids[1:], a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
                assert next(iter(x)) == next(iter(y)) == token
                torch.testing.assert_close(torch.tensor(x[token].logprob), torch.tensor(y[token].logprob),
                                           atol=LOGITS_ATOL, rtol=LOGITS_RTOL)

        full = tp1.stats()["kv_cache_bytes_per_rank"][0]
        assert tp2.stats()["kv_cache_bytes_per_rank"] == [full // 2, full // 2]
        assert_logits_match(model, tp2, prompts[:5])
        assert model.model.layers[0].self_attn.q_proj.out_features == 256  # the caller's model is untouched
    finally:
        tp2.shutdown()


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_8_kv_heads_under_preemption(tiny, mode):
    """12 blocks cannot hold the batch: requests are preempted and resumed; the driver broadcasts the swaps
    and every rank moves its own shard of the blocks."""
    model, prompts, want = tiny
    tp2 = kvpage.LLM(model=model, num_kv_blocks=12, preemption_mode=mode, tensor_parallel_size=2)
    got, stats = generate_then_shut_down(tp2, prompts, GREEDY)
    assert_same_greedy(model, prompts, want, got)
    assert stats[f"num_{mode}_preemptions"] > 0 and stats[f"num_{mode}_preemptions"] == stats["num_preemptions"]
    if mode == "swap":
        assert stats["num_swapped_out_blocks"] > 0 and stats["num_swapped_in_blocks"] > 0


def test_one_kv_head_is_replicated_on_both_ranks():
    """MQA: fewer KV heads than ranks, so both ranks hold the whole (single-head) cache. Also: the caller's own
    torch.distributed default group is neither needed, nor taken over, nor destroyed."""
    import torch.distributed as dist

    model = tiny_llama(seed=3, num_key_value_heads=1)
    prompts = random_prompts([9, 30, 17], seed=4)
    tp1 = kvpage.LLM(model=model, num_kv_blocks=32)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        tp2 = kvpage.LLM(model=model, num_kv_blocks=32, tensor_parallel_size=2)
        try:
            assert_same_greedy(model, prompts, tp1.generate(prompts, GREEDY, use_tqdm=False),
                               tp2.generate(prompts, GREEDY, use_tqdm=False))
            full = tp1.stats()["kv_cache_bytes_per_rank"][0]
            assert tp2.stats()["kv_cache_bytes_per_rank"] == [full, full]
            assert_logits_match(model, tp2, prompts)
        finally:
            tp2.shutdown()
        assert dist.is_initialized() and dist.get_world_size() == 1
    finally:
        dist.destroy_process_group()


def test_8_kv_heads_fp8_cache(tiny):
    """kv_cache_dtype="fp8" reaches every rank: each holds its half of the heads in float8_e4m3fn (an
    eighth of TP=1's fp32 bytes), and greedy tokens follow TP=1's fp8 engine."""
    model, prompts, _ = tiny
    want = kvpage.LLM(model=model, num_kv_blocks=256, kv_cache_dtype="fp8").generate(prompts, GREEDY, use_tqdm=False)
    full = kvpage.LLM(model=model, num_kv_blocks=256).stats()["kv_cache_bytes_per_rank"][0]
    tp2 = kvpage.LLM(model=model, num_kv_blocks=256, tensor_parallel_size=2, kv_cache_dtype="fp8")
    try:
        got = tp2.generate(prompts, GREEDY, use_tqdm=False)
        assert tp2.stats()["kv_cache_bytes_per_rank"] == [full // 8, full // 8]
        assert all(k.dtype == torch.float8_e4m3fn for kv in tp2.runner.runner.kv_caches for k in kv)
    finally:
        tp2.shutdown()
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


@pytest.mark.parametrize("precision", ["highest", "medium"])
def test_8_kv_heads_16bit_weights(precision):
    """weight_dtype="bfloat16" (and matmul_precision) reach every rank: each rounds its shard of a freshly
    built model and packs its linears in 16 bits (bf16 dot-product pairs for "medium" where the CPU has
    them); greedy tokens follow TP=1's (for "medium" up to near-ties: the ranks' partial sums differ)."""
    from kvpage.model import cpu_layout
    from kvpage.ops.layers import bf16_dot_available

    prompts = prefix_sharing_prompts()
    storage = dict(weight_dtype="bfloat16", matmul_precision=precision)
    want = kvpage.LLM(model=tiny_llama(), num_kv_blocks=256, **storage).generate(prompts, GREEDY, use_tqdm=False)
    tp2 = kvpage.LLM(model=tiny_llama(), num_kv_blocks=256, tensor_parallel_size=2, **storage)
    try:
        got = tp2.generate(prompts, GREEDY, use_tqdm=False)
        rank0 = tp2.runner.runner.model
        slabs = tp2.runner.runner.forward.packed_weights()
        if cpu_layout.slab_kernel_available():  # each layer's 4 matrices (a shard's) and the LM head's slice
            assert len(slabs) == 4 * rank0.config.num_hidden_layers + 1
            assert all(packed.dtype == torch.bfloat16 for packed in slabs)
            pairs = precision == "medium" and bf16_dot_available()
            assert all(packed.dim() == (4 if pairs else 3) for packed in slabs)
        else:  # no slab kernel (KVPAGE_CPU_ISA=generic): float32 products of the rounded weights
            assert not slabs
        assert all(torch.equal(p, p.bfloat16().float()) for p in rank0.parameters())
    finally:
        tp2.shutdown()
    if precision == "highest":
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    else:
        reference = tiny_llama()
        with torch.no_grad():
            for p in reference.parameters():
                p.copy_(p.bfloat16().float())
        assert_same_greedy(reference, prompts, want, got)
