"""fp8 (float8_e4m3fn) KV caches: reshape_and_cache quantises, attention dequantises with per-tensor
scales, the cache ops move fp8 blocks like any other. Everything is compared with ops/reference.py:
the write bit for bit, attention within the float32 tolerances of the dequantised reference."""
import pytest
import torch

from kvpage import ops
from kvpage.ops import reference
from paged_data import (DTYPES, HEAD_CONFIGS, cdiv, distinct_block_tables, generator, int32, query_start_loc,
                        randn, random_block_tables, write_every_value)
from tolerances import assert_attention_close

FP8 = torch.float8_e4m3fn
NAN_CODES = (0x7F, 0xFF)


def fp8_cache(num_blocks, block_size, num_kv_heads, head_size, gen, k_scale=1.0, v_scale=1.0):
    """An fp8 (key_cache, value_cache) holding quantised random values spread over fp8's range."""
    key_cache, value_cache = ops.allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_size, FP8)
    shape = key_cache.shape
    key_cache.copy_(reference.quantize_fp8(torch.randn(shape, generator=gen) * 3, k_scale))
    value_cache.copy_(reference.quantize_fp8(torch.randn(shape, generator=gen) * 3, v_scale))
    return key_cache, value_cache


def same_bits(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def hard_values(dtype):
    """Every finite value of the source dtype's neighbourhood that matters to e4m3: all fp16
    values (subnormal to 65504, so saturation, fp8 subnormals and every rounding tie), both zeros
    and infinities."""
    halves = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    values = halves[~halves.isnan()].float()
    return values.to(dtype)


@pytest.mark.parametrize("scale", [1.0, 0.37, 2.0, 1e-3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_write_quantises_like_torch(dtype, scale):
    caches, expected = write_every_value(hard_values(dtype), FP8, k_scale=scale, v_scale=1.0)
    assert same_bits(caches[0], expected[0]) and same_bits(caches[1], expected[1])


def test_write_from_strided_views_and_saturation():
    gen = generator(2)
    qkv = randn((20, 5 * 64), torch.float32, gen) * 1000  # many values beyond +-448
    _, key, value = qkv.split([3 * 64, 64, 64], dim=-1)
    key, value = key.view(20, 1, 64), value.view(20, 1, 64)
    caches = ops.allocate_kv_cache(4, 8, 1, 64, FP8)
    expected = [t.clone() for t in caches]
    slots = torch.arange(20)
    ops.reshape_and_cache(key, value, *caches, slots, k_scale=0.5, v_scale=3.0)
    reference.reshape_and_cache(key, value, *expected, slots, k_scale=0.5, v_scale=3.0)
    assert same_bits(caches[0], expected[0]) and same_bits(caches[1], expected[1])
    codes = caches[0].view(torch.uint8)
    assert not torch.isin(codes, torch.tensor(NAN_CODES, dtype=torch.uint8)).any(), "saturates, never NaN"
    assert caches[0].float().abs().max() == 448


def test_attention_reads_every_code_exactly(cpu_isa):
    """One token per sequence: softmax weight 1, so the output is the dequantised V row itself."""
    codes = torch.tensor([c for c in range(256) if c not in NAN_CODES], dtype=torch.uint8)
    head_size, v_scale = 64, 0.75
    num_seqs = cdiv(codes.numel(), head_size)
    codes = torch.cat([codes, codes[: num_seqs * head_size - codes.numel()]])
    key_cache, value_cache = ops.allocate_kv_cache(num_seqs, 1, 1, head_size, FP8)
    value_cache.view(torch.uint8).copy_(codes.view(num_seqs, 1, 1, head_size))
    query = torch.randn(num_seqs, 1, head_size)
    tables = torch.arange(num_seqs, dtype=torch.int32).view(num_seqs, 1)
    out = ops.paged_attention(query, key_cache, value_cache, tables, int32([1] * num_seqs), v_scale=v_scale)
    expected = value_cache.view(num_seqs, head_size).float() * v_scale
    assert torch.equal(out.view(num_seqs, head_size), expected)


@pytest.mark.parametrize("head_size", [16, 64, 80, 128, 256])
@pytest.mark.parametrize("heads", HEAD_CONFIGS.values(), ids=HEAD_CONFIGS.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_matches_dequantised_reference(cpu_isa, dtype, heads, head_size):
    num_heads, num_kv_heads = heads
    gen, block_size, k_scale, v_scale = generator(3), 16, 0.05, 0.5
    seq_lens = [1, 15, 100, 700]
    caches = fp8_cache(60, block_size, num_kv_heads, head_size, gen, k_scale, v_scale)
    tables = random_block_tables(seq_lens, block_size, 60, gen)
    query = randn((len(seq_lens), num_heads, head_size), dtype, gen)
    expected = reference.paged_attention(query, *caches, tables, int32(seq_lens), k_scale=k_scale, v_scale=v_scale)
    for partition_size in (None, 64):
        out = ops.paged_attention(query, *caches, tables, int32(seq_lens), partition_size=partition_size,
                                  k_scale=k_scale, v_scale=v_scale)
        assert_attention_close(out, expected)


@pytest.mark.parametrize("heads", HEAD_CONFIGS.values(), ids=HEAD_CONFIGS.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_matches_dequantised_reference(cpu_isa, dtype, heads):
    num_heads, num_kv_heads = heads
    gen, block_size, head_size, k_scale, v_scale = generator(4), 16, 64, 0.1, 2.0
    lens = [(0, 33), (40, 7), (130, 1), (5, 0)]  # (cached context, query tokens)
    seq_lens = [c + q for c, q in lens]
    caches = fp8_cache(40, block_size, num_kv_heads, head_size, gen, k_scale, v_scale)
    tables = distinct_block_tables(seq_lens, block_size, 40, gen)
    starts = query_start_loc([q for _, q in lens])
    query = randn((int(starts[-1]), num_heads, head_size), dtype, gen)
    args = (query, *caches, tables, starts, int32(seq_lens))
    out = ops.paged_prefill_attention(*args, k_scale=k_scale, v_scale=v_scale)
    assert_attention_close(out, reference.paged_prefill_attention(*args, k_scale=k_scale, v_scale=v_scale))


def test_written_then_attended_matches_full_precision_closely():
    """End to end: an fp8 cache written by reshape_and_cache gives attention within fp8's error of
    the float32 cache (a loose bound; the exact comparisons are above)."""
    gen, num_tokens = generator(5), 64
    key, value = randn((num_tokens, 3, 64), torch.float32, gen), randn((num_tokens, 3, 64), torch.float32, gen)
    slots = torch.arange(num_tokens)
    fp32_caches = ops.allocate_kv_cache(4, 16, 3, 64)
    fp8_caches = ops.allocate_kv_cache(4, 16, 3, 64, FP8)
    ops.reshape_and_cache(key, value, *fp32_caches, slots)
    ops.reshape_and_cache(key, value, *fp8_caches, slots, k_scale=0.02, v_scale=0.02)
    query = randn((1, 9, 64), torch.float32, gen)
    tables, seq_lens = int32([[0, 1, 2, 3]]), int32([num_tokens])
    exact = ops.paged_attention(query, *fp32_caches, tables, seq_lens)
    approx = ops.paged_attention(query, *fp8_caches, tables, seq_lens, k_scale=0.02, v_scale=0.02)
    assert (approx - exact).abs().max() < 0.1 * exact.abs().max()
    assert not torch.equal(approx, exact)


def test_copy_and_swap_move_fp8_blocks():
    gen = generator(6)
    keys, values = zip(*(fp8_cache(8, 16, 2, 64, gen) for _ in range(3)))
    expected_keys, expected_values = [k.clone() for k in keys], [v.clone() for v in values]
    mapping = torch.tensor([[0, 5], [2, 7]])
    ops.copy_blocks(list(keys), list(values), mapping)
    reference.copy_blocks(expected_keys, expected_values, mapping)
    assert all(same_bits(a, b) for a, b in zip(keys + values, expected_keys + expected_values))
    host = [torch.zeros_like(t) for t in keys]
    ops.swap_blocks(list(keys), host, mapping)
    assert all(same_bits(h[5], k[0]) and same_bits(h[7], k[2]) for h, k in zip(host, keys))


@pytest.mark.parametrize("bad, error, words", [
    (dict(k_scale=0.0), ValueError, "k_scale"),
    (dict(v_scale=-1.0), ValueError, "v_scale"),
    (dict(v_scale=float("inf")), ValueError, "v_scale"),
    (dict(k_scale=float("nan")), ValueError, "k_scale"),
    (dict(k_scale=True), TypeError, "k_scale"),
    (dict(v_scale="1"), TypeError, "v_scale"),
    # float32 holds the scale and its reciprocal: zero codes would become NaN, or the output zero.
    (dict(k_scale=1e-300), ValueError, "k_scale"),
    (dict(v_scale=1e39), ValueError, "v_scale"),
])
def test_bad_scales_name_the_argument(bad, error, words):
    caches = ops.allocate_kv_cache(2, 16, 1, 64, FP8)
    x = torch.randn(1, 1, 64)
    with pytest.raises(error, match=words):
        ops.reshape_and_cache(x, x, *caches, torch.tensor([0]), **bad)
    with pytest.raises(error, match=words):
        ops.paged_attention(x, *caches, int32([[0]]), int32([1]), **bad)


def test_scales_apply_to_fp8_caches_only():
    caches = ops.allocate_kv_cache(2, 16, 1, 64)
    x = torch.randn(1, 1, 64)
    with pytest.raises(ValueError, match="k_scale.*fp8"):
        ops.reshape_and_cache(x, x, *caches, torch.tensor([0]), k_scale=2.0)
    with pytest.raises(ValueError, match="v_scale.*fp8"):
        ops.paged_prefill_attention(x, *caches, int32([[0]]), int32([0, 1]), int32([1]), v_scale=0.5)


def test_dtype_rules():
    fp8_caches = ops.allocate_kv_cache(2, 16, 1, 64, FP8)
    half_caches = ops.allocate_kv_cache(2, 16, 1, 64, torch.float16)
    with pytest.raises(TypeError, match="query dtype"):  # fp8 is a cache dtype, not a compute dtype
        ops.paged_attention(torch.zeros(1, 1, 64, dtype=FP8), *fp8_caches, int32([[0]]), int32([1]))
    # Besides fp8, only float32 compute over a 16-bit cache mixes (tests/ops/test_narrowed_cache_ops.py).
    with pytest.raises(TypeError, match="query dtype"):
        ops.paged_attention(torch.zeros(1, 1, 64, dtype=torch.bfloat16), *half_caches, int32([[0]]), int32([1]))
    with pytest.raises(TypeError, match="key dtype"):
        x = torch.zeros(1, 1, 64, dtype=torch.bfloat16)
        ops.reshape_and_cache(x, x, *half_caches, torch.tensor([0]))
    with pytest.raises(TypeError, match="value dtype"):  # key and value in one dtype
        ops.reshape_and_cache(torch.zeros(1, 1, 64), torch.zeros(1, 1, 64, dtype=torch.float16), *half_caches,
                              torch.tensor([0]))
    with pytest.raises(TypeError, match="dtype must be one of"):
        ops.allocate_kv_cache(2, 16, 1, 64, torch.float8_e5m2)
