"""The hybrid block manager (one table per KV-cache group, window groups freeing what left the window)
against brute-force models written from the definitions, not from the manager's arithmetic:
a block of a window-W group is needed iff one of its positions p can still be read by a future query
q >= c (the next query's position), i.e. p > c - W."""
import pytest
from hypothesis import given, settings, strategies as st

from kvpage.core import (NULL_BLOCK, BlockManager, InvariantError, KVCacheGroup, KVCacheLayout, ScheduledSequence,
                         Sequence, check_block_manager, kv_cache_layout, num_blocks_for, num_blocks_per_group, num_blocks_per_seq)
from kvpage.core.hashing import group_key

FULL_AND_WINDOW = kv_cache_layout([None, 6, 6, None, 6, 6])  # groups: full, W=6, W=6 (two layers each)
TWO_WINDOWS = kv_cache_layout([None, 3, 9])  # groups: full, W=3, W=9


def needed_blocks(num_computed: int, num_table_blocks: int, window, block_size: int) -> list[bool]:
    """Brute force: which logical blocks some future query (position >= num_computed) can still read."""
    if window is None:
        return [True] * num_table_blocks
    return [any(p > num_computed - window for p in range(i * block_size, (i + 1) * block_size))
            for i in range(num_table_blocks)]


def assert_tables_hold_exactly_the_window(bm: BlockManager, seq: Sequence) -> None:
    for g, (table, window) in enumerate(zip(seq.block_tables, bm.sliding_windows)):
        expected = needed_blocks(seq.num_computed_tokens, len(table), window, bm.block_size)
        assert [b != NULL_BLOCK for b in table] == expected, f"group {g}: {table}"


def grow(bm: BlockManager, seq: Sequence, chunks: list[int], on_step=None) -> None:
    """Allocate with the first chunk, then append and compute each later one (decode past the prompt)."""
    for k, n in enumerate(chunks):
        while seq.num_computed_tokens + n > len(seq.token_ids):
            seq.append_token(len(seq.token_ids) % 7)
        if k == 0:
            bm.allocate(seq, n)
        else:
            bm.append_slots(seq, n)
        if on_step is not None:
            on_step(seq)  # the step's peak: its blocks are all there, none freed yet
        bm.mark_computed(seq, n)
        assert_tables_hold_exactly_the_window(bm, seq)
        check_block_manager(bm, [seq])


@pytest.mark.parametrize("layout", [FULL_AND_WINDOW, TWO_WINDOWS, kv_cache_layout([5, 5])])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_window_groups_keep_exactly_the_window_and_free_the_rest(layout, block_size):
    bm = BlockManager(400, block_size, enable_prefix_caching=False, kv_cache_layout=layout)
    seq = Sequence(0, list(range(30)))
    grow(bm, seq, [7, 11, 12] + [1] * 40)
    used = sum(sum(needed_blocks(seq.num_computed_tokens, len(t), w, block_size))
               for t, w in zip(seq.block_tables, bm.sliding_windows))
    assert bm.num_free_blocks == 400 - used
    stats = bm.stats()
    assert stats.num_used_blocks_per_group == tuple(sum(b != NULL_BLOCK for b in t) for t in seq.block_tables)
    bm.free(seq)
    check_block_manager(bm, [])
    assert bm.num_free_blocks == 400


