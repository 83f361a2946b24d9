"""RowTables, the pure bookkeeping under PagedCache: padding-free rows, shared blocks, copy-on-write."""
from __future__ import annotations

import pytest

from kvpage.core import BlockPool
from kvpage.integrations import OutOfBlocks, RowTables

BS = 4


def tables(num_blocks: int, counts: list[int]) -> RowTables:
    t = RowTables(BlockPool(num_blocks), BS)
    t.start(len(counts))
    t.append(counts)
    return t


def test_rows_take_blocks_for_their_own_tokens():
    t = tables(16, [1, 0, 9])
    assert [len(r.block_table) for r in t.rows] == [1, 0, 3] and t.pool.num_used == 4
    slots, copies = t.append([2, 1, 0])
    # Row 0 continues in its block (offsets 1, 2); row 1 gets its first block.
    b0, b1 = t.rows[0].block_table[0], t.rows[1].block_table[0]
    assert slots == [b0 * BS + 1, b0 * BS + 2, b1 * BS] and copies == []


def test_shared_partial_block_is_copied_once_per_extra_sharer():
    t = tables(16, [6])  # blocks: one full, one holding 2 tokens
    t.select([0, 0, 0])
    full, partial = t.rows[0].block_table
    assert t.pool.ref_counts[full] == t.pool.ref_counts[partial] == 3
    _, copies = t.append([1, 1, 1])
    # The first two rows copy the shared partial block; the last, then alone on it, writes in place.
    assert [src for src, _ in copies] == [partial, partial] and t.rows[2].block_table[1] == partial
    assert all(r.block_table[0] == full for r in t.rows) and t.pool.ref_counts[full] == 3
    assert t.num_copy_on_write == 2


def test_reserve_counts_copies_exactly_and_refuses_without_changing_anything():
    t = tables(3, [6])  # 2 blocks used, 1 free
    t.select([0, 0])
    t.append([1, 1])  # needs exactly one copy: fits in the one free block
    assert t.pool.num_free_blocks == 0
    before = [list(r.block_table) for r in t.rows], [r.num_tokens for r in t.rows]
    with pytest.raises(OutOfBlocks, match="needs 2 more"):
        t.append([2, 2])  # 7 -> 9 tokens: both rows cross into a new block
    assert ([list(r.block_table) for r in t.rows], [r.num_tokens for r in t.rows]) == before


def test_select_and_truncate_return_blocks():
    t = tables(16, [5, 9])
    t.select([1])
    assert t.pool.num_used == 3
    t.truncate(t.rows[0], 4)
    assert t.rows[0].block_table and len(t.rows[0].block_table) == 1 and t.pool.num_used == 1
    t.clear()
    assert t.pool.num_used == 0 and len(t) == 0
    with pytest.raises(IndexError):
        tables(4, [1]).select([1])
