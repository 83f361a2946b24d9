"""Prefix-cache time to first token, copy-on-write block counts and the step roofline, against
hand-worked cases."""
import pytest

from kvpage.costmodel import (Chunk, Device, chunked_prefill_steps, cow, get_device, get_model, prefix_cache_ttft,
                              step_seconds)

SMOL = get_model("smollm2-135m")
# Compute-bound toy device: 1 PFLOP/s achieved, memory so fast the weight read never dominates.
FAST = Device("toy", "compute-bound", memory_bytes=1e12, memory_bandwidth=1e18, peak_flops=1e15,
              link_bandwidth=1e9, transfer_overhead_s=0.0, flops_efficiency=1.0, dtype_bytes=2)


def t(*chunks):
    return step_seconds(SMOL, FAST, [Chunk(*c) for c in chunks])


def test_step_is_the_slower_of_flops_and_bytes():
    flops = 48 * SMOL.flops_per_token + SMOL.attention_flops(48, 0)
    assert t((48, 0)) == pytest.approx(flops / 1e15)
    slow_memory = Device("mem", "memory-bound", memory_bytes=1e12, memory_bandwidth=1e9, peak_flops=1e15,
                         link_bandwidth=1e9, transfer_overhead_s=0.0, flops_efficiency=1.0, dtype_bytes=2,
                         step_overhead_s=0.01)
    nbytes = SMOL.num_params * 2 + (10 + 1) * 2 * 30 * 3 * 64 * 2  # weights + one decode's KV context
    assert step_seconds(SMOL, slow_memory, [Chunk(1, 10)]) == pytest.approx(0.01 + nbytes / 1e9)


def test_prefix_cache_hits_come_from_blocks_computed_earlier_or_in_the_same_step():
    # 3 requests of 32 shared + 16 own tokens, a 48-token budget: one prompt per step.
    plan = prefix_cache_ttft(SMOL, FAST, num_requests=3, shared_tokens=32, unique_tokens=16, block_size=16,
                             max_num_batched_tokens=48)
    full, rest = t((48, 0)), t((16, 32), (16, 32))
    assert plan.ttft_off_s == pytest.approx([full, full + t((48, 0)), 3 * full])
    assert plan.hit_tokens_on == [0, 32, 32]
    assert plan.ttft_on_s == pytest.approx([full, full + rest, full + rest])
    assert plan.saved_prefill_tokens == 64
    # A 64-token budget has room for request 2 in request 1's step, which computes the shared blocks:
    # it hits them there (an in-step hit) and finishes in that step; request 3 takes the next.
    plan = prefix_cache_ttft(SMOL, FAST, 3, 32, 16, 16, max_num_batched_tokens=64)
    assert plan.hit_tokens_on == [0, 32, 32]
    both = t((48, 0), (16, 32))
    assert plan.ttft_on_s == pytest.approx([both, both, both + t((16, 32))])


def test_the_seeds_fifty_requests_sharing_a_2000_token_prompt():
    h100 = get_device("h100")
    llama = get_model("llama-3-8b")
    plan = prefix_cache_ttft(llama, h100, 50, 2000, 32, 16, max_num_batched_tokens=2048)
    assert plan.saved_prefill_tokens == 49 * 2000  # every request but the first hits the whole prompt
    exact_budget = prefix_cache_ttft(llama, h100, 50, 2000, 32, 16, max_num_batched_tokens=2032)
    assert exact_budget.saved_prefill_tokens == 49 * 2000
    assert plan.mean_on_s < plan.mean_off_s / 5
    assert plan.ttft_off_s == sorted(plan.ttft_off_s)


def test_copy_on_write_blocks_worked_by_hand():
    # The seed: two samples of a 500-token prompt at their first divergence. 31 full prompt blocks are
    # shared; the partial 32nd is copied once, and the last writer keeps the original.
    at_fork = cow.parallel_sampling(2, 500, 1, 16)
    assert (at_fork.blocks_shared, at_fork.blocks_unshared) == (31 + 2, 2 * 32)
    assert cow.parallel_sampling(2, 512, 1, 16).blocks_shared == 32 + 2  # block-aligned: the seed's count
    plan = cow.parallel_sampling(4, 500, 32, 16)  # 532 tokens: 34 blocks each, 31 of them shared
    assert (plan.blocks_shared, plan.blocks_unshared, plan.saved_blocks) == (31 + 4 * 3, 4 * 34, 136 - 43)
    assert cow.parallel_sampling(8, 500, 0, 16).blocks_shared == 32  # nobody wrote yet: all shared


def test_beam_search_bounds():
    plan = cow.beam_search(4, 500, 32, 16)
    assert (plan.blocks_shared_min, plan.blocks_shared) == (33 + 4, 43)  # all but the last block shared .. none
    assert plan.blocks_unshared == 136
    with pytest.raises(ValueError):
        cow.beam_search(0, 500, 32, 16)


def test_chunked_prefill_steps():
    whole = chunked_prefill_steps(SMOL, FAST, 4096, [40] * 4, max_num_batched_tokens=4100)
    chunked = chunked_prefill_steps(SMOL, FAST, 4096, [40] * 4, max_num_batched_tokens=512)
    assert len(whole) == 1 and len(chunked) == -(-4096 // 508)
    assert max(chunked) < whole[0] / 5
    assert chunked[1] < chunked[-2]  # later chunks attend over more of the prompt
    with pytest.raises(ValueError, match="no room"):
        chunked_prefill_steps(SMOL, FAST, 100, [1] * 4, max_num_batched_tokens=4)
