"""Which CUDA kernel serves which call, read off the emulator's count of mma.sync operations:
prefill with fp16 / bf16 queries runs on tensor cores over 16-bit and fp8 caches alike, and so
does decode of fp16 / bf16 GQA groups over their own dtype's cache; fp32 queries, fp8-cache
decode, MHA decode and head sizes above 128 take the SIMT kernel. tests/cuda checks the results of every path;
this checks that the fast path is the one taken."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cuda"))
from cuda_backends import get_backend  # noqa: E402

FP8 = torch.float8_e4m3fn


def stats_of(call) -> dict:
    """The emulator's counters (launches, blocks, mmas, ...) that call() adds."""
    emu = get_backend("emu").emu
    before = emu.stats()
    call()
    return {k: v - before[k] for k, v in emu.stats().items()}


def attention_inputs(ops, dtype, cache_dtype, num_tokens, num_heads=4, head_size=64):
    gen = torch.Generator().manual_seed(0)
    key_cache, value_cache = ops.allocate_kv_cache(8, 16, 2, head_size, dtype=cache_dtype, device="cpu")
    for cache in (key_cache, value_cache):
        cache.copy_(torch.randn(cache.shape, generator=gen).to(cache_dtype))
    query = torch.randn(num_tokens, num_heads, head_size, generator=gen).to(dtype)
    tables = torch.arange(8, dtype=torch.int32).view(1, 8)
    return query, key_cache, value_cache, tables


@pytest.mark.parametrize("dtype, cache_dtype, tensor_cores", [
    (torch.float16, torch.float16, True),
    (torch.bfloat16, torch.bfloat16, True),
    (torch.float16, FP8, True),
    (torch.bfloat16, FP8, True),
    (torch.float32, torch.float32, False),
    (torch.float32, FP8, False),
])
def test_prefill_path(dtype, cache_dtype, tensor_cores):
    ops = get_backend("emu").ops
    query, key_cache, value_cache, tables = attention_inputs(ops, dtype, cache_dtype, 40)
    starts, lens = torch.tensor([0, 40], dtype=torch.int32), torch.tensor([100], dtype=torch.int32)
    mmas = stats_of(lambda: ops.paged_prefill_attention(query, key_cache, value_cache, tables, starts, lens))["mmas"]
    assert (mmas > 0) == tensor_cores, f"{mmas} mma.sync operations"


@pytest.mark.parametrize("cache_dtype", [torch.float16, FP8])
@pytest.mark.parametrize("num_sms", [132, 1])
def test_prefill_cta_shapes(num_sms, cache_dtype):
    # 2 sequences x 4 heads, a 128-row tile each, head size 64: under 132 SMs the grid takes
    # 8-warp CTAs (16 rows a warp), with one SM the 4-warp ones (32 rows a warp). Both against the
    # reference, with cached context (28 and 10 tokens).
    from kvpage.ops import reference

    backend = get_backend("emu")
    query, key_cache, value_cache, tables = attention_inputs(backend.ops, torch.float16, cache_dtype, 200)
    starts, lens = torch.tensor([0, 100, 200], dtype=torch.int32), torch.tensor([128, 110], dtype=torch.int32)
    tables = torch.cat([tables, tables.flip(1)])
    out = []

    def prefill():
        backend.emu.set_num_sms(num_sms)  # after stats_of's get_backend, which sets 132
        out.append(backend.ops.paged_prefill_attention(query, key_cache, value_cache, tables, starts, lens))

    try:
        added = stats_of(prefill)
    finally:
        backend.emu.set_num_sms(132)
    # Two launches: the one-warp tile-offsets kernel, then the prefill grid.
    assert (added["threads"] - 32) // (added["blocks"] - 1) == (256 if num_sms == 132 else 128)
    out = out[0]
    expected = reference.paged_prefill_attention(query, key_cache, value_cache, tables, starts, lens)
    torch.testing.assert_close(out.float(), expected.float(), atol=3e-3, rtol=3e-3)


@pytest.mark.parametrize("dtype, cache_dtype, num_heads, head_size, tensor_cores", [
    (torch.float16, torch.float16, 4, 64, True),     # GQA group of 2
    (torch.bfloat16, torch.bfloat16, 6, 128, True),  # group of 3, as SmolLM2
    (torch.float16, torch.float16, 2, 64, False),    # MHA: one head per KV head
    (torch.float16, torch.float16, 4, 192, False),   # past head size 128
    (torch.float16, FP8, 4, 64, False),
    (torch.float32, torch.float32, 4, 64, False),
])
def test_decode_path(dtype, cache_dtype, num_heads, head_size, tensor_cores):
    ops = get_backend("emu").ops
    query, key_cache, value_cache, tables = attention_inputs(ops, dtype, cache_dtype, 1, num_heads, head_size)
    lens = torch.tensor([100], dtype=torch.int32)
    mmas = stats_of(lambda: ops.paged_attention(query, key_cache, value_cache, tables, lens))["mmas"]
    assert (mmas > 0) == tensor_cores, f"{mmas} mma.sync operations"


