"""OffloadingConnector: a KV tier behind the pool's prefix cache, through the connector seam
(kv_offload.connector_api). Scheduler side; pure Python, no torch.

Partial last blocks: only full blocks are prefix-cache entries (vLLM's rule), so a chat's next turn would
recompute the tokens of the previous answer's last, partly filled block. When a sequence finishes, the
offloading connector stores that block's computed tokens' K/V as a tier entry keyed like a block whose key
holds fewer than block_size tokens (its parent's chain hash, those tokens, the extra keys, the group; the full
key verified on load). A lookup whose full-block hit ends at a block boundary then probes for the longest such
entry whose tokens are a prefix of the prompt's next tokens (leaving the last token to compute); it is loaded
into the fresh block the sequence gets for that position, which it owns alone and which is no prefix-cache
entry until the sequence's own prefill fills it (then the usual full-block caching applies). Not with a
sliding-window KV-cache group (a window's blocks are matched by the window rule, whole blocks only) nor decode
context parallelism (no tier at all there).
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from statistics import median

from kvpage.core.hashing import ROOT_HASH, TOKEN_BYTES, group_key, hash_block, pack_tokens
from kvpage.core.kv_cache_groups import NULL_BLOCK, first_kept_block
from kvpage.core.prefix_cache import BlockKey
from kvpage.core.sequence import Sequence

from .connector_api import KVConnectorBase, KVConnectorMeta

logger = logging.getLogger(__name__)

# Tier hashes whose load failed, kept as misses (OffloadingConnector.on_load_failed); past this many the oldest
# is forgotten (a file still there and still bad then costs one more recovered step).
MAX_FAILED_LOADS = 65536


class OffloadingConnector(KVConnectorBase):
    """A tier (kv_offload.tiers, kv_offload.disk_tier) behind the pool's prefix cache: evicted blocks are stored
    into it, and a prompt's blocks past the pool's hit are looked up in it, continuing down the hash chain."""

    def __init__(self, tier, block_size: int, save_now=None, recompute_seconds=None,
                 sliding_windows: tuple[int | None, ...] = (None,)) -> None:
        """save_now(stores): the worker's save, called right after a step committed with the blocks it
        filled (write-through: a process killed right after still leaves them in a disk tier). None: blocks
        reach the tier only when the pool evicts them. recompute_seconds(num_tokens): what prefilling them
        would cost (the scheduler's cost model), against which a hit's load is priced; None: always load.
        sliding_windows: each KV-cache group's window (None: full attention), in layout order: the tier
        holds one entry per (block hash, group), keyed as the pool's prefix cache keys that group's blocks."""
        self.tier = tier
        self.block_size = block_size
        self.sliding_windows = tuple(sliding_windows)
        # Partial last blocks (module docstring): only where every group is full attention.
        self.partial_blocks = all(w is None for w in self.sliding_windows)
        self.save_now = save_now
        self.recompute_seconds = recompute_seconds
        self.load_cost = LoadCost()
        # The payloads the last lookup of each sequence verified (read once, loaded after allocation).
        self._matched: dict[int, _Match] = {}
        self._loads: list[tuple[int, object]] = []
        self._load_keys: list[tuple[bytes, BlockKey]] = []  # each load's (tier hash, key): other TP ranks' reads
        self._touches: list[bytes] = []  # tier entries the pool's LRU used again (other TP ranks' LRUs follow)
        # verify_remote(epoch, [(tier hash, key)]) -> [bool]: under tensor parallelism, whether every other rank
        # holds and verified each entry (and keeps it for this schedule's loads: kv_offload.tp); None: one process.
        self.verify_remote = None
        self._epoch = 0  # schedules so far: a rank keeps what it verified for one schedule only
        self._remote_verified: set[bytes] = set()
        self._stores: list[tuple[bytes, BlockKey, int]] = []
        self._storing: set[bytes] = set()
        self.hit_tokens = 0  # first admissions only: a recompute after preemption is no cache hit
        self.loaded_blocks = 0
        self.loaded_bytes = 0
        self.stored_blocks = 0  # handed to the tier (the tier's own stats say what it kept)
        self.declined_blocks = 0  # held by the tier, but recomputing them was priced cheaper than loading
        self.partial_hit_tokens = 0  # of hit_tokens, those loaded from partial last blocks
        self.partial_stored_blocks = 0  # partial last blocks handed to the tier (one per group)
        # [failed loads] the counters before this step's schedule, and the last meta's (device block, tier hash)
        # loads: a step whose load fails counts nothing, and its failed entries are misses from then on.
        self._counted_before_step = (0, 0, 0, 0)
        self._last_loads: list[tuple[int, bytes]] = []
        self._failed_loads: dict[bytes, None] = {}  # insertion order: the oldest is forgotten first
        self._warned_failed_load = False

    def __reduce__(self):
        # The tier (its memory, files and writer thread) belongs to the process that built it: a pickled copy
        # elsewhere (`kvpage serve` keeps a copy of the engine core's scheduler for its admission checks) gets
        # a connector that matches and keeps nothing.
        return (KVConnectorBase, ())

    # -- scheduler side ------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int) -> int:
        """Whole blocks from num_computed_tokens on that the tier holds for every KV-cache group, verified,
        before the prompt's last token (which must run for its logits), then the tokens of a partial last
        block found right after them (_match_partial; so the count need not be whole blocks); 0 where the
        cost model prices recomputing them cheaper than loading them (as the scheduler prices swap vs recompute).

        A hit of h blocks needs, from the tier, each full-attention group's blocks [first, h) and each
        sliding-window group's blocks of the window that ends at h (vLLM's hybrid rule; the pool's own hit
        below `first` already holds the window's part there): a group that cannot supply its part shortens
        the hit, and so does a block that fails its checks when read."""
        bs = self.block_size
        if num_computed_tokens % bs:
            return 0  # the pool's full hit: nothing past it
        first = num_computed_tokens // bs
        limit = (len(seq.token_ids) - 1) // bs
        match = self._matched.get(seq.seq_id)
        if match is None or match.first != first:
            match = _Match(first)
        h = self._fit(seq, match, limit)  # index look-ups only: nothing read yet
        if h > first and not match.payloads and not self._worth_loading(len(self._needed(first, h)), (h - first) * bs):
            self.declined_blocks += len(self._needed(first, h))
            return 0
        h = self._read(seq, match, h)
        num_partial = self._match_partial(seq, match, h)
        if h > first or num_partial:
            if len(self._matched) > 8:  # only the queue's heads are looked up repeatedly
                self._matched.clear()
            self._matched[seq.seq_id] = match
        else:
            self._matched.pop(seq.seq_id, None)
        return (h - first) * bs + num_partial

    def _match_partial(self, seq: Sequence, match: "_Match", h: int) -> int:
        """Tokens of logical block h (where the full-block hit ends) that a partial entry supplies for every
        group, verified (module docstring): the longest the tier holds whose tokens are a prefix of the
        prompt's there, leaving its last token to compute; 0 if none, or where recomputing them is priced
        cheaper than loading a block per group. One hash and one index look-up per length tried."""
        if not self.partial_blocks:
            return 0
        # An earlier schedule's match (the queue's head looked up again): every other rank verifies it afresh,
        # for this schedule's loads.
        if match.partial is not None and match.partial.block == h and all(self._remote_flags(match.partial.entries)):
            return match.partial.num_tokens
        match.partial = None
        bs, num_groups = self.block_size, len(self.sliding_windows)
        start = h * bs
        longest = min(bs - 1, len(seq.token_ids) - 1 - start)
        if longest < 1:
            return 0
        parent = block_hash(seq, h - 1, bs) if h else ROOT_HASH
        packed = pack_tokens(seq.token_ids[start:start + longest])
        for n in range(longest, 0, -1):
            token_bytes = packed[:n * TOKEN_BYTES]
            chain = hash_block(parent, token_bytes, seq.extra_keys)
            # Index look-ups only (tier.indexed, no file system call per length tried): a partial entry another
            # process sharing a disk tier's directory wrote since this one started is not seen (a miss costs less
            # than a block's recompute); one written before is (the start-up scan indexes every file).
            if not all((e := group_key(chain, g)) not in self._failed_loads and self.tier.indexed(e)
                       for g in range(num_groups)):
                continue
            entries = partial_entries(parent, token_bytes, seq.extra_keys, num_groups)
            payloads = self.tier.match_many(entries)
            if len(payloads) < num_groups or any(p is None for p in payloads) or not all(self._remote_flags(entries)):
                continue  # failed a check (the tier dropped it) or another rank lacks it: a shorter one may do
            if not self._worth_loading(num_groups, n):
                self.declined_blocks += num_groups
                return 0
            match.partial = _Partial(h, n, entries, payloads)
            return n
        return 0

    def _needed(self, first: int, h: int) -> list[tuple[int, int]]:
        """(group, logical block) entries a hit of blocks [first, h) takes from the tier."""
        bs = self.block_size
        return [(g, i) for g, w in enumerate(self.sliding_windows)
                for i in range(first if w is None else max(first, first_kept_block(h * bs, w, bs)), h)]

    def _fit(self, seq: Sequence, match: "_Match", limit: int) -> int:
        """The longest hit end h <= limit every group can supply from the tier (as the block manager's
        PrefixMatcher fits windows into the pool's hit): the full groups' common run of held blocks, then
        shortened until each window group holds its window's blocks."""
        bs, first = self.block_size, match.first

        def held(g: int, i: int) -> bool:
            if (g, i) in match.payloads:
                return True
            tier_hash = group_key(block_hash(seq, i, bs), g)
            return (g, i) not in match.bad and tier_hash not in self._failed_loads and self.tier.contains(tier_hash)

        h = first
        full = [g for g, w in enumerate(self.sliding_windows) if w is None]
        while h < limit and all(held(g, h) for g in full):
            h += 1
        windows = [(g, w) for g, w in enumerate(self.sliding_windows) if w is not None]
        while h > first:
            for g, w in windows:
                lo = max(first, first_kept_block(h * bs, w, bs))
                miss = next((i for i in range(h - 1, lo - 1, -1) if not held(g, i)), None)
                if miss is not None:
                    # Windows only move right as h grows: h - 1 fits this group if its window starts past
                    # the miss, else no end above the miss does.
                    h = h - 1 if max(first, first_kept_block((h - 1) * bs, w, bs)) > miss else miss
                    break
            else:
                return h
        return first

    def _read(self, seq: Sequence, match: "_Match", h: int) -> int:
        """Read and verify what a hit ending at h needs (on every TP rank); a block failing its checks (or
        gone since) is a miss from then on, and the hit is fitted again below it. Returns the hit's end."""
        first = match.first
        start, num_read = time.perf_counter(), 0
        while h > first:
            needed = self._needed(first, h)
            num_payloads = len(match.payloads)
            ok = self._read_local(seq, match, [e for e in needed if e not in match.payloads])
            num_read += len(match.payloads) - num_payloads + (not ok)
            if ok and self._verify_remote(seq, match, needed):
                break
            h = self._fit(seq, match, h)
        self.load_cost.add_read(num_read, time.perf_counter() - start)
        return h

    def _read_local(self, seq: Sequence, match: "_Match", entries: list[tuple[int, int]]) -> bool:
        """Read entries from this process's tier until one fails (then a miss: False)."""
        bs = self.block_size
        # A disk tier checks headers and keys now and its payloads when they load (match_many: DiskBlocks).
        payloads = self.tier.match_many([(group_key(block_hash(seq, i, bs), g), block_key(seq, i, bs, g))
                                         for g, i in entries])
        for entry, payload in zip(entries, payloads):
            if payload is None:
                match.bad.add(entry)
                return False
            match.payloads[entry] = payload
        return True

    def _verify_remote(self, seq: Sequence, match: "_Match", entries: list[tuple[int, int]]) -> bool:
        """Under tensor parallelism: whether every other rank verified each entry in this schedule (those that
        did not are misses from then on). One process: True."""
        if self.verify_remote is None:
            return True
        bs = self.block_size
        flags = self._remote_flags([(group_key(block_hash(seq, i, bs), g), block_key(seq, i, bs, g))
                                    for g, i in entries])
        for entry, ok in zip(entries, flags):
            if not ok:
                match.bad.add(entry)
                match.payloads.pop(entry, None)
        return all(flags)

    def _remote_flags(self, items: list[tuple[bytes, BlockKey]]) -> list[bool]:
        """Under tensor parallelism: whether every other rank holds and verified each (tier hash, key) in this
        schedule (asked once per entry and schedule). One process: all True."""
        if self.verify_remote is None:
            return [True] * len(items)
        todo = [item for item in items if item[0] not in self._remote_verified]
        for (tier_hash, _), ok in zip(todo, self.verify_remote(self._epoch, todo)):
            if ok:
                self._remote_verified.add(tier_hash)
        return [tier_hash in self._remote_verified for tier_hash, _ in items]

    def _worth_loading(self, num_blocks: int, num_tokens: int) -> bool:
        """Load unless the measured cost of loading num_blocks entries exceeds the cost model's recompute
        cost for the hit's num_tokens tokens."""
        load = self.load_cost.seconds(num_blocks)
        if load is None or self.recompute_seconds is None:
            return True  # nothing measured yet: a tier hit is presumed cheaper (it is, by far, on CPU)
        recompute = self.recompute_seconds(num_tokens)
        return recompute is None or load <= recompute

    def update_state_after_alloc(self, seq: Sequence, blocks: list[int], is_recompute: bool = False) -> None:
        """Load the matched blocks: `blocks` are group 0's device blocks of those tokens, in order (the last one
        a matched partial block's: a fresh block of the sequence's own); every group's table holds a fresh
        block where it needs the tier's bytes and NULL_BLOCK where a window group needs nothing
        (BlockManager.allocate's num_external_tokens)."""
        if not blocks:
            return
        match = self._matched.pop(seq.seq_id)
        partial = match.partial
        first, end = match.first, match.first + len(blocks)
        h = end - (partial is not None)  # the full blocks' end
        if seq.block_tables[0][first:end] != list(blocks) or (partial is not None and partial.block != h):
            raise RuntimeError(f"seq {seq.seq_id}: blocks {blocks} to load are not its table's [{first}, {end})")
        bs = self.block_size
        for g, table in enumerate(seq.block_tables):
            for i in range(first, h):
                if table[i] == NULL_BLOCK:
                    continue
                payload = match.payloads.get((g, i))
                if payload is None:
                    raise RuntimeError(f"seq {seq.seq_id}: group {g}'s block {i} to load was not matched")
                self._load(table[i], payload, (group_key(block_hash(seq, i, bs), g), block_key(seq, i, bs, g)))
        num_partial = 0
        if partial is not None:
            num_partial = partial.num_tokens
            for table, payload, entry in zip(seq.block_tables, partial.payloads, partial.entries):
                self._load(table[h], payload, entry)
        if not is_recompute:
            self.hit_tokens += (h - first) * bs + num_partial
            self.partial_hit_tokens += num_partial

    def _load(self, block_id: int, payload, entry: tuple[bytes, BlockKey]) -> None:
        """Load the tier entry (tier hash, key) `entry`, matched as `payload`, into device block block_id."""
        self._loads.append((block_id, payload))
        self._load_keys.append(entry)
        self.loaded_bytes += len(payload)
        self.loaded_blocks += 1

    def request_finished(self, seq: Sequence) -> None:
        """A finished sequence is about to free its blocks: store its last partial block (the computed tokens
        past its last full block) as a partial entry (module docstring), in the next stores. Its bytes stay
        intact until a step runs (on_step_computed saves them at once where the worker saves write-through;
        else the next step's worker saves them before anything else)."""
        if not self.partial_blocks or seq.swapped or not seq.block_tables[0]:
            return
        bs = self.block_size
        i, n = divmod(seq.num_computed_tokens, bs)
        if not n:
            return
        parent = block_hash(seq, i - 1, bs) if i else ROOT_HASH
        packed = pack_tokens(seq.token_ids[i * bs:i * bs + n])
        for (tier_hash, key), table in zip(partial_entries(parent, packed, seq.extra_keys, len(seq.block_tables)),
                                          seq.block_tables):
            if tier_hash in self._storing or self.tier.contains(tier_hash):
                continue
            self._queue_store(tier_hash, key, table[i])
            self.partial_stored_blocks += 1

    def on_evict(self, block_hash: bytes, key: BlockKey, block_id: int) -> None:
        if self.tier.contains(block_hash):
            self.tier.touch(block_hash)
            self._touches.append(block_hash)
        elif block_hash not in self._storing:
            self._queue_store(block_hash, key, block_id)

    def _queue_store(self, tier_hash: bytes, key: BlockKey, block_id: int) -> None:
        """Store device block block_id as tier entry tier_hash in the next stores (the tier lacks it)."""
        self._failed_loads.pop(tier_hash, None)  # stored afresh: a hit again once it is written
        self._storing.add(tier_hash)
        self._stores.append((tier_hash, key, block_id))

    def on_step_computed(self, block_manager) -> None:
        """After update_from_output: store the blocks the step indexed (computed, loaded or swapped in: all
        hold their K/V now) that the tier lacks. Nothing can overwrite them before the next schedule()."""
        if self.save_now is None:
            return
        if self._stores:  # finished sequences' partial blocks (request_finished): freed, but no step ran since
            self.save_now(self._stores)
            self.stored_blocks += len(self._stores)
            self._stores, self._storing = [], set()
        cache = block_manager.device.cache
        stores = []
        for block_id in block_manager.blocks_indexed_this_step():
            block_hash, key = cache.hash_of(block_id), cache.key_of(block_id)
            if block_hash is None or block_hash in self._storing or self.tier.contains(block_hash):
                continue
            self._failed_loads.pop(block_hash, None)  # stored afresh: a hit again once it is written
            stores.append((block_hash, key, block_id))
        if stores:
            self.save_now(stores)
            self.stored_blocks += len(stores)

    def begin_step(self) -> None:
        # Loads of a schedule() that was rolled back never happen. Stores stay: the evicted blocks'
        # bytes are intact until a step runs, and the next step's meta carries them.
        self._loads, self._load_keys = [], []
        self._counted_before_step = (self.hit_tokens, self.loaded_blocks, self.loaded_bytes, self.partial_hit_tokens)
        self._last_loads = []
        self._epoch += 1
        self._remote_verified.clear()

    def build_connector_meta(self) -> KVConnectorMeta | None:
        if not self._loads and not self._stores and not self._touches:
            return None
        meta = KVConnectorMeta(self._loads, self._stores, self._load_keys, self._touches)
        self._last_loads = [(block_id, h) for (block_id, _), (h, _) in zip(meta.loads, meta.load_keys)]
        self.stored_blocks += len(self._stores)
        self._loads, self._stores, self._storing, self._load_keys, self._touches = [], [], set(), [], []
        return meta

    def on_load_failed(self, block_ids: list[int]) -> None:
        """The last step's load failed for these device blocks (KVLoadError; the engine recomputes the step, and
        the scheduler takes the tier hits out of its requests' num_cached_tokens): the step's loads count as no
        hit, no loaded block or byte (what its retry loads counts then), and the failed entries are misses until
        the pool stores them afresh (on_evict, on_step_computed). The tier drops a failed entry, but where it
        cannot delete the file (a read-only directory, another user's file) its next lookup finds the file again,
        which passes the match-time checks and fails its load again: without this the engine would retry that
        step for ever."""
        self.hit_tokens, self.loaded_blocks, self.loaded_bytes, self.partial_hit_tokens = self._counted_before_step
        failed = set(block_ids)
        hashes = [tier_hash for block_id, tier_hash in self._last_loads if block_id in failed]
        if hashes and not self._warned_failed_load:
            self._warned_failed_load = True
            logger.warning("kvpage: KV offload: a tier load failed; its %d entries (and any that fail later) are "
                           "misses until stored afresh (a damaged file the tier cannot delete is not loaded again)",
                           len(hashes))
        for tier_hash in hashes:
            self._failed_loads[tier_hash] = None
        while len(self._failed_loads) > MAX_FAILED_LOADS:
            del self._failed_loads[next(iter(self._failed_loads))]

    def stats(self) -> dict:
        t = self.tier.stats
        return {
            "kv_offload_tier": self.tier.name, "kv_offload_hit_tokens": self.hit_tokens,
            "kv_offload_loaded_blocks": self.loaded_blocks, "kv_offload_loaded_bytes": self.loaded_bytes,
            "kv_offload_stored_blocks": t.stored_blocks, "kv_offload_stored_bytes": t.stored_bytes,
            "kv_offload_dropped_blocks": t.dropped_blocks, "kv_offload_evicted_blocks": t.evicted_blocks,
            "kv_offload_rejected_blocks": t.rejected_blocks, "kv_offload_declined_blocks": self.declined_blocks,
            "kv_offload_partial_hit_tokens": self.partial_hit_tokens,
            "kv_offload_partial_stored_blocks": self.partial_stored_blocks,
            "kv_offload_blocks": len(self.tier),
            "kv_offload_bytes": self.tier.used_bytes, "kv_offload_capacity_bytes": self.tier.capacity_bytes,
        }


@dataclass
class _Match:
    """One sequence's tier hit past the pool's first `first` blocks: the verified payloads read so far by
    (group, logical block), and the entries that failed their checks (misses from then on)."""

    first: int
    payloads: dict[tuple[int, int], bytes] = field(default_factory=dict)
    bad: set[tuple[int, int]] = field(default_factory=set)
    partial: "_Partial | None" = None  # a partial last block matched right after the full blocks


@dataclass
class _Partial:
    """A partial entry matched for logical block `block`: its num_tokens tokens, and per group its
    (tier hash, key) and payload."""

    block: int
    num_tokens: int
    entries: list[tuple[bytes, BlockKey]]
    payloads: list


class LoadCost:
    """Measured seconds per block loaded from the tier: the read (and checks) at match time plus the copy
    into the cache (the worker's; for a disk tier behind a CPU pool, the payload's read and checksum, which
    happen there), each the median per block over the recent loads, so one load stretched by another process
    on the machine moves nothing."""

    def __init__(self, window: int = 32) -> None:
        self._reads: deque = deque(maxlen=window)
        self._copies: deque = deque(maxlen=window)

    def add_read(self, num_blocks: int, seconds: float) -> None:
        if num_blocks > 0:
            self._reads.append(seconds / num_blocks)

    def add_copy(self, num_blocks: int, seconds: float) -> None:
        if num_blocks > 0:
            self._copies.append(seconds / num_blocks)

    def seconds(self, num_blocks: int) -> float | None:
        """What loading num_blocks blocks costs; None until a load was measured."""
        if not self._reads:
            return None
        per_block = median(self._reads) + (median(self._copies) if self._copies else 0.0)
        return num_blocks * per_block


def block_key(seq: Sequence, i: int, block_size: int, group: int = 0) -> BlockKey:
    """Full block i's key of KV-cache group `group` as the block manager's prefix cache commits to it."""
    parent = block_hash(seq, i - 1, block_size) if i else ROOT_HASH
    tokens = pack_tokens(seq.token_ids[i * block_size:(i + 1) * block_size])
    return BlockKey(parent, tokens, seq.extra_keys, group)


def partial_entries(parent: bytes, token_bytes: bytes, extra_keys: tuple,
                    num_groups: int) -> list[tuple[bytes, BlockKey]]:
    """Each group's (tier hash, key) of a partial block: the tokens (packed, fewer than a block's) after the
    block whose chain hash is `parent`. Keyed as a block's key would be; a full block's key always holds
    block_size tokens, so the two never share a key."""
    chain = hash_block(parent, token_bytes, extra_keys)
    return [(group_key(chain, g), BlockKey(parent, token_bytes, extra_keys, g)) for g in range(num_groups)]


def block_hash(seq: Sequence, i: int, block_size: int) -> bytes:
    """Full block i's chain hash, through the sequence's memo (the block manager's, which agrees)."""
    hashes = seq.block_hashes
    while len(hashes) <= i:
        hashes.append(block_key(seq, len(hashes), block_size).digest())
    return hashes[i]
