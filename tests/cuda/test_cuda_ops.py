"""Every kvpage op on CUDA against kvpage.ops.reference (computed on the same GPU tensors).

Random block tables scatter and repeat physical blocks; slot mappings carry -1; key/value and
query are strided views of a fused qkv tensor; contexts run from 1 token to several 512-token
decode partitions; prefill has cached (prefix) context. Skips cleanly without CUDA."""
import pytest
import torch

from kvpage import ops
from kvpage.ops import reference

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and ops.built_with_cuda),
                                reason="needs a CUDA device and kvpage built with CUDA")

# The one place for tolerances: fp32 differs from the reference only in summation order;
# 16-bit runs round P to the cache dtype before P @ V on tensor cores, and round the output.
TOLERANCES = {
    torch.float32: dict(atol=5e-5, rtol=1e-4),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEAD_SIZES = [64, 80, 96, 112, 128, 192, 256, 48, 160]  # the last two take masked instantiations
HEADS = [(4, 4), (8, 2), (9, 3), (32, 8), (8, 1), (12, 1)]  # MHA, GQA, SmolLM2, Llama-3, MQA, group > 8


def assert_close(actual, expected):
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCES[expected.dtype])


def generator(seed):
    return torch.Generator().manual_seed(seed)


def make_cache(num_blocks, block_size, num_kv_heads, head_size, dtype, gen):
    key_cache, value_cache = ops.allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_size,
                                                   dtype=dtype, device="cuda")
    key_cache.copy_(torch.randn(key_cache.shape, generator=gen).to(dtype))
    value_cache.copy_(torch.randn(value_cache.shape, generator=gen).to(dtype))
    return key_cache, value_cache


