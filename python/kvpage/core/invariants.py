"""A full consistency check of a BlockManager against the sequences that hold its blocks.

O(total blocks + table entries): for tests and debugging, never for the engine's step loop.
"""
from __future__ import annotations

from collections import Counter

from .block_manager import BlockManager
from .block_moves import live_blocks
from .block_pool import BlockPool
from .block_table import num_blocks_for
from .hashing import pack_tokens
from .kv_cache_groups import NULL_BLOCK, first_kept_block
from .sequence import Sequence


class InvariantError(AssertionError):
    pass


def _expect(ok: bool, message: str) -> None:
    if not ok:
        raise InvariantError(message)


def check_pool(pool: BlockPool, table_entries: Counter, name: str) -> None:
    """Ref counts equal table entries; free, used and cached blocks partition the pool."""
    for block_id in range(pool.num_blocks):
        _expect(pool.ref_counts[block_id] == table_entries.get(block_id, 0),
                f"{name} block {block_id}: ref count {pool.ref_counts[block_id]},"
                f" but {table_entries.get(block_id, 0)} table entries point at it")
    _expect(set(table_entries) <= set(range(pool.num_blocks)), f"{name}: a table points outside the pool")
    free = pool.free_blocks()
    cached = pool.cache.evictable_blocks() if pool.cache is not None else []
    used = [b for b in range(pool.num_blocks) if pool.ref_counts[b] > 0]
    _expect(len(set(free)) == len(free), f"{name}: a block is on the free list twice")
    _expect(not set(free) & set(cached), f"{name}: a block is both free and cached")
    _expect(not (set(free) | set(cached)) & set(used), f"{name}: a free or cached block is referenced")
    _expect(len(free) + len(used) + len(cached) == pool.num_blocks,
            f"{name}: free {len(free)} + used {len(used)} + cached {len(cached)} != total {pool.num_blocks}")
    _expect(pool.num_used == len(used), f"{name}: used counter {pool.num_used} != {len(used)}")
    if pool.cache is not None:
        for block_hash, block_id in pool.cache.indexed():
            key = pool.cache.key_of(block_id)
            _expect(pool.cache.hash_of(block_id) == block_hash, f"{name}: index of block {block_id} is inconsistent")
            _expect(key.digest() == block_hash, f"{name}: cached block {block_id}'s tokens do not hash to its key")
        _expect(all(pool.cache.contains_block(b) for b in cached), f"{name}: an evictable block has no hash")


def check_sequence(manager: BlockManager, seq: Sequence) -> None:
    bs = manager.block_size
    c = seq.num_computed_tokens
    _expect(0 <= c <= len(seq.token_ids), f"seq {seq.seq_id}: num_computed_tokens {c} out of range")
    tables = seq.block_tables
    if not seq.block_table:
        _expect(all(not t for t in tables), f"seq {seq.seq_id}: group 0 holds no blocks but another group does")
        return
    _expect(len(tables) == manager.num_groups, f"seq {seq.seq_id}: {len(tables)} block tables for"
                                                f" {manager.num_groups} KV-cache groups")
    _expect(len({len(t) for t in tables}) == 1, f"seq {seq.seq_id}: its groups' tables differ in length")
    _expect(len(seq.block_table) >= num_blocks_for(c, bs),
            f"seq {seq.seq_id}: {len(seq.block_table)} blocks cannot hold {c} computed tokens")
    live = list(live_blocks(seq))
    _expect(len(set(live)) == len(live), f"seq {seq.seq_id}: a block appears twice")
    for g, (table, window) in enumerate(zip(tables, manager.sliding_windows)):
        # A window group holds exactly the blocks from its window's first on: no block it still
        # needs is missing, none it no longer needs is kept.
        kept = first_kept_block(c, window, bs)
        _expect(all(b == NULL_BLOCK for b in table[:kept]) and NULL_BLOCK not in table[kept:],
                f"seq {seq.seq_id} group {g}: NULL_BLOCK entries {[i for i, b in enumerate(table) if b == NULL_BLOCK]},"
                f" expected exactly those before block {kept}")
    cache = manager.device.cache
    if cache is None or seq.swapped:
        return
    for g, table in enumerate(tables):
        for i in range(c // bs):
            key = cache.key_of(table[i]) if table[i] != NULL_BLOCK else None
            if key is not None:
                _expect(key.token_bytes == pack_tokens(seq.token_ids[i * bs:(i + 1) * bs]) and key.group == g,
                        f"seq {seq.seq_id}: group {g}'s block {i} is indexed under other tokens or another group")


def check_block_manager(manager: BlockManager, seqs: list[Sequence]) -> None:
    """Raise InvariantError unless `manager` is consistent with `seqs`, every sequence holding blocks:
    ref counts equal the entries of every group's tables, and free + used + cached == num_blocks."""
    on_device = Counter(b for seq in seqs if not seq.swapped for b in live_blocks(seq))
    on_host = Counter(b for seq in seqs if seq.swapped for b in live_blocks(seq))
    check_pool(manager.device, on_device, "device")
    check_pool(manager.host, on_host, "host")
    for seq in seqs:
        check_sequence(manager, seq)
    stats = manager.stats()
    _expect(stats.num_free_blocks + stats.num_used_blocks + stats.num_cached_blocks == stats.num_blocks,
            "stats: free + used + cached != total")
    on_device_seqs = [seq for seq in seqs if seq.block_table and not seq.swapped]
    per_group = tuple(len({b for seq in on_device_seqs for b in seq.block_tables[g] if b != NULL_BLOCK})
                      for g in range(manager.num_groups))
    _expect(stats.num_used_blocks_per_group == per_group,
            f"stats: per-group used blocks {stats.num_used_blocks_per_group}, but the tables hold {per_group}")
