"""paged_attention (decode) against reference.paged_attention."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from kvpage import ops
from kvpage.ops import reference
from paged_data import (ALL_BLOCK_SIZES, BLOCK_SIZES, DEFAULT_PARTITION, DTYPES, HEAD_CONFIGS, HEAD_SIZES,
                        attention_shapes, block_tables_for, cdiv, decode_seq_lens, fused_qkv, generator,
                        int32, randn, distinct_block_tables, poison_unused_slots, random_block_tables,
                        random_kv_cache)
from tolerances import assert_attention_close

SINGLE_PASS = 1 << 20  # partition_size >= every sequence: one pass per sequence


def make_decode(seq_lens, block_size, num_heads, num_kv_heads, head_size, dtype, num_blocks=10, seed=0,
                fused=False):
    """(query, key_cache, value_cache, block_tables, seq_lens) for one decode step."""
    gen = generator(seed)
    key_cache, value_cache = random_kv_cache(num_blocks, block_size, num_kv_heads, head_size, dtype, gen)
    block_tables = random_block_tables(seq_lens, block_size, num_blocks, gen)
    if fused:  # the query a fused qkv projection leaves: strided over tokens
        query = fused_qkv(len(seq_lens), num_heads, num_kv_heads, head_size, dtype, gen)[0]
    else:
        query = randn((len(seq_lens), num_heads, head_size), dtype, gen)
    return query, key_cache, value_cache, block_tables, int32(seq_lens)


def check_decode(args, **kwargs):
    out = ops.paged_attention(*args, **kwargs)
    assert_attention_close(out, reference.paged_attention(*args, scale=kwargs.get("scale")))
    return out


@pytest.mark.parametrize("heads", HEAD_CONFIGS.values(), ids=HEAD_CONFIGS.keys())
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_matrix(dtype, head_size, block_size, heads):
    # One token, partial / exactly full / just-spilled blocks, and a few blocks' worth.
    seq_lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5]
    check_decode(make_decode(seq_lens, block_size, *heads, head_size, dtype, fused=True))


@pytest.mark.parametrize("block_size", [b for b in ALL_BLOCK_SIZES if b not in BLOCK_SIZES])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_every_power_of_two_block_size(dtype, block_size):
    seq_lens = [1, 2, block_size + 3, 300]
    check_decode(make_decode(seq_lens, block_size, 9, 3, 64, dtype, num_blocks=max(4, 600 // block_size)))


@pytest.mark.parametrize("heads", HEAD_CONFIGS.values(), ids=HEAD_CONFIGS.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_contexts_up_to_several_partitions(cpu_isa, dtype, heads):
    # Either side of the default 512-token partition, and three to four partitions long.
    seq_lens = [1, 511, 512, 513, 1100, 1700]
    args = make_decode(seq_lens, 16, *heads, 64, dtype, num_blocks=40)
    split = check_decode(args, partition_size=128)
    single = check_decode(args, partition_size=SINGLE_PASS)
    check_decode(args)  # automatic choice
    # The log-sum-exp merge of partitions must reproduce the single pass, not just the reference.
    assert_attention_close(split, single)


@pytest.mark.parametrize("heads", [(12, 1), (32, 2), (40, 2)], ids=["group12", "group16", "group20"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_wide_groups_pad_rows_to_whole_vectors(cpu_isa, dtype, heads):
    # Groups of a vector's lanes or more (8 on AVX2, 16 on AVX-512) take the kernel whose lanes are
    # query rows; 12 and 20 leave some padded, 16 fills AVX-512's exactly.
    seq_lens = [1, 17, 300, 700]
    args = make_decode(seq_lens, 16, *heads, 64, dtype, num_blocks=50)
    check_decode(args, partition_size=128)
    check_decode(args, partition_size=SINGLE_PASS)


@pytest.mark.parametrize("block_size", [8, 16, 32, 64])
def test_decode_partition_boundaries(cpu_isa, block_size):
    partition = 64  # every length sits at, just under or just over a multiple of it
    seq_lens = [63, 64, 65, 127, 128, 129, 191, 192, 193]
    check_decode(make_decode(seq_lens, block_size, 4, 2, 48, torch.float32, num_blocks=12),
                 partition_size=partition)


@pytest.mark.parametrize("seq_lens", [[1500], [600] * 16, [40, 7, 90]], ids=["one-long", "many-long", "short"])
def test_automatic_partition_choice_is_single_pass_or_default_split(cpu_isa, seq_lens):
    """Without partition_size the kernel picks one of the two paths; whichever it takes must give
    the same bits as forcing that path, and match the reference."""
    args = make_decode(seq_lens, 16, 8, 2, 64, torch.float32, num_blocks=48)
    auto = check_decode(args)
    forced_split = ops.paged_attention(*args, partition_size=DEFAULT_PARTITION)
    forced_single = ops.paged_attention(*args, partition_size=SINGLE_PASS)
    assert torch.equal(auto, forced_split) or torch.equal(auto, forced_single)


def test_decode_repeated_physical_blocks():
    """Copy-on-write and prefix sharing make one physical block appear in several rows, and a
    tiny cache can make it appear several times in one row."""
    block_size = 8
    args = list(make_decode([40, 24, 17], block_size, 6, 2, 64, torch.float32, num_blocks=4))
    args[3] = int32([[2, 2, 0, 2, 3], [3, 2, 2, 9, 9], [2, 1, 2, 9, 9]])  # 9: unused padding
    check_decode(tuple(args))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_into_strided_out_leaves_neighbours_alone(dtype):
    args = make_decode([5, 70, 33], 16, 9, 3, 80, dtype)
    query = args[0]
    buffer = torch.full((query.shape[0], query.shape[1], 2 * query.shape[2]), 7.0, dtype=dtype)
    out = buffer[..., : query.shape[2]]  # last dim contiguous, token and head strides doubled
    returned = ops.paged_attention(*args, scale=0.3, out=out)
    assert returned is out
    assert_attention_close(out, reference.paged_attention(*args, scale=0.3))
    assert torch.all(buffer[..., query.shape[2]:] == 7.0)


def test_decode_empty_batch():
    query, key_cache, value_cache, _, _ = make_decode([3], 16, 4, 4, 64, torch.float32)
    empty_query = query[:0]
    out = ops.paged_attention(empty_query, key_cache, value_cache, torch.zeros(0, 2, dtype=torch.int32),
                              int32([]))
    assert out.shape == empty_query.shape


def test_decode_same_result_with_range_checks_off():
    args = make_decode([9, 300, 41], 16, 9, 3, 64, torch.bfloat16)
    checked = ops.paged_attention(*args)
    with ops.range_checks(False):
        unchecked = ops.paged_attention(*args)
    assert torch.equal(checked, unchecked)


def test_seed_claim_8k_context_with_16_token_blocks():
    """An 8k-token sequence with 16-token blocks needs 512 logical blocks: an int32 table row of 2 KiB.
    The physical cache can be far smaller than the logical context when the table repeats blocks."""
    seq_len, block_size, num_physical_blocks = 8192, 16, 24
    logical_blocks = cdiv(seq_len, block_size)
    gen = generator(8192)
    block_tables = torch.randint(0, num_physical_blocks, (1, logical_blocks), generator=gen, dtype=torch.int32)
    assert block_tables[0].numel() == 512
    assert block_tables[0].nbytes == 2 * 1024
    key_cache, value_cache = random_kv_cache(num_physical_blocks, block_size, 1, 64, torch.float32, gen)
    query = randn((1, 2, 64), torch.float32, gen)
    check_decode((query, key_cache, value_cache, block_tables, int32([seq_len])))


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=attention_shapes(), seq_lens=decode_seq_lens(), data=st.data())
def test_decode_random_batches(cpu_isa, shape, seq_lens, data):
    block_tables = data.draw(block_tables_for(seq_lens, shape.block_size, shape.num_blocks))
    # None: automatic; a small multiple of the block size: many partitions; huge: single pass.
    partition_size = data.draw(st.sampled_from([None, shape.block_size, 4 * shape.block_size, SINGLE_PASS]))
    gen = generator(shape.seed)
    key_cache, value_cache = random_kv_cache(shape.num_blocks, shape.block_size, shape.num_kv_heads,
                                             shape.head_size, shape.dtype, gen)
    query = randn((len(seq_lens), shape.num_heads, shape.head_size), shape.dtype, gen)
    check_decode((query, key_cache, value_cache, block_tables, int32(seq_lens)), partition_size=partition_size)


@pytest.mark.parametrize("num_threads", [1, 3])
def test_decode_bits_do_not_depend_on_thread_count(cpu_isa, num_threads):
    """Work items are handed to whichever thread is free; each must compute the same bits anywhere."""
    args = make_decode([1, 700, 1300, 33], 16, 8, 2, 64, torch.float32, num_blocks=40)
    baseline = check_decode(args, partition_size=256)
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        assert torch.equal(ops.paged_attention(*args, partition_size=256), baseline)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_never_reads_slots_past_seq_len(cpu_isa, dtype):
    """NaN in every slot outside the sequences (block tails, unused blocks) must not reach the output."""
    seq_lens = [1, 17, 600, 45]
    gen = generator(9)
    key_cache, value_cache = random_kv_cache(60, 16, 2, 64, dtype, gen)
    block_tables = distinct_block_tables(seq_lens, 16, 60, gen)
    poison_unused_slots([key_cache, value_cache], block_tables, int32(seq_lens))
    query = randn((len(seq_lens), 4, 64), dtype, gen)
    args = (query, key_cache, value_cache, block_tables, int32(seq_lens))
    for partition_size in (None, 64, SINGLE_PASS):
        check_decode(args, partition_size=partition_size)
