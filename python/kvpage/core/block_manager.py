"""The block manager: block tables over a shared device pool, copy-on-write, prefix caching, swap."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable

from .block_moves import BlockMapping, live_blocks, move_tables, num_unique_blocks, on_device, on_host
from .block_pool import BlockPool
from .block_table import blocks_to_append, num_blocks_for, slot_mapping
from .kv_cache_groups import FULL_ATTENTION_LAYOUT, NULL_BLOCK, KVCacheLayout, first_kept_block
from .prefix_match import PrefixMatcher, num_hit_tokens
from .sequence import Sequence, SequenceLike, as_seqs


@dataclass(frozen=True)
class CacheConfig:
    """The KV cache a scheduler builds its block manager from (vLLM's CacheConfig)."""

    num_blocks: int
    block_size: int = 16
    num_host_blocks: int = 0
    enable_prefix_caching: bool = True
    kv_cache_layout: KVCacheLayout | None = None  # None: one group of all layers

    def build(self) -> "BlockManager":
        return BlockManager(self.num_blocks, self.block_size, self.num_host_blocks, self.enable_prefix_caching,
                            kv_cache_layout=self.kv_cache_layout)


@dataclass(frozen=True)
class BlockManagerStats:
    num_blocks: int
    num_used_blocks: int
    num_cached_blocks: int  # unreferenced, still holding a prefix-cache entry
    num_free_blocks: int  # plain free; free + used + cached == num_blocks
    num_host_blocks: int
    num_host_used_blocks: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    num_copy_on_write: int
    num_swapped_out_blocks: int
    num_swapped_in_blocks: int
    # Device blocks each KV-cache group's tables hold (layout order); sums to num_used_blocks.
    num_used_blocks_per_group: tuple[int, ...] = ()
    max_num_used_blocks: int = 0  # the most device blocks in use at once so far
    kv_cache_layout: KVCacheLayout = FULL_ATTENTION_LAYOUT

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.prefix_cache_queried_tokens
        return self.prefix_cache_hit_tokens / q if q else 0.0


class BlockManager:
    """Single-writer bookkeeping of which physical block holds which sequence's tokens.

    The scheduler drives it once per step: `allocate` admits a waiting sequence (reusing cached
    prefix blocks), `append_slots` makes room for the tokens a running sequence computes this step
    (returning copy-on-write pairs for `ops.copy_blocks`), and `mark_computed` records, after the
    step ran, that those tokens' K/V are in the cache, so full blocks become prefix-cache hits.

    What the prefix cache holds, and which blocks a step is computing (in-step hits: `note_computing`,
    `begin_step`), is prefix_match.PrefixMatcher's to say.

    Hybrid models (vLLM's hybrid KV cache manager): `kv_cache_layout` groups the layers by window
    (kv_cache_groups.py), and every sequence holds one table per group (seq.block_tables, all the same
    length), all drawn from the one pool. A sliding-window group of W keeps only positions
    >= num_computed_tokens - W + 1: mark_computed, once a step's tokens are in the cache, puts
    NULL_BLOCK where a block left the window and frees it (to the prefix cache's LRU if indexed).
    Freeing there, after compute, keeps every block a step reads or writes alive through the step,
    also blocks another sequence hit in the same step (note_computing). A prefix hit of h tokens
    needs, in a window group, only the blocks of the window ending at h (vLLM's rule).
    """

    def __init__(self, num_blocks: int, block_size: int = 16, num_host_blocks: int = 0,
                 enable_prefix_caching: bool = True, watermark: float = 0.01,
                 kv_cache_layout: KVCacheLayout | None = None) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be a fraction in [0, 1), got {watermark!r}")
        self._set_layout(FULL_ATTENTION_LAYOUT if kv_cache_layout is None else kv_cache_layout)
        self.block_size = block_size
        # Each device block is tagged with the group whose tables it was drawn for (per-group stats).
        self.device = BlockPool(num_blocks, enable_prefix_caching, num_tags=self.num_groups)
        self.host = BlockPool(num_host_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self._refs = self.device.ref_counts  # a shortcut for the per-token path (the pool never replaces it)
        # None without prefix caching: nothing is ever a hit.
        self._prefix = PrefixMatcher(self.device.cache, block_size, self.kv_cache_layout) if enable_prefix_caching else None
        # Admission keeps this many blocks spare so running sequences can grow without preemption.
        self.watermark_blocks = int(watermark * num_blocks)
        self._queried_tokens = 0
        self._hit_tokens = 0
        self._num_cow = 0
        self._swapped_out = 0
        self._swapped_in = 0

    def _set_layout(self, layout: KVCacheLayout) -> None:
        if not isinstance(layout, KVCacheLayout) or not layout.groups:
            raise ValueError(f"kv_cache_layout must be a KVCacheLayout (kv_cache_groups.kv_cache_layout) or None,"
                             f" got {layout!r}")
        self.kv_cache_layout = layout
        self.sliding_windows = layout.sliding_windows
        self.num_groups = len(self.sliding_windows)
        self._window_groups = tuple((g, w) for g, w in enumerate(self.sliding_windows) if w is not None)
        by_window: dict[int, list[int]] = {}  # groups sharing a window free at the same positions
        for g, w in self._window_groups:
            by_window.setdefault(w, []).append(g)
        self._groups_by_window = tuple((w, tuple(gs)) for w, gs in by_window.items())

    @property
    def num_blocks(self) -> int:
        return self.device.num_blocks

    @property
    def num_host_blocks(self) -> int:
        return self.host.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.device.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        """Device blocks admission may ever fill: all but the watermark."""
        return self.device.num_blocks - self.watermark_blocks

    # -- admission -----------------------------------------------------------------------------

    def lookup_prefix(self, seq: Sequence, use_prefix_cache: bool = True) -> int:
        """Tokens of `seq` the prefix cache already holds (or this step computes: note_computing), so
        need not compute; takes nothing.

        A whole number of blocks, except on a full hit (every block of the prompt cached), where the
        last token still runs for its logits: then len - 1. use_prefix_cache=False (here and in
        can_allocate / allocate): read nothing from the cache, for a prompt that must be computed
        whole (prompt_logprobs); its blocks are still cached once full.
        """
        return num_hit_tokens(seq, len(self._match_prefix(seq, use_prefix_cache)[0]), self.block_size)

    def can_allocate(self, seq: Sequence, num_new_tokens: int | None = None, use_prefix_cache: bool = True,
                     num_external_tokens: int = 0) -> bool:
        """Whether `allocate(seq, num_new_tokens, ...)` fits and still leaves the watermark free."""
        hits, skips = self._external_hits(seq, self._match_prefix(seq, use_prefix_cache), num_external_tokens)
        num_new_blocks, num_revived = self._plan_allocation(seq, hits, num_new_tokens, skips)
        return num_new_blocks + num_revived <= self.device.num_free_blocks - self.watermark_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int | None = None, use_prefix_cache: bool = True,
                 count_hits: bool = True, num_external_tokens: int = 0) -> int:
        """Give a waiting sequence blocks for its cached prefix plus the next `num_new_tokens` tokens.

        `num_new_tokens` counts tokens past the cached prefix to compute this step (None: all the
        rest; 0, where there are hits: the cached prefix only). Only those get blocks now; later chunks and decode grow the table via append_slots.
        Sets and returns seq.num_computed_tokens, the number of prefix-cache hit tokens.
        count_hits=False: leave the prefix-cache statistics alone (a re-admission after preemption).
        num_external_tokens: [kv tier] of num_new_tokens, the first ones a KV connector loads (whole blocks
        right after the cached prefix, then, where no group has a window, possibly part of one more: a partial
        last block, loaded into the fresh block drawn here): a window group gets NULL_BLOCK, no block, where a
        loaded position is outside the window that ends at the load's end (nothing is loaded there, nothing will
        read it).
        """
        if seq.block_table or seq.swapped:
            raise ValueError(f"seq {seq.seq_id} already holds blocks; allocate is for waiting sequences")
        hits, skips = self._external_hits(seq, self._match_prefix(seq, use_prefix_cache), num_external_tokens)
        num_new_blocks, num_revived = self._plan_allocation(seq, hits, num_new_tokens, skips)
        needed = num_new_blocks + num_revived
        if needed > self.device.num_free_blocks:
            raise RuntimeError(f"cannot allocate seq {seq.seq_id}: needs {needed} blocks,"
                               f" {self.device.num_free_blocks} free")
        pool = self.device
        # Revive hits before drawing new blocks, so a draw cannot evict a block just matched.
        for table in hits:
            for block_id in table:
                if block_id != NULL_BLOCK:
                    pool.incref(block_id)
        num_hit_blocks = len(hits[0])
        per_group = self._blocks_per_group(seq, num_hit_blocks, num_new_tokens)
        length = num_hit_blocks + per_group
        seq.block_tables = [self._grow(g, table, skip, length) for g, (table, skip) in enumerate(zip(hits, skips))]
        num_cached = num_hit_tokens(seq, num_hit_blocks, self.block_size)
        seq.num_computed_tokens = num_cached
        if self.enable_prefix_caching and use_prefix_cache and count_hits:  # [kv tier] count_hits
            self._queried_tokens += len(seq.token_ids)
            self._hit_tokens += num_cached
        return num_cached

    # -- in-step hits ----------------------------------------------------------------------------

    def begin_step(self) -> None:
        """A new step is being scheduled: the last step's announced blocks are computed or forgotten."""
        if self._prefix is not None:
            self._prefix.begin_step()

    def note_computing(self, seq: Sequence, start: int, end: int) -> None:
        """This step computes tokens [start, end) of `seq` (slots already made): the full blocks they
        complete are hits for sequences admitted later in the step. Call after taking the slot
        mapping of [start, end), which must write these blocks, not skip them as hits."""
        if self._prefix is not None:
            self._prefix.note_computing(seq, start, end)

    def _match_prefix(self, seq: Sequence, use_prefix_cache: bool = True) -> list[list[int]]:
        if self._prefix is None or seq.block_table or not use_prefix_cache:
            return [[] for _ in range(self.num_groups)]
        return self._prefix.match(seq)

    def _plan_allocation(self, seq: Sequence, hits: list[list[int]], num_new_tokens: int | None,
                         skips: list[int]) -> tuple[int, int]:
        """(fresh blocks to draw, over all groups; cached hits to revive): both come out of the free count."""
        num_hit_blocks = len(hits[0])
        per_group = self._blocks_per_group(seq, num_hit_blocks, num_new_tokens)
        refs = self.device.ref_counts
        revived = sum(1 for table in hits for b in table if b != NULL_BLOCK and refs[b] == 0)
        # [kv tier] a window group draws nothing for the NULL_BLOCK entries a load skips (skips: _external_hits)
        skipped = sum(max(0, skip - num_hit_blocks) for skip in skips)
        return per_group * self.num_groups - skipped, revived

    def _blocks_per_group(self, seq: Sequence, num_hit_blocks: int, num_new_tokens: int | None) -> int:
        """Table entries each group adds past a hit of num_hit_blocks for num_new_tokens (None: all the rest)."""
        num_cached = num_hit_tokens(seq, num_hit_blocks, self.block_size)
        remaining = len(seq.token_ids) - num_cached
        if num_new_tokens is None:
            num_new_tokens = remaining
        elif not (1 if not num_hit_blocks else 0) <= num_new_tokens <= remaining:
            # 0: only the cached prefix (a beam whose last token waits for its siblings' decode step).
            raise ValueError(f"num_new_tokens must be in [{1 if not num_hit_blocks else 0}, {remaining}] for seq"
                             f" {seq.seq_id}, got {num_new_tokens}")
        # Every group grows alike: a window group writes (and this step's queries read) all the new blocks.
        return max(0, num_blocks_for(num_cached + num_new_tokens, self.block_size) - num_hit_blocks)

    def _external_hits(self, seq: Sequence, hits: list[list[int]],
                       num_external_tokens: int) -> tuple[list[list[int]], list[int]]:
        """[kv tier] (the pool's hits, each group's first logical block it holds) once num_external_tokens
        more are loaded right after the hit: a window group's entries before the window at the load's end
        are NULL_BLOCK (pool hits there are not revived; loaded positions there get no block); 0 elsewhere."""
        if not num_external_tokens:
            return hits, [0] * self.num_groups
        bs = self.block_size
        start = len(hits[0]) * bs
        # A partial last block only where no group has a window (its fresh block is then drawn like any other).
        partial_ok = not self._window_groups
        if (num_external_tokens < 0 or (num_external_tokens % bs and not partial_ok)
                or start + num_external_tokens >= len(seq.token_ids)):
            raise ValueError(f"num_external_tokens must be the tokens right after seq {seq.seq_id}'s cached prefix"
                             f" ({start} tokens), leaving its last token (whole blocks of {bs} where a KV-cache group"
                             f" has a sliding window), got {num_external_tokens}")
        end = start + num_external_tokens
        skips = [first_kept_block(end, w, bs) for w in self.sliding_windows]
        hits = [table if not skip else [NULL_BLOCK] * min(skip, len(table)) + table[skip:]
                for table, skip in zip(hits, skips)]
        return hits, skips

    def _grow(self, group: int, table: list[int], skip: int, length: int) -> list[int]:
        """`table` extended to `length` entries: NULL_BLOCK up to logical block `skip` ([kv tier] a load's
        positions outside a window), fresh blocks after."""
        nulls = max(0, min(skip, length) - len(table))
        return table + [NULL_BLOCK] * nulls + [self._draw(group) for _ in range(length - len(table) - nulls)]

    def _draw(self, group: int) -> int:
        """A fresh device block for one of `group`'s tables."""
        return self.device.allocate(group)

    # -- running sequences ---------------------------------------------------------------------

    def num_blocks_to_append(self, plan: Iterable[tuple[Sequence, int]]) -> int:
        """Blocks append_slots draws for every (seq, num_new_tokens) of `plan`, called in that order:
        table growth plus copy-on-write replacements (several writers of one shared block each copy
        it but the last, which by then holds it alone)."""
        return blocks_to_append(((table, seq.num_computed_tokens, n) for seq, n in plan for table in seq.block_tables),
                                self.device.ref_counts, self.block_size)

    def can_append_slots(self, seqs: SequenceLike, num_new_tokens: int = 1) -> bool:
        """Whether every given sequence can take `num_new_tokens` more tokens this step.

        No watermark here: the watermark is the reserve admission leaves precisely so that running
        sequences can spend it instead of being preempted.
        """
        plan = [(seq, num_new_tokens) for seq in as_seqs(seqs)]
        return self.num_blocks_to_append(plan) <= self.device.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int = 1) -> BlockMapping:
        """Make slots for tokens [num_computed_tokens, num_computed_tokens + num_new_tokens), the
        sequence's proposed tokens (spec_token_ids) counting as tokens after its last (lookahead slots:
        whatever of them is rejected stays uncomputed, and the next step overwrites its slots).

        A new block is drawn only when the last one is full. A block about to be written that other
        tables also point at is replaced by a private block first (copy-on-write); the returned
        (src, dst) pairs are for `ops.copy_blocks`, to run before this step's forward pass. Each group
        alike: the positions written are inside every window, so never a NULL_BLOCK entry.
        """
        start = seq.num_computed_tokens
        end = start + num_new_tokens
        table = seq.block_tables[0]  # not the block_table property: a call per token adds up
        # [spec decode] lookahead slots: a decode's proposed tokens (seq.spec_token_ids) get slots too.
        if num_new_tokens < 1 or end > len(seq.token_ids) + len(seq.spec_token_ids) or not table or seq.swapped:
            self._reject_append(seq, num_new_tokens)
        bs = self.block_size
        first, last = start // bs, (end - 1) // bs
        refs = self._refs
        # Decode fast path: the next slot is in the last block and nobody else points at it.
        if first == last < len(table) and refs[table[first]] == 1:
            if self.num_groups == 1:
                return []
            for t in seq.block_tables:
                if refs[t[first]] != 1:
                    break
            else:
                return []
        pool = self.device
        needed = self.num_blocks_to_append([(seq, num_new_tokens)])
        if needed > pool.num_free_blocks:
            raise RuntimeError(f"cannot append {num_new_tokens} tokens to seq {seq.seq_id}: needs"
                               f" {needed} blocks, {pool.num_free_blocks} free")
        grow = max(0, last + 1 - len(table))
        copies: BlockMapping = []
        for g, table in enumerate(seq.block_tables):
            for i in [i for i in range(first, min(len(table), last + 1)) if refs[table[i]] > 1]:
                src, dst = table[i], self._draw(g)
                pool.decref(src)
                table[i] = dst
                # Only a block already holding this sequence's tokens needs its contents copied.
                if i * bs < start:
                    copies.append((src, dst))
            for _ in range(grow):
                table.append(self._draw(g))
        self._num_cow += len(copies)
        return copies

    def _reject_append(self, seq: Sequence, num_new_tokens: int) -> None:
        if seq.swapped:
            raise ValueError(f"seq {seq.seq_id} is swapped out; swap_in before appending")
        if not seq.block_table:
            raise ValueError(f"seq {seq.seq_id} holds no blocks; allocate it first")
        raise ValueError(f"num_new_tokens={num_new_tokens} for seq {seq.seq_id}: need 1 <= num_new_tokens"
                         f" <= {len(seq.token_ids) + len(seq.spec_token_ids) - seq.num_computed_tokens}"
                         " (its uncomputed tokens and proposed tokens)")

    def mark_computed(self, seq: Sequence, num_new_tokens: int) -> None:
        """After a step ran: advance num_computed_tokens; blocks that just filled become cache hits."""
        old = seq.num_computed_tokens
        new = old + num_new_tokens
        bs = self.block_size
        if num_new_tokens < 0 or new > len(seq.token_ids) or new > len(seq.block_tables[0]) * bs or seq.swapped:
            raise ValueError(f"num_new_tokens={num_new_tokens} for seq {seq.seq_id}: it has"
                             f" {len(seq.token_ids) - old} uncomputed tokens and slots up to"
                             f" {len(seq.block_table) * bs}" + (" (swapped out)" if seq.swapped else ""))
        seq.num_computed_tokens = new
        if new // bs != old // bs and self._prefix is not None:
            for i in range(old // bs, new // bs):
                self._prefix.index_block(seq, i)
        # After indexing: a block leaving a window stays a prefix hit (parked in the LRU).
        if self._window_groups:
            self._release_windows(seq, new)

    def _release_windows(self, seq: Sequence, num_computed: int) -> None:
        """Free what left each window group's window, given the next query starts at num_computed.
        Per token: one division per distinct window and one look per group when nothing leaves."""
        tables, bs = seq.block_tables, self.block_size
        for window, groups in self._groups_by_window:
            stop = (num_computed - window + 1) // bs  # first_kept_block, inline: <= 0 before the window moves
            if stop > 0:
                for g in groups:
                    if tables[g][stop - 1] != NULL_BLOCK:
                        self._release_before(tables[g], stop)

    def _release_before(self, table: list[int], stop: int) -> None:
        """Free a window group's blocks before logical block `stop`, putting NULL_BLOCK in their place;
        earlier ones are NULL already, so this walks back only over the blocks that just left."""
        pool = self.device
        for i in range(stop - 1, -1, -1):
            block_id = table[i]
            if block_id == NULL_BLOCK:
                return
            table[i] = NULL_BLOCK
            pool.decref(block_id)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Point the child's table at the parent's blocks (parallel sampling, beam search)."""
        if child.block_table or child.swapped:
            raise ValueError(f"child seq {child.seq_id} already holds blocks")
        if parent.swapped:
            raise ValueError(f"parent seq {parent.seq_id} is swapped out; swap_in before forking")
        n = parent.num_computed_tokens
        if child.token_ids[:n] != parent.token_ids[:n] or child.extra_keys != parent.extra_keys:
            raise ValueError(f"child seq {child.seq_id} must agree with parent seq {parent.seq_id}"
                             f" on its {n} computed tokens and its extra_keys")
        for block_id in live_blocks(parent):
            self.device.incref(block_id)
        child.block_tables = [list(table) for table in parent.block_tables]
        child.num_computed_tokens = n
        child.block_hashes = parent.block_hashes[: n // self.block_size]

    def free(self, seq: Sequence) -> None:
        """Release a finished, aborted or recompute-preempted sequence's blocks (idempotent)."""
        pool = self.host if seq.swapped else self.device
        # Tail first, so the LRU reclaims a sequence's tail before the prefix others may share.
        for table in seq.block_tables:
            for block_id in reversed(table):
                if block_id != NULL_BLOCK:
                    pool.decref(block_id)
        seq.block_tables = [[] for _ in range(self.num_groups)]
        seq.num_computed_tokens = 0
        seq.swapped = False

    def blocks_indexed_this_step(self) -> list[int]:
        """[kv tier] Device blocks that became prefix-cache entries since begin_step(): once the step has run
        (update_from_output), each holds its entry's K/V, which a KV offload tier stores (write-through)."""
        return [] if self._prefix is None else self._prefix.indexed_this_step()

    def recover(self, seqs: Iterable[Sequence], dropped: Iterable[Sequence] = ()) -> None:
        """After a step failed part way: `dropped` sequences hold nothing any more (as after free, but
        without touching the pools, whose counts the failure may have torn), the blocks indexed during
        the step stop being prefix hits (a swap-in or load indexes its blocks before the step fills
        them), and both pools are rebuilt from the tables of `seqs`, every sequence still holding blocks."""
        for seq in dropped:
            seq.block_tables = [[] for _ in range(self.num_groups)]
            seq.num_computed_tokens = 0
            seq.swapped = False
        for block_id in self.blocks_indexed_this_step():
            self.device.uncache(block_id)
        self.begin_step()
        seqs = list(seqs)
        on_device = [seq for seq in seqs if not seq.swapped]
        groups = {b: g for seq in on_device for g, table in enumerate(seq.block_tables) for b in table if b != NULL_BLOCK}
        self.device.rebuild(Counter(b for seq in on_device for b in live_blocks(seq)), groups)
        self.host.rebuild(Counter(b for seq in seqs if seq.swapped for b in live_blocks(seq)))

    def slot_mapping(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Cache slot of each token position in [start, end) of `seq` (block_id * block_size + offset;
        -1 where the cache already holds that position's K/V, or another sequence writes it this step).
        Group 0's; slot_mappings gives every group's."""
        if seq.swapped:
            raise ValueError(f"seq {seq.seq_id} is swapped out; its slots are not on the device")
        return self._slots(seq.block_table, start, end)

    def slot_mappings(self, seq: Sequence, start: int, end: int) -> list[list[int]]:
        """slot_mapping for each group's table, in layout order."""
        if seq.swapped:
            raise ValueError(f"seq {seq.seq_id} is swapped out; its slots are not on the device")
        return [self._slots(table, start, end) for table in seq.block_tables]

    def _slots(self, table: list[int], start: int, end: int) -> list[int]:
        slots = slot_mapping(table, self.block_size, start, end)
        if self._prefix is None or end <= start:
            return slots
        # Only the last token of a full hit lands in a hit block: its K/V are there already (or are
        # being written by the step's other prefill), and a hit block is never written (others may be
        # reading it), so it maps to -1.
        bs = self.block_size
        is_hit = self._prefix.is_hit_block
        if is_hit(table[start // bs]):
            slots = [-1 if is_hit(table[p // bs]) else slot for p, slot in zip(range(start, end), slots)]
        return slots

    # -- swap ----------------------------------------------------------------------------------

    def can_swap_out(self, seqs: SequenceLike) -> bool:
        return num_unique_blocks(on_device(seqs)) <= self.host.num_free_blocks

    def swap_out(self, seqs: SequenceLike) -> BlockMapping:
        """Move a group's device blocks to the host pool; returns (device, host) pairs for ops.swap_blocks.

        A block shared inside the group moves once and stays shared on the host. The device copies
        keep their prefix-cache entries (as cached blocks), so a later request may still hit them.
        """
        leaving = on_device(seqs)
        if not self.can_swap_out(leaving):
            raise RuntimeError(f"cannot swap out: needs {num_unique_blocks(leaving)} host blocks,"
                               f" {self.host.num_free_blocks} free")
        mapping = move_tables(leaving, self.device, self.host, lambda seq, g, i: None)
        for seq in leaving:
            seq.swapped = True
        self._swapped_out += len(mapping)
        return mapping

    def can_swap_in(self, seqs: SequenceLike) -> bool:
        needed = num_unique_blocks(on_host(seqs))
        return needed <= self.device.num_free_blocks - self.watermark_blocks

    def swap_in(self, seqs: SequenceLike) -> BlockMapping:
        """Move a group's host blocks back; returns (host, device) pairs for ops.swap_blocks.

        A full computed block whose contents the device prefix cache still holds is reused, not copied.
        """
        returning = on_host(seqs)
        needed = num_unique_blocks(returning)
        if needed > self.device.num_free_blocks:
            raise RuntimeError(f"cannot swap in: needs {needed} device blocks, {self.device.num_free_blocks} free")
        mapping = move_tables(returning, self.host, self.device, self._device_hit)
        bs = self.block_size
        for seq in returning:
            seq.swapped = False
            if self._prefix is not None:
                for i in range(seq.num_computed_tokens // bs):
                    self._prefix.index_block(seq, i)
        self._swapped_in += len(mapping)
        return mapping

    def _device_hit(self, seq: Sequence, group: int, i: int) -> int | None:
        if self._prefix is None or i >= seq.num_computed_tokens // self.block_size:
            return None
        return self._prefix.lookup(seq, group, i)

    # -- statistics ----------------------------------------------------------------------------

    def stats(self) -> BlockManagerStats:
        device, host = self.device, self.host
        return BlockManagerStats(
            num_blocks=device.num_blocks,
            num_used_blocks=device.num_used,
            num_cached_blocks=device.num_cached_blocks,
            num_free_blocks=device.num_blocks - device.num_used - device.num_cached_blocks,
            num_host_blocks=host.num_blocks,
            num_host_used_blocks=host.num_used,
            prefix_cache_queried_tokens=self._queried_tokens,
            prefix_cache_hit_tokens=self._hit_tokens,
            num_copy_on_write=self._num_cow,
            num_swapped_out_blocks=self._swapped_out,
            num_swapped_in_blocks=self._swapped_in,
            num_used_blocks_per_group=device.num_used_per_tag,
            max_num_used_blocks=device.max_num_used,
            kv_cache_layout=self.kv_cache_layout,
        )
