import time

import pytest

from kvpage.core import BlockKey, BlockPool, ROOT_HASH
from kvpage.core.hashing import pack_tokens


def _index(pool, block_id, tokens):
    key = BlockKey(ROOT_HASH, pack_tokens(tokens), ())
    assert pool.cache.insert(block_id, key.digest(), key)
    return key


def test_allocate_hands_out_distinct_blocks_and_free_returns_them():
    pool = BlockPool(4)
    blocks = [pool.allocate() for _ in range(4)]
    assert sorted(blocks) == [0, 1, 2, 3]
    assert pool.ref_counts == [1, 1, 1, 1] and pool.num_free_blocks == 0
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        pool.allocate()
    pool.decref(blocks[2])
    assert pool.num_free_blocks == 1 and pool.allocate() == blocks[2]


def test_ref_count_keeps_a_shared_block_until_its_last_reference_goes():
    pool = BlockPool(2)
    block = pool.allocate()
    pool.incref(block)
    pool.decref(block)
    assert pool.ref_counts[block] == 1 and pool.num_used == 1
    pool.decref(block)
    assert pool.ref_counts[block] == 0 and pool.num_used == 0
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.decref(block)
    assert pool.ref_counts[block] == 0


def _seconds_per_op(num_blocks):
    pool = BlockPool(num_blocks)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(2000):
            pool.decref(pool.allocate())
        best = min(best, time.perf_counter() - t0)
    return best


def test_allocate_and_free_cost_does_not_grow_with_pool_size():
    # O(1): a pool 1000x larger may not be several times slower per operation (O(n) would be ~1000x).
    assert _seconds_per_op(200_000) < 4 * _seconds_per_op(200)


def test_cached_blocks_are_reclaimed_only_when_the_free_list_is_dry_oldest_first():
    pool = BlockPool(3, enable_prefix_caching=True)
    a, b, c = (pool.allocate() for _ in range(3))
    _index(pool, a, [1])
    _index(pool, b, [2])
    pool.decref(a)
    pool.decref(b)
    pool.decref(c)  # not indexed: plain free
    assert pool.num_cached_blocks == 2 and pool.num_free_blocks == 3
    assert pool.allocate() == c  # the plain free block goes first
    assert pool.allocate() == a  # then the least recently freed cached block
    assert not pool.cache.contains_block(a) and pool.cache.contains_block(b)


def test_a_hit_revives_a_cached_block():
    pool = BlockPool(2, enable_prefix_caching=True)
    block = pool.allocate()
    key = _index(pool, block, [9, 9])
    pool.decref(block)
    assert pool.cache.lookup(key.digest(), key) == block
    pool.incref(block)
    assert pool.ref_counts[block] == 1 and pool.num_cached_blocks == 0 and pool.num_used == 1


def test_lookup_compares_contents_not_only_the_hash():
    pool = BlockPool(1, enable_prefix_caching=True)
    block = pool.allocate()
    key = _index(pool, block, [1, 2])
    impostor = BlockKey(ROOT_HASH, pack_tokens([3, 4]), ())
    assert pool.cache.lookup(key.digest(), impostor) is None
    assert pool.cache.lookup(key.digest(), key) == block


@pytest.mark.parametrize("num_blocks,match", [(2**31 + 1, "at most 2147483648"),
                                              (2**31, "bookkeeping alone needs")])
def test_a_pool_too_large_to_keep_is_refused(num_blocks, match, monkeypatch):
    """Past int32 block ids, or past the free memory for the pool's own lists (96 GiB at 2**31 blocks:
    Linux would OOM-kill the process filling them, not raise)."""
    from kvpage.core import block_pool

    monkeypatch.setattr(block_pool, "available_host_bytes", lambda: 2**34)  # 16 GiB free, whatever this machine has
    with pytest.raises(ValueError, match=match):
        BlockPool(num_blocks)


def test_a_tagged_pool_counts_used_blocks_per_tag():
    """A hybrid KV cache's pool: each block counts under the group (tag) it was allocated for, also
    when a prefix hit revives it from the cache and after a rebuild from the tables."""
    pool = BlockPool(4, enable_prefix_caching=True, num_tags=2)
    a, b, c = pool.allocate(0), pool.allocate(1), pool.allocate(1)
    assert pool.num_used_per_tag == (1, 2)
    _index(pool, b, [7])
    pool.decref(b)  # parked in the cache
    assert pool.num_used_per_tag == (1, 1)
    pool.incref(b)  # revived: a group-1 block again
    pool.incref(a)
    assert pool.num_used_per_tag == (1, 2)
    pool.rebuild({a: 1, c: 1}, {a: 1, c: 0})  # the tables say: a is group 1's now, c group 0's, b unreferenced
    assert pool.num_used_per_tag == (1, 1) and pool.num_used == 2
    assert BlockPool(3).num_used_per_tag == (0,)  # untagged: just num_used
