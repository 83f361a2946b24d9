"""Every op of kvpage's CUDA backend against kvpage.ops.reference: on a GPU, and in the CPU
emulator of tests/cuda_emu, which runs the same kernels and op glue without one (cuda_backends.py;
each test runs once per backend, and skips where its backend cannot run).

Random block tables scatter and repeat physical blocks; slot mappings carry -1; key/value and
query are strided views of a fused qkv tensor; contexts run from 1 token to several 512-token
decode partitions; prefill has cached (prefix) context. fp8 (e4m3) caches: the write bit for bit
against reference.quantize_fp8, attention against the dequantised reference for every query
dtype, with scales != 1. Device placement rules (streams, pinned memory, tensors on the wrong
device) are GPU-only: test_cuda_devices.py."""
import pytest
import torch

from cuda_backends import BACKENDS, end_if_context_broken, get_backend
from kvpage import ops
from kvpage.ops import reference

B = None  # the backend of the running test (set by the fixture below)


@pytest.fixture(params=BACKENDS, autouse=True)
def backend(request):
    global B
    B = get_backend(request.param)
    yield B
    if B.name == "cuda":
        end_if_context_broken(request.node.nodeid)
    B = None

# The one place for tolerances: fp32 differs from the reference only in summation order;
# 16-bit runs round P to the cache dtype before P @ V on tensor cores, and round the output.
TOLERANCES = {
    torch.float32: dict(atol=5e-5, rtol=1e-4),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
FP8 = torch.float8_e4m3fn
FP8_NAN_CODES = (0x7F, 0xFF)
FP8_SCALES = (0.05, 0.5)  # (k_scale, v_scale) of the fp8 attention tests
HEAD_SIZES = [64, 80, 96, 112, 128, 192, 256, 48, 160]  # the last two take masked instantiations
HEADS = [(4, 4), (8, 2), (9, 3), (32, 8), (8, 1), (12, 1)]  # MHA, GQA, SmolLM2, Llama-3, MQA, group > 8


def assert_close(actual, expected):
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCES[expected.dtype])


def generator(seed):
    return torch.Generator().manual_seed(seed)


def make_cache(num_blocks, block_size, num_kv_heads, head_size, dtype, gen, k_scale=1.0, v_scale=1.0):
    """Random N(0, 1) caches; an fp8 one holds them quantised with the given scales (so small
    scales give large codes, large ones many subnormal codes), dequantising to about N(0, 1)."""
    key_cache, value_cache = B.ops.allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_size,
                                                     dtype=dtype, device=B.device)
    for cache, scale in ((key_cache, k_scale), (value_cache, v_scale)):
        values = torch.randn(cache.shape, generator=gen)
        cache.copy_(reference.quantize_fp8(values, scale) if dtype == FP8 else values.to(dtype))
    return key_cache, value_cache


def reference_inputs(query, key_cache, *rest):
    """The reference's arguments: the GPU tensors themselves, or CPU copies for an fp8 cache (the
    reference gathers cache blocks by advanced indexing, which not every torch supports for fp8
    on CUDA; the CPU path is the one tests/ops checks)."""
    tensors = (query, key_cache, *rest)
    return [t.cpu() for t in tensors] if key_cache.dtype == FP8 else list(tensors)


def same_bits(a, b):
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8).cpu(), b.view(torch.uint8).cpu())


