"""KV-cache tiers behind the device pool's prefix cache: what every tier shares (an LRU index within a capacity,
counters) and the host-memory tier; the disk tier is kv_offload.disk_tier. Pure Python, no torch.

A tier maps a block's chain hash (hashing.hash_block: the block's tokens, extra keys and every block
before it) to the block's K/V bytes ("payload": every layer's K and V of that block, laid out by the
worker, kv_offload.worker). Each entry also keeps the block's full BlockKey; `get` hands bytes out only
when the key the caller wants equals the stored one, as the prefix cache does, so a hash collision can
never hand out someone else's KV. A full tier evicts its least recently used entry.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

from kvpage.core.prefix_cache import BlockKey


class TierStats:
    """Counters of one tier (blocks and bytes; read by the engine's stats)."""

    def __init__(self) -> None:
        self.stored_blocks = 0
        self.stored_bytes = 0
        self.dropped_blocks = 0  # stores given up: the write queue full, or a write failed
        self.evicted_blocks = 0
        self.read_blocks = 0
        self.read_bytes = 0
        self.rejected_blocks = 0  # entries found but failing a check (corrupt, truncated, foreign)


class LRUIndex:
    """A tier's entries: block hash -> (size in bytes, value), least recently used first, and the sizes'
    sum. Thread-safe (the disk tier's writer thread adds entries while the scheduler looks them up)."""

    def __init__(self) -> None:
        self._entries: OrderedDict[bytes, tuple[int, object]] = OrderedDict()
        self.bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._entries

    def items(self) -> list[tuple[bytes, tuple[int, object]]]:
        with self._lock:
            return list(self._entries.items())

    def use(self, block_hash: bytes):
        """The entry's value, now the most recently used; None if absent."""
        with self._lock:
            entry = self._entries.get(block_hash)
            if entry is None:
                return None
            self._entries.move_to_end(block_hash)
            return entry[1]

    def add(self, block_hash: bytes, size: int, value=None, replace: bool = True) -> bool:
        """Index the entry as the most recently used; replace=False keeps an existing one (False returned)."""
        with self._lock:
            old = self._entries.pop(block_hash, None)
            if old is not None:
                if not replace:
                    self._entries[block_hash] = old
                    self._entries.move_to_end(block_hash)
                    return False
                self.bytes -= old[0]
            self._entries[block_hash] = (size, value)
            self.bytes += size
            return True

    def size(self, block_hash: bytes) -> int | None:
        """The entry's size in bytes (its LRU position unchanged); None if absent."""
        entry = self._entries.get(block_hash)
        return None if entry is None else entry[0]

    def discard(self, block_hash: bytes) -> None:
        with self._lock:
            old = self._entries.pop(block_hash, None)
            if old is not None:
                self.bytes -= old[0]

    def pop_lru_over(self, capacity_bytes: int, incoming: int = 0) -> tuple[bytes, object] | None:
        """The least recently used entry, removed, while the sizes plus `incoming` exceed capacity_bytes;
        None once they fit (or nothing is left)."""
        with self._lock:
            if not self._entries or self.bytes + incoming <= capacity_bytes:
                return None
            block_hash, (size, value) = self._entries.popitem(last=False)
            self.bytes -= size
            return block_hash, value


class _Tier:
    """What both tiers share: an LRU index within capacity_bytes, and counters."""

    name = ""

    def __init__(self, capacity_bytes: int) -> None:
        if not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be a non-negative int, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self._index = LRUIndex()
        self.stats = TierStats()

    def __len__(self) -> int:
        return len(self._index)

    @property
    def used_bytes(self) -> int:
        return self._index.bytes

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self._index

    def indexed(self, block_hash: bytes) -> bool:
        """Whether this process's index holds the entry (no more: DiskTier.contains also looks for a file another
        process wrote since the start-up scan, a stat per miss)."""
        return block_hash in self._index

    def touch(self, block_hash: bytes) -> None:
        self._index.use(block_hash)

    def _evict_over_capacity(self, incoming: int = 0) -> None:
        """Evict least recently used entries until `incoming` more bytes fit."""
        while (evicted := self._index.pop_lru_over(self.capacity_bytes, incoming)) is not None:
            self._on_evicted(*evicted)
            self.stats.evicted_blocks += 1

    def _on_evicted(self, block_hash: bytes, value) -> None:
        pass

    def get_many(self, requests: list[tuple[bytes, BlockKey]]) -> list:
        """get() of each (hash, key) in order, up to and including the first miss (None): a hit needs every
        block before it, so nothing past a miss is read."""
        return _until_miss(requests, self.get)

    def match_many(self, requests: list[tuple[bytes, BlockKey]]) -> list:
        """What the connector's lookup holds for each (hash, key), as get_many: verified payloads here; a tier
        that reads its payloads only when they load hands out references to them instead (DiskTier)."""
        return self.get_many(requests)

    def _count_read(self, payload) -> None:
        self.stats.read_blocks += 1
        self.stats.read_bytes += len(payload)

    def _count_stored(self, payload) -> None:
        self.stats.stored_blocks += 1
        self.stats.stored_bytes += len(payload)


class HostMemoryTier(_Tier):
    """Blocks in host memory (behind a GPU pool; also the tier of choice for tests): an LRU of
    hash -> (key, payload bytes) holding at most capacity_bytes of payload. Stores are synchronous."""

    name = "host"

    def get(self, block_hash: bytes, key: BlockKey) -> bytes | None:
        entry = self._index.use(block_hash)
        if entry is None or entry[0] != key:
            return None
        self._count_read(entry[1])
        return entry[1]

    def put(self, block_hash: bytes, key: BlockKey, payload) -> None:
        payload = bytes(payload)
        if len(payload) > self.capacity_bytes:
            self.stats.dropped_blocks += 1
            return
        self._index.discard(block_hash)
        self._evict_over_capacity(len(payload))
        self._index.add(block_hash, len(payload), (key, payload))
        self._count_stored(payload)

    def entries(self) -> list[tuple[bytes, BlockKey, bytes]]:
        """(hash, key, payload) of every entry, least recently used first (tests check the invariants)."""
        return [(h, key, payload) for h, (_, (key, payload)) in self._index.items()]

    def flush(self) -> None:
        """Stores are synchronous here: nothing to wait for."""

    def close(self) -> None:
        pass


def _until_miss(requests: list[tuple[bytes, BlockKey]], lookup) -> list:
    """lookup(hash, key) of each request in order, up to and including the first None."""
    out = []
    for block_hash, key in requests:
        out.append(lookup(block_hash, key))
        if out[-1] is None:
            break
    return out
