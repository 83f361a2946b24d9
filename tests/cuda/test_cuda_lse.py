"""return_lse of the CUDA backend's attention ops against kvpage.ops.reference, on a GPU and in the
CPU emulator (cuda_backends.py): the SIMT decode kernel (fp32, MHA, fp8 caches) and the tensor-core
one (16-bit GQA groups), single pass and split into partitions (the reduce kernel's LSE); the
tensor-core prefill and the SIMT prefill of fp32 queries; and merge_attention_states of partials
each over a random share of a sequence's blocks (decode context parallelism with an interleave of
a whole block) against attention over all of them."""
import pytest
import torch

from kvpage import ops
from kvpage.ops import reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
FP8 = torch.float8_e4m3fn
# Float32 whatever the dtype: the kernels' scores are fp32 (tensor cores multiply 16-bit operands
# exactly and accumulate in fp32), summed in another order than the reference's, with exp2f / log2f.
LSE_TOLERANCE = dict(atol=1e-4, rtol=1e-5)
OUT_TOLERANCES = {torch.float32: dict(atol=5e-5, rtol=1e-4), torch.float16: dict(atol=3e-3, rtol=3e-3),
                  torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
BLOCK_SIZE, NUM_BLOCKS = 16, 48


def cache_pair(b, num_kv_heads, head_size, dtype, gen, k_scale=1.0, v_scale=1.0):
    key_cache, value_cache = b.ops.allocate_kv_cache(NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_size, dtype=dtype,
                                                     device=b.device)
    for cache, scale in ((key_cache, k_scale), (value_cache, v_scale)):
        values = torch.randn(cache.shape, generator=gen)
        cache.copy_(reference.quantize_fp8(values, scale) if dtype == FP8 else values.to(dtype))
    return key_cache, value_cache


def tables_for(seq_lens, gen, device):
    width = -(-max(seq_lens) // BLOCK_SIZE) + 1
    return torch.randint(0, NUM_BLOCKS, (len(seq_lens), width), generator=gen, dtype=torch.int32).to(device)


def ints(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


def assert_matches_reference(result, expected):
    (out, lse), (expected_out, expected_lse) = result, expected
    assert lse.dtype == torch.float32 and lse.shape == out.shape[:2] and lse.is_contiguous()
    torch.testing.assert_close(lse.cpu(), expected_lse, **LSE_TOLERANCE)
    torch.testing.assert_close(out.cpu().float(), expected_out.float(), **OUT_TOLERANCES[expected_out.dtype])


def decode_case(b, dtype, heads, cache_dtype=None, head_size=64, seq_lens=(1, 37, 300), seed=0, **scales):
    gen = torch.Generator().manual_seed(seed)
    caches = cache_pair(b, heads[1], head_size, cache_dtype or dtype, gen, **scales)
    query = torch.randn(len(seq_lens), heads[0], head_size, generator=gen).to(dtype).to(b.device)
    return query, *caches, tables_for(seq_lens, gen, b.device), ints(seq_lens, b.device)


def check_decode(b, args, partition_size, **scales):
    result = b.ops.paged_attention(*args, partition_size=partition_size, return_lse=True, **scales)
    expected = reference.paged_attention(*[t.cpu() for t in args], return_lse=True, **scales)
    assert_matches_reference(result, expected)
    plain = b.ops.paged_attention(*args, partition_size=partition_size, **scales)
    assert torch.equal(result[0].cpu(), plain.cpu())  # asking for the lse changes no output bit


@pytest.mark.parametrize("partition_size", [None, 64])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (12, 1)], ids=["mha", "gqa", "mqa12"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_lse(backend, dtype, heads, partition_size):
    check_decode(backend, decode_case(backend, dtype, heads), partition_size)


@pytest.mark.parametrize("partition_size", [None, 64])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp8_decode_lse(backend, dtype, partition_size):
    scales = dict(k_scale=0.05, v_scale=0.5)
    check_decode(backend, decode_case(backend, dtype, (8, 2), FP8, **scales), partition_size, **scales)


def prefill_case(b, dtype, heads, cache_dtype=None, head_size=64, lens=((0, 40), (30, 7), (5, 1)), seed=1,
                 **scales):
    """lens: (cached context, query tokens) per sequence."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in lens]
    q_lens = [q for _, q in lens]
    caches = cache_pair(b, heads[1], head_size, cache_dtype or dtype, gen, **scales)
    query = torch.randn(sum(q_lens), heads[0], head_size, generator=gen).to(dtype).to(b.device)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=b.device)
    return query, *caches, tables_for(seq_lens, gen, b.device), starts, ints(seq_lens, b.device)


@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_lse(backend, dtype, heads, head_size):
    args = prefill_case(backend, dtype, heads, head_size=head_size)
    result = backend.ops.paged_prefill_attention(*args, return_lse=True)
    assert_matches_reference(result, reference.paged_prefill_attention(*[t.cpu() for t in args], return_lse=True))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_fp8_prefill_lse(backend, dtype):
    scales = dict(k_scale=0.1, v_scale=2.0)
    args = prefill_case(backend, dtype, (8, 2), FP8, **scales)
    result = backend.ops.paged_prefill_attention(*args, return_lse=True, **scales)
    expected = reference.paged_prefill_attention(*[t.cpu() for t in args], return_lse=True, **scales)
    assert_matches_reference(result, expected)


def block_shares(table, seq_lens, ranks, gen):
    """Each rank's (block table, seq_lens) over a random share of every sequence's blocks, in order
    (a partial last block can only be a share's last), or None for a sequence with no block there."""
    shares = [[] for _ in range(ranks)]
    for row, seq_len in zip(table.cpu(), seq_lens.tolist()):
        num_blocks = -(-seq_len // BLOCK_SIZE)
        owner = torch.randint(0, ranks, (num_blocks,), generator=gen)
        for rank in range(ranks):
            mine = (owner == rank).nonzero().flatten()
            tokens = sum(min(BLOCK_SIZE, seq_len - BLOCK_SIZE * int(b)) for b in mine)
            shares[rank].append((row[mine], tokens) if tokens else None)
    return shares


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_merge_of_block_shares_is_attention_over_all(backend, dtype, ranks):
    query, key_cache, value_cache, table, seq_lens = decode_case(backend, dtype, (8, 2), seq_lens=(5, 100, 300))
    gen = torch.Generator().manual_seed(ranks)
    outs = torch.full((ranks, *query.shape), float("nan"), dtype=dtype, device=backend.device)
    lses = torch.full((ranks, *query.shape[:2]), float("-inf"), device=backend.device)
    for rank, share in enumerate(block_shares(table, seq_lens, ranks, gen)):
        rows = [s for s, part in enumerate(share) if part is not None]
        if not rows:
            continue
        width = max(len(share[s][0]) for s in rows)
        tables = torch.stack([torch.nn.functional.pad(share[s][0], (0, width - len(share[s][0]))) for s in rows])
        outs[rank, rows], lses[rank, rows] = backend.ops.paged_attention(
            query[rows], key_cache, value_cache, tables.to(torch.int32).to(backend.device),
            ints([share[s][1] for s in rows], backend.device), partition_size=64, return_lse=True)
    merged = ops.merge_attention_states(outs, lses)
    full = backend.ops.paged_attention(query, key_cache, value_cache, table, seq_lens, return_lse=True)
    torch.testing.assert_close(merged[1].cpu(), full[1].cpu(), **LSE_TOLERANCE)
    assert_matches_reference(merged, reference.paged_attention(query.cpu(), key_cache.cpu(), value_cache.cpu(),
                                                               table.cpu(), seq_lens.cpu(), return_lse=True))