def block_tables_for(seq_lens, block_size, num_blocks, gen, extra_columns=2):
    """Scattered physical blocks with repeats (shared prefixes); spare columns past each sequence."""
    width = max(-(-max(seq_lens) // block_size), 1) + extra_columns
    return torch.randint(0, num_blocks, (len(seq_lens), width), generator=gen, dtype=torch.int32).to(B.device)


def ints(values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype, device=B.device)


def fused_qkv(num_tokens, num_heads, num_kv_heads, head_size, dtype, gen):
    """query, key, value as strided views of one [tokens, heads + 2 kv_heads, D] tensor."""
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_size, generator=gen).to(dtype).to(B.device)
    return (qkv[:, :num_heads], qkv[:, num_heads:num_heads + num_kv_heads],
            qkv[:, num_heads + num_kv_heads:])


# ---- decode ------------------------------------------------------------------------------------

def run_decode(dtype, head_size, heads, block_size, seq_lens, partition_size=None, seed=0, cache_dtype=None,
               scales=(1.0, 1.0)):
    """dtype: the query's; cache_dtype: the cache's (default the query's; FP8 takes scales)."""
    gen = generator(seed)
    num_heads, num_kv_heads = heads
    k_scale, v_scale = scales
    key_cache, value_cache = make_cache(64, block_size, num_kv_heads, head_size, cache_dtype or dtype, gen,
                                        k_scale, v_scale)
    tables = block_tables_for(seq_lens, block_size, 64, gen)
    query = fused_qkv(len(seq_lens), num_heads, num_kv_heads, head_size, dtype, gen)[0]
    lens = ints(seq_lens)
    out = B.ops.paged_attention(query, key_cache, value_cache, tables, lens, partition_size=partition_size,
                                k_scale=k_scale, v_scale=v_scale)
    args = reference_inputs(query, key_cache, value_cache, tables, lens)
    assert_close(out.to(args[0].device), reference.paged_attention(*args, k_scale=k_scale, v_scale=v_scale))


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

def run_prefill(dtype, head_size, heads, block_size, q_lens, ctx_lens, seed=0, cache_dtype=None,
                scales=(1.0, 1.0)):
    gen = generator(seed)
    num_heads, num_kv_heads = heads
    k_scale, v_scale = scales
    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens)]
    key_cache, value_cache = make_cache(128, block_size, num_kv_heads, head_size, cache_dtype or dtype, gen,
                                        k_scale, v_scale)
    tables = block_tables_for(seq_lens, block_size, 128, gen)
    query = fused_qkv(sum(q_lens), num_heads, num_kv_heads, head_size, dtype, gen)[0]
    starts = ints([0] + torch.tensor(q_lens).cumsum(0).tolist())
    lens = ints(seq_lens)
    out = B.ops.paged_prefill_attention(query, key_cache, value_cache, tables, starts, lens, k_scale=k_scale,
                                        v_scale=v_scale)
    args = reference_inputs(query, key_cache, value_cache, tables, starts, lens)
    expected = reference.paged_prefill_attention(*args, k_scale=k_scale, v_scale=v_scale)
    assert_close(out.to(expected.device), expected)


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
@pytest.mark.parametrize("head_size", [64, 128])
def test_prefill_tile_starting_at_a_warps_last_row(dtype, head_size):
    # Cached context 33 (97): a warp's last query row sits exactly on the first key of a K/V
    # tile (33 + 31 = 64, 97 + 31 = 128), the edge of the tensor-core kernel's tile skip.
    run_prefill(dtype, head_size, (8, 2), 16, [150, 96], [33, 97])


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
    fused = torch.randn(tokens, 2 * num_kv_heads * head_size + pad, generator=gen).to(dtype).to(B.device)
    key = fused[:, :num_kv_heads * head_size].view(tokens, num_kv_heads, head_size)
    value = fused[:, num_kv_heads * head_size:2 * num_kv_heads * head_size].view(tokens, num_kv_heads, head_size)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[::7] = -1
    slots = slots.to(B.device)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    reference.reshape_and_cache(key, value, expected_k, expected_v, slots)
    B.ops.reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks(dtype):
    gen = generator(1)
    layers = [make_cache(40, 16, 2, 64, dtype, gen) for _ in range(3)]
    keys, values = [k for k, _ in layers], [v for _, v in layers]
    mapping = torch.tensor([[0, 5], [3, 7], [3, 9], [12, 39]])
    expected_k, expected_v = [k.clone() for k in keys], [v.clone() for v in values]
    reference.copy_blocks(expected_k, expected_v, mapping)
    B.ops.copy_blocks(keys, values, mapping)
    for a, b in zip(keys + values, expected_k + expected_v):
        assert torch.equal(a, b)


