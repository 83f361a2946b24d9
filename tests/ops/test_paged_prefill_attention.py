"""paged_prefill_attention (varlen causal over the paged cache) against reference.paged_prefill_attention."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from kvpage import ops
from kvpage.ops import reference
from paged_data import (ALL_BLOCK_SIZES, BLOCK_SIZES, DTYPES, HEAD_CONFIGS, HEAD_SIZES, attention_shapes,
                        block_tables_for, fused_qkv, generator, int32, prefill_lens, query_start_loc, randn,
                        distinct_block_tables, poison_unused_slots, random_block_tables,
                        random_kv_cache)
from tolerances import assert_attention_close


def make_prefill(lens, block_size, num_heads, num_kv_heads, head_size, dtype, num_blocks=10, seed=0,
                 fused=False):
    """Inputs for one varlen step; lens is a list of (cached context, query length) per sequence."""
    gen = generator(seed)
    q_lens = [q_len for _, q_len in lens]
    seq_lens = [context + q_len for context, q_len in lens]
    key_cache, value_cache = random_kv_cache(num_blocks, block_size, num_kv_heads, head_size, dtype, gen)
    block_tables = random_block_tables(seq_lens, block_size, num_blocks, gen)
    if fused:
        query = fused_qkv(sum(q_lens), num_heads, num_kv_heads, head_size, dtype, gen)[0]
    else:
        query = randn((sum(q_lens), num_heads, head_size), dtype, gen)
    return query, key_cache, value_cache, block_tables, query_start_loc(q_lens), int32(seq_lens)


def check_prefill(args, **kwargs):
    out = ops.paged_prefill_attention(*args, **kwargs)
    assert_attention_close(out, reference.paged_prefill_attention(*args, **kwargs))
    return out


def matrix_lens(block_size):
    """(context, q_len): empty sequences, single tokens after a prefix, a fresh prompt spilling into
    a second block, a chunk that starts mid-block, a prefix with no new tokens, a two-block chunk."""
    return [(0, 0), (0, 1), (2 * block_size + 3, 1), (0, block_size + 3), (block_size - 2, 5), (7, 0),
            (2 * block_size, 2 * block_size)]


@pytest.mark.parametrize("heads", HEAD_CONFIGS.values(), ids=HEAD_CONFIGS.keys())
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_matrix(dtype, head_size, block_size, heads):
    check_prefill(make_prefill(matrix_lens(block_size), block_size, *heads, head_size, dtype, fused=True))


@pytest.mark.parametrize("block_size", [b for b in ALL_BLOCK_SIZES if b not in BLOCK_SIZES])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_every_power_of_two_block_size(dtype, block_size):
    lens = [(0, 3), (block_size + 1, 4), (block_size - 1, 1), (130, 50)]
    check_prefill(make_prefill(lens, block_size, 9, 3, 64, dtype, num_blocks=max(4, 400 // block_size)))


@pytest.mark.parametrize("head_size", [64, 256])
@pytest.mark.parametrize("heads", HEAD_CONFIGS.values(), ids=HEAD_CONFIGS.keys())
def test_prefill_query_lengths_around_tile_sizes(cpu_isa, heads, head_size):
    # The kernel tiles query tokens (sizes depend on head size and group); lengths around 2^k cover
    # full, partial and single-token tiles whatever the tile size.
    lens = [(0, 63), (5, 64), (0, 65), (40, 17), (0, 4), (3, 129)]
    check_prefill(make_prefill(lens, 16, *heads, head_size, torch.float32, num_blocks=16))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_after_a_long_cached_prefix(cpu_isa, dtype):
    """A prefix-cache hit: most of the context is already cached, only a few tokens are new."""
    lens = [(1500, 3), (700, 1), (1030, 40)]
    check_prefill(make_prefill(lens, 16, 8, 2, 64, dtype, num_blocks=32))


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", HEAD_CONFIGS.values(), ids=HEAD_CONFIGS.keys())
def test_prefill_long_history_tile_edges(cpu_isa, heads, block_size):
    """A chat turn's prefill over a long cached history: several 128-token chunks and 64-token value
    runs, with query tiles whose rows fill whole vectors, part of one, or only 8-15 lanes of one (a
    prompt's last tile, which the wide kernels take from half a vector on), contexts at and beside block
    boundaries; then a window, a softcap and sinks on the same shapes."""
    lens = [(1300, 130), (64 * block_size, 37), (255, 12), (40 * block_size - 1, 1)]
    args = make_prefill(lens, block_size, *heads, 64, torch.float32, num_blocks=48)
    check_prefill(args)
    sinks = torch.randn(heads[0], generator=generator(1)) * 2
    check_prefill(args, sliding_window=200, softcap=3.0, sinks=sinks)


def test_prefill_with_no_query_tokens():
    args = make_prefill([(0, 0), (5, 0)], 16, 4, 4, 64, torch.float32)
    assert args[0].shape[0] == 0
    assert ops.paged_prefill_attention(*args).shape == args[0].shape


def test_prefill_of_one_token_matches_decode(cpu_isa):
    """A q_len-1 prefill after a prefix is a decode step; the two kernels must agree."""
    lens = [(40, 1), (0, 1), (333, 1)]
    query, key_cache, value_cache, block_tables, loc, seq_lens = make_prefill(lens, 16, 9, 3, 64, torch.float32)
    prefill = check_prefill((query, key_cache, value_cache, block_tables, loc, seq_lens))
    decode = ops.paged_attention(query, key_cache, value_cache, block_tables, seq_lens)
    assert_attention_close(prefill, decode)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_chunked_prefill_matches_whole_prompt(cpu_isa, dtype):
    """Chunked prefill as the engine runs it: each chunk's K/V is written by reshape_and_cache, then
    the chunk attends to everything cached so far. Chunk boundaries fall mid-block on purpose."""
    block_size, num_heads, num_kv_heads, head_size = 16, 6, 2, 64
    chunks = [37, 1, 50, 12]
    prompt_len = sum(chunks)
    gen = generator(3)
    query, key, value = fused_qkv(prompt_len, num_heads, num_kv_heads, head_size, dtype, gen)
    key_cache, value_cache = ops.allocate_kv_cache(12, block_size, num_kv_heads, head_size, dtype)
    block_tables = int32([[11, 3, 7, 0, 5, 9, 2]])
    slots = torch.tensor([int(block_tables[0, p // block_size]) * block_size + p % block_size
                          for p in range(prompt_len)])

    chunk_outputs, done = [], 0
    for chunk in chunks:
        tokens = slice(done, done + chunk)
        ops.reshape_and_cache(key[tokens], value[tokens], key_cache, value_cache, slots[tokens])
        done += chunk
        args = (query[tokens], key_cache, value_cache, block_tables, int32([0, chunk]), int32([done]))
        chunk_outputs.append(check_prefill(args))

    whole = ops.paged_prefill_attention(query, key_cache, value_cache, block_tables, int32([0, prompt_len]),
                                        int32([prompt_len]))
    assert_attention_close(torch.cat(chunk_outputs), whole)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=attention_shapes(), lens=prefill_lens(), data=st.data())
def test_prefill_random_batches(cpu_isa, shape, lens, data):
    seq_lens = [context + q_len for context, q_len in lens]
    q_lens = [q_len for _, q_len in lens]
    block_tables = data.draw(block_tables_for(seq_lens, shape.block_size, shape.num_blocks))
    gen = generator(shape.seed)
    key_cache, value_cache = random_kv_cache(shape.num_blocks, shape.block_size, shape.num_kv_heads,
                                             shape.head_size, shape.dtype, gen)
    query = randn((sum(q_lens), shape.num_heads, shape.head_size), shape.dtype, gen)
    check_prefill((query, key_cache, value_cache, block_tables, query_start_loc(q_lens), int32(seq_lens)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_never_reads_slots_past_seq_len(cpu_isa, dtype):
    """NaN in every slot outside the sequences (block tails, unused blocks) must not reach the output."""
    lens = [(0, 1), (10, 7), (300, 45), (0, 0), (3, 0)]
    seq_lens = int32([context + q_len for context, q_len in lens])
    gen = generator(10)
    key_cache, value_cache = random_kv_cache(40, 16, 2, 64, dtype, gen)
    block_tables = distinct_block_tables(seq_lens.tolist(), 16, 40, gen)
    poison_unused_slots([key_cache, value_cache], block_tables, seq_lens)
    query = randn((sum(q for _, q in lens), 6, 64), dtype, gen)
    check_prefill((query, key_cache, value_cache, block_tables, query_start_loc([q for _, q in lens]), seq_lens))
