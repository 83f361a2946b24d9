"""float16 / bfloat16 KV caches under float32 compute (kv_cache_dtype="bfloat16" / "float16" for a
float32 model, CPU): reshape_and_cache rounds each element to nearest even, attention widens the cache
back to float32. Compared with ops/reference.py: the write bit for bit (torch's own rounding),
attention within the float32 tolerances of the reference over the same 16-bit cache."""
import pytest
import torch

from kvpage import ops
from kvpage.ops import reference
from paged_data import (HEAD_CONFIGS, distinct_block_tables, generator, int32, query_start_loc, randn,
                        random_block_tables, write_every_value)
from tolerances import assert_attention_close

NARROW = (torch.bfloat16, torch.float16)


def same_bits(a, b):
    """Bit for bit, NaN for NaN (torch's own conversions disagree on NaN's payload, scalar vs vector)."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a.view(torch.int16)[~nan], b.view(torch.int16)[~nan])


def hard_floats():
    """float32 values around every rounding decision of both 16-bit formats: random bit patterns
    (every exponent, ties included), their neighbours, overflow, subnormals, zeros, inf and NaN."""
    bits = torch.randint(-(2**31), 2**31 - 1, (4096,), generator=generator(7), dtype=torch.int64).to(torch.int32)
    values = bits.view(torch.float32)
    ties = (torch.arange(-2048, 2048, dtype=torch.int32) << 13 | 0x1000).view(torch.float32)  # fp16 halfway
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 65504.0, 65520.0, 1e-8,
                            3.0e38, -3.0e38, 1e-40])
    return torch.cat([values, ties, special])


@pytest.mark.parametrize("cache_dtype", NARROW, ids=str)
def test_write_rounds_like_torch(cache_dtype):
    caches, expected = write_every_value(hard_floats(), cache_dtype)
    assert same_bits(caches[0], expected[0]) and same_bits(caches[1], expected[1])


@pytest.mark.parametrize("cache_dtype", NARROW, ids=str)
def test_write_from_strided_views(cache_dtype):
    gen = generator(2)
    qkv = randn((20, 5 * 64), torch.float32, gen)
    _, key, value = qkv.split([3 * 64, 64, 64], dim=-1)
    key, value = key.view(20, 1, 64), value.view(20, 1, 64)
    caches = ops.allocate_kv_cache(4, 8, 1, 64, cache_dtype)
    expected = [t.clone() for t in caches]
    ops.reshape_and_cache(key, value, *caches, torch.arange(20))
    reference.reshape_and_cache(key, value, *expected, torch.arange(20))
    assert same_bits(caches[0], expected[0]) and same_bits(caches[1], expected[1])


def narrow_cache(num_blocks, block_size, num_kv_heads, head_size, cache_dtype, gen):
    caches = ops.allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_size, cache_dtype)
    for cache in caches:
        cache.copy_(torch.randn(cache.shape, generator=gen))
    return caches


@pytest.mark.parametrize("head_size", [16, 64, 128])
@pytest.mark.parametrize("heads", HEAD_CONFIGS.values(), ids=HEAD_CONFIGS.keys())
@pytest.mark.parametrize("cache_dtype", NARROW, ids=str)
def test_decode_matches_reference(cpu_isa, cache_dtype, heads, head_size):
    num_heads, num_kv_heads = heads
    gen, block_size, seq_lens = generator(3), 16, [1, 15, 100, 700]
    caches = narrow_cache(60, block_size, num_kv_heads, head_size, cache_dtype, gen)
    tables = random_block_tables(seq_lens, block_size, 60, gen)
    query = randn((len(seq_lens), num_heads, head_size), torch.float32, gen)
    expected = reference.paged_attention(query, *caches, tables, int32(seq_lens))
    for partition_size in (None, 64):
        out = ops.paged_attention(query, *caches, tables, int32(seq_lens), partition_size=partition_size)
        assert out.dtype == torch.float32
        assert_attention_close(out, expected)


@pytest.mark.parametrize("heads", [(4, 4), (6, 3), (9, 3), (8, 2), (16, 2)], ids=lambda h: f"group{h[0] // h[1]}")
@pytest.mark.parametrize("cache_dtype", NARROW, ids=str)
def test_decode_bits_equal_the_widened_float32_cache(cpu_isa, cache_dtype, heads):
    """Widening a 16-bit element to float32 is exact, so decode over a 16-bit cache must give the very
    bits it gives over a float32 cache holding the widened values: small GQA groups read 16-bit tiles
    in place (widening as they load), larger ones convert a tile first; either way the same floats
    reach the same arithmetic."""
    num_heads, num_kv_heads = heads
    gen, block_size, seq_lens = generator(6), 16, [1, 15, 100, 700]
    narrow = narrow_cache(60, block_size, num_kv_heads, 64, cache_dtype, gen)
    wide = tuple(cache.float() for cache in narrow)
    tables = random_block_tables(seq_lens, block_size, 60, gen)
    query = randn((len(seq_lens), num_heads, 64), torch.float32, gen)
    for partition_size in (None, 64):
        got = ops.paged_attention(query, *narrow, tables, int32(seq_lens), partition_size=partition_size)
        want = ops.paged_attention(query, *wide, tables, int32(seq_lens), partition_size=partition_size)
        assert torch.equal(got, want)


@pytest.mark.parametrize("heads", HEAD_CONFIGS.values(), ids=HEAD_CONFIGS.keys())
@pytest.mark.parametrize("cache_dtype", NARROW, ids=str)
def test_prefill_matches_reference(cpu_isa, cache_dtype, heads):
    num_heads, num_kv_heads = heads
    gen, block_size, head_size = generator(4), 16, 64
    lens = [(0, 33), (40, 7), (130, 1), (5, 0)]  # (cached context, query tokens)
    seq_lens = [c + q for c, q in lens]
    caches = narrow_cache(40, block_size, num_kv_heads, head_size, cache_dtype, gen)
    tables = distinct_block_tables(seq_lens, block_size, 40, gen)
    starts = query_start_loc([q for _, q in lens])
    query = randn((int(starts[-1]), num_heads, head_size), torch.float32, gen)
    args = (query, *caches, tables, starts, int32(seq_lens))
    assert_attention_close(ops.paged_prefill_attention(*args), reference.paged_prefill_attention(*args))


@pytest.mark.parametrize("cache_dtype", NARROW, ids=str)
def test_written_then_attended_is_close_to_float32(cache_dtype):
    """End to end: a 16-bit cache written by reshape_and_cache attends within its rounding of the
    float32 cache (a loose bound; the exact comparisons are above)."""
    gen, num_tokens = generator(5), 64
    key, value = randn((num_tokens, 3, 64), torch.float32, gen), randn((num_tokens, 3, 64), torch.float32, gen)
    slots = torch.arange(num_tokens)
    wide, narrow = ops.allocate_kv_cache(4, 16, 3, 64), ops.allocate_kv_cache(4, 16, 3, 64, cache_dtype)
    ops.reshape_and_cache(key, value, *wide, slots)
    ops.reshape_and_cache(key, value, *narrow, slots)
    query = randn((1, 9, 64), torch.float32, gen)
    tables, seq_lens = int32([[0, 1, 2, 3]]), int32([num_tokens])
    exact = ops.paged_attention(query, *wide, tables, seq_lens)
    approx = ops.paged_attention(query, *narrow, tables, seq_lens)
    assert (approx - exact).abs().max() < 0.02 * exact.abs().max()
    assert not torch.equal(approx, exact)
