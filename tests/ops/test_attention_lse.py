"""return_lse of paged_attention and paged_prefill_attention against the reference's log-sum-exp, on
every CPU kernel ISA: single pass and partitioned decode, GQA / MQA and groups wide enough for the
row-lanes kernel, 16-bit queries, fp8 caches with scales; and the op's checks of an lse tensor."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from kvpage import ops
from kvpage.ops import reference
from paged_data import (DTYPES, attention_shapes, block_tables_for, decode_seq_lens, generator, int32,
                        query_start_loc, randn, random_block_tables, random_kv_cache)
from tolerances import assert_attention_close, assert_lse_close

HEADS = {"mha": (4, 4), "gqa9x3": (9, 3), "mqa": (8, 1), "group12": (12, 1)}
FP8 = torch.float8_e4m3fn
SINGLE_PASS = 1 << 20


def caches(num_blocks, block_size, num_kv_heads, head_size, dtype, gen, k_scale=1.0, v_scale=1.0):
    """Random caches; fp8 ones hold N(0, 1) values quantised with the scales."""
    if dtype != FP8:
        return random_kv_cache(num_blocks, block_size, num_kv_heads, head_size, dtype, gen)
    pair = ops.allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_size, FP8)
    for cache, scale in zip(pair, (k_scale, v_scale)):
        cache.copy_(reference.quantize_fp8(torch.randn(cache.shape, generator=gen), scale))
    return pair


def decode_args(seq_lens, heads, dtype, cache_dtype=None, head_size=64, block_size=16, seed=0, **scales):
    gen = generator(seed)
    num_blocks = max(8, sum(seq_lens) // block_size + 2)
    kv = caches(num_blocks, block_size, heads[1], head_size, cache_dtype or dtype, gen, **scales)
    tables = random_block_tables(seq_lens, block_size, num_blocks, gen)
    return randn((len(seq_lens), heads[0], head_size), dtype, gen), *kv, tables, int32(seq_lens)


def prefill_args(lens, heads, dtype, cache_dtype=None, head_size=64, block_size=16, seed=0, **scales):
    """lens: (cached context, query tokens) per sequence."""
    gen = generator(seed)
    seq_lens = [c + q for c, q in lens]
    num_blocks = max(8, sum(seq_lens) // block_size + 2)
    kv = caches(num_blocks, block_size, heads[1], head_size, cache_dtype or dtype, gen, **scales)
    tables = random_block_tables(seq_lens, block_size, num_blocks, gen)
    starts = query_start_loc([q for _, q in lens])
    query = randn((int(starts[-1]), heads[0], head_size), dtype, gen)
    return query, *kv, tables, starts, int32(seq_lens)


def check_lse(op, reference_op, args, op_kwargs=(), **kwargs):
    """The op's (out, lse) against the reference's; out must be the bits return_lse=False gives.
    op_kwargs: the op's own (partition_size)."""
    op_kwargs = dict(op_kwargs, **kwargs)
    out, lse = op(*args, return_lse=True, **op_kwargs)
    expected_out, expected_lse = reference_op(*args, return_lse=True, **kwargs)
    assert lse.dtype == torch.float32 and lse.shape == args[0].shape[:2] and lse.is_contiguous()
    assert_lse_close(lse, expected_lse)
    assert_attention_close(out, expected_out)
    assert torch.equal(out, op(*args, **op_kwargs))


@pytest.mark.parametrize("partition_size", [64, SINGLE_PASS], ids=["split", "single"])
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_lse(cpu_isa, dtype, heads, partition_size):
    args = decode_args([1, 17, 64, 300], heads, dtype)
    check_lse(ops.paged_attention, reference.paged_attention, args, {"partition_size": partition_size})


