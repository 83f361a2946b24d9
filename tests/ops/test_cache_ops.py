"""allocate_kv_cache, reshape_and_cache, copy_blocks and swap_blocks against the reference: bit-exact."""
import pytest
import torch
from hypothesis import given, strategies as st

from kvpage import ops
from kvpage.ops import reference
from paged_data import (ALL_BLOCK_SIZES, DTYPES, HEAD_SIZES, fused_qkv, generator, randn, random_kv_cache,
                        snapshot)
from tolerances import assert_bit_exact

# -- allocate_kv_cache -------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", ALL_BLOCK_SIZES)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_allocate_kv_cache_layout(dtype, head_size, block_size):
    key_cache, value_cache = ops.allocate_kv_cache(3, block_size, 2, head_size, dtype=dtype)
    for cache in (key_cache, value_cache):
        assert cache.shape == (3, 2, block_size, head_size)  # the documented layout
        assert cache.dtype == dtype and cache.device.type == "cpu" and cache.is_contiguous()
        assert not cache.any()
    assert key_cache.data_ptr() != value_cache.data_ptr()


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu"), "meta"])
def test_allocate_kv_cache_device(device):
    key_cache, value_cache = ops.allocate_kv_cache(2, 16, 1, 64, device=device)
    assert key_cache.device == value_cache.device == torch.device(device)


# -- reshape_and_cache -------------------------------------------------------------------------------


def random_slot_mapping(num_tokens, num_slots, gen, skip_every=3):
    """Distinct slots in random order (two tokens to one slot would race), every few a -1."""
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    slots[::skip_every] = -1
    return slots


def check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping):
    expected_key, expected_value = snapshot(key_cache, value_cache)
    reference.reshape_and_cache(key, value, expected_key, expected_value, slot_mapping)
    ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    # Whole-cache comparison: written slots hold the token, -1 and unused slots kept their old bits.
    assert_bit_exact(key_cache, expected_key)
    assert_bit_exact(value_cache, expected_value)