@pytest.mark.parametrize("layout", [FULL_AND_WINDOW, TWO_WINDOWS])
@pytest.mark.parametrize("block_size,chunk", [(1, 1), (4, 1), (4, 5), (16, 1), (16, 40)])
def test_num_blocks_per_group_is_the_peak_of_a_growing_sequence(layout, block_size, chunk):
    """The planning formula against the peak a sequence actually reaches (decode from one token passes
    every alignment, so the decode bound is met exactly)."""
    num_tokens = 120
    bm = BlockManager(1000, block_size, enable_prefix_caching=False, kv_cache_layout=layout)
    peak = [0] * bm.num_groups

    def record(seq):
        for g, table in enumerate(seq.block_tables):
            peak[g] = max(peak[g], sum(b != NULL_BLOCK for b in table))

    chunks = [chunk] * ((num_tokens - 40) // chunk) + [1] * 40
    grow(bm, Sequence(0, [1] * chunk), chunks[:num_tokens], record)
    bound = num_blocks_per_group(layout, num_tokens, block_size, max_step_tokens=chunk)
    assert all(p <= b for p, b in zip(peak, bound))
    if chunk == 1:
        assert tuple(peak) == bound
    assert num_blocks_per_seq(layout, num_tokens, block_size, chunk) == sum(bound)


def test_num_blocks_per_seq_of_a_full_layout_is_the_whole_sequence():
    layout = kv_cache_layout([None] * 4)
    for n in (0, 1, 15, 16, 17, 1000):
        assert num_blocks_per_seq(layout, n, 16) == num_blocks_for(n, 16)
    # A Gemma-3-like pattern (5 window layers of 1024 per full layer) at 16k tokens: about a quarter.
    gemma = kv_cache_layout(([1024] * 5 + [None]) * 6)
    assert num_blocks_per_seq(gemma, 16384, 16) * 4 <= 6 * num_blocks_for(16384, 16)
    with pytest.raises(ValueError, match="max_step_tokens"):
        num_blocks_per_seq(gemma, 10, 16, max_step_tokens=0)


def test_the_default_layout_is_one_full_group():
    bm = BlockManager(10, 4)
    assert bm.num_groups == 1 and bm.sliding_windows == (None,)
    seq = Sequence(0, list(range(6)))
    bm.allocate(seq)
    assert seq.block_tables == [seq.block_table] == [[0, 1]]
    assert bm.slot_mappings(seq, 0, 6) == [bm.slot_mapping(seq, 0, 6)]
    assert bm.stats().num_used_blocks_per_group == (2,)
    manual = ScheduledSequence("r", 0, 0, 6, seq.token_ids, [0, 1], list(range(6)), True, True, 1)
    assert manual.block_tables == [[0, 1]] and manual.slot_mappings == [list(range(6))]


def test_a_layout_that_is_not_one_is_refused_by_name():
    with pytest.raises(ValueError, match="kv_cache_layout"):
        BlockManager(10, 4, kv_cache_layout=[None, 4])


def test_admission_counts_every_group():
    bm = BlockManager(8, 4, watermark=0.0, kv_cache_layout=TWO_WINDOWS)
    seq = Sequence(0, list(range(10)))  # 3 blocks in each of 3 groups: 9 > 8
    assert not bm.can_allocate(seq)
    assert bm.can_allocate(seq, 8)  # 2 blocks each
    bm.allocate(seq, 8)
    assert bm.num_free_blocks == 2
    bm.mark_computed(seq, 8)  # the W=3 group's block 0 has left its window: freed
    assert bm.num_free_blocks == 3 and seq.block_tables[1][0] == NULL_BLOCK
    assert bm.num_blocks_to_append([(seq, 2)]) == 3  # the third block, in each group
    assert bm.can_append_slots(seq, 2)
    bm.append_slots(seq, 2)
    assert not bm.can_allocate(Sequence(1, [1]))


def test_fork_and_copy_on_write_per_group(prefill, fork):
    bm = BlockManager(40, 4, kv_cache_layout=FULL_AND_WINDOW)
    parent = prefill(bm, 0, list(range(14)))  # block 3 half full in every group
    child = fork(bm, parent, 1)
    assert child.block_tables == parent.block_tables
    before = [list(t) for t in parent.block_tables]
    parent.append_token(99)
    copies = bm.append_slots(parent, 1)
    # The shared last block is copied in each group; the child keeps the originals.
    assert sorted(src for src, _ in copies) == sorted(t[3] for t in before)
    assert child.block_tables == before
    assert all(t[3] != b[3] for t, b in zip(parent.block_tables, before))
    bm.mark_computed(parent, 1)
    check_block_manager(bm, [parent, child])
    bm.free(parent)
    bm.free(child)
    check_block_manager(bm, [])


def test_swap_moves_live_blocks_and_keeps_null_entries(prefill):
    bm = BlockManager(40, 4, num_host_blocks=40, kv_cache_layout=FULL_AND_WINDOW)
    seq = prefill(bm, 0, list(range(22)))
    nulls = [[b == NULL_BLOCK for b in t] for t in seq.block_tables]
    live = sum(b != NULL_BLOCK for t in seq.block_tables for b in t)
    assert any(any(n) for n in nulls)
    out = bm.swap_out(seq)
    assert len(out) == live and bm.stats().num_host_used_blocks == live
    assert [[b == NULL_BLOCK for b in t] for t in seq.block_tables] == nulls
    check_block_manager(bm, [seq])
    back = bm.swap_in(seq)
    assert len(back) <= live  # blocks the device cache still holds come back without a copy
    assert [[b == NULL_BLOCK for b in t] for t in seq.block_tables] == nulls
    check_block_manager(bm, [seq])
    seq.append_token(5)
    bm.append_slots(seq, 1)
    bm.mark_computed(seq, 1)
    assert_tables_hold_exactly_the_window(bm, seq)


def test_cache_entries_are_per_group(prefill):
    bm = BlockManager(40, 4, kv_cache_layout=TWO_WINDOWS)
    seq = prefill(bm, 0, list(range(9)))  # blocks 0, 1 full
    cache = bm.device.cache
    for g, table in enumerate(seq.block_tables):
        for i in range(2):
            if table[i] != NULL_BLOCK:
                assert cache.get(group_key(seq.block_hashes[i], g)) == table[i]
                assert cache.key_of(table[i]).group == g


def expected_hit_blocks(cached: set, layout, num_tokens: int, block_size: int) -> int:
    """Brute force over every candidate: the longest hit every group can supply (vLLM's rule)."""
    for h in range(num_tokens // block_size, 0, -1):
        q = min(h * block_size, num_tokens - 1)  # where the first computed query starts
        if all((g, i) in cached for g, w in enumerate(layout.sliding_windows) for i in range(h)
               if needed_blocks(q, h, w, block_size)[i]):
            return h
    return 0


@settings(max_examples=80, deadline=None)
@given(layout=st.sampled_from([FULL_AND_WINDOW, TWO_WINDOWS, kv_cache_layout([3, 7]), kv_cache_layout([None, None, 5]),
                               KVCacheLayout((KVCacheGroup(None, (0,)), KVCacheGroup(None, (1,))), 1)]),
       block_size=st.sampled_from([1, 2, 4]), num_tokens=st.integers(2, 30), data=st.data())
def test_prefix_hit_is_the_longest_every_group_supplies(layout, block_size, num_tokens, data):
    bm = BlockManager(200, block_size, kv_cache_layout=layout)
    tokens = list(range(num_tokens))
    a = Sequence(0, tokens)
    bm.allocate(a)
    # Every full block gets indexed as A computes; those that leave a window are freed but stay
    # indexed (parked), then A ends: all of them are hits until some entries go (the holes).
    cached = {(g, i): b for g, t in enumerate(a.block_tables) for i, b in enumerate(t[:num_tokens // block_size])}
    bm.mark_computed(a, num_tokens)
    bm.free(a)
    holes = data.draw(st.sets(st.sampled_from(sorted(cached)), max_size=len(cached)) if cached else st.just(set()))
    for block_id in (cached[k] for k in holes):
        bm.device.uncache(block_id)
    present = {k for k, b in cached.items() if k not in holes and bm.device.cache.contains_block(b)}
    h = expected_hit_blocks(present, layout, num_tokens, block_size)
    b = Sequence(1, list(tokens))
    hit_tokens = min(h * block_size, num_tokens - 1)
    assert bm.lookup_prefix(b) == hit_tokens
    assert bm.allocate(b, num_tokens - hit_tokens) == hit_tokens
    for g, (table, window) in enumerate(zip(b.block_tables, bm.sliding_windows)):
        needed = needed_blocks(hit_tokens, h, window, block_size)
        assert [x != NULL_BLOCK for x in table[:h]] == needed
        assert all(table[i] == bm.device.cache.get(group_key(b.block_hashes[i], g)) for i in range(h) if needed[i])
    check_block_manager(bm, [b])


def test_in_step_hits_take_only_the_window():
    """A request admitted in the step that computes a shared prompt hits those blocks; in a window
    group only the window's, and the computing sequence's frees afterwards leave them alive."""
    bm = BlockManager(100, 4, kv_cache_layout=FULL_AND_WINDOW)
    prompt = list(range(24))
    bm.begin_step()
    a = Sequence(0, prompt + [50])
    bm.allocate(a)
    bm.slot_mappings(a, 0, 25)
    bm.note_computing(a, 0, 25)
    b = Sequence(1, prompt + [60, 61])
    assert bm.allocate(b) == 24
    for table, window in zip(b.block_tables, bm.sliding_windows):
        assert [x != NULL_BLOCK for x in table[:6]] == needed_blocks(24, 6, window, 4)
    bm.mark_computed(a, 25)  # a frees what left its window; b still holds its share
    check_block_manager(bm, [a, b])
    assert all(bm.device.ref_counts[x] >= 1 for t in b.block_tables for x in t if x != NULL_BLOCK)


def test_the_invariant_check_catches_a_window_group_holding_too_much_or_too_little(prefill):
    bm = BlockManager(40, 4, kv_cache_layout=FULL_AND_WINDOW)
    seq = prefill(bm, 0, list(range(22)))  # next query at 22, W=6: blocks from (22 - 5) // 4 = 4 on
    check_block_manager(bm, [seq])
    window_table = seq.block_tables[1]
    kept = window_table[4]
    window_table[4] = NULL_BLOCK  # a block the window still reads, dropped (its ref count kept)
    with pytest.raises(InvariantError):
        check_block_manager(bm, [seq])
    window_table[4] = kept
    stale = bm.device.allocate()
    window_table[3] = stale  # a block before the window, still held
    with pytest.raises(InvariantError, match="NULL_BLOCK entries"):
        check_block_manager(bm, [seq])
    window_table[3] = NULL_BLOCK
    bm.device.decref(stale)
    check_block_manager(bm, [seq])