@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_lse(cpu_isa, dtype, heads):
    # Single tokens after a prefix, a fresh prompt past one query tile, a chunk starting mid-block.
    args = prefill_args([(0, 1), (40, 1), (0, 70), (13, 20), (9, 0)], heads, dtype)
    check_lse(ops.paged_prefill_attention, reference.paged_prefill_attention, args, scale=0.3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp8_cache_lse_uses_dequantised_keys(cpu_isa, dtype):
    scales = dict(k_scale=0.05, v_scale=0.5)
    args = decode_args([1, 100, 300], (9, 3), dtype, FP8, **scales)
    for partition_size in (64, SINGLE_PASS):
        check_lse(ops.paged_attention, reference.paged_attention, args, {"partition_size": partition_size}, **scales)
    args = prefill_args([(0, 30), (50, 9)], (9, 3), dtype, FP8, **scales)
    check_lse(ops.paged_prefill_attention, reference.paged_prefill_attention, args, **scales)


@settings(max_examples=12)
@given(shape=attention_shapes(), seq_lens=decode_seq_lens(), data=st.data())
def test_decode_lse_random_batches(shape, seq_lens, data):
    tables = data.draw(block_tables_for(seq_lens, shape.block_size, shape.num_blocks))
    partition_size = data.draw(st.sampled_from([None, shape.block_size * data.draw(st.integers(1, 8))]))
    gen = generator(shape.seed)
    kv = random_kv_cache(shape.num_blocks, shape.block_size, shape.num_kv_heads, shape.head_size, shape.dtype, gen)
    query = randn((len(seq_lens), shape.num_heads, shape.head_size), shape.dtype, gen)
    args = (query, *kv, tables, int32(seq_lens))
    _, lse = ops.paged_attention(*args, partition_size=partition_size, return_lse=True)
    assert_lse_close(lse, reference.paged_attention(*args, return_lse=True)[1])


def test_empty_batch_gives_empty_lse():
    query, *rest = decode_args([3], (4, 2), torch.float32)
    out, lse = ops.paged_attention(query[:0], *rest[:2], rest[2][:0], rest[3][:0], return_lse=True)
    assert out.shape == (0, 4, 64) and lse.shape == (0, 4) and lse.dtype == torch.float32


def raw_decode_call(args, lse):
    """torch.ops.kvpage.paged_attention with an lse tensor of the caller's making."""
    query = args[0]
    return torch.ops.kvpage.paged_attention(torch.empty_like(query), *args, query.shape[-1] ** -0.5, 0, True,
                                            1.0, 1.0, lse)


@pytest.mark.parametrize("make_lse, error, message", [
    (lambda q: torch.empty(q.shape[:2], dtype=torch.float64), TypeError, "lse must have dtype float32"),
    (lambda q: torch.empty(q.shape[:2], dtype=torch.bfloat16), TypeError, "lse must have dtype float32"),
    (lambda q: torch.empty(q.shape[0], q.shape[1] + 1), ValueError, r"lse must be \[num_tokens, num_heads\]"),
    (lambda q: torch.empty(q.shape[0]), ValueError, r"lse must be \[num_tokens, num_heads\]"),
    (lambda q: torch.empty(q.shape[1], q.shape[0]).t(), ValueError, "lse must be contiguous"),
], ids=["float64", "bfloat16", "shape", "rank", "strided"])
def test_bad_lse_tensor_is_named(make_lse, error, message):
    args = decode_args([5, 9], (4, 2), torch.float32)
    with pytest.raises(error, match=message):
        raw_decode_call(args, make_lse(args[0]))


def test_lse_sharing_memory_with_an_input_is_refused():
    args = decode_args([5, 9], (4, 2), torch.float32)
    overlapping = args[0].view(-1)[: args[0].shape[0] * args[0].shape[1]].view(args[0].shape[:2])
    with pytest.raises(ValueError, match="lse and query share memory"):
        raw_decode_call(args, overlapping)


@pytest.mark.parametrize("value", [1, "yes", None])
def test_return_lse_must_be_a_bool(value):
    args = decode_args([5], (4, 2), torch.float32)
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        ops.paged_attention(*args, return_lse=value)
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        ops.paged_prefill_attention(*prefill_args([(0, 3)], (4, 2), torch.float32), return_lse=value)
