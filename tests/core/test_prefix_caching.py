"""Automatic prefix caching: hash-chained full blocks, reuse while the chain matches, LRU of freed blocks."""
import pytest

import kvpage.core.hashing
from kvpage.core import BlockManager, Sequence, check_block_manager

SYSTEM = list(range(1000, 1040))  # 40 tokens: 2 full blocks of 16 and 8 more


def test_second_request_reuses_the_shared_full_blocks_with_ref_counts(prefill):
    bm = BlockManager(32, block_size=16)
    first = prefill(bm, 0, SYSTEM + [1, 2, 3])
    second = Sequence(1, SYSTEM + [4, 5])
    assert bm.lookup_prefix(second) == 32
    assert bm.allocate(second) == 32 and second.num_computed_tokens == 32
    assert second.block_table[:2] == first.block_table[:2]
    assert second.block_table[2] != first.block_table[2]  # the partial third block is never shared
    assert [bm.device.ref_counts[b] for b in first.block_table] == [2, 2, 1]
    check_block_manager(bm, [first, second])


def test_a_full_hit_recomputes_only_the_last_token_and_never_writes_the_cached_block(prefill):
    bm = BlockManager(8, block_size=16)
    first = prefill(bm, 0, list(range(32)))
    same = Sequence(1, list(range(32)))
    assert bm.lookup_prefix(same) == 31
    assert bm.allocate(same) == 31  # the last token runs again, for its logits
    assert same.block_table == first.block_table and bm.stats().num_used_blocks == 2
    assert bm.slot_mapping(same, 31, 32) == [-1]  # its K/V are in the shared block already
    bm.mark_computed(same, 1)
    check_block_manager(bm, [first, same])
    # Decoding on draws a private block: the shared ones stay as they were.
    same.append_token(99)
    assert bm.append_slots(same, 1) == []
    assert len(same.block_table) == 3 and same.block_table[2] not in first.block_table
    assert bm.slot_mapping(same, 32, 33) == [same.block_table[2] * 16]
    check_block_manager(bm, [first, same])


def test_a_full_hit_on_a_one_token_block_still_computes_that_token():
    bm = BlockManager(8, block_size=1)
    seq = Sequence(0, [7])
    bm.allocate(seq)
    bm.mark_computed(seq, 1)
    again = Sequence(1, [7])
    assert bm.allocate(again) == 0 and again.block_table == seq.block_table
    assert bm.slot_mapping(again, 0, 1) == [-1]


def test_match_stops_at_the_first_block_that_differs(prefill):
    bm = BlockManager(16, block_size=4)
    prefill(bm, 0, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13])
    assert bm.lookup_prefix(Sequence(1, [1, 2, 3, 4, 5, 6, 0, 8, 9, 10, 11, 12, 13])) == 4
    # Same tokens shifted by one are not a match: the chain only recognises block-aligned prefixes.
    assert bm.lookup_prefix(Sequence(2, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9])) == 0


def test_freed_blocks_stay_cached_and_a_hit_revives_them(prefill):
    bm = BlockManager(8, block_size=16)
    first = prefill(bm, 0, SYSTEM)
    blocks = list(first.block_table)
    bm.free(first)
    stats = bm.stats()
    assert (stats.num_used_blocks, stats.num_cached_blocks, stats.num_free_blocks) == (0, 2, 6)
    again = Sequence(1, SYSTEM + [7])
    assert bm.allocate(again) == 32
    assert again.block_table[:2] == blocks[:2]
    assert bm.stats().num_cached_blocks == 0
    check_block_manager(bm, [again])


def test_cached_blocks_are_reclaimed_only_when_the_free_pool_runs_dry(prefill):
    bm = BlockManager(4, block_size=4, watermark=0.0)
    bm.free(prefill(bm, 0, [1, 2, 3, 4, 5, 6, 7, 8, 9]))  # 2 cached blocks, 2 plain free
    filler = Sequence(1, [50, 51, 52, 53, 54, 55, 56, 57])
    bm.allocate(filler)  # takes the 2 plain free blocks: the cache survives
    assert bm.stats().num_cached_blocks == 2
    assert bm.lookup_prefix(Sequence(2, [1, 2, 3, 4, 5, 6, 7, 8, 9])) == 8
    bm.allocate(Sequence(3, [60]))  # free pool dry: reclaims one cached block
    assert bm.stats().num_cached_blocks == 1
    assert bm.lookup_prefix(Sequence(4, [1, 2, 3, 4, 5, 6, 7, 8, 9])) < 8


