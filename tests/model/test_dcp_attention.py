"""One DCP group simulated in one process: each rank writes the positions it keeps and attends over them
(model/context_parallel.py), and the merged partials must equal attention over one whole cache
(ops/reference.py), for decode, prefill and chunked-prefill steps, with and without a sliding window."""
from dataclasses import replace

import pytest
import torch

from kvpage import ops
from kvpage.core import NULL_BLOCK, first_kept_block
from kvpage.core.context_parallel import ContextParallelPlacement
from kvpage.model.context_parallel import local_attention, local_slot_mapping, localize, tokens_on_rank
from kvpage.model.metadata import AttentionMetadata
from kvpage.ops import reference


def _step(placement, starts, query_lens, generator):
    """A step in the driver's virtual blocks: sequences whose K/V of positions < start are cached, each
    bringing query_lens tokens. Returns metadata, positions, and each sequence's virtual block table."""
    vbs = placement.virtual_block_size
    ids = torch.randperm(64, generator=generator).tolist()
    tables, slots, positions = [], [], []
    for start, n in zip(starts, query_lens):
        table = [ids.pop() for _ in range(-(-(start + n) // vbs))]
        tables.append(table)
        positions += range(start, start + n)
        slots += [table[p // vbs] * vbs + p % vbs for p in range(start, start + n)]
    meta = AttentionMetadata.build(list(query_lens), [s + n for s, n in zip(starts, query_lens)], tables, slots)
    return meta, torch.tensor(positions), tables


def _null_before_windows(meta, tables, starts, window, vbs):
    """meta whose block tables hold NULL_BLOCK (-1) for the virtual blocks a window group has freed: every
    block wholly before the first position the step's queries can see, max(0, start - W + 1)."""
    width = meta.block_tables.shape[1]
    nulled = [[NULL_BLOCK if b < first_kept_block(start, window, vbs) else block for b, block in enumerate(table)]
              for table, start in zip(tables, starts)]
    padded = torch.tensor([t + [0] * (width - len(t)) for t in nulled], dtype=torch.int32)
    return replace(meta, block_tables=padded)


@pytest.mark.parametrize("size,interleave,block_size", [(2, 1, 8), (2, 4, 8), (3, 2, 4), (4, 1, 16)])
@pytest.mark.parametrize("starts,query_lens", [([0, 0, 0], [1, 9, 40]),  # prefill (one-token prompt included)
                                              ([5, 31, 0], [1, 1, 1]),  # decode, a first-position one too
                                              ([7, 20], [12, 1]),  # chunked prefill beside a decode
                                              ([37, 50, 26], [1, 1, 9])])  # past small windows
@pytest.mark.parametrize("window_cycles", [None, 1, 3, 8])  # W = cycles * I * D: in-block, mid-block, > context
def test_partials_merge_to_whole_attention(size, interleave, block_size, starts, query_lens, window_cycles):
    """Windowed too: each rank attends within W / D local keys (the window group's tables NULL before the
    window), and the merge equals attention within W over the whole cache."""
    g = torch.Generator().manual_seed(size * 100 + interleave)
    placement = ContextParallelPlacement(size, interleave, block_size)
    window = None if window_cycles is None else window_cycles * interleave * size
    options = {} if window is None else {"sliding_window": window}
    heads, kv_heads, dim = 4, 1, 16
    meta, positions, tables = _step(placement, starts, query_lens, g)
    total = [s + n for s, n in zip(starts, query_lens)]
    keys = [torch.randn(n, kv_heads, dim, generator=g) for n in total]
    values = [torch.randn(n, kv_heads, dim, generator=g) for n in total]
    query = torch.randn(len(positions), heads, dim, generator=g)
    scale = dim**-0.5
    rank_meta = meta if window is None else _null_before_windows(meta, tables, starts, window,
                                                                 placement.virtual_block_size)

    outs, lses = [], []
    for rank in range(size):
        cache = ops.allocate_kv_cache(64, block_size, kv_heads, dim)
        for cache_part in cache:  # garbage where nothing is written: a wrong read cannot pass unnoticed
            cache_part.fill_(float("nan"))
        for s, table in enumerate(tables):  # every position of every sequence, as earlier steps and this one wrote it
            vbs = placement.virtual_block_size
            slots = torch.tensor([table[p // vbs] * vbs + p % vbs for p in range(total[s])])
            ops.reshape_and_cache(keys[s], values[s], *cache, local_slot_mapping(placement, rank, slots))
        cp = localize(placement, rank, rank_meta, positions)
        local = {} if window is None else {"sliding_window": window // size}
        out, lse = local_attention(query, *cache, cp, scale, **local)
        outs.append(out)
        lses.append(lse)
    merged, _ = ops.merge_attention_states(torch.stack(outs), torch.stack(lses))

    whole = ops.allocate_kv_cache(len(total), 64, kv_heads, dim)
    for s in range(len(total)):
        ops.reshape_and_cache(keys[s], values[s], *whole, torch.arange(total[s]) + s * 64)
    qsl = meta.query_start_loc
    expected = reference.paged_prefill_attention(query, *whole, torch.arange(len(total), dtype=torch.int32)[:, None],
                                                 qsl, meta.seq_lens, scale, **options)
    torch.testing.assert_close(merged, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("size,interleave,block_size", [(2, 1, 4), (3, 2, 4), (4, 4, 8)])
def test_tensor_arithmetic_matches_placement(size, interleave, block_size):
    p = ContextParallelPlacement(size, interleave, block_size)
    slots = torch.arange(-1, 5 * p.virtual_block_size)
    lengths = torch.arange(0, 3 * p.virtual_block_size)
    for rank in range(size):
        assert local_slot_mapping(p, rank, slots).tolist() == [-1 if s < 0 else p.local_slot(s, rank) for s in slots.tolist()]
        assert tokens_on_rank(p, rank, lengths).tolist() == [p.tokens_on_rank(n, rank) for n in lengths.tolist()]
