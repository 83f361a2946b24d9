"""PagedCache(kv_cache_dtype="fp8"): HF generate with K/V stored as float8_e4m3fn in the paged blocks
against HF generate on its own DynamicCache with an attention that rounds K/V through fp8 the same
way (reference.hf_fp8_kv_attention)."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_helpers import left_padded
from kvpage import PagedCache
from kvpage.ops import reference
from tiny_models import random_prompts, tiny_model

# Attention sums in another order than sdpa, so a later layer's K/V can differ by an ulp, and an
# element at an fp8 rounding midpoint then lands on the neighbouring code (6% apart): logits move
# by a few hundredths. A row may part from the reference only where its top two logits are that
# close, and at most half the rows may.
FP8_TIE_TOLERANCE = 0.25


def assert_rows_follow(got, expected, logits, prompt_width):
    parted = 0
    for row in range(got.shape[0]):
        for i, (a, b) in enumerate(zip(got[row, prompt_width:].tolist(), expected[row, prompt_width:].tolist())):
            if a != b:
                gap = (logits[i][row, b] - logits[i][row, a]).abs().item()
                assert gap < FP8_TIE_TOLERANCE, f"row {row} token {i}: {a} vs reference {b}, logit gap {gap:.3g}"
                parted += 1
                break
    assert parted <= got.shape[0] // 2, f"{parted} of {got.shape[0]} rows parted from the fp8 reference"


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_fp8_paged_cache_follows_fp8_rounded_reference(family):
    model = tiny_model(family)
    ids, mask = left_padded(random_prompts([5, 23, 40, 9]), pad_id=0)
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=16)
    with torch.inference_mode():
        model.set_attn_implementation(reference.register_hf_fp8_kv_attention())
        expected = model.generate(ids, cache=DynamicCache(config=model.config), output_logits=True,
                                  return_dict_in_generate=True, **kwargs)
        model.set_attn_implementation("sdpa")
        full_precision = model.generate(ids, cache=DynamicCache(config=model.config), **kwargs)
        model.set_attn_implementation("kvpage")
        cache = PagedCache(model.config, kv_cache_dtype="fp8")
        got = model.generate(ids, cache=cache, **kwargs)
    assert_rows_follow(got, expected.sequences, expected.logits, ids.shape[1])
    assert not torch.equal(expected.sequences, full_precision), "fp8 rounding changed nothing: proves little"
    assert all(k.dtype == torch.float8_e4m3fn for kv in cache.kv_caches for k in kv)
    assert cache.bytes_per_block() * 4 == PagedCache(model.config).bytes_per_block()


@pytest.mark.parametrize("bad", ["fp8_e5m2", None, torch.float8_e4m3fn])
def test_fp8_paged_cache_rejects_unknown_names(bad):
    model = tiny_model("llama")
    model.set_attn_implementation("kvpage")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        PagedCache(model.config, kv_cache_dtype=bad)


@pytest.mark.parametrize("name,cache_dtype", [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_16_bit_paged_cache_follows_rounded_reference(name, cache_dtype):
    """A float32 model's K/V in 16 bits (CPU): HF generate follows sdpa over K/V rounded the same way."""
    model = tiny_model("llama")
    ids, mask = left_padded(random_prompts([5, 23, 40, 9]), pad_id=0)
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=16)
    with torch.inference_mode():
        model.set_attn_implementation(reference.register_hf_rounded_kv_attention(cache_dtype))
        expected = model.generate(ids, cache=DynamicCache(config=model.config), output_logits=True,
                                  return_dict_in_generate=True, **kwargs)
        model.set_attn_implementation("kvpage")
        cache = PagedCache(model.config, kv_cache_dtype=name)
        got = model.generate(ids, cache=cache, **kwargs)
    assert_rows_follow(got, expected.sequences, expected.logits, ids.shape[1])
    assert all(k.dtype == cache_dtype for kv in cache.kv_caches for k in kv)
    assert cache.bytes_per_block() * 2 == PagedCache(model.config).bytes_per_block()