def test_the_least_recently_freed_cached_block_goes_first(prefill):
    bm = BlockManager(4, block_size=4, watermark=0.0)
    old = prefill(bm, 0, [1, 1, 1, 1, 0])
    new = prefill(bm, 1, [2, 2, 2, 2, 0])
    bm.free(old)
    bm.free(new)
    bm.allocate(Sequence(2, list(range(8))))  # 2 plain free blocks
    bm.allocate(Sequence(3, [9]))  # evicts one cached block
    assert bm.lookup_prefix(Sequence(4, [1, 1, 1, 1, 0])) == 0
    assert bm.lookup_prefix(Sequence(5, [2, 2, 2, 2, 0])) == 4


def test_blocks_become_cacheable_as_they_fill_during_decode(prefill):
    bm = BlockManager(8, block_size=4)
    seq = prefill(bm, 0, [1, 2])
    for token in [3, 4, 5]:
        seq.append_token(token)
        bm.append_slots(seq)
        bm.mark_computed(seq, 1)
    assert bm.stats().num_used_blocks == 2
    assert bm.lookup_prefix(Sequence(1, [1, 2, 3, 4, 9])) == 4  # filled by decode, not by the prompt
    # Appended but not yet computed tokens are not cacheable.
    seq.append_token(6)
    seq.append_token(7)
    seq.append_token(8)
    assert bm.lookup_prefix(Sequence(2, [1, 2, 3, 4, 5, 6, 7, 8, 9])) == 4


def test_switch_off_means_no_hits_and_no_cached_blocks(prefill):
    bm = BlockManager(8, block_size=4, enable_prefix_caching=False)
    bm.free(prefill(bm, 0, list(range(9))))
    again = Sequence(1, list(range(9)))
    assert bm.lookup_prefix(again) == 0 and bm.allocate(again) == 0
    stats = bm.stats()
    assert (stats.num_cached_blocks, stats.prefix_cache_queried_tokens, stats.prefix_cache_hit_tokens) == (0, 0, 0)


def test_a_hash_collision_is_not_a_hit(monkeypatch, prefill):
    monkeypatch.setattr(kvpage.core.hashing, "hash_block", lambda parent, token_bytes, extra=(): b"same")
    bm = BlockManager(8, block_size=4)
    first = prefill(bm, 0, [1, 2, 3, 4, 5])
    other = Sequence(1, [9, 9, 9, 9, 5])
    assert bm.allocate(other) == 0
    assert set(other.block_table).isdisjoint(first.block_table)
    assert bm.allocate(Sequence(2, [1, 2, 3, 4, 5])) == 4  # equal tokens still hit


def test_extra_keys_separate_caches(prefill):
    bm = BlockManager(8, block_size=4)
    prefill(bm, 0, [1, 2, 3, 4, 5], extra_keys=("lora-a",))
    assert bm.lookup_prefix(Sequence(1, [1, 2, 3, 4, 5], extra_keys=("lora-b",))) == 0
    assert bm.lookup_prefix(Sequence(2, [1, 2, 3, 4, 5], extra_keys=("lora-a",))) == 4


def test_admission_counts_revived_cached_hits_against_free_blocks(prefill):
    bm = BlockManager(3, block_size=4, watermark=0.0)
    bm.free(prefill(bm, 0, [1, 2, 3, 4, 5, 6, 7, 8]))  # 2 cached + 1 plain free
    hog = Sequence(1, [9])
    bm.allocate(hog)  # only cached blocks are left: 2 reclaimable
    again = Sequence(2, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    # Needs the 2 cached hits revived plus 1 fresh block: 3 > 2 reclaimable.
    assert bm.lookup_prefix(again) == 8 and not bm.can_allocate(again)
    with pytest.raises(RuntimeError, match="cannot allocate"):
        bm.allocate(again)
    check_block_manager(bm, [hog])


def test_identical_concurrent_blocks_keep_one_cache_entry():
    bm = BlockManager(8, block_size=4)
    a = Sequence(0, [1, 2, 3, 4, 5])
    b = Sequence(1, [1, 2, 3, 4, 6])
    bm.allocate(a)
    bm.allocate(b)  # before a computed anything: no hit, its own copy of the same block
    bm.mark_computed(a, 5)
    bm.mark_computed(b, 5)
    assert a.block_table[0] != b.block_table[0]
    assert len(bm.device.cache) == 1
    bm.free(a)
    bm.free(b)
    assert bm.stats().num_cached_blocks == 1
    check_block_manager(bm, [])