@pytest.mark.parametrize("direction", ["out", "in"])
def test_swap_blocks(direction):
    gen = generator(2)
    gpu = [make_cache(20, 16, 2, 64, torch.float16, gen)[i] for i in range(2)]
    host = [B.pin(torch.randn(t.shape, generator=gen).to(t.dtype)) for t in gpu]
    src, dst = (gpu, host) if direction == "out" else (host, gpu)
    mapping = torch.tensor([[1, 0], [4, 19], [19, 3]])
    expected = [d.clone() for d in dst]
    reference.swap_blocks(src, expected, mapping)
    B.ops.swap_blocks(src, dst, mapping)
    B.synchronize()
    for a, b in zip(dst, expected):
        assert torch.equal(a.cpu(), b.cpu())


# ---- fp8 (e4m3) caches -------------------------------------------------------------------------

def fp8_hard_values():
    """Every finite fp16 value and both infinities, as float32: beyond +-448 (saturation), e4m3's
    subnormal range and below, every rounding tie, -0.0."""
    halves = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    return halves[~halves.isnan()].float()


def fp8_write_inputs(dtype, num_tokens, num_kv_heads, head_size, pad, gen, hard=True):
    """key, value [num_tokens, num_kv_heads, head_size] as strided views of one fused row per
    token; pad=1 breaks 16-byte alignment (the scalar kernel)."""
    width = num_kv_heads * head_size
    if hard:
        values = fp8_hard_values()
        values = values[torch.randperm(values.numel(), generator=gen)]
        values = values.repeat(-(-2 * num_tokens * width // values.numel()))[:2 * num_tokens * width]
    else:
        values = torch.randn(2 * num_tokens * width, generator=gen) * 100
    fused = torch.zeros(num_tokens, 2 * width + pad)
    fused[:, :2 * width] = values.view(num_tokens, 2 * width)
    fused = fused.to(dtype).to(B.device)
    key = fused[:, :width].view(num_tokens, num_kv_heads, head_size)
    value = fused[:, width:2 * width].view(num_tokens, num_kv_heads, head_size)
    return key, value


def check_fp8_write(key, value, num_blocks, block_size, k_scale, v_scale, gen, slots=None):
    """reshape_and_cache into fresh fp8 caches against the reference; random slots with every
    7th token skipped unless given. Returns the caches."""
    num_tokens, num_kv_heads, head_size = key.shape
    key_cache, value_cache = B.ops.allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_size, dtype=FP8,
                                                     device=B.device)
    key_cache.view(torch.uint8).fill_(0x5A), value_cache.view(torch.uint8).fill_(0x5A)  # skipped slots stay
    if slots is None:
        slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
        slots[::7] = -1
    # The expectation on the CPU: torch's own conversion, independent of the CUDA build.
    expected = [key_cache.cpu(), value_cache.cpu()]
    reference.reshape_and_cache(key.cpu(), value.cpu(), *expected, slots, k_scale=k_scale, v_scale=v_scale)
    B.ops.reshape_and_cache(key, value, key_cache, value_cache, slots.to(B.device), k_scale=k_scale, v_scale=v_scale)
    assert same_bits(key_cache, expected[0]), "key_cache differs from reference.quantize_fp8"
    assert same_bits(value_cache, expected[1]), "value_cache differs from reference.quantize_fp8"
    return key_cache, value_cache


@pytest.mark.parametrize("scale", [1.0, 0.37, 2.0, 1e-3])
@pytest.mark.parametrize("pad", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp8_write_is_bit_exact(dtype, pad, scale):
    gen = generator(11)
    num_kv_heads, head_size, block_size = 4, 64, 16
    num_tokens = 260  # every finite fp16 value once, scattered over the tokens
    key, value = fp8_write_inputs(dtype, num_tokens, num_kv_heads, head_size, pad, gen)
    check_fp8_write(key, value, 20, block_size, scale, 1.0 / scale, gen)


@pytest.mark.parametrize("head_size", [16, 80, 128, 256])
def test_fp8_write_head_sizes_and_mixed_dtypes(head_size):
    # Keys and values of different dtypes (and alignments) take one launch each.
    gen = generator(head_size)
    num_tokens, num_kv_heads = 50, 2
    key = fp8_write_inputs(torch.float16, num_tokens, num_kv_heads, head_size, 0, gen, hard=False)[0]
    value = fp8_write_inputs(torch.float32, num_tokens, num_kv_heads, head_size, 1, gen, hard=False)[1]
    key_cache, _ = check_fp8_write(key, value, 8, 8, 0.37, 0.9, gen)
    codes = key_cache.view(torch.uint8)
    assert not torch.isin(codes, torch.tensor(FP8_NAN_CODES, dtype=torch.uint8, device=B.device)).any()


def test_fp8_write_saturates_rounds_to_even_and_keeps_signed_zero():
    # Saturation (464 is the tie between 448 and the missing 480), -0.0, subnormal ties
    # (2^-10 is half the smallest subnormal 2^-9: to even, 0), underflow keeps the sign.
    values_and_codes = [(1e6, 0x7E), (-1e6, 0xFE), (448.0, 0x7E), (464.0, 0x7E), (-465.0, 0xFE),
                        (float("inf"), 0x7E), (float("-inf"), 0xFE), (-0.0, 0x80), (0.0, 0x00),
                        (2.0 ** -10, 0x00), (-(2.0 ** -10), 0x80), (3 * 2.0 ** -10, 0x02), (2.0 ** -9, 0x01),
                        (2.0 ** -7 * 1.0625, 0x04), (1e-30, 0x00), (-1e-30, 0x80)]
    x = torch.tensor([v for v, _ in values_and_codes]).repeat(4).view(1, 1, 64).to(B.device)
    key_cache, _ = check_fp8_write(x, x.clone(), 2, 16, 1.0, 1.0, generator(12), slots=torch.tensor([3]))
    assert key_cache[0, 0, 3].view(torch.uint8)[:16].tolist() == [c for _, c in values_and_codes]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_size", [64, 128, 256, 48, 160])
def test_fp8_decode_head_sizes(dtype, head_size):
    run_decode(dtype, head_size, (8, 2), 16, [1, 17, 300, 1100], cache_dtype=FP8, scales=FP8_SCALES)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", HEADS)
def test_fp8_decode_heads(dtype, heads):
    # One group tile each: 1 (MHA), 4 (group 4, 3), 8 (group 8, 12).
    run_decode(dtype, 128, heads, 16, [5, 64, 513, 1600], seed=heads[0], cache_dtype=FP8, scales=(0.3, 2.0))


@pytest.mark.parametrize("partition_size", [None, 64, 512, 4096])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp8_decode_partitions(dtype, partition_size):
    run_decode(dtype, 64, (9, 3), 8, [1, 63, 64, 65, 700, 2050], partition_size=partition_size,
               cache_dtype=FP8, scales=FP8_SCALES)
    run_decode(dtype, 128, (16, 2), 32, [1, 700, 2050], partition_size=partition_size, cache_dtype=FP8,
               scales=FP8_SCALES)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (32, 8), (12, 1)])
