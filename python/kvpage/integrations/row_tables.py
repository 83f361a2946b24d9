"""Block tables for the rows of a padded HF batch, over one kvpage BlockPool.

A row holds its real tokens only, packed from position 0: padding takes no slot and no block. Rows may
share blocks (beam search re-points them: a ref count per table entry, kvpage.core.BlockPool); a row
about to append to a partly filled block it shares gets a private copy first (copy-on-write). Pure
bookkeeping, no tensors: the caller moves the K/V (ops.copy_blocks for the pairs `append` returns).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvpage.core import BlockPool, num_blocks_for, slot_mapping
from kvpage.core.block_table import blocks_to_append

BlockPairs = list[tuple[int, int]]


class OutOfBlocks(RuntimeError):
    """The pool cannot hold a step's tokens; nothing was changed."""


@dataclass
class Row:
    block_table: list[int] = field(default_factory=list)
    num_tokens: int = 0  # real tokens held; the table has exactly num_blocks_for(num_tokens) blocks


class RowTables:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.rows: list[Row] = []
        self.top_block = -1  # the highest block id ever handed out (the K/V tensors must reach it)
        self.num_copy_on_write = 0

    def __len__(self) -> int:
        return len(self.rows)

    def start(self, num_rows: int) -> None:
        """Empty tables for a new batch."""
        self.clear()
        self.rows = [Row() for _ in range(num_rows)]

    def append(self, counts: list[int]) -> tuple[list[int], BlockPairs]:
        """Room for counts[i] more tokens in row i: (their slots, row after row; copy-on-write pairs).

        Raises before changing anything if the pool cannot take them all.
        """
        self._reserve(counts)
        slots: list[int] = []
        copies: BlockPairs = []
        for row, n in zip(self.rows, counts):
            if n:
                copies += self._grow(row, n)
                slots += slot_mapping(row.block_table, self.block_size, row.num_tokens, row.num_tokens + n)
                row.num_tokens += n
        self.num_copy_on_write += len(copies)
        return slots, copies

    def truncate(self, row: Row, num_tokens: int) -> None:
        """Keep the first num_tokens tokens of `row`; blocks past them go back to the pool, tail first."""
        keep = num_blocks_for(num_tokens, self.block_size)
        for block_id in reversed(row.block_table[keep:]):
            self.pool.decref(block_id)
        del row.block_table[keep:]
        row.num_tokens = num_tokens

    def select(self, indices: list[int]) -> None:
        """Row i becomes old row indices[i]: the same blocks, one more reference each (no copy)."""
        bad = [i for i in indices if not 0 <= i < len(self.rows)]
        if bad:
            raise IndexError(f"row indices {bad[:4]} out of range for {len(self.rows)} rows")
        rows = []
        for i in indices:
            source = self.rows[i]
            for block_id in source.block_table:
                self.pool.incref(block_id)
            rows.append(Row(list(source.block_table), source.num_tokens))
        self.clear()
        self.rows = rows

    def clear(self) -> None:
        for row in self.rows:
            self.truncate(row, 0)
        self.rows = []

    def snapshot(self) -> list[tuple[list[int], int]]:
        """Each row's (block table, length), for restore()."""
        return [(list(row.block_table), row.num_tokens) for row in self.rows]

    def restore(self, snapshot: list[tuple[list[int], int]]) -> None:
        """Put the rows back as `snapshot` found them, taking back the appends (and their copy-on-write) since:
        blocks only they took go back to the pool. The same rows must still be there (no select in between)."""
        for row, (table, num_tokens) in zip(self.rows, snapshot):
            for block_id in table:  # the old blocks are all still held (a block copied away was shared), so
                self.pool.incref(block_id)  # referencing them first frees none of them in between
            for block_id in reversed(row.block_table):
                self.pool.decref(block_id)
            row.block_table[:] = table
            row.num_tokens = num_tokens

    def _reserve(self, counts: list[int]) -> None:
        # A row holds exactly the blocks of its tokens, so it writes from its length on.
        plan = [(row.block_table, row.num_tokens, n) for row, n in zip(self.rows, counts) if n]
        needed = blocks_to_append(plan, self.pool.ref_counts, self.block_size)
        if needed > self.pool.num_free_blocks:
            raise OutOfBlocks(f"out of KV blocks: this forward pass needs {needed} more, and"
                               f" {self.pool.num_free_blocks} of the pool's {self.pool.num_blocks} are free")

    def _grow(self, row: Row, n: int) -> BlockPairs:
        pool, table, copies = self.pool, row.block_table, []
        if row.num_tokens % self.block_size and pool.ref_counts[table[-1]] > 1:
            # The next token lands in a partly filled block another row points at too: copy it first.
            src, dst = table[-1], pool.allocate()
            pool.decref(src)
            table[-1] = dst
            copies.append((src, dst))
            self.top_block = max(self.top_block, dst)
        for _ in range(num_blocks_for(row.num_tokens + n, self.block_size) - len(table)):
            table.append(pool.allocate())
            self.top_block = max(self.top_block, table[-1])
        return copies
