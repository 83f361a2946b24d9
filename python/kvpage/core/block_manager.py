"""The block manager: block tables over a shared device pool, copy-on-write, prefix caching, swap."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable

from . import hashing
from .block_moves import BlockMapping, move_tables, num_unique_blocks, on_device, on_host
from .block_pool import BlockPool
from .block_table import blocks_to_append, num_blocks_for, slot_mapping
from .hashing import ROOT_HASH
from .prefix_cache import BlockKey
from .sequence import Sequence, SequenceLike, as_seqs


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

    In-step hits (vLLM v1's rule): `note_computing` announces the full blocks a step's prefill is
    about to fill, and a sequence admitted later in the same step hits them too. That is sound
    because each layer of the forward pass writes every scheduled token's K/V before any token
    attends. `begin_step` forgets the announcements; `in_step_readers` says who relied on them.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, num_host_blocks: int = 0,
                 enable_prefix_caching: bool = True, watermark: float = 0.01) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be a fraction in [0, 1), got {watermark!r}")
        self.block_size = block_size
        self.device = BlockPool(num_blocks, enable_prefix_caching)
        self.host = BlockPool(num_host_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        # Shortcuts for the per-token path (the pool never replaces these objects).
        self._refs = self.device.ref_counts
        self._cache = self.device.cache
        # Admission keeps this many blocks spare so running sequences can grow without preemption.
        self.watermark_blocks = int(watermark * num_blocks)
        # This step's announced blocks: hash -> (block, key), and who hit them (see note_computing).
        self._computing: dict[bytes, tuple[int, BlockKey]] = {}
        self._computing_blocks: set[int] = set()
        self._in_step_readers: set[int] = set()
        self._indexed_this_step: list[int] = []  # what undo_step_indexing takes back
        self._queried_tokens = 0
        self._hit_tokens = 0
        self._num_cow = 0
        self._swapped_out = 0
        self._swapped_in = 0

    @property
    def num_free_blocks(self) -> int:
        return self.device.num_free_blocks

    # -- admission -----------------------------------------------------------------------------

    def lookup_prefix(self, seq: Sequence, use_prefix_cache: bool = True) -> int:
        """Tokens of `seq` the prefix cache already holds (or this step computes: note_computing), so
        need not compute; takes nothing.

        A whole number of blocks, except on a full hit (every block of the prompt cached), where the
        last token still runs for its logits: then len - 1. use_prefix_cache=False (here and in
        can_allocate / allocate): read nothing from the cache, for a prompt that must be computed
        whole (prompt_logprobs); its blocks are still cached once full.
        """
        return self._num_hit_tokens(seq, self._match_prefix(seq, use_prefix_cache))

    def can_allocate(self, seq: Sequence, num_new_tokens: int | None = None, use_prefix_cache: bool = True) -> bool:
        """Whether `allocate(seq, num_new_tokens)` fits and still leaves the watermark free."""
        hits = self._match_prefix(seq, use_prefix_cache)
        num_new_blocks, num_revived = self._plan_allocation(seq, hits, num_new_tokens)
        return num_new_blocks + num_revived <= self.device.num_free_blocks - self.watermark_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int | None = None, use_prefix_cache: bool = True) -> int:
        """Give a waiting sequence blocks for its cached prefix plus the next `num_new_tokens` tokens.

        `num_new_tokens` counts tokens past the cached prefix to compute this step (None: all the
        rest; 0, where there are hits: the cached prefix only). Only those get blocks now; later chunks and decode grow the table via append_slots.
        Sets and returns seq.num_computed_tokens, the number of prefix-cache hit tokens.
        """
        if seq.block_table or seq.swapped:
            raise ValueError(f"seq {seq.seq_id} already holds blocks; allocate is for waiting sequences")
        hits = self._match_prefix(seq, use_prefix_cache)
        num_new_blocks, num_revived = self._plan_allocation(seq, hits, num_new_tokens)
        needed = num_new_blocks + num_revived
        if needed > self.device.num_free_blocks:
            raise RuntimeError(f"cannot allocate seq {seq.seq_id}: needs {needed} blocks,"
                               f" {self.device.num_free_blocks} free")
        pool = self.device
        # Revive hits before drawing new blocks, so a draw cannot evict a block just matched.
        for block_id in hits:
            pool.incref(block_id)
        seq.block_table = hits + [pool.allocate() for _ in range(num_new_blocks)]
        if self._computing_blocks and not self._computing_blocks.isdisjoint(hits):
            self._in_step_readers.add(seq.seq_id)
        num_cached = self._num_hit_tokens(seq, hits)
        seq.num_computed_tokens = num_cached
        if self.enable_prefix_caching and use_prefix_cache:
            self._queried_tokens += len(seq.token_ids)
            self._hit_tokens += num_cached
        return num_cached

    # -- in-step hits ----------------------------------------------------------------------------

    def begin_step(self) -> None:
        """A new step is being scheduled: the last step's announced blocks are computed or forgotten."""
        self._computing.clear()
        self._computing_blocks.clear()
        self._in_step_readers.clear()
        self._indexed_this_step.clear()

    def note_computing(self, seq: Sequence, start: int, end: int) -> None:
        """This step computes tokens [start, end) of `seq` (slots already made): the full blocks they
        complete are hits for sequences admitted later in the step. Call after taking the slot
        mapping of [start, end), which must write these blocks, not skip them as hits."""
        if self._cache is None:
            return
        for i in range(start // self.block_size, end // self.block_size):
            block_hash = self._block_hash(seq, i)
            if block_hash not in self._computing and self._cache.get(block_hash) is None:
                block_id = seq.block_table[i]
                self._computing[block_hash] = (block_id, self._block_key(seq, i))
                self._computing_blocks.add(block_id)

    def in_step_readers(self) -> set[int]:
        """Sequences admitted this step with hits on blocks the step itself computes: if the step
        fails, what they hit was never written."""
        return set(self._in_step_readers)

    def _match_prefix(self, seq: Sequence, use_prefix_cache: bool = True) -> list[int]:
        cache = self._cache
        if cache is None or seq.block_table or not use_prefix_cache:
            return []
        hits: list[int] = []
        for i in range(len(seq.token_ids) // self.block_size):
            block_id = self._lookup(seq, i)
            if block_id is None and self._computing:
                block_id = self._lookup_computing(seq, i)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _num_hit_tokens(self, seq: Sequence, hits: list[int]) -> int:
        # A full hit still recomputes the last token, for its logits (vLLM instead gives up the whole
        # last block); slot_mapping keeps that token off the cached block it already sits in.
        return min(len(hits) * self.block_size, len(seq.token_ids) - 1)

    def _plan_allocation(self, seq: Sequence, hits: list[int], num_new_tokens: int | None) -> tuple[int, int]:
        """(fresh blocks to draw, cached hits to revive): both come out of the free count."""
        num_cached = self._num_hit_tokens(seq, hits)
        remaining = len(seq.token_ids) - num_cached
        if num_new_tokens is None:
            num_new_tokens = remaining
        elif not (1 if not hits else 0) <= num_new_tokens <= remaining:
            # 0: only the cached prefix (a beam whose last token waits for its siblings' decode step).
            raise ValueError(f"num_new_tokens must be in [{1 if not hits else 0}, {remaining}] for seq"
                             f" {seq.seq_id}, got {num_new_tokens}")
        new_blocks = num_blocks_for(num_cached + num_new_tokens, self.block_size) - len(hits)
        refs = self.device.ref_counts
        return new_blocks, sum(1 for b in hits if refs[b] == 0)

    # -- running sequences ---------------------------------------------------------------------

    def num_blocks_to_append(self, plan: Iterable[tuple[Sequence, int]]) -> int:
        """Blocks append_slots draws for every (seq, num_new_tokens) of `plan`, called in that order:
        table growth plus copy-on-write replacements (several writers of one shared block each copy
        it but the last, which by then holds it alone)."""
        return blocks_to_append(((seq.block_table, seq.num_computed_tokens, n) for seq, n in plan),
                                self.device.ref_counts, self.block_size)

    def can_append_slots(self, seqs: SequenceLike, num_new_tokens: int = 1) -> bool:
        """Whether every given sequence can take `num_new_tokens` more tokens this step.

        No watermark here: the watermark is the reserve admission leaves precisely so that running
        sequences can spend it instead of being preempted.
        """
        plan = [(seq, num_new_tokens) for seq in as_seqs(seqs)]
        return self.num_blocks_to_append(plan) <= self.device.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int = 1) -> BlockMapping:
        """Make slots for tokens [num_computed_tokens, num_computed_tokens + num_new_tokens).

        A new block is drawn only when the last one is full. A block about to be written that other
        tables also point at is replaced by a private block first (copy-on-write); the returned
        (src, dst) pairs are for `ops.copy_blocks`, to run before this step's forward pass.
        """
        start = seq.num_computed_tokens
        end = start + num_new_tokens
        table = seq.block_table
        if num_new_tokens < 1 or end > len(seq.token_ids) or not table or seq.swapped:
            self._reject_append(seq, num_new_tokens)
        bs = self.block_size
        first, last = start // bs, (end - 1) // bs
        refs = self._refs
        # Decode fast path: the next slot is in the last block and nobody else points at it.
        if first == last < len(table) and refs[table[first]] == 1:
            return []
        pool = self.device
        needed = self.num_blocks_to_append([(seq, num_new_tokens)])
        if needed > pool.num_free_blocks:
            raise RuntimeError(f"cannot append {num_new_tokens} tokens to seq {seq.seq_id}: needs"
                               f" {needed} blocks, {pool.num_free_blocks} free")
        shared = [i for i in range(first, min(len(table), last + 1)) if refs[table[i]] > 1]
        grow = max(0, last + 1 - len(table))
        copies: BlockMapping = []
        for i in shared:
            src, dst = table[i], pool.allocate()
            pool.decref(src)
            table[i] = dst
            # Only a block already holding this sequence's tokens needs its contents copied.
            if i * bs < start:
                copies.append((src, dst))
        self._num_cow += len(copies)
        for _ in range(grow):
            table.append(pool.allocate())
        return copies

    def _reject_append(self, seq: Sequence, num_new_tokens: int) -> None:
        if seq.swapped:
            raise ValueError(f"seq {seq.seq_id} is swapped out; swap_in before appending")
        if not seq.block_table:
            raise ValueError(f"seq {seq.seq_id} holds no blocks; allocate it first")
        raise ValueError(f"num_new_tokens={num_new_tokens} for seq {seq.seq_id}: need 1 <= num_new_tokens"
                         f" <= {len(seq.token_ids) - seq.num_computed_tokens} (its uncomputed tokens)")

    def mark_computed(self, seq: Sequence, num_new_tokens: int) -> None:
        """After a step ran: advance num_computed_tokens; blocks that just filled become cache hits."""
        old = seq.num_computed_tokens
        new = old + num_new_tokens
        bs = self.block_size
        if num_new_tokens < 0 or new > len(seq.token_ids) or new > len(seq.block_table) * bs or seq.swapped:
            raise ValueError(f"num_new_tokens={num_new_tokens} for seq {seq.seq_id}: it has"
                             f" {len(seq.token_ids) - old} uncomputed tokens and slots up to"
                             f" {len(seq.block_table) * bs}" + (" (swapped out)" if seq.swapped else ""))
        seq.num_computed_tokens = new
        if new // bs != old // bs and self._cache is not None:
            for i in range(old // bs, new // bs):
                self._cache_block(seq, i)

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
        for block_id in parent.block_table:
            self.device.incref(block_id)
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = n
        child.block_hashes = parent.block_hashes[: n // self.block_size]

    def free(self, seq: Sequence) -> None:
        """Release a finished, aborted or recompute-preempted sequence's blocks (idempotent)."""
        pool = self.host if seq.swapped else self.device
        # Tail first, so the LRU reclaims a sequence's tail before the prefix others may share.
        for block_id in reversed(seq.block_table):
            pool.decref(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.swapped = False

    def counters(self) -> tuple[int, ...]:
        """The statistics counters, for a step that may have to be taken back (restore_counters)."""
        return self._queried_tokens, self._hit_tokens, self._num_cow, self._swapped_out, self._swapped_in

    def restore_counters(self, counters: tuple[int, ...]) -> None:
        self._queried_tokens, self._hit_tokens, self._num_cow, self._swapped_out, self._swapped_in = counters

    def undo_step_indexing(self) -> None:
        """Take back the prefix-cache entries made since begin_step(): a swap-in indexes its device
        blocks before the step copies anything into them, so a step taken back leaves them empty."""
        self.forget_contents(self._indexed_this_step)
        self._indexed_this_step.clear()

    def rebuild_accounting(self, seqs) -> None:
        """Make both pools agree with the block tables of `seqs` (every sequence holding blocks): the
        tables are the truth, ref counts and free lists are derived from them."""
        seqs = list(seqs)
        self.device.rebuild(Counter(b for seq in seqs if not seq.swapped for b in seq.block_table))
        self.host.rebuild(Counter(b for seq in seqs if seq.swapped for b in seq.block_table))

    def forget_contents(self, block_ids) -> None:
        """Device blocks a failed step was to fill by swap-in or copy may hold anything: never a prefix hit."""
        for block_id in block_ids:
            self.device.uncache(block_id)

    def slot_mapping(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Cache slot of each token position in [start, end) of `seq` (block_id * block_size + offset;
        -1 where the cache already holds that position's K/V, or another sequence writes it this step)."""
        if seq.swapped:
            raise ValueError(f"seq {seq.seq_id} is swapped out; its slots are not on the device")
        slots = slot_mapping(seq.block_table, self.block_size, start, end)
        if self._cache is None or end <= start:
            return slots
        # Only the last token of a full hit lands in a hit block: its K/V are there already (or are
        # being written by the step's other prefill), and a hit block is never written (others may be
        # reading it), so it maps to -1.
        table, bs = seq.block_table, self.block_size
        if self._is_hit_block(table[start // bs]):
            slots = [-1 if self._is_hit_block(table[p // bs]) else slot for p, slot in zip(range(start, end), slots)]
        return slots

    def _is_hit_block(self, block_id: int) -> bool:
        return self._cache.contains_block(block_id) or block_id in self._computing_blocks

    # -- prefix cache --------------------------------------------------------------------------

    def _block_key(self, seq: Sequence, i: int) -> BlockKey:
        """What full logical block i's hash commits to: its parent's hash, its tokens, extra keys."""
        parent = self._block_hash(seq, i - 1) if i else ROOT_HASH
        bs = self.block_size
        return BlockKey(parent, hashing.pack_tokens(seq.token_ids[i * bs:(i + 1) * bs]), seq.extra_keys)

    def _block_hash(self, seq: Sequence, i: int) -> bytes:
        """Hash of full logical block i, extending the sequence's memoised chain as needed."""
        hashes = seq.block_hashes
        while len(hashes) <= i:
            hashes.append(self._block_key(seq, len(hashes)).digest())
        return hashes[i]

    def _lookup(self, seq: Sequence, i: int) -> int | None:
        """The cached block holding exactly seq's logical block i, if any."""
        cache = self._cache
        block_id = cache.get(self._block_hash(seq, i))
        # Confirm the contents: a hash collision must never hand out someone else's KV.
        if block_id is None or cache.key_of(block_id) != self._block_key(seq, i):
            return None
        return block_id

    def _lookup_computing(self, seq: Sequence, i: int) -> int | None:
        """The block this step computes as exactly seq's logical block i, if any (see note_computing)."""
        entry = self._computing.get(self._block_hash(seq, i))
        if entry is None or entry[1] != self._block_key(seq, i):
            return None
        return entry[0]

    def _cache_block(self, seq: Sequence, i: int) -> None:
        cache = self._cache
        block_id = seq.block_table[i]
        # Already indexed: a prefix hit, or a block this sequence shares with its fork parent.
        if cache.contains_block(block_id):
            return
        key = self._block_key(seq, i)
        hashes = seq.block_hashes
        if len(hashes) == i:  # the usual case, a block that just filled: pack and hash it once
            hashes.append(key.digest())
        if cache.insert(block_id, hashes[i], key):
            self._indexed_this_step.append(block_id)

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
        mapping = move_tables(leaving, self.device, self.host, lambda seq, i: None)
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
            if self._cache is not None:
                for i in range(seq.num_computed_tokens // bs):
                    self._cache_block(seq, i)
        self._swapped_in += len(mapping)
        return mapping

    def _device_hit(self, seq: Sequence, i: int) -> int | None:
        if self._cache is None or i >= seq.num_computed_tokens // self.block_size:
            return None
        return self._lookup(seq, i)

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
        )