def test_fp8_prefill(dtype, heads):
    run_prefill(dtype, 64, heads, 16, [3, 64, 65, 0, 200], [0, 0, 31, 10, 500], cache_dtype=FP8,
                scales=(0.1, 2.0))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_size", [128, 256, 80])
def test_fp8_prefill_head_sizes(dtype, head_size):
    run_prefill(dtype, head_size, (8, 2), 8, [70, 1, 130], [0, 40, 200], cache_dtype=FP8, scales=FP8_SCALES)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_fp8_prefill_long(dtype):
    # Many K/V tiles through the tensor-core kernel's fp8 staging buffers, a cached prefix too.
    run_prefill(dtype, 128, (32, 8), 16, [1024, 300], [0, 1500], cache_dtype=FP8, scales=(0.1, 2.0))


@pytest.mark.parametrize("partition_size", [None, 64])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp8_attention_reads_every_code_exactly(dtype, partition_size):
    """One token per sequence: softmax weight 1, so the output is the dequantised V row itself,
    bit for bit (every non-NaN code, subnormals and -0.0 included), in every query dtype: a code
    times 0.75 has at most 6 significant bits, exact in fp16 and bf16 too. 16-bit queries
    prefill on tensor cores, whose tiles hold the codes converted to the query's dtype."""
    codes = torch.tensor([c for c in range(256) if c not in FP8_NAN_CODES], dtype=torch.uint8)
    head_size, v_scale = 64, 0.75
    num_seqs = -(-codes.numel() // head_size)
    codes = torch.cat([codes, codes[: num_seqs * head_size - codes.numel()]])
    key_cache, value_cache = B.ops.allocate_kv_cache(num_seqs, 1, 1, head_size, dtype=FP8, device=B.device)
    key_cache.view(torch.uint8).zero_()
    value_cache.view(torch.uint8).copy_(codes.view(num_seqs, 1, 1, head_size))
    query = torch.randn(num_seqs, 1, head_size, device=B.device).to(dtype)
    # 64 spare table columns: partition_size=64 then splits (the one token's partition and an
    # empty one) and the reduce runs.
    tables = torch.zeros(num_seqs, 65, dtype=torch.int32, device=B.device)
    tables[:, 0] = torch.arange(num_seqs, dtype=torch.int32, device=B.device)
    out = B.ops.paged_attention(query, key_cache, value_cache, tables, ints([1] * num_seqs), v_scale=v_scale,
                                partition_size=partition_size)
    expected = (value_cache.view(num_seqs, head_size).float() * v_scale).to(dtype)
    assert torch.equal(out.view(num_seqs, head_size), expected)
    starts = ints(list(range(num_seqs + 1)))
    out = B.ops.paged_prefill_attention(query, key_cache, value_cache, tables, starts, ints([1] * num_seqs),
                                        v_scale=v_scale)
    assert torch.equal(out.view(num_seqs, head_size), expected)


def test_fp8_written_then_attended_tracks_full_precision():
    """End to end: K/V written into an fp8 cache by reshape_and_cache give attention within fp8's
    error of an fp16 cache (a loose bound; the exact comparisons are above)."""
    gen = generator(13)
    num_tokens, kv_heads, head_size = 200, 2, 128
    key = (torch.randn(num_tokens, kv_heads, head_size, generator=gen)).half().to(B.device)
    value = (torch.randn(num_tokens, kv_heads, head_size, generator=gen)).half().to(B.device)
    slots = torch.arange(num_tokens, device=B.device)
    fp16_caches = B.ops.allocate_kv_cache(16, 16, kv_heads, head_size, dtype=torch.float16, device=B.device)
    fp8_caches = B.ops.allocate_kv_cache(16, 16, kv_heads, head_size, dtype=FP8, device=B.device)
    B.ops.reshape_and_cache(key, value, *fp16_caches, slots)
    B.ops.reshape_and_cache(key, value, *fp8_caches, slots, k_scale=0.02, v_scale=0.02)
    query = torch.randn(3, 8, head_size, generator=gen).half().to(B.device)
    tables, lens = torch.arange(16, dtype=torch.int32, device=B.device).repeat(3, 1), ints([num_tokens, 77, 1])
    exact = B.ops.paged_attention(query, *fp16_caches, tables, lens)
    approx = B.ops.paged_attention(query, *fp8_caches, tables, lens, k_scale=0.02, v_scale=0.02)
    assert (approx.float() - exact.float()).abs().max() < 0.1 * exact.float().abs().max()


def test_fp8_copy_and_swap_move_bytes():
    gen = generator(14)
    layers = [make_cache(40, 16, 2, 64, FP8, gen, 0.3, 0.7) for _ in range(3)]
    keys, values = [k for k, _ in layers], [v for _, v in layers]
    mapping = torch.tensor([[0, 5], [3, 7], [3, 9], [12, 39]])
    expected_k, expected_v = [k.clone() for k in keys], [v.clone() for v in values]
    reference.copy_blocks(expected_k, expected_v, mapping)
    B.ops.copy_blocks(keys, values, mapping)
    assert all(same_bits(a, b) for a, b in zip(keys + values, expected_k + expected_v))
    host = [B.pin(torch.zeros(k.shape, dtype=FP8)) for k in keys]
    B.ops.swap_blocks(keys, host, mapping)
    B.synchronize()
    for h, k in zip(host, keys):
        assert all(same_bits(h[d], k[s]) for s, d in mapping.tolist())
    back = [torch.zeros_like(k) for k in keys]
    B.ops.swap_blocks(host, back, torch.tensor([[5, 1], [39, 2]]))
    B.synchronize()
    assert all(same_bits(b[1], k[0]) and same_bits(b[2], k[12]) for b, k in zip(back, keys))


def test_scales_on_non_fp8_caches_raise():
    query, key_cache, value_cache, tables, lens = decode_inputs()
    with pytest.raises(ValueError, match="k_scale"):
        B.ops.paged_attention(query, key_cache, value_cache, tables, lens, k_scale=2.0)
    with pytest.raises(ValueError, match="v_scale"):
        B.ops.paged_prefill_attention(query, key_cache, value_cache, tables, ints([0, 1, 2]), lens, v_scale=0.5)
    with pytest.raises(ValueError, match="k_scale"):
        B.ops.reshape_and_cache(query[:, :2], query[:, 2:], key_cache, value_cache, ints([0, 1], torch.int64),
                                k_scale=0.37)


def test_fp8_dtype_rules():
    _, key_cache, value_cache, tables, lens = decode_inputs(FP8)
    with pytest.raises(TypeError, match="query dtype"):  # fp8 is a cache dtype only
        B.ops.paged_attention(torch.zeros(2, 4, 64, dtype=FP8, device=B.device), key_cache, value_cache, tables, lens)
    half_caches = make_cache(8, 16, 2, 64, torch.float16, generator(0))
    with pytest.raises(TypeError, match="query dtype"):  # mixing dtypes is for fp8 caches only
        B.ops.paged_attention(torch.zeros(2, 4, 64, device=B.device), *half_caches, tables, lens)


# ---- bad input ---------------------------------------------------------------------------------

def decode_inputs(cache_dtype=torch.float16):
    gen = generator(3)
    key_cache, value_cache = make_cache(8, 16, 2, 64, cache_dtype, gen)
    query = torch.randn(2, 4, 64, generator=gen).half().to(B.device)
    return query, key_cache, value_cache, ints([[0, 1], [2, 3]]), ints([20, 32])


def test_range_checks_name_the_argument():
    query, key_cache, value_cache, tables, lens = decode_inputs()
    with pytest.raises(ValueError, match="block_tables"):
        B.ops.paged_attention(query, key_cache, value_cache, ints([[0, 1], [2, 99]]), lens)
    with pytest.raises(ValueError, match="seq_lens"):
        B.ops.paged_attention(query, key_cache, value_cache, tables, ints([20, 33]))
    with pytest.raises(ValueError, match="slot_mapping"):
        B.ops.reshape_and_cache(query[:, :2], query[:, 2:], key_cache, value_cache,
                                ints([0, 8 * 16], torch.int64))
    with pytest.raises(ValueError, match="query_start_loc"):
        B.ops.paged_prefill_attention(query, key_cache, value_cache, tables, ints([0, 2, 1]), lens)
    with pytest.raises(ValueError, match="block_mapping"):
        B.ops.copy_blocks([key_cache], [value_cache], [[0, 8]])


@pytest.mark.parametrize("cache_dtype", [torch.float16, FP8], ids=str)
def test_unchecked_bad_indices_stay_in_bounds(cache_dtype):
    # With range checks off the kernels mask bad indices: garbage out, but no fault.
    query, key_cache, value_cache, _, _ = decode_inputs(cache_dtype)
    with ops.range_checks(False):
        B.ops.paged_attention(query, key_cache, value_cache, ints([[0, 1 << 30], [-5, 3]]),
                              ints([1 << 20, -3]))
        B.ops.paged_prefill_attention(query, key_cache, value_cache, ints([[0, 1], [7, 1 << 29]]),
                                      ints([5, -100, 1 << 30]), ints([1 << 25, 2]))
        B.ops.reshape_and_cache(query[:, :2], query[:, 2:], key_cache, value_cache,
                                ints([1 << 40, -7], torch.int64))
        B.ops.copy_blocks([key_cache], [value_cache], [[0, 1 << 40]])
    B.synchronize()


def test_wrong_dtype():
    query, key_cache, value_cache, tables, lens = decode_inputs()
    with pytest.raises(TypeError, match="seq_lens"):
        B.ops.paged_attention(query, key_cache, value_cache, tables, lens.long())
    with pytest.raises(TypeError, match="query"):
        B.ops.paged_attention(query.float(), key_cache, value_cache, tables, lens)
