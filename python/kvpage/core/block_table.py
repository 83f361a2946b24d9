"""Arithmetic on block tables (logical block i of a sequence -> physical block id)."""
from __future__ import annotations

from collections import Counter
from typing import Iterable, Sequence


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` slots: a new block only once the last one is full."""
    return (num_tokens + block_size - 1) // block_size


def slot_mapping(block_table: list[int], block_size: int, start: int, end: int) -> list[int]:
    """Physical slot (block_id * block_size + offset) of each token position in [start, end)."""
    if not 0 <= start <= end:
        raise ValueError(f"need 0 <= start <= end, got start={start}, end={end}")
    if end > len(block_table) * block_size:
        raise ValueError(
            f"end={end} is past the {len(block_table)} blocks of this block table"
            f" ({len(block_table) * block_size} slots)")
    slots: list[int] = []
    pos = start
    # One range per block: a prefill of thousands of tokens costs a few dozen extends, not a loop per token.
    while pos < end:
        logical, offset = divmod(pos, block_size)
        stop = min(end, (logical + 1) * block_size)
        base = block_table[logical] * block_size
        slots.extend(range(base + offset, base + offset + stop - pos))
        pos = stop
    return slots


def blocks_to_append(plan: Iterable[tuple[list[int], int, int]], ref_counts: Sequence[int], block_size: int) -> int:
    """Blocks that appending to several tables draws: plan holds (block_table, start, num_new_tokens),
    tokens [start, start + num_new_tokens) to be written. Each table grows to hold them, and each
    writer of a block other tables point at too gets a private copy first (copy-on-write), except
    the last writer of a block, which by then holds it alone (BlockManager.append_slots, RowTables)."""
    grow, writers = 0, Counter()
    for table, start, n in plan:
        last = (start + n - 1) // block_size
        grow += max(0, last + 1 - len(table))
        writers.update(table[i] for i in range(start // block_size, min(len(table), last + 1)))
    return grow + sum(w - (ref_counts[b] == w) for b, w in writers.items())
