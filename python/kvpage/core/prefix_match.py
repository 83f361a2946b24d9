"""Which device blocks already hold a sequence's prefix, per KV-cache group.

The block manager owns the pools and the block tables; this answers its content questions: the hash
chain of a sequence's full blocks, the longest prefix every group can supply from the prefix cache (or
from blocks this very step computes: in-step hits), and indexing a block once its K/V are in the cache.
"""
from __future__ import annotations

from . import hashing
from .hashing import ROOT_HASH, group_key
from .kv_cache_groups import NULL_BLOCK, KVCacheLayout, first_kept_block
from .prefix_cache import BlockKey, PrefixCache
from .sequence import Sequence


def num_hit_tokens(seq: Sequence, num_hit_blocks: int, block_size: int) -> int:
    """Tokens a hit of num_hit_blocks spares: a full hit still recomputes the last token, for its logits
    (vLLM instead gives up the whole last block); slot mapping keeps that token off its cached block."""
    return min(num_hit_blocks * block_size, len(seq.token_ids) - 1)


class PrefixMatcher:
    """In-step hits (vLLM v1's rule): `note_computing` announces the full blocks a step's prefill is
    about to fill, and a sequence admitted later in the same step hits them too. That is sound because
    each layer of the forward pass writes every scheduled token's K/V before any token attends.
    `begin_step` forgets the announcements."""

    def __init__(self, cache: PrefixCache, block_size: int, layout: KVCacheLayout) -> None:
        self.cache = cache
        self.block_size = block_size
        self.sliding_windows = layout.sliding_windows
        self._window_groups = tuple((g, w) for g, w in enumerate(self.sliding_windows) if w is not None)
        self._full_groups = tuple(g for g, w in enumerate(self.sliding_windows) if w is None)
        # This step's announced blocks: cache key -> (block, key) (see note_computing).
        self._computing: dict[bytes, tuple[int, BlockKey]] = {}
        self._computing_blocks: set[int] = set()
        self._indexed_this_step: list[int] = []

    def begin_step(self) -> None:
        """A new step is being scheduled: the last step's announced blocks are computed or forgotten."""
        self._computing.clear()
        self._computing_blocks.clear()
        self._indexed_this_step.clear()

    def indexed_this_step(self) -> list[int]:
        """Device blocks that became prefix-cache entries since begin_step()."""
        return list(self._indexed_this_step)

    def note_computing(self, seq: Sequence, start: int, end: int) -> None:
        """This step computes tokens [start, end) of `seq` (slots already made): the full blocks they
        complete are hits for sequences admitted later in the step."""
        for i in range(start // self.block_size, end // self.block_size):
            chain_hash = self._block_hash(seq, i)
            for g, table in enumerate(seq.block_tables):
                block_hash = group_key(chain_hash, g)
                if block_hash not in self._computing and self.cache.get(block_hash) is None:
                    block_id = table[i]  # never NULL: the step writes it
                    self._computing[block_hash] = (block_id, self._block_key(seq, i, g))
                    self._computing_blocks.add(block_id)

    def is_hit_block(self, block_id: int) -> bool:
        """Whether the block holds cached K/V, or K/V another sequence computes this step: never written."""
        return self.cache.contains_block(block_id) or block_id in self._computing_blocks

    # -- matching ------------------------------------------------------------------------------

    def match(self, seq: Sequence) -> list[list[int]]:
        """Each group's hit blocks for the longest prefix every group can supply (vLLM's hybrid rule):
        a full group needs all its blocks, a window group only those in the window of the hit's end
        (NULL_BLOCK before it). All lists have the hit's length in blocks."""
        limit = len(seq.token_ids) // self.block_size
        full_hits = {}
        for g in self._full_groups:  # each stops at its first miss; later groups need look no further
            full_hits[g] = self._match_full(seq, g, limit)
            limit = len(full_hits[g])
        memo = {g: {} for g, _ in self._window_groups}
        h = self._fit_windows(seq, limit, memo) if self._window_groups else limit
        tables = []
        for g, window in enumerate(self.sliding_windows):
            if window is None:
                tables.append(full_hits[g][:h])
            else:
                lo = self._first_hit_block(seq, h, window)
                tables.append([NULL_BLOCK] * lo + [memo[g][i] for i in range(lo, h)])
        return tables

    def _match_full(self, seq: Sequence, group: int, limit: int) -> list[int]:
        hits: list[int] = []
        for i in range(limit):
            block_id = self._lookup_any(seq, group, i)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _lookup_any(self, seq: Sequence, group: int, i: int) -> int | None:
        """A cached block, or one this step computes (note_computing), holding seq's block i of `group`."""
        block_id = self.lookup(seq, group, i)
        if block_id is None and self._computing:
            block_id = self._lookup_computing(seq, group, i)
        return block_id

    def _fit_windows(self, seq: Sequence, h: int, memo: dict[int, dict[int, int | None]]) -> int:
        """The longest hit of at most h blocks for which every window group holds its window's blocks."""
        while h > 0:
            for g, window in self._window_groups:
                lo = self._first_hit_block(seq, h, window)
                miss = next((i for i in range(h - 1, lo - 1, -1) if self._memo_lookup(seq, g, i, memo[g]) is None),
                            None)
                if miss is not None:
                    # Blocks above the miss all hit, and windows only move right as h grows: h - 1 still
                    # fits this group if its window starts past the miss, else nothing above the miss does.
                    h = h - 1 if self._first_hit_block(seq, h - 1, window) > miss else miss
                    break
            else:
                return h
        return 0

    def _memo_lookup(self, seq: Sequence, group: int, i: int, memo: dict[int, int | None]) -> int | None:
        if i not in memo:
            memo[i] = self._lookup_any(seq, group, i)
        return memo[i]

    def _first_hit_block(self, seq: Sequence, num_hit_blocks: int, window: int) -> int:
        """The first block a window group needs for a hit of num_hit_blocks: the next query starts at
        the hit's token count."""
        return first_kept_block(num_hit_tokens(seq, num_hit_blocks, self.block_size), window, self.block_size)

    # -- the content index -----------------------------------------------------------------------

    def _block_key(self, seq: Sequence, i: int, group: int = 0) -> BlockKey:
        """What full logical block i's hash commits to: its parent's hash, its tokens, extra keys (and,
        as a cache entry, its group)."""
        parent = self._block_hash(seq, i - 1) if i else ROOT_HASH
        bs = self.block_size
        return BlockKey(parent, hashing.pack_tokens(seq.token_ids[i * bs:(i + 1) * bs]), seq.extra_keys, group)

    def _block_hash(self, seq: Sequence, i: int) -> bytes:
        """Hash of full logical block i, extending the sequence's memoised chain as needed."""
        hashes = seq.block_hashes
        while len(hashes) <= i:
            hashes.append(self._block_key(seq, len(hashes)).digest())
        return hashes[i]

    def lookup(self, seq: Sequence, group: int, i: int) -> int | None:
        """The cached block of `group` holding exactly seq's logical block i, if any."""
        cache = self.cache
        block_id = cache.get(group_key(self._block_hash(seq, i), group))
        # Confirm the contents: a hash collision must never hand out someone else's KV.
        if block_id is None or cache.key_of(block_id) != self._block_key(seq, i, group):
            return None
        return block_id

    def _lookup_computing(self, seq: Sequence, group: int, i: int) -> int | None:
        """The block of `group` this step computes as exactly seq's logical block i, if any (see note_computing)."""
        entry = self._computing.get(group_key(self._block_hash(seq, i), group))
        if entry is None or entry[1] != self._block_key(seq, i, group):
            return None
        return entry[0]

    def index_block(self, seq: Sequence, i: int) -> None:
        """Index full computed block i of every group (a window group's NULL_BLOCK entries aside)."""
        cache = self.cache
        key = None
        hashes = seq.block_hashes
        for g, table in enumerate(seq.block_tables):
            block_id = table[i]
            # Already indexed: a prefix hit, or a block this sequence shares with its fork parent.
            if block_id == NULL_BLOCK or cache.contains_block(block_id):
                continue
            if key is None:
                key = self._block_key(seq, i)  # memoises the chain up to block i - 1
                if len(hashes) == i:  # the usual case, a block that just filled: pack and hash it once
                    hashes.append(key.digest())
            if cache.insert(block_id, group_key(hashes[i], g), key._replace(group=g) if g else key):
                self._indexed_this_step.append(block_id)
