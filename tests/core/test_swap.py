"""Swap: a group's blocks move to the host pool and back, each shared block once, sharing preserved."""
import pytest

from kvpage.core import BlockManager, Sequence, SequenceGroup, check_block_manager


def _group(bm, num_tokens, num_samples):
    parent = Sequence(0, list(range(num_tokens)))
    bm.allocate(parent)
    bm.mark_computed(parent, num_tokens)
    seqs = [parent]
    for i in range(1, num_samples):
        child = parent.fork(i)
        bm.fork(parent, child)
        child.append_token(100 + i)
        bm.append_slots(child)
        bm.mark_computed(child, 1)
        seqs.append(child)
    return SequenceGroup("req", seqs)


def test_swap_out_moves_each_shared_block_once_and_keeps_sharing():
    bm = BlockManager(16, block_size=4, num_host_blocks=16)
    group = _group(bm, 10, 3)  # 2 shared full blocks + 3 private third blocks
    device_blocks = {b for seq in group for b in seq.block_table}
    tables = [list(seq.block_table) for seq in group]
    mapping = bm.swap_out(group)
    assert len(mapping) == len(device_blocks) == 5
    assert {d for d, _ in mapping} == device_blocks
    to_host = dict(mapping)
    for seq, table in zip(group, tables):
        assert seq.swapped and seq.block_table == [to_host[b] for b in table]
    assert [bm.host.ref_counts[to_host[b]] for b in tables[0][:2]] == [3, 3]
    assert bm.stats().num_used_blocks == 0 and bm.stats().num_host_used_blocks == 5
    assert bm.stats().num_swapped_out_blocks == 5
    check_block_manager(bm, list(group))


def test_swap_in_is_the_reverse():
    bm = BlockManager(16, block_size=4, num_host_blocks=16, enable_prefix_caching=False)
    group = _group(bm, 10, 2)
    bm.swap_out(group)
    host_tables = [list(seq.block_table) for seq in group]
    mapping = bm.swap_in(group)
    assert len(mapping) == 4 and {h for h, _ in mapping} == {b for t in host_tables for b in t}
    to_device = dict(mapping)
    for seq, table in zip(group, host_tables):
        assert not seq.swapped and seq.block_table == [to_device[b] for b in table]
    assert bm.stats().num_host_used_blocks == 0 and bm.stats().num_used_blocks == 4
    check_block_manager(bm, list(group))


def test_swap_in_reuses_device_blocks_the_prefix_cache_still_holds():
    bm = BlockManager(16, block_size=4, num_host_blocks=16)
    group = _group(bm, 10, 1)
    bm.swap_out(group)
    (seq,) = group
    mapping = bm.swap_in(group)
    # The two full blocks were still cached on the device: only the partial one is copied back.
    assert len(mapping) == 1 and mapping[0][1] == seq.block_table[2]
    check_block_manager(bm, [seq])


def test_swap_out_needs_room_in_the_host_pool():
    bm = BlockManager(20, block_size=4, num_host_blocks=2)
    group = _group(bm, 10, 1)
    assert not bm.can_swap_out(group)
    with pytest.raises(RuntimeError, match="cannot swap out"):
        bm.swap_out(group)
    assert not group.seqs[0].swapped
    check_block_manager(bm, list(group))


def test_swap_in_keeps_the_device_watermark_free():
    bm = BlockManager(20, block_size=4, num_host_blocks=8, enable_prefix_caching=False, watermark=0.25)
    group = _group(bm, 10, 1)
    bm.swap_out(group)
    hog = Sequence(9, list(range(15 * 4)))
    bm.allocate(hog)  # 5 of 20 free, and the watermark is 5
    assert not bm.can_swap_in(group)
    bm.free(hog)
    assert bm.can_swap_in(group)


def test_freeing_a_swapped_sequence_returns_host_blocks():
    bm = BlockManager(8, block_size=4, num_host_blocks=8)
    group = _group(bm, 10, 2)
    bm.swap_out(group)
    for seq in group:
        bm.free(seq)
    check_block_manager(bm, [])
    assert bm.stats().num_host_used_blocks == 0


def test_a_swapped_sequence_cannot_be_appended_to_or_mapped():
    bm = BlockManager(8, block_size=4, num_host_blocks=8)
    group = _group(bm, 6, 1)
    bm.swap_out(group)
    (seq,) = group
    seq.append_token(1)
    with pytest.raises(ValueError, match="swapped out"):
        bm.append_slots(seq)
    with pytest.raises(ValueError, match="swapped out"):
        bm.slot_mapping(seq, 0, 6)
