"""Allocation, block-table growth, slot mapping, freeing, watermark, statistics and bad input."""
import pytest

from kvpage.core import BlockManager, Sequence, check_block_manager


def test_new_block_only_at_the_17th_token(prefill, decode):
    bm = BlockManager(8, block_size=16, enable_prefix_caching=False)
    seq = prefill(bm, 0, range(15))
    assert len(seq.block_table) == 1
    decode(bm, seq, 100)  # 16th token: still fits the first block
    assert len(seq.block_table) == 1 and bm.stats().num_used_blocks == 1
    decode(bm, seq, 101)  # 17th token
    assert len(seq.block_table) == 2 and bm.stats().num_used_blocks == 2


def test_admission_takes_blocks_only_for_the_tokens_computed_now():
    bm = BlockManager(3, block_size=16, enable_prefix_caching=False, watermark=0.0)
    seq = Sequence(0, list(range(100)))  # 7 blocks eventually
    assert not bm.can_allocate(seq)
    assert bm.can_allocate(seq, 20)
    assert bm.allocate(seq, 20) == 0
    assert len(seq.block_table) == 2
    bm.mark_computed(seq, 20)
    # The next chunk grows the table by what it needs, again not more.
    assert bm.can_append_slots(seq, 16) and not bm.can_append_slots(seq, 40)
    bm.append_slots(seq, 16)
    assert len(seq.block_table) == 3


def test_decode_claims_one_block_per_block_size_tokens(prefill, decode):
    bm = BlockManager(16, block_size=4, enable_prefix_caching=False)
    seq = prefill(bm, 0, range(1))
    for token in range(30):
        decode(bm, seq, token)
        assert len(seq.block_table) == (len(seq.token_ids) + 3) // 4


def test_slot_mapping_is_block_id_times_block_size_plus_offset():
    bm = BlockManager(8, block_size=4, enable_prefix_caching=False)
    seq = Sequence(0, list(range(10)))
    bm.allocate(seq)
    expected = [seq.block_table[p // 4] * 4 + p % 4 for p in range(10)]
    assert bm.slot_mapping(seq, 0, 10) == expected
    assert bm.slot_mapping(seq, 3, 9) == expected[3:9]
    assert bm.slot_mapping(seq, 5, 5) == []
    with pytest.raises(ValueError, match="end=13"):
        bm.slot_mapping(seq, 0, 13)


def test_free_returns_every_block_and_is_idempotent(prefill):
    bm = BlockManager(10, block_size=4, enable_prefix_caching=False)
    seqs = [prefill(bm, i, range(7 + i)) for i in range(3)]
    assert bm.stats().num_used_blocks == 2 + 2 + 3
    for seq in seqs:
        bm.free(seq)
        bm.free(seq)
        assert seq.block_table == [] and seq.num_computed_tokens == 0
    check_block_manager(bm, [])
    assert bm.stats().num_free_blocks == 10


def test_abort_of_a_waiting_sequence_frees_nothing_and_breaks_nothing(prefill):
    bm = BlockManager(4, block_size=4)
    running = prefill(bm, 0, range(5))
    bm.free(Sequence(1, [1, 2, 3]))
    check_block_manager(bm, [running])


def test_watermark_holds_back_admission_but_not_running_sequences():
    bm = BlockManager(100, block_size=1, enable_prefix_caching=False, watermark=0.05)
    assert bm.watermark_blocks == 5
    seq = Sequence(0, list(range(95)))
    assert bm.can_allocate(seq)
    assert not bm.can_allocate(Sequence(1, list(range(96))))
    bm.allocate(seq)
    bm.mark_computed(seq, 95)
    for token in range(5):  # a running sequence may spend the reserve
        seq.append_token(token)
        assert bm.can_append_slots(seq)
        bm.append_slots(seq)
        bm.mark_computed(seq, 1)
    seq.append_token(0)
    assert not bm.can_append_slots(seq)
    with pytest.raises(RuntimeError, match="cannot append"):
        bm.append_slots(seq)
    check_block_manager(bm, [seq])


def test_stats_count_blocks_prefix_queries_and_copies(prefill, decode):
    bm = BlockManager(20, block_size=4)
    a = prefill(bm, 0, range(9))
    b = Sequence(1, list(range(9)))
    assert bm.allocate(b) == 8
    child = a.fork(2)
    bm.fork(a, child)
    decode(bm, a, 1)
    decode(bm, child, 2)
    stats = bm.stats()
    assert (stats.num_blocks, stats.num_used_blocks, stats.num_cached_blocks) == (20, 5, 0)
    assert stats.num_free_blocks == 15
    assert (stats.prefix_cache_queried_tokens, stats.prefix_cache_hit_tokens) == (18, 8)
    assert stats.prefix_cache_hit_rate == pytest.approx(8 / 18)
    assert stats.num_copy_on_write == 1


def test_bad_arguments_raise_and_name_the_argument():
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, block_size=0)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(-1)
    with pytest.raises(ValueError, match="watermark"):
        BlockManager(4, watermark=1.5)
    with pytest.raises(ValueError, match="token_ids"):
        Sequence(0, [])
    with pytest.raises(TypeError, match="extra_keys"):
        Sequence(0, [1], extra_keys=(object(),))
    bm = BlockManager(4, block_size=4)
    seq = Sequence(0, [1, 2, 3])
    with pytest.raises(ValueError, match="allocate it first"):
        bm.append_slots(seq)
    with pytest.raises(ValueError, match="num_new_tokens"):
        bm.allocate(seq, 0)
    with pytest.raises(ValueError, match="num_new_tokens"):
        bm.allocate(seq, 4)
    bm.allocate(seq)
    with pytest.raises(ValueError, match="already holds blocks"):
        bm.allocate(seq)
    with pytest.raises(ValueError, match="num_new_tokens"):
        bm.append_slots(seq, 4)  # only 3 uncomputed tokens exist
    with pytest.raises(ValueError, match="num_new_tokens"):
        bm.mark_computed(seq, 4)
    check_block_manager(bm, [seq])


def test_allocate_that_does_not_fit_raises_without_side_effects():
    bm = BlockManager(2, block_size=4, enable_prefix_caching=False)
    seq = Sequence(0, list(range(12)))
    with pytest.raises(RuntimeError, match="cannot allocate"):
        bm.allocate(seq)
    assert seq.block_table == [] and bm.stats().num_free_blocks == 2
