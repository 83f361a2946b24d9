"""Re-pointing block tables from one pool to another: the bookkeeping half of a swap (the block manager
decides what moves; ops.swap_blocks copies the data)."""
from __future__ import annotations

from .block_pool import BlockPool
from .kv_cache_groups import NULL_BLOCK
from .sequence import Sequence, SequenceLike, as_seqs

BlockMapping = list[tuple[int, int]]  # (source block, destination block) pairs


def move_tables(seqs: list[Sequence], src: BlockPool, dst: BlockPool, find_existing) -> BlockMapping:
    """Re-point every group's table from src to dst, one dst block per distinct src block (or the
    block find_existing(seq, group, i) names, already holding that content); NULL_BLOCK entries stay
    NULL. Returns the copies to make."""
    new_of: dict[int, int] = {}
    copies: BlockMapping = []
    for seq in seqs:
        tables = []
        for g, old in enumerate(seq.block_tables):
            table = []
            for i, block_id in enumerate(old):
                if block_id == NULL_BLOCK:
                    table.append(NULL_BLOCK)
                    continue
                new = new_of.get(block_id)
                if new is not None:
                    dst.incref(new)
                elif (new := find_existing(seq, g, i)) is not None:
                    dst.incref(new)
                    new_of[block_id] = new
                else:
                    new = new_of[block_id] = dst.allocate(g)  # tagged with its group where dst keeps tags
                    copies.append((block_id, new))
                table.append(new)
            tables.append(table)
        for old in seq.block_tables:
            for block_id in reversed(old):
                if block_id != NULL_BLOCK:
                    src.decref(block_id)
        seq.block_tables = tables
    return copies


def live_blocks(seq: Sequence):
    """The block ids seq's tables point at, every group, NULL_BLOCK entries left out."""
    return (b for table in seq.block_tables for b in table if b != NULL_BLOCK)


def on_device(seqs: SequenceLike) -> list[Sequence]:
    return [seq for seq in as_seqs(seqs) if seq.block_table and not seq.swapped]


def on_host(seqs: SequenceLike) -> list[Sequence]:
    return [seq for seq in as_seqs(seqs) if seq.swapped]


def num_unique_blocks(seqs: list[Sequence]) -> int:
    return len({block_id for seq in seqs for block_id in live_blocks(seq)})
