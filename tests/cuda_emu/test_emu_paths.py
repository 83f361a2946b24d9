"""Which CUDA kernel serves which call, read off the emulator's count of mma.sync operations:
prefill with fp16 / bf16 queries runs on tensor cores over 16-bit and fp8 caches alike; fp32
queries, and every decode, take the SIMT kernel. tests/cuda checks the results of every path;
this checks that the fast path is the one taken."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cuda"))
from cuda_backends import get_backend  # noqa: E402

FP8 = torch.float8_e4m3fn


def mmas_of(call):
    emu = get_backend("emu").emu
    before = emu.stats()["mmas"]
    call()
    return emu.stats()["mmas"] - before


def attention_inputs(ops, dtype, cache_dtype, num_tokens):
    gen = torch.Generator().manual_seed(0)
    key_cache, value_cache = ops.allocate_kv_cache(8, 16, 2, 64, dtype=cache_dtype, device="cpu")
    for cache in (key_cache, value_cache):
        cache.copy_(torch.randn(cache.shape, generator=gen).to(cache_dtype))
    query = torch.randn(num_tokens, 4, 64, generator=gen).to(dtype)
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
    mmas = mmas_of(lambda: ops.paged_prefill_attention(query, key_cache, value_cache, tables, starts, lens))
    assert (mmas > 0) == tensor_cores, f"{mmas} mma.sync operations"


@pytest.mark.parametrize("cache_dtype", [torch.float16, FP8])
def test_decode_is_simt(cache_dtype):
    ops = get_backend("emu").ops
    query, key_cache, value_cache, tables = attention_inputs(ops, torch.float16, cache_dtype, 1)
    lens = torch.tensor([100], dtype=torch.int32)
    assert mmas_of(lambda: ops.paged_attention(query, key_cache, value_cache, tables, lens)) == 0
