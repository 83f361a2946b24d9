"""Fork and copy-on-write: sharing is free until a shared block is written, then one block is copied."""
import pytest

from kvpage.core import BlockManager, Sequence, check_block_manager


def test_fork_points_the_child_at_the_parents_blocks(prefill, fork):
    bm = BlockManager(64, block_size=16)
    parent = prefill(bm, 0, range(40))
    child = fork(bm, parent, 1)
    assert child.block_table == parent.block_table
    assert child.num_computed_tokens == 40
    assert all(bm.device.ref_counts[b] == 2 for b in parent.block_table)
    assert bm.stats().num_used_blocks == 3
    check_block_manager(bm, [parent, child])


def test_two_samples_of_a_500_token_prompt_do_not_hold_64_blocks(prefill, decode, fork):
    bm = BlockManager(100, block_size=16)
    a = prefill(bm, 0, range(500))
    assert len(a.block_table) == 32  # 31 full blocks + 4 tokens in the 32nd
    b = fork(bm, a, 1)
    assert bm.stats().num_used_blocks == 32
    # First divergence: each sample writes a different token at position 500, in the shared 32nd block.
    copies = decode(bm, a, 7) + decode(bm, b, 8)
    assert len(copies) == 1 and bm.stats().num_copy_on_write == 1
    shared = set(a.block_table) & set(b.block_table)
    assert len(shared) == 31 and all(bm.device.ref_counts[x] == 2 for x in shared)
    # Each holds exactly one block of its own: the writer the copy, the other the original.
    assert len(set(a.block_table) - shared) == 1 and len(set(b.block_table) - shared) == 1
    assert copies[0] == (b.block_table[31], a.block_table[31])
    assert bm.stats().num_used_blocks == 33
    check_block_manager(bm, [a, b])


def test_two_samples_of_a_block_aligned_512_token_prompt_hold_32_shared_plus_one_new_each(prefill, decode, fork):
    bm = BlockManager(100, block_size=16)
    a = prefill(bm, 0, range(512))
    b = fork(bm, a, 1)
    copies = decode(bm, a, 7) + decode(bm, b, 8)
    assert copies == []  # nothing shared is written: the next token opens a new block
    assert len(set(a.block_table) & set(b.block_table)) == 32
    assert bm.stats().num_used_blocks == 34


def test_copy_on_write_happens_once_per_divergence_not_per_token(prefill, decode, fork):
    bm = BlockManager(100, block_size=16)
    a = prefill(bm, 0, range(500))
    b = fork(bm, a, 1)
    for step in range(100):
        decode(bm, a, step)
        decode(bm, b, step + 1000)
    assert bm.stats().num_copy_on_write == 1
    assert len(set(a.block_table) & set(b.block_table)) == 31
    # 600 tokens each = 38 blocks each, 31 of them shared.
    assert bm.stats().num_used_blocks == 31 + 2 * 7
    check_block_manager(bm, [a, b])


def test_only_the_written_block_is_copied_for_each_of_n_samples(prefill, decode, fork):
    bm = BlockManager(100, block_size=4)
    parent = prefill(bm, 0, range(10))  # blocks: full, full, 2 tokens
    samples = [parent] + [fork(bm, parent, i) for i in range(1, 4)]
    original = parent.block_table[2]
    all_copies = [c for i, s in enumerate(samples) for c in decode(bm, s, 100 + i)]
    # Four writers of one shared block: three copy it, the last one left owns the original.
    assert len(all_copies) == 3
    assert {src for src, _ in all_copies} == {original}
    assert len({s.block_table[2] for s in samples}) == 4
    assert all(bm.device.ref_counts[b] == 4 for b in parent.block_table[:2])
    check_block_manager(bm, samples)


def test_freeing_the_parent_leaves_the_child_whole(prefill, decode, fork):
    bm = BlockManager(10, block_size=4)
    parent = prefill(bm, 0, range(6))
    child = fork(bm, parent, 1)
    bm.free(parent)
    assert all(bm.device.ref_counts[b] == 1 for b in child.block_table)
    assert decode(bm, child, 5) == []  # sole owner now: writes in place
    check_block_manager(bm, [child])


def test_fork_rejects_a_child_that_disagrees_on_computed_tokens(prefill):
    bm = BlockManager(10, block_size=4)
    parent = prefill(bm, 0, range(6))
    with pytest.raises(ValueError, match="agree"):
        bm.fork(parent, Sequence(1, [9, 9, 9, 9, 9, 9]))
    check_block_manager(bm, [parent])


@pytest.mark.parametrize("num_forks,prompt_len,chunk", [(3, 40, 1), (4, 32, 1), (2, 40, 20), (1, 40, 1)])
def test_num_blocks_to_append_of_a_plan_is_what_append_slots_draws(prefill, fork, num_forks, prompt_len, chunk):
    # Several writers of one shared block in one plan: each copies it but the last, which holds it alone.
    bm = BlockManager(64, block_size=16)
    parent = prefill(bm, 0, range(prompt_len))
    seqs = [parent] + [fork(bm, parent, i + 1) for i in range(num_forks)]
    for seq in seqs:
        seq.token_ids += [7] * chunk
    plan = [(seq, chunk) for seq in seqs]
    expected = bm.num_blocks_to_append(plan)
    free = bm.num_free_blocks
    for seq, n in plan:
        bm.append_slots(seq, n)
    assert free - bm.num_free_blocks == expected
    check_block_manager(bm, seqs)
