"""Content index over one pool's full blocks, and the LRU of indexed blocks that no table references."""
from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

from . import hashing


class BlockKey(NamedTuple):
    """Everything a block's hash commits to, kept so a hit can be confirmed rather than trusted."""

    parent_hash: bytes
    token_bytes: bytes  # hashing.pack_tokens of the block's token ids
    extra_keys: tuple
    # The KV-cache group whose layers' K/V the block holds (kv_cache_groups): equal tokens in two groups
    # are two entries, since each group's block holds other layers.
    group: int = 0

    def digest(self) -> bytes:
        """The block's index key: its chain hash (the same for every group), tagged with a group > 0."""
        return hashing.group_key(hashing.hash_block(self.parent_hash, self.token_bytes, self.extra_keys), self.group)


class PrefixCache:
    """hash -> block for blocks whose KV is complete; one block per hash.

    A block stays indexed while referenced and after its last reference goes (then it is
    "evictable": free to reuse, but still worth a hit); the pool reclaims evictable blocks, oldest
    first, only once its plain free list is empty.
    """

    def __init__(self) -> None:
        self._block_by_hash: dict[bytes, int] = {}
        self._hash_of_block: dict[int, bytes] = {}
        self._key_of_block: dict[int, BlockKey] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        # [kv tier] on_evict(block_hash, key, block_id), where a KV offload tier is configured (kvpage.kv_offload):
        # an evicted block's bytes are still intact until the step that reuses it runs, and go to the tier.
        self.on_evict = None

    def __len__(self) -> int:
        return len(self._block_by_hash)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def get(self, block_hash: bytes) -> int | None:
        """The block indexed under `block_hash`; a caller must still compare its key (see lookup)."""
        return self._block_by_hash.get(block_hash)

    def lookup(self, block_hash: bytes, key: BlockKey) -> int | None:
        block_id = self._block_by_hash.get(block_hash)
        # Compare the contents too: a hash collision must never hand out someone else's KV.
        if block_id is None or self._key_of_block[block_id] != key:
            return None
        return block_id

    def insert(self, block_id: int, block_hash: bytes, key: BlockKey) -> bool:
        """Index a just-completed block; False when an equal block is already indexed (keep that one)."""
        if block_hash in self._block_by_hash or block_id in self._hash_of_block:
            return False
        self._block_by_hash[block_hash] = block_id
        self._hash_of_block[block_id] = block_hash
        self._key_of_block[block_id] = key
        return True

    def contains_block(self, block_id: int) -> bool:
        return block_id in self._hash_of_block

    def is_evictable(self, block_id: int) -> bool:
        return block_id in self._evictable

    def park(self, block_id: int) -> None:
        """Last reference gone: keep the contents for future hits, at the young end of the LRU."""
        self._evictable[block_id] = None

    def revive(self, block_id: int) -> None:
        del self._evictable[block_id]

    def evict(self) -> int:
        """Reclaim the least recently freed indexed block; it stops being a hit."""
        block_id, _ = self._evictable.popitem(last=False)
        block_hash = self._hash_of_block.pop(block_id)
        del self._block_by_hash[block_hash]
        key = self._key_of_block.pop(block_id)
        if self.on_evict is not None:  # [kv tier]
            self.on_evict(block_hash, key, block_id)
        return block_id

    def remove(self, block_id: int) -> None:
        """Stop indexing a block whose contents can no longer be trusted (a step that was to fill it failed)."""
        block_hash = self._hash_of_block.pop(block_id, None)
        if block_hash is None:
            return
        del self._block_by_hash[block_hash]
        del self._key_of_block[block_id]
        self._evictable.pop(block_id, None)

    def rebuild(self, ref_counts: list[int]) -> set[int]:
        """Drop any entry an interrupted update left half made, and make exactly the indexed blocks
        nobody references evictable (those already parked keep their LRU order). Returns them."""
        whole = {b: h for b, h in self._hash_of_block.items()
                 if self._block_by_hash.get(h) == b and b in self._key_of_block}
        self._key_of_block = {b: self._key_of_block[b] for b in whole}
        self._hash_of_block = whole
        self._block_by_hash = {h: b for b, h in whole.items()}
        unreferenced = [b for b in whole if not ref_counts[b]]
        order = [b for b in self._evictable if b in whole and not ref_counts[b]]
        order += [b for b in unreferenced if b not in self._evictable]
        self._evictable = OrderedDict.fromkeys(order)
        return set(order)

    def hash_of(self, block_id: int) -> bytes | None:
        return self._hash_of_block.get(block_id)

    def key_of(self, block_id: int) -> BlockKey | None:
        return self._key_of_block.get(block_id)

    def evictable_blocks(self) -> list[int]:
        return list(self._evictable)

    def indexed(self) -> list[tuple[bytes, int]]:
        return list(self._block_by_hash.items())
