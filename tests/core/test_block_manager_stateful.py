"""Random allocate / append / fork / free / swap / prefix-hit programs against a simulated KV cache.

Besides the bookkeeping invariants, the machine keeps a fake cache (one entry per slot, written
through every group's slot mapping and moved by the returned copy and swap mappings, as the kernels
would). The entry at position p is the sequence's tokens up to p: what a real K/V depends on, so two
sequences may share it exactly when a prefix hit or a fork lets them. After every step, every
position of every sequence that any group can still read must be in a live block of that group
holding that entry: that catches a missed copy-on-write, a wrong swap mapping, a false prefix hit,
and a window group freeing (or letting another sequence overwrite) a block its window still reads,
not just a miscounted ref count. Layouts: the default one full group, and hybrid ones (kv_cache_groups)
with one or two windows, with and without a full group.
"""
import os

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpage.core import NULL_BLOCK, BlockManager, Sequence, check_block_manager, kv_cache_layout

_PROFILE = os.environ.get("KVPAGE_HYPOTHESIS_PROFILE", "ci")
_EXAMPLES, _STEPS = {"ci": (60, 40), "deep": (2000, 100)}.get(_PROFILE, (60, 40))

# Few, short, overlapping prompts over a tiny vocabulary: prefix hits and shared blocks are common.
PREFIXES = ([1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3], [1, 2, 3, 1, 0, 0, 0, 0, 2, 2], [3, 3, 3, 3, 3, 3, 3, 3])
VOCAB = st.integers(0, 3)
LAYOUTS = (None, kv_cache_layout([None, 3, 3, None]), kv_cache_layout([None, 2, 5]), kv_cache_layout([4, 4]),
           kv_cache_layout([1, None]), kv_cache_layout([1]), kv_cache_layout([None, None, 3]))


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize(block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(4, 40),
                num_host_blocks=st.integers(0, 24), prefix_caching=st.booleans(), layout=st.sampled_from(LAYOUTS))
    def setup(self, block_size, num_blocks, num_host_blocks, prefix_caching, layout):
        self.bm = BlockManager(num_blocks, block_size, num_host_blocks, prefix_caching, watermark=0.05,
                               kv_cache_layout=layout)
        self.groups: list[list[Sequence]] = []
        self.history: list[list[int]] = []
        self.device_kv: dict[int, list] = {}
        self.host_kv: dict[int, list] = {}
        self.next_id = 0

    # -- helpers -------------------------------------------------------------------------------

    def _kv(self, seq):
        return self.host_kv if seq.swapped else self.device_kv

    def _run(self, seq, num_new_tokens):
        """What a forward pass does: write this step's tokens through the slot mapping."""
        start = seq.num_computed_tokens
        bs = self.bm.block_size
        for slots in self.bm.slot_mappings(seq, start, start + num_new_tokens):
            for pos, slot in zip(range(start, start + num_new_tokens), slots):
                if slot < 0:  # already cached (a full hit's last token): the invariant checks it is there
                    continue
                self.device_kv.setdefault(slot // bs, [None] * bs)[slot % bs] = tuple(seq.token_ids[:pos + 1])
        self.bm.mark_computed(seq, num_new_tokens)

    @staticmethod
    def _copy(src_kv, dst_kv, mapping):
        for src, dst in mapping:
            dst_kv[dst] = list(src_kv[src])

    def _seqs(self):
        return [seq for group in self.groups for seq in group]

    def _on_device(self):
        return [seq for seq in self._seqs() if not seq.swapped]

    def _groups(self, swapped):
        return [group for group in self.groups if group[0].swapped == swapped]

    def _admit(self, tokens, chunk):
        seq = Sequence(self.next_id, tokens)
        self.next_id += 1
        hit = self.bm.lookup_prefix(seq)
        # Whole blocks, or on a full hit all but the last token, which must run for its logits.
        assert hit < len(tokens) and (hit % self.bm.block_size == 0 or hit == len(tokens) - 1)
        num_new = min(chunk, len(tokens) - hit)
        if not self.bm.can_allocate(seq, num_new):
            return
        assert self.bm.allocate(seq, num_new) == hit == seq.num_computed_tokens
        self._run(seq, num_new)
        self.groups.append([seq])
        self.history.append(list(tokens))

    # -- rules ---------------------------------------------------------------------------------

    @rule(prefix=st.sampled_from(PREFIXES), cut=st.integers(0, 12), suffix=st.lists(VOCAB, max_size=6),
          chunk=st.integers(1, 20))
    def new_request(self, prefix, cut, suffix, chunk):
        tokens = prefix[:cut] + suffix
        if tokens:
            self._admit(tokens, chunk)

    @precondition(lambda self: self.history)
    @rule(data=st.data(), extra=st.lists(VOCAB, max_size=3), chunk=st.integers(1, 20))
    def prefix_hit(self, data, extra, chunk):
        """Resubmit an earlier request's tokens (a recompute preemption or a repeated prompt)."""
        self._admit(data.draw(st.sampled_from(self.history)) + extra, chunk)

    @precondition(lambda self: self._on_device())
    @rule(data=st.data(), n=st.integers(1, 6), token=VOCAB)
    def step(self, data, n, token):
        seq = data.draw(st.sampled_from(self._on_device()))
        if seq.num_computed_tokens == len(seq.token_ids):
            seq.append_token(token)  # decode: the sampled token is computed next step
        n = min(n, len(seq.token_ids) - seq.num_computed_tokens)
        if not self.bm.can_append_slots(seq, n):
            return
        self._copy(self.device_kv, self.device_kv, self.bm.append_slots(seq, n))
        self._run(seq, n)

    @precondition(lambda self: self._groups(swapped=False))
    @rule(data=st.data())
    def fork(self, data):
        group = data.draw(st.sampled_from(self._groups(swapped=False)))
        parent = data.draw(st.sampled_from(group))
        if len(group) >= 4:
            return
        child = parent.fork(self.next_id)
        self.next_id += 1
        self.bm.fork(parent, child)
        group.append(child)

    @precondition(lambda self: self._groups(swapped=False))
    @rule(data=st.data(), tokens=st.tuples(VOCAB, VOCAB))
    def fork_and_decode_both(self, data, tokens):
        """n > 1 and beam search: a child forked from a computed parent, and both decode in one step,
        each into the partly filled block they share: copy-on-write in every group."""
        group = data.draw(st.sampled_from(self._groups(swapped=False)))
        parent = data.draw(st.sampled_from(group))
        if len(group) >= 4 or parent.num_computed_tokens < len(parent.token_ids):
            return
        child = parent.fork(self.next_id)
        self.next_id += 1
        self.bm.fork(parent, child)
        group.append(child)
        pair = [parent, child]
        for seq, token in zip(pair, tokens):
            seq.append_token(token)
        if not self.bm.can_append_slots(pair, 1):
            return
        for seq in pair:  # the step's appends, then its forward pass
            self._copy(self.device_kv, self.device_kv, self.bm.append_slots(seq, 1))
        for seq in pair:
            self._run(seq, 1)

    @precondition(lambda self: self.groups)
    @rule(data=st.data())
    def free(self, data):
        group = data.draw(st.sampled_from(self.groups))
        seq = data.draw(st.sampled_from(group))
        self.bm.free(seq)
        assert not seq.block_table and seq.num_computed_tokens == 0
        group.remove(seq)
        if not group:
            self.groups.remove(group)

    @precondition(lambda self: self._groups(swapped=False))
    @rule(data=st.data())
    def swap_out(self, data):
        group = data.draw(st.sampled_from(self._groups(swapped=False)))
        if not self.bm.can_swap_out(group):
            return
        distinct = {b for seq in group for t in seq.block_tables for b in t if b != NULL_BLOCK}
        mapping = self.bm.swap_out(group)
        assert sorted(src for src, _ in mapping) == sorted(distinct)  # each shared block moves once
        self._copy(self.device_kv, self.host_kv, mapping)

    @precondition(lambda self: self._groups(swapped=True))
    @rule(data=st.data())
    def swap_in(self, data):
        group = data.draw(st.sampled_from(self._groups(swapped=True)))
        if not self.bm.can_swap_in(group):
            return
        self._copy(self.host_kv, self.device_kv, self.bm.swap_in(group))
        assert not any(seq.swapped for seq in group)

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def bookkeeping_is_consistent(self):
        if hasattr(self, "bm"):
            check_block_manager(self.bm, self._seqs())

    @invariant()
    def every_readable_position_is_in_a_live_block_of_its_own(self):
        """Each group's table holds every computed position a future query (at num_computed_tokens or
        later) can read: all of them for a full group, those past c - W for a window of W."""
        if not hasattr(self, "bm"):
            return
        bs = self.bm.block_size
        for seq in self._seqs():
            kv = self._kv(seq)
            refs = (self.bm.host if seq.swapped else self.bm.device).ref_counts
            c = seq.num_computed_tokens
            for g, (table, window) in enumerate(zip(seq.block_tables, self.bm.sliding_windows)):
                first = 0 if window is None else max(0, c - window + 1)
                for pos in range(first, c):
                    block_id = table[pos // bs]
                    assert block_id != NULL_BLOCK and refs[block_id] > 0, \
                        f"seq {seq.seq_id} group {g}: position {pos} (window {window}) is in no live block"
                    block = kv.get(block_id)
                    assert block is not None and block[pos % bs] == tuple(seq.token_ids[:pos + 1]), \
                        f"seq {seq.seq_id} group {g}: position {pos} does not hold its K/V"

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for seq in self._seqs():
            self.bm.free(seq)
        check_block_manager(self.bm, [])
        stats = self.bm.stats()
        assert stats.num_used_blocks == 0 and stats.num_host_used_blocks == 0
        assert stats.num_free_blocks + stats.num_cached_blocks == stats.num_blocks


BlockManagerMachine.TestCase.settings = settings(max_examples=_EXAMPLES, stateful_step_count=_STEPS,
                                                 deadline=None)
TestBlockManagerMachine = BlockManagerMachine.TestCase
