"""A pool of physical KV blocks on one device: O(1) allocate and free, one ref count per block."""
from __future__ import annotations

from .host_memory import available_host_bytes, gib
from .prefix_cache import PrefixCache


MAX_NUM_BLOCKS = 2**31  # block ids go to the kernels as int32
# Host bytes per block of the pool's own lists: a ref-count slot, a free-list slot and its int object.
_BOOKKEEPING_BYTES_PER_BLOCK = 48


def _check_bookkeeping_fits(num_blocks: int) -> None:
    if num_blocks > MAX_NUM_BLOCKS:
        raise ValueError(f"num_blocks must be at most {MAX_NUM_BLOCKS} (block ids are int32), got {num_blocks}")
    need = num_blocks * _BOOKKEEPING_BYTES_PER_BLOCK
    free = available_host_bytes()
    if free is not None and need > free:
        raise ValueError(f"num_blocks={num_blocks}: the block pool's bookkeeping alone needs {gib(need)},"
                         f" but only {gib(free)} of memory is free")


class BlockPool:
    """Ref counts equal the number of block-table entries pointing at each block, nothing else.

    Each block is in exactly one state: free (ref 0, plain free list), used (ref > 0), or cached
    (ref 0, still indexed by the prefix cache, reclaimed LRU-first once the free list runs dry).

    num_tags > 1: each block carries the tag it was allocated with (a hybrid KV cache's group) and
    the pool counts used blocks per tag, in O(1) per change (num_used_per_tag).
    """

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = False, num_tags: int = 1) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks must be a non-negative int, got {num_blocks!r}")
        _check_bookkeeping_fits(num_blocks)
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        # A stack: popping from the end hands out block 0 first and keeps both ends O(1).
        self._free = list(range(num_blocks - 1, -1, -1))
        self.cache = PrefixCache() if enable_prefix_caching else None
        self.num_used = 0
        self.max_num_used = 0  # the peak of num_used
        self.tags = [0] * num_blocks if num_tags > 1 else None
        self._used_per_tag = [0] * num_tags

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: plain free ones plus cached ones it may reclaim."""
        if self.cache is None:
            return len(self._free)
        return len(self._free) + self.cache.num_evictable

    @property
    def num_cached_blocks(self) -> int:
        return 0 if self.cache is None else self.cache.num_evictable

    @property
    def num_used_per_tag(self) -> tuple[int, ...]:
        return (self.num_used,) if self.tags is None else tuple(self._used_per_tag)

    def allocate(self, tag: int = 0) -> int:
        if self._free:
            block_id = self._free.pop()
        elif self.cache is not None and self.cache.num_evictable:
            block_id = self.cache.evict()
        else:
            raise RuntimeError(f"out of KV blocks: all {self.num_blocks} are in use")
        self.ref_counts[block_id] = 1
        self.num_used += 1
        if self.num_used > self.max_num_used:
            self.max_num_used = self.num_used
        if self.tags is not None:
            self.tags[block_id] = tag
            self._used_per_tag[tag] += 1
        return block_id

    def incref(self, block_id: int) -> None:
        refs = self.ref_counts
        if refs[block_id] == 0:
            # Only a cached block can be referenced again from zero: a prefix-cache hit revives it
            # (under its own tag: a cache entry names the tag its block was allocated with).
            self.cache.revive(block_id)
            self.num_used += 1
            if self.num_used > self.max_num_used:
                self.max_num_used = self.num_used
            if self.tags is not None:
                self._used_per_tag[self.tags[block_id]] += 1
        refs[block_id] += 1

    def decref(self, block_id: int) -> None:
        refs = self.ref_counts
        n = refs[block_id]
        if n > 1:
            refs[block_id] = n - 1
            return
        if n != 1:
            raise RuntimeError(f"block {block_id} freed more often than it was referenced")
        refs[block_id] = 0
        self.num_used -= 1
        if self.tags is not None:
            self._used_per_tag[self.tags[block_id]] -= 1
        if self.cache is not None and self.cache.contains_block(block_id):
            self.cache.park(block_id)
        else:
            self._free.append(block_id)

    def uncache(self, block_id: int) -> None:
        """Drop a block's prefix-cache entry: it is no hit any more, and once unreferenced it is plain free."""
        cache = self.cache
        if cache is None or not cache.contains_block(block_id):
            return
        parked = cache.is_evictable(block_id)
        cache.remove(block_id)
        if parked:
            self._free.append(block_id)

    def rebuild(self, table_entries, tags=None) -> None:
        """Recompute every ref count, the used counter and the free list from `table_entries` (block ->
        how many tables point at it; `tags`: block -> its tag, for the referenced blocks of a tagged
        pool): the way back to a consistent pool after an exception cut a mutation short. Indexed
        blocks nobody references stay prefix-cache hits."""
        refs = self.ref_counts
        refs[:] = [0] * self.num_blocks  # in place: the block manager keeps a reference to this list
        for block_id, count in table_entries.items():
            refs[block_id] = count
        self.num_used = sum(1 for r in refs if r)
        if self.tags is not None:
            for block_id, tag in (tags or {}).items():
                self.tags[block_id] = tag
            self._used_per_tag = [0] * len(self._used_per_tag)
            for block_id in table_entries:
                self._used_per_tag[self.tags[block_id]] += 1
        cached = self.cache.rebuild(refs) if self.cache is not None else set()
        self._free = [b for b in range(self.num_blocks - 1, -1, -1) if not refs[b] and b not in cached]

    def free_blocks(self) -> list[int]:
        """The plain free list (for checks and tests; not on any hot path)."""
        return list(self._free)
