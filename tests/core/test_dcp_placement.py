"""The driver's DCP arithmetic (kvpage.core.context_parallel) against a direct enumeration of positions."""
import pytest

from kvpage.core.context_parallel import ContextParallelPlacement, check_context_parallel

LAYOUTS = [(d, i, b) for d in (1, 2, 3, 4) for b in (4, 16) for i in (1, 2, 4) if b % i == 0]


@pytest.mark.parametrize("size,interleave,block_size", LAYOUTS)
def test_each_position_has_one_rank_and_one_slot(size, interleave, block_size):
    p = ContextParallelPlacement(size, interleave, block_size)
    blocks = [7, 2, 5]  # a block table: virtual block k of the sequence is block id blocks[k]
    seen = {r: [] for r in range(size)}
    for pos in range(len(blocks) * p.virtual_block_size):
        slot = blocks[pos // p.virtual_block_size] * p.virtual_block_size + pos % p.virtual_block_size
        owners = [r for r in range(size) if p.local_slot(slot, r) >= 0]
        assert owners == [(pos // interleave) % size]
        local = p.local_slot(slot, owners[0])
        # Inside the rank's own block of the same id, and in position order within it.
        assert local // block_size == blocks[pos // p.virtual_block_size]
        seen[owners[0]].append(local)
    for r, slots in seen.items():
        assert len(set(slots)) == len(slots) == len(blocks) * block_size
        # Positions a rank keeps are laid out in order within each block: its k-th position -> offset k % B.
        assert [s % block_size for s in slots] == [k % block_size for k in range(len(slots))]


@pytest.mark.parametrize("size,interleave,block_size", LAYOUTS)
def test_tokens_on_rank_counts_positions(size, interleave, block_size):
    p = ContextParallelPlacement(size, interleave, block_size)
    for length in range(0, 3 * p.virtual_block_size + 3):
        counts = [sum(1 for pos in range(length) if p.rank_of(pos) == r) for r in range(size)]
        assert [p.tokens_on_rank(length, r) for r in range(size)] == counts
        assert sum(counts) == length


@pytest.mark.parametrize("args,name", [
    ((2, 2, 1, 16, 4, 1), None),  # MQA, TP=2: both ranks hold the one KV head
    ((4, 2, 2, 16, 8, 2), None),  # GQA 8/2 at TP=4: two ranks per KV head
    ((4, 4, 1, 16, 8, 1), None),
    ((3, 1, 4, 16, 9, 3), None),  # D=1: only the interleave is checked
    ((2, 0, 1, 16, 4, 1), "decode_context_parallel_size"),
    ((2, 2.0, 1, 16, 4, 1), "decode_context_parallel_size"),
    ((2, 2, 3, 16, 4, 1), "dcp_kv_cache_interleave_size"),
    ((2, 2, 0, 16, 4, 1), "dcp_kv_cache_interleave_size"),
    ((1, 2, 1, 16, 4, 1), "tensor_parallel_size"),  # D must divide T
    ((4, 3, 1, 16, 4, 1), "tensor_parallel_size"),
    ((2, 2, 1, 16, 4, 2), "num_kv_heads"),  # no replication to split: 2 KV heads on 2 ranks
    ((6, 2, 1, 16, 6, 2), "num_kv_heads"),  # 3 ranks per KV head: a group of 2 would straddle two heads
    ((4, 2, 1, 16, 6, 1), "query heads"),  # 6 query heads over 4 ranks: unequal shares
])
def test_vllm_rules(args, name):
    if name is None:
        check_context_parallel(*args)
        return
    with pytest.raises(ValueError, match=name):
        check_context_parallel(*args)