def block_tables_for(seq_lens, block_size, num_blocks, gen, extra_columns=2):
    """Scattered physical blocks with repeats (shared prefixes); spare columns past each sequence."""
    width = max(-(-max(seq_lens) // block_size), 1) + extra_columns
    return torch.randint(0, num_blocks, (len(seq_lens), width), generator=gen, dtype=torch.int32).cuda()


def ints(values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype, device="cuda")


def fused_qkv(num_tokens, num_heads, num_kv_heads, head_size, dtype, gen):
    """query, key, value as strided views of one [tokens, heads + 2 kv_heads, D] tensor."""
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_size, generator=gen).to(dtype).cuda()
    return (qkv[:, :num_heads], qkv[:, num_heads:num_heads + num_kv_heads],
            qkv[:, num_heads + num_kv_heads:])


# ---- decode ------------------------------------------------------------------------------------

def run_decode(dtype, head_size, heads, block_size, seq_lens, partition_size=None, seed=0):
    gen = generator(seed)
    num_heads, num_kv_heads = heads
    key_cache, value_cache = make_cache(64, block_size, num_kv_heads, head_size, dtype, gen)
    tables = block_tables_for(seq_lens, block_size, 64, gen)
    query = fused_qkv(len(seq_lens), num_heads, num_kv_heads, head_size, dtype, gen)[0]
    lens = ints(seq_lens)
    out = ops.paged_attention(query, key_cache, value_cache, tables, lens, partition_size=partition_size)
    assert_close(out, reference.paged_attention(query, key_cache, value_cache, tables, lens))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
def test_decode_head_sizes(dtype, head_size):
    run_decode(dtype, head_size, (8, 2), 16, [1, 17, 300, 1100])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("block_size", [1, 8, 16, 32, 256])
def test_decode_heads_and_blocks(dtype, heads, block_size):
    run_decode(dtype, 128, heads, block_size, [5, 64, 513, 1600], seed=block_size)


@pytest.mark.parametrize("partition_size", [None, 64, 512, 4096])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_partitions(dtype, partition_size):
    # 4096 >= every table row: forces the single pass; 64 makes many partitions.
    run_decode(dtype, 64, (9, 3), 16, [1, 63, 64, 65, 700, 2050], partition_size=partition_size)


def test_decode_many_sequences_single_pass():
    # Enough CTAs that the automatic choice is the single pass even with long rows.
    run_decode(torch.float16, 128, (32, 8), 16, [37 * (i % 50) + 1 for i in range(300)])


# ---- prefill -----------------------------------------------------------------------------------

def run_prefill(dtype, head_size, heads, block_size, q_lens, ctx_lens, seed=0):
    gen = generator(seed)
    num_heads, num_kv_heads = heads
    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens)]
    key_cache, value_cache = make_cache(128, block_size, num_kv_heads, head_size, dtype, gen)
    tables = block_tables_for(seq_lens, block_size, 128, gen)
    query = fused_qkv(sum(q_lens), num_heads, num_kv_heads, head_size, dtype, gen)[0]
    starts = ints([0] + torch.tensor(q_lens).cumsum(0).tolist())
    lens = ints(seq_lens)
    out = ops.paged_prefill_attention(query, key_cache, value_cache, tables, starts, lens)
    expected = reference.paged_prefill_attention(query, key_cache, value_cache, tables, starts, lens)
    assert_close(out, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
def test_prefill_head_sizes(dtype, head_size):
    run_prefill(dtype, head_size, (8, 2), 16, [70, 1, 130], [0, 40, 200])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("block_size", [1, 8, 16, 32, 256])
def test_prefill_heads_and_blocks(dtype, heads, block_size):
    run_prefill(dtype, 64, heads, block_size, [3, 64, 65, 0, 200], [0, 0, 31, 10, 500], seed=block_size)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_long(dtype):
    run_prefill(dtype, 128, (32, 8), 16, [1024, 300], [0, 1500])


# ---- cache ops -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [64, 80, 128])
@pytest.mark.parametrize("pad", [0, 1])  # pad=1 breaks 16-byte alignment: the scalar kernel
def test_reshape_and_cache(dtype, head_size, pad):
    gen = generator(head_size)
    num_kv_heads, block_size, num_blocks, tokens = 4, 16, 32, 100
    key_cache, value_cache = make_cache(num_blocks, block_size, num_kv_heads, head_size, dtype, gen)
    fused = torch.randn(tokens, 2 * num_kv_heads * head_size + pad, generator=gen).to(dtype).cuda()
    key = fused[:, :num_kv_heads * head_size].view(tokens, num_kv_heads, head_size)
    value = fused[:, num_kv_heads * head_size:2 * num_kv_heads * head_size].view(tokens, num_kv_heads, head_size)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[::7] = -1
    slots = slots.cuda()
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    reference.reshape_and_cache(key, value, expected_k, expected_v, slots)
    ops.reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks(dtype):
    gen = generator(1)
    layers = [make_cache(40, 16, 2, 64, dtype, gen) for _ in range(3)]
    keys, values = [k for k, _ in layers], [v for _, v in layers]
    mapping = torch.tensor([[0, 5], [3, 7], [3, 9], [12, 39]])
    expected_k, expected_v = [k.clone() for k in keys], [v.clone() for v in values]
    reference.copy_blocks(expected_k, expected_v, mapping)
    ops.copy_blocks(keys, values, mapping)
    for a, b in zip(keys + values, expected_k + expected_v):
        assert torch.equal(a, b)


@pytest.mark.parametrize("direction", ["out", "in"])
def test_swap_blocks(direction):
    gen = generator(2)
    gpu = [make_cache(20, 16, 2, 64, torch.float16, gen)[i] for i in range(2)]
    host = [torch.randn(t.shape, generator=gen).to(t.dtype).pin_memory() for t in gpu]
    src, dst = (gpu, host) if direction == "out" else (host, gpu)
    mapping = torch.tensor([[1, 0], [4, 19], [19, 3]])
    expected = [d.clone() for d in dst]
    reference.swap_blocks(src, expected, mapping)
    ops.swap_blocks(src, dst, mapping)
    torch.cuda.synchronize()
    for a, b in zip(dst, expected):
        assert torch.equal(a.cpu(), b.cpu())


def test_swap_rejects_pageable_host_memory():
    gpu = torch.zeros(4, 16, device="cuda")
    with pytest.raises(ValueError, match="pinned"):
        ops.swap_blocks([gpu], [torch.zeros(4, 16)], [[0, 1]])


# ---- bad input ---------------------------------------------------------------------------------

def decode_inputs():
    gen = generator(3)
    key_cache, value_cache = make_cache(8, 16, 2, 64, torch.float16, gen)
    query = torch.randn(2, 4, 64, generator=gen).half().cuda()
    return query, key_cache, value_cache, ints([[0, 1], [2, 3]]), ints([20, 32])


def test_range_checks_name_the_argument():
    query, key_cache, value_cache, tables, lens = decode_inputs()
    with pytest.raises(ValueError, match="block_tables"):
        ops.paged_attention(query, key_cache, value_cache, ints([[0, 1], [2, 99]]), lens)
    with pytest.raises(ValueError, match="seq_lens"):
        ops.paged_attention(query, key_cache, value_cache, tables, ints([20, 33]))
    with pytest.raises(ValueError, match="slot_mapping"):
        ops.reshape_and_cache(query[:, :2], query[:, 2:], key_cache, value_cache,
                              ints([0, 8 * 16], torch.int64))
    with pytest.raises(ValueError, match="query_start_loc"):
        ops.paged_prefill_attention(query, key_cache, value_cache, tables, ints([0, 2, 1]), lens)
    with pytest.raises(ValueError, match="block_mapping"):
        ops.copy_blocks([key_cache], [value_cache], [[0, 8]])


def test_unchecked_bad_indices_stay_in_bounds():
    # With range checks off the kernels mask bad indices: garbage out, but no fault.
    query, key_cache, value_cache, _, _ = decode_inputs()
    with ops.range_checks(False):
        ops.paged_attention(query, key_cache, value_cache, ints([[0, 1 << 30], [-5, 3]]),
                            ints([1 << 20, -3]))
        ops.paged_prefill_attention(query, key_cache, value_cache, ints([[0, 1], [7, 1 << 29]]),
                                    ints([5, -100, 1 << 30]), ints([1 << 25, 2]))
        ops.reshape_and_cache(query[:, :2], query[:, 2:], key_cache, value_cache,
                              ints([1 << 40, -7], torch.int64))
        ops.copy_blocks([key_cache], [value_cache], [[0, 1 << 40]])
    torch.cuda.synchronize()


def test_wrong_device_and_dtype():
    query, key_cache, value_cache, tables, lens = decode_inputs()
    with pytest.raises(ValueError, match="block_tables"):
        ops.paged_attention(query, key_cache, value_cache, tables.cpu(), lens)
    with pytest.raises(TypeError, match="seq_lens"):
        ops.paged_attention(query, key_cache, value_cache, tables, lens.long())
    with pytest.raises(TypeError, match="query"):
        ops.paged_attention(query.float(), key_cache, value_cache, tables, lens)


def test_runs_on_current_stream_and_device():
    query, key_cache, value_cache, tables, lens = decode_inputs()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), ops.range_checks(False):
        out = ops.paged_attention(query, key_cache, value_cache, tables, lens)
    stream.synchronize()
    assert_close(out, reference.paged_attention(query, key_cache, value_cache, tables, lens))
