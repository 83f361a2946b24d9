"""LLM(kv_cache_dtype="bfloat16" / "float16") for the float32 default model on CPU: K/V rounded to 16
bits in the cache, attention in float32. The reference is HF generate on the same weights with an
attention that sees K/V exactly as such a cache holds them (reference.round_through_cache, then sdpa):
greedy tokens must agree, up to near-ties."""
from __future__ import annotations

import copy

import pytest
import torch

from kvpage.model.runner import check_cache_dtype
from kvpage.ops import reference
from engine_helpers import BF16_TIE_TOLERANCE, GREEDY, PROMPTS, assert_greedy_matches, hf_generate, make_llm

NARROW_PROMPTS = PROMPTS[:6] + PROMPTS[12:14]
NARROW = {"bfloat16": torch.bfloat16, "float16": torch.float16}
# As with fp8 (test_fp8_engine.py), a K/V element within float32 noise of a rounding midpoint lands on
# neighbouring 16-bit values in kvpage and in the reference: small logit moves at near-ties only.
TIE_TOLERANCE = BF16_TIE_TOLERANCE


@pytest.fixture(scope="module", params=sorted(NARROW))
def narrowed(request, llm, prompt_ids):
    """(kv_cache_dtype name, HF's greedy tokens on K/V rounded through that dtype)."""
    model = copy.deepcopy(llm.model)
    model.set_attn_implementation(reference.register_hf_rounded_kv_attention(NARROW[request.param]))
    ids = prompt_ids[:6] + prompt_ids[12:14]
    return request.param, hf_generate(model.eval(), ids, GREEDY.max_tokens)


@pytest.mark.parametrize("config", [{}, dict(enable_prefix_caching=False, max_num_batched_tokens=32)],
                         ids=["prefix_caching", "chunked_prefill"])
def test_narrowed_cache_matches_hf_on_rounded_kv(llm, narrowed, config):
    name, refs = narrowed
    engine = make_llm(llm, kv_cache_dtype=name, **config)
    assert all(t.dtype == NARROW[name] for kv in engine.runner.kv_caches for t in kv)
    outputs = engine.generate(NARROW_PROMPTS, GREEDY, use_tqdm=False)
    ties = assert_greedy_matches(outputs, refs, tie_tolerance=TIE_TOLERANCE)
    assert ties <= len(refs) // 2, f"{ties} of {len(refs)} prompts parted from the {name} reference"


def test_narrowed_cache_swaps_and_holds_twice_the_tokens(llm, narrowed):
    name, refs = narrowed
    engine = make_llm(llm, kv_cache_dtype=name, num_kv_blocks=16, preemption_mode="swap")
    assert engine.runner.kv_cache_bytes_per_block() * 2 == llm.runner.kv_cache_bytes_per_block()
    outputs = engine.generate(NARROW_PROMPTS, GREEDY, use_tqdm=False)
    ties = assert_greedy_matches(outputs, refs, tie_tolerance=TIE_TOLERANCE)
    assert ties <= len(refs) // 2
    assert engine.stats()["num_swapped_out_blocks"] > 0


@pytest.mark.parametrize("cache_dtype,dtype,device", [
    (torch.bfloat16, torch.float32, "cuda"),  # the CUDA kernels pair 16-bit caches with 16-bit compute only
    (torch.float16, torch.bfloat16, "cpu"),  # narrowing is from float32
    (torch.float32, torch.bfloat16, "cpu"),
])
def test_unsupported_pairings_name_kv_cache_dtype(cache_dtype, dtype, device):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        check_cache_dtype(cache_dtype, dtype, torch.device(device))
