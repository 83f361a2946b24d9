"""sliding_window, softcap and sinks on the CUDA backend's attention kernels against kvpage.ops.reference,
on a GPU and in the CPU emulator (cuda_backends.py): the SIMT decode kernel (fp32, MHA, fp8 caches), the
tensor-core one (16-bit GQA groups), single pass and split (the reduce adds the sinks), the tensor-core
prefill (16-bit and fp8 caches, query tiles longer than the window) and the SIMT prefill of fp32 queries;
block-table entries before the window hold ids no cache has (never read, range checks skip them) and the
blocks before it NaN; lse includes the sink once, so merges compose; bad options named."""
import pytest
import torch

from kvpage import ops
from kvpage.ops import reference

FP8 = torch.float8_e4m3fn
LSE_TOLERANCE = dict(atol=1e-4, rtol=1e-5)
# 16-bit runs round P to the cache dtype before P @ V on tensor cores, and round the output.
OUT_TOLERANCES = {torch.float32: dict(atol=5e-5, rtol=1e-4), torch.float16: dict(atol=3e-3, rtol=3e-3),
                  torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
BAD_ID = 1 << 30
# (query dtype, cache dtype, heads): which kernel serves it.
DECODE_PATHS = {
    "simt-fp32-gqa": (torch.float32, torch.float32, (8, 2)),
    "simt-fp16-mha": (torch.float16, torch.float16, (4, 4)),
    "mma-fp16-gqa": (torch.float16, torch.float16, (8, 2)),
    "mma-bf16-gqa12": (torch.bfloat16, torch.bfloat16, (12, 1)),
    "simt-fp8": (torch.float16, FP8, (6, 2)),
}
PREFILL_PATHS = {
    "mma-fp16": (torch.float16, torch.float16, (8, 2)),
    "mma-bf16": (torch.bfloat16, torch.bfloat16, (4, 4)),
    "mma-fp8": (torch.float16, FP8, (6, 2)),
    "simt-fp32": (torch.float32, torch.float32, (4, 2)),
}


def ints(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


def caches(b, num_blocks, block_size, num_kv_heads, head_size, dtype, gen):
    key_cache, value_cache = b.ops.allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_size, dtype=dtype,
                                                     device=b.device)
    for cache in (key_cache, value_cache):
        values = torch.randn(cache.shape, generator=gen)
        cache.copy_(reference.quantize_fp8(values, 0.5) if dtype == FP8 else values.to(dtype))
    return key_cache, value_cache


def scales_for(cache_dtype):
    return dict(k_scale=0.5, v_scale=0.5) if cache_dtype == FP8 else {}


def sinks_for(num_heads, device, seed=0):
    return (torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) * 2).to(device)


def hide_before_window(tables, first_positions, block_size, window, fill):
    """fill in each row's table entries before its earliest query's first visible block."""
    tables = tables.clone()
    for row, pos in enumerate(first_positions):
        tables[row, : reference.first_visible_block(pos, block_size, window)] = fill
    return tables


def check(result, expected):
    (out, lse), (want, want_lse) = result, expected
    torch.testing.assert_close(lse.cpu(), want_lse, **LSE_TOLERANCE)
    torch.testing.assert_close(out.cpu().float(), want.float(), **OUT_TOLERANCES[want.dtype])


def reference_options(opts):
    return {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in opts.items()}


