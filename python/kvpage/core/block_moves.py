"""Re-pointing block tables from one pool to another: the bookkeeping half of a swap (the block manager
decides what moves; ops.swap_blocks copies the data)."""
from __future__ import annotations

from .block_pool import BlockPool
from .sequence import Sequence, SequenceLike, as_seqs

BlockMapping = list[tuple[int, int]]  # (source block, destination block) pairs


def move_tables(seqs: list[Sequence], src: BlockPool, dst: BlockPool, find_existing) -> BlockMapping:
    """Re-point tables from src to dst, one dst block per distinct src block (or the block
    find_existing(seq, i) names, already holding that content); returns the copies to make."""
    new_of: dict[int, int] = {}
    copies: BlockMapping = []
    for seq in seqs:
        table = []
        for i, block_id in enumerate(seq.block_table):
            new = new_of.get(block_id)
            if new is not None:
                dst.incref(new)
            elif (new := find_existing(seq, i)) is not None:
                dst.incref(new)
                new_of[block_id] = new
            else:
                new = new_of[block_id] = dst.allocate()
                copies.append((block_id, new))
            table.append(new)
        for block_id in reversed(seq.block_table):
            src.decref(block_id)
        seq.block_table = table
    return copies


def on_device(seqs: SequenceLike) -> list[Sequence]:
    return [seq for seq in as_seqs(seqs) if seq.block_table and not seq.swapped]


def on_host(seqs: SequenceLike) -> list[Sequence]:
    return [seq for seq in as_seqs(seqs) if seq.swapped]


def num_unique_blocks(seqs: list[Sequence]) -> int:
    return len({block_id for seq in seqs for block_id in seq.block_table})