def decode_grid(rows, capacity):
    """(launches, blocks) of one decode call: SmolLM2's 9 / 3 heads (one CTA per KV head), fp16."""
    backend = get_backend("emu")
    gen = torch.Generator().manual_seed(1)
    key_cache, value_cache = backend.ops.allocate_kv_cache(8, 16, 3, 64, dtype=torch.float16, device="cpu")
    query = torch.randn(rows, 9, 64, generator=gen).half()
    tables = torch.randint(0, 8, (rows, capacity // 16), generator=gen, dtype=torch.int32)
    lens = torch.full((rows,), 20, dtype=torch.int32)  # short rows: later partitions exit at once
    added = stats_of(lambda: backend.ops.paged_attention(query, key_cache, value_cache, tables, lens))
    return added["launches"], added["blocks"]


# The emulator reports 132 SMs and 228 KiB of shared memory per SM (an H100 / H200), as
# get_backend sets: SmolLM2's tensor-core decode (head size 64) runs 4 CTAs per SM, a wave of 528,
# with 3 CTAs a partition. Under a wave the split takes the shortest partitions (from 128 tokens,
# or 512 once the single pass gives every other SM a CTA) that keep the grid within one wave;
# between one and two waves the longest that still make two; from two waves, single pass.
@pytest.mark.parametrize("rows, capacity, partition", [
    (1, 2048, 128),    # 3 CTAs a partition: 48 at the 128-token floor
    (16, 2048, 256),   # 48 CTAs a partition: 768 at 128 tokens is over a wave, 384 at 256
    (32, 2048, 512),   # 96: the 512-token floor, 384 CTAs
    (64, 2048, 1024),  # 192: 768 at 512 tokens, 384 at 1024
    (64, 8192, 4096),  # 192: 384 CTAs at 4096 tokens
    (128, 2048, 0),    # 384: within a wave only at 2048 tokens, the whole row
    (200, 2048, 1024), # 600, over a wave: 1200 CTAs at 1024 tokens, 600 at 2048
    (200, 512, 0),     # 600, and no split reaches two waves
    (352, 2048, 0),    # 1056: two waves in one pass
    (1, 512, 128),
    (1, 128, 0),       # one partition is the single pass
])
def test_decode_split_keeps_the_sms_busy(rows, capacity, partition):
    launches, blocks = decode_grid(rows, capacity)
    if partition == 0:
        assert (launches, blocks) == (1, rows * 3)
    else:  # the split kernel's grid, then the reduce's (row, query head) grid
        assert (launches, blocks) == (2, rows * 3 * (capacity // partition) + rows * 9)


def test_window_prefill_skips_the_kv_tiles_it_cannot_see():
    """A 64-token window over a 1,024-token prompt: each query tile gathers and multiplies only the K/V
    tiles its window reaches (a few per tile), not the whole causal prefix."""
    ops = get_backend("emu").ops
    gen = torch.Generator().manual_seed(2)
    key_cache, value_cache = ops.allocate_kv_cache(64, 16, 2, 64, dtype=torch.float16, device="cpu")
    for cache in (key_cache, value_cache):
        cache.copy_(torch.randn(cache.shape, generator=gen).half())
    query = torch.randn(1024, 4, 64, generator=gen).half()
    tables = torch.arange(64, dtype=torch.int32).view(1, 64)
    starts, lens = torch.tensor([0, 1024], dtype=torch.int32), torch.tensor([1024], dtype=torch.int32)

    def mmas(**options):
        return stats_of(lambda: ops.paged_prefill_attention(query, key_cache, value_cache, tables, starts, lens,
                                                            **options))["mmas"]

    full, windowed = mmas(), mmas(sliding_window=64)
    assert 0 < windowed < 0.3 * full, (windowed, full)


@pytest.mark.parametrize("window, partition", [(256, 128), (100, 0), (4096, 128)])
def test_decode_split_plans_for_the_window(window, partition):
    """A row reads at most its window: the split is planned for min(window, table width) tokens (one
    row, 2,048-token table: 16 partitions of 128 without a window)."""
    backend = get_backend("emu")
    gen = torch.Generator().manual_seed(1)
    key_cache, value_cache = backend.ops.allocate_kv_cache(8, 16, 3, 64, dtype=torch.float16, device="cpu")
    query = torch.randn(1, 9, 64, generator=gen).half()
    tables = torch.randint(0, 8, (1, 128), generator=gen, dtype=torch.int32)
    lens = torch.tensor([2000], dtype=torch.int32)
    added = stats_of(lambda: backend.ops.paged_attention(query, key_cache, value_cache, tables, lens,
                                                         sliding_window=window))
    parts = min(window, 2048) // partition if partition else 0
    if parts == 0:
        assert (added["launches"], added["blocks"]) == (1, 3)
    else:
        assert (added["launches"], added["blocks"]) == (2, 3 * parts + 9)