@pytest.mark.parametrize("num_kv_heads", [1, 3, 8])
@pytest.mark.parametrize("block_size", [1, 8, 16, 32, 256])
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reshape_and_cache_fused_qkv_views(dtype, head_size, block_size, num_kv_heads):
    gen = generator(block_size + head_size)
    num_blocks = max(2, 64 // block_size)
    num_tokens = min(40, num_blocks * block_size)
    _, key, value = fused_qkv(num_tokens, 2 * num_kv_heads, num_kv_heads, head_size, dtype, gen)
    assert not key.is_contiguous()  # the point of the test: token stride is the fused width
    key_cache, value_cache = random_kv_cache(num_blocks, block_size, num_kv_heads, head_size, dtype, gen)
    check_reshape_and_cache(key, value, key_cache, value_cache,
                            random_slot_mapping(num_tokens, num_blocks * block_size, gen))


def test_reshape_and_cache_skipped_slots_stay_untouched():
    gen = generator(1)
    key_cache, value_cache = random_kv_cache(4, 8, 2, 64, torch.float16, gen)
    before = snapshot(key_cache, value_cache)
    key, value = randn((5, 2, 64), torch.float16, gen), randn((5, 2, 64), torch.float16, gen)
    ops.reshape_and_cache(key, value, key_cache, value_cache, torch.full((5,), -1))
    assert_bit_exact(key_cache, before[0])
    assert_bit_exact(value_cache, before[1])


def test_reshape_and_cache_no_tokens():
    key_cache, value_cache = ops.allocate_kv_cache(2, 16, 2, 64)
    empty = torch.zeros(0, 2, 64)
    ops.reshape_and_cache(empty, empty, key_cache, value_cache, torch.zeros(0, dtype=torch.int64))
    assert not key_cache.any() and not value_cache.any()


@given(dtype=st.sampled_from(DTYPES), block_size=st.sampled_from(ALL_BLOCK_SIZES[:7]),
       head_size=st.sampled_from((16, 64, 80)), num_kv_heads=st.integers(1, 4), num_blocks=st.integers(1, 8),
       data=st.data())
def test_reshape_and_cache_random(dtype, block_size, head_size, num_kv_heads, num_blocks, data):
    num_slots = num_blocks * block_size
    # Distinct real slots (two tokens to one slot would race), some tokens skipped with -1.
    slots = data.draw(st.lists(st.integers(0, num_slots - 1), unique=True, max_size=min(48, num_slots)))
    skipped = data.draw(st.lists(st.booleans(), min_size=len(slots), max_size=len(slots)))
    slots = [-1 if skip else slot for slot, skip in zip(slots, skipped)]
    gen = generator(data.draw(st.integers(0, 2**31 - 1)))
    key_cache, value_cache = random_kv_cache(num_blocks, block_size, num_kv_heads, head_size, dtype, gen)
    _, key, value = fused_qkv(len(slots), num_kv_heads, num_kv_heads, head_size, dtype, gen)
    check_reshape_and_cache(key, value, key_cache, value_cache, torch.tensor(slots, dtype=torch.int64))


# -- copy_blocks -------------------------------------------------------------------------------------


def random_layers(num_layers, num_blocks, dtype, gen, block_size=8, num_kv_heads=2, head_size=32):
    caches = [random_kv_cache(num_blocks, block_size, num_kv_heads, head_size, dtype, gen)
              for _ in range(num_layers)]
    return [k for k, _ in caches], [v for _, v in caches]


def check_copy_blocks(key_caches, value_caches, block_mapping):
    expected_keys, expected_values = snapshot(*key_caches), snapshot(*value_caches)
    mapping = torch.tensor(block_mapping, dtype=torch.int64).reshape(-1, 2)
    reference.copy_blocks(expected_keys, expected_values, mapping)
    ops.copy_blocks(key_caches, value_caches, mapping)
    for actual, expected in zip(key_caches + value_caches, expected_keys + expected_values):
        assert_bit_exact(actual, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_layers", [1, 3])
def test_copy_blocks_every_layer_in_one_call(dtype, num_layers):
    key_caches, value_caches = random_layers(num_layers, 10, dtype, generator(num_layers))
    # One source fanned out to two destinations (copy-on-write of a shared block), plus another pair.
    check_copy_blocks(key_caches, value_caches, [[1, 4], [1, 7], [2, 9]])


def test_copy_blocks_accepts_pairs_and_empty_mappings():
    key_caches, value_caches = random_layers(2, 6, torch.float32, generator(5))
    expected_keys, expected_values = snapshot(*key_caches), snapshot(*value_caches)
    ops.copy_blocks(key_caches, value_caches, [])
    ops.copy_blocks(key_caches, value_caches, torch.zeros(0, 2, dtype=torch.int64))
    ops.copy_blocks([], [], [])
    for actual, expected in zip(key_caches + value_caches, expected_keys + expected_values):
        assert_bit_exact(actual, expected)
    ops.copy_blocks(key_caches, value_caches, [(0, 5), (3, 2)])  # a list of pairs is converted
    reference.copy_blocks(expected_keys, expected_values, torch.tensor([[0, 5], [3, 2]]))
    for actual, expected in zip(key_caches + value_caches, expected_keys + expected_values):
        assert_bit_exact(actual, expected)


@st.composite
def copy_mappings(draw, num_blocks):
    """(src, dst) pairs with distinct destinations that are never also sources."""
    blocks = draw(st.permutations(range(num_blocks)))
    num_dst = draw(st.integers(0, num_blocks - 1))
    dsts, srcs = blocks[:num_dst], blocks[num_dst:]
    return [[draw(st.sampled_from(srcs)), dst] for dst in dsts]


@given(dtype=st.sampled_from(DTYPES), num_layers=st.integers(1, 3), num_blocks=st.integers(2, 9), data=st.data())
def test_copy_blocks_random(dtype, num_layers, num_blocks, data):
    key_caches, value_caches = random_layers(num_layers, num_blocks, dtype, generator(num_blocks))
    check_copy_blocks(key_caches, value_caches, data.draw(copy_mappings(num_blocks)))


# -- swap_blocks -------------------------------------------------------------------------------------


def check_swap_blocks(src, dst, block_mapping):
    src_before = snapshot(*src)
    expected = snapshot(*dst)
    mapping = torch.tensor(block_mapping, dtype=torch.int64).reshape(-1, 2)
    reference.swap_blocks(src, expected, mapping)
    ops.swap_blocks(src, dst, mapping)
    for actual, wanted in zip(dst, expected):
        assert_bit_exact(actual, wanted)
    for actual, wanted in zip(src, src_before):
        assert_bit_exact(actual, wanted)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_swap_blocks_all_layers_between_pools_of_different_sizes(dtype):
    """Swap-out to a smaller host pool and back: K and V of every layer in one call each way."""
    gen = generator(2)
    device_keys, device_values = random_layers(2, 12, dtype, gen)
    host_keys, host_values = random_layers(2, 5, dtype, gen)
    device, host = device_keys + device_values, host_keys + host_values
    check_swap_blocks(device, host, [[11, 0], [3, 4], [3, 2]])  # one source to two host blocks is fine
    check_swap_blocks(host, device, [[0, 1], [4, 0]])


def test_swap_blocks_single_tensors_and_pairs():
    gen = generator(4)
    src, _ = random_kv_cache(6, 16, 1, 64, torch.bfloat16, gen)
    dst, _ = random_kv_cache(3, 16, 1, 64, torch.bfloat16, gen)
    expected = dst.clone()
    reference.swap_blocks(src, expected, torch.tensor([[5, 0], [1, 2]]))
    ops.swap_blocks(src, dst, [(5, 0), (1, 2)])
    assert_bit_exact(dst, expected)


@given(dtype=st.sampled_from(DTYPES), num_src=st.integers(1, 8), num_dst=st.integers(1, 8), data=st.data())
def test_swap_blocks_random(dtype, num_src, num_dst, data):
    dsts = data.draw(st.lists(st.integers(0, num_dst - 1), unique=True, max_size=num_dst))
    mapping = [[data.draw(st.integers(0, num_src - 1)), dst] for dst in dsts]
    gen = generator(num_src * 10 + num_dst)
    src_keys, src_values = random_layers(2, num_src, dtype, gen)
    dst_keys, dst_values = random_layers(2, num_dst, dtype, gen)
    check_swap_blocks(src_keys + src_values, dst_keys + dst_values, mapping)
