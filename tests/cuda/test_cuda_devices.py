"""Device placement on a real GPU (no emulator: it has one device and one stream): the ops run on
the current stream, swaps refuse pageable host memory, and index tensors on the wrong device are
named."""
import pytest
import torch

from kvpage import ops
from kvpage.ops import reference

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and ops.built_with_cuda),
                                reason="needs a CUDA device and kvpage built with CUDA")


def decode_inputs():
    gen = torch.Generator().manual_seed(3)
    key_cache, value_cache = ops.allocate_kv_cache(8, 16, 2, 64, dtype=torch.float16, device="cuda")
    for cache in (key_cache, value_cache):
        cache.copy_(torch.randn(cache.shape, generator=gen).half())
    query = torch.randn(2, 4, 64, generator=gen).half().cuda()
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device="cuda")
    return query, key_cache, value_cache, tables, torch.tensor([20, 32], dtype=torch.int32, device="cuda")


def test_swap_rejects_pageable_host_memory():
    gpu = torch.zeros(4, 16, device="cuda")
    with pytest.raises(ValueError, match="pinned"):
        ops.swap_blocks([gpu], [torch.zeros(4, 16)], [[0, 1]])


def test_index_tensors_on_the_wrong_device():
    query, key_cache, value_cache, tables, lens = decode_inputs()
    with pytest.raises(ValueError, match="block_tables"):
        ops.paged_attention(query, key_cache, value_cache, tables.cpu(), lens)
    with pytest.raises(ValueError, match="seq_lens"):
        ops.paged_attention(query, key_cache, value_cache, tables, lens.cpu())


def test_runs_on_current_stream_and_device():
    query, key_cache, value_cache, tables, lens = decode_inputs()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), ops.range_checks(False):
        out = ops.paged_attention(query, key_cache, value_cache, tables, lens)
    stream.synchronize()
    expected = reference.paged_attention(query, key_cache, value_cache, tables, lens)
    torch.testing.assert_close(out.float(), expected.float(), atol=3e-3, rtol=3e-3)