def decode_args(b, dtype, cache_dtype, heads, seq_lens, block_size=16, window=None, fill=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = max(8, sum(-(-n // block_size) for n in seq_lens) // 2)
    kv = caches(b, num_blocks, block_size, heads[1], 64, cache_dtype, gen)
    tables = torch.randint(0, num_blocks, (len(seq_lens), -(-max(seq_lens) // block_size) + 1), generator=gen,
                           dtype=torch.int32)
    if fill is not None:
        tables = hide_before_window(tables, [n - 1 for n in seq_lens], block_size, window, fill)
    query = torch.randn(len(seq_lens), heads[0], 64, generator=gen).to(dtype).to(b.device)
    return query, *kv, tables.to(b.device), ints(seq_lens, b.device)


def run_decode(b, args, partition_size, **opts):
    scales = scales_for(args[1].dtype)
    result = b.ops.paged_attention(*args, partition_size=partition_size, return_lse=True, **scales, **opts)
    expected = reference.paged_attention(*[t.cpu() for t in args], return_lse=True, **scales,
                                         **reference_options(opts))
    check(result, expected)


@pytest.mark.parametrize("partition_size", [None, 32, 4096])
@pytest.mark.parametrize("path", DECODE_PATHS.values(), ids=DECODE_PATHS.keys())
def test_decode_options(backend, path, partition_size):
    dtype, cache_dtype, heads = path
    seq_lens = [1, 16, 37, 300]
    args = decode_args(backend, dtype, cache_dtype, heads, seq_lens, window=45, fill=-1)
    sinks = sinks_for(heads[0], backend.device)
    run_decode(backend, args, partition_size, sliding_window=45, softcap=3.0, sinks=sinks)
    full = decode_args(backend, dtype, cache_dtype, heads, seq_lens)
    for opts in (dict(sliding_window=1), dict(sliding_window=37), dict(sliding_window=1000), dict(softcap=2.0),
                 dict(sinks=sinks)):
        run_decode(backend, full, partition_size, **opts)


@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_decode_window_block_sizes(backend, block_size):
    seq_lens = [3, block_size + 1, 250]
    for window in (1, 20, 249):
        args = decode_args(backend, torch.float16, torch.float16, (8, 2), seq_lens, block_size, window, BAD_ID)
        for checks in (True, False):
            with ops.range_checks(checks):
                run_decode(backend, args, None, sliding_window=window, sinks=sinks_for(8, backend.device))


def test_decode_never_reads_blocks_before_the_window(backend):
    seq_lens, window, block_size = [64, 200], 70, 16
    gen = torch.Generator().manual_seed(3)
    key_cache, value_cache = caches(backend, 30, block_size, 2, 64, torch.float16, gen)
    tables = torch.randperm(30, generator=gen)[:26].to(torch.int32).view(2, 13)
    for row, n in enumerate(seq_lens):
        hidden = tables[row, : reference.first_visible_block(n - 1, block_size, window)].long().to(backend.device)
        key_cache[hidden] = float("nan")
        value_cache[hidden] = float("nan")
    query = torch.randn(2, 8, 64, generator=gen).half().to(backend.device)
    args = (query, key_cache, value_cache, tables.to(backend.device), ints(seq_lens, backend.device))
    for partition_size in (None, 16, 4096):
        out = backend.ops.paged_attention(*args, partition_size=partition_size, sliding_window=window)
        assert not out.isnan().any()
        clean = hide_before_window(tables, [n - 1 for n in seq_lens], block_size, window, 0)
        want = reference.paged_attention(query.cpu(), key_cache.cpu(), value_cache.cpu(), clean,
                                         ints(seq_lens, "cpu"), sliding_window=window)
        torch.testing.assert_close(out.cpu(), want, **OUT_TOLERANCES[torch.float16])


def prefill_args(b, dtype, cache_dtype, heads, lens, block_size=16, window=None, fill=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in lens]
    num_blocks = max(8, sum(-(-n // block_size) for n in seq_lens) // 2)
    kv = caches(b, num_blocks, block_size, heads[1], 64, cache_dtype, gen)
    tables = torch.randint(0, num_blocks, (len(lens), -(-max(seq_lens) // block_size) + 1), generator=gen,
                           dtype=torch.int32)
    if fill is not None:
        tables = hide_before_window(tables, [c for c, _ in lens], block_size, window, fill)
    query = torch.randn(sum(q for _, q in lens), heads[0], 64, generator=gen).to(dtype).to(b.device)
    starts = [0]
    for _, q in lens:
        starts.append(starts[-1] + q)
    return query, *kv, tables.to(b.device), ints(starts, b.device), ints(seq_lens, b.device)


def run_prefill(b, args, **opts):
    scales = scales_for(args[1].dtype)
    result = b.ops.paged_prefill_attention(*args, return_lse=True, **scales, **opts)
    expected = reference.paged_prefill_attention(*[t.cpu() for t in args], return_lse=True, **scales,
                                                 **reference_options(opts))
    check(result, expected)


@pytest.mark.parametrize("path", PREFILL_PATHS.values(), ids=PREFILL_PATHS.keys())
def test_prefill_options(backend, path):
    """A fresh prompt of 3 query tiles, a chunk starting mid-block after a long context, a single
    token: windows inside one K/V tile, ending mid-block, and wider than any context."""
    dtype, cache_dtype, heads = path
    lens = [(0, 150), (203, 37), (90, 1)]
    sinks = sinks_for(heads[0], backend.device)
    for window in (5, 45, 130):
        args = prefill_args(backend, dtype, cache_dtype, heads, lens, window=window, fill=-1)
        run_prefill(backend, args, sliding_window=window, softcap=3.0, sinks=sinks)
    full = prefill_args(backend, dtype, cache_dtype, heads, lens)
    for opts in (dict(sliding_window=1000), dict(softcap=2.0), dict(sinks=sinks), dict(sliding_window=64)):
        run_prefill(backend, full, **opts)


@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_prefill_window_block_sizes_and_garbage(backend, block_size):
    lens = [(0, 70), (130, 50)]
    for window in (3, 33, 129):
        args = prefill_args(backend, torch.float16, torch.float16, (4, 2), lens, block_size, window, BAD_ID)
        for checks in (True, False):
            with ops.range_checks(checks):
                run_prefill(backend, args, sliding_window=window)


def test_lse_with_sinks_merges_over_disjoint_keys(backend):
    seq_len, split = 230, 5 * 16
    args = decode_args(backend, torch.float16, torch.float16, (8, 2), [seq_len])
    query, key_cache, value_cache, tables, lens = args
    sinks = sinks_for(8, backend.device)
    whole = backend.ops.paged_attention(*args, return_lse=True, sinks=sinks)
    first = backend.ops.paged_attention(query, key_cache, value_cache, tables[:, :5].contiguous(),
                                        ints([split], backend.device), return_lse=True, sinks=sinks)
    rest = backend.ops.paged_attention(query, key_cache, value_cache, tables[:, 5:].contiguous(),
                                       ints([seq_len - split], backend.device), return_lse=True)
    out, lse = ops.merge_attention_states([first[0].cpu(), rest[0].cpu()], [first[1].cpu(), rest[1].cpu()])
    torch.testing.assert_close(lse, whole[1].cpu(), **LSE_TOLERANCE)
    torch.testing.assert_close(out.float(), whole[0].cpu().float(), **OUT_TOLERANCES[torch.float16])


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(sliding_window=0), ValueError, "sliding_window"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(sinks=torch.zeros(3)), ValueError, "sinks"),
])
def test_bad_options_are_named(backend, kwargs, error, words):
    args = decode_args(backend, torch.float16, torch.float16, (8, 2), [20])
    kwargs = {k: (v.to(backend.device) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    with pytest.raises(error, match=words):
        backend.ops.paged_attention(*args, **kwargs)
