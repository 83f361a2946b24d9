"""Builders of op inputs (caches, block tables, fused qkv views) and hypothesis strategies for them.

Everything random takes a torch.Generator, so a hypothesis example (which draws the seed) is
reproducible. Sizes stay small: the reference runs python loops."""
import itertools
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from kvpage import ops

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HEAD_SIZES = (16, 48, 64, 80, 96, 112, 128, 192, 256)
BLOCK_SIZES = (8, 16, 32)
# Every block size the kernels accept; the extremes get their own tests.
ALL_BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# (num_heads, num_kv_heads): SmolLM2's 9/3 and Llama-3-8B's 32/8 for GQA.
HEAD_CONFIGS = {"mha": (4, 4), "gqa9x3": (9, 3), "gqa32x8": (32, 8), "mqa": (8, 1)}
DEFAULT_PARTITION = 512  # tokens per decode partition when the kernel splits on its own


def cdiv(a, b):
    return -(-a // b)


def generator(seed=0):
    return torch.Generator().manual_seed(seed)


def randn(shape, dtype, gen):
    return torch.randn(shape, generator=gen).to(dtype)


def int32(values):
    return torch.tensor(values, dtype=torch.int32)


def write_every_value(values, cache_dtype, **scales):
    """values laid out as tokens of 2 KV heads x 64 (the last token padded with repeats) and written by
    ops.reshape_and_cache and by reference.reshape_and_cache into fresh caches of cache_dtype, in random
    slots (every 7th token skipped); returns (kvpage's caches, the reference's), for a bit comparison."""
    from kvpage.ops import reference

    num_kv_heads, head_size, block_size = 2, 64, 16
    per_token = num_kv_heads * head_size
    num_tokens = cdiv(values.numel(), per_token)
    values = torch.cat([values, values[: num_tokens * per_token - values.numel()]])
    key = values.view(num_tokens, num_kv_heads, head_size)
    value = key.flip(0)
    num_blocks = cdiv(num_tokens, block_size) + 1
    caches = ops.allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_size, cache_dtype)
    expected = [t.clone() for t in caches]
    slots = torch.randperm(num_blocks * block_size, generator=generator(1))[:num_tokens]
    slots[::7] = -1
    ops.reshape_and_cache(key, value, *caches, slots, **scales)
    reference.reshape_and_cache(key, value, *expected, slots, **scales)
    return caches, expected


def random_kv_cache(num_blocks, block_size, num_kv_heads, head_size, dtype, gen):
    """A (key_cache, value_cache) from allocate_kv_cache, filled with random values."""
    key_cache, value_cache = ops.allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_size, dtype)
    key_cache.copy_(randn(key_cache.shape, dtype, gen))
    value_cache.copy_(randn(value_cache.shape, dtype, gen))
    return key_cache, value_cache


def random_block_tables(seq_lens, block_size, num_blocks, gen, extra_columns=1):
    """int32 [num_seqs, max_blocks]: physical blocks drawn with replacement from a small cache, so
    they repeat inside a row and across rows. Columns past a sequence's last block hold an id
    outside the cache: an op that reads them would be reading past its sequence."""
    max_blocks = max([cdiv(n, block_size) for n in seq_lens], default=0) + extra_columns
    tables = torch.full((len(seq_lens), max_blocks), num_blocks, dtype=torch.int32)
    for row, seq_len in enumerate(seq_lens):
        used = cdiv(seq_len, block_size)
        tables[row, :used] = torch.randint(0, num_blocks, (used,), generator=gen, dtype=torch.int32)
    return tables


def query_start_loc(q_lens):
    return int32([0, *itertools.accumulate(q_lens)])


def fused_qkv(num_tokens, num_heads, num_kv_heads, head_size, dtype, gen):
    """query, key, value [T, H, D] as views of one [T, (Hq + 2 Hkv) * D] projection output, the way
    a fused qkv linear leaves them: token stride is the fused width, not H * D."""
    qkv = randn((num_tokens, (num_heads + 2 * num_kv_heads) * head_size), dtype, gen)
    q, k, v = qkv.split([num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size], dim=-1)
    return (q.view(num_tokens, num_heads, head_size), k.view(num_tokens, num_kv_heads, head_size),
            v.view(num_tokens, num_kv_heads, head_size))


def snapshot(*tensors):
    return [t.clone() for t in tensors]


# -- hypothesis strategies ------------------------------------------------------------------------


@dataclass
class AttentionShape:
    dtype: torch.dtype
    head_size: int
    block_size: int
    num_heads: int
    num_kv_heads: int
    num_blocks: int  # few, so block tables repeat physical blocks
    seed: int


@st.composite
def attention_shapes(draw, max_block_size=64):
    num_kv_heads = draw(st.integers(1, 3))
    return AttentionShape(
        dtype=draw(st.sampled_from(DTYPES)),
        head_size=draw(st.sampled_from((16, 32, 64, 80, 128))),
        block_size=draw(st.sampled_from([b for b in ALL_BLOCK_SIZES if b <= max_block_size])),
        num_heads=num_kv_heads * draw(st.integers(1, 4)),
        num_kv_heads=num_kv_heads,
        num_blocks=draw(st.integers(1, 12)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@st.composite
def block_tables_for(draw, seq_lens, block_size, num_blocks):
    """Hypothesis-drawn block tables (shrinkable), same layout as random_block_tables."""
    extra_columns = draw(st.integers(0, 2))
    max_blocks = max([cdiv(n, block_size) for n in seq_lens], default=0) + extra_columns
    rows = []
    for seq_len in seq_lens:
        used = cdiv(seq_len, block_size)
        ids = draw(st.lists(st.integers(0, num_blocks - 1), min_size=used, max_size=used))
        rows.append(ids + [num_blocks] * (max_blocks - used))
    return torch.tensor(rows, dtype=torch.int32).reshape(len(seq_lens), max_blocks)


def decode_seq_lens(max_len=300, max_seqs=4):
    return st.lists(st.integers(1, max_len), min_size=1, max_size=max_seqs)


def prefill_lens(max_context=150, max_q_len=40, max_seqs=4):
    """Lists of (cached context, query length); either may be 0."""
    return st.lists(st.tuples(st.integers(0, max_context), st.integers(0, max_q_len)),
                    min_size=1, max_size=max_seqs)


def poison_unused_slots(caches, block_tables, seq_lens, value=float("nan")):
    """Fills every slot no sequence reads (tails of last blocks, unreferenced blocks) with value,
    the way stale data from a block's previous owner sits there. Needs tables that don't share blocks."""
    block_size = caches[0].shape[2]
    used = torch.zeros(caches[0].shape[0], block_size, dtype=torch.bool)
    for row, seq_len in zip(block_tables.tolist(), seq_lens.tolist()):
        for position in range(seq_len):
            used[row[position // block_size], position % block_size] = True
    assert not used.all(), "nothing to poison: the test would prove nothing"
    for cache in caches:
        cache.masked_fill_(~used[:, None, :, None], value)


def distinct_block_tables(seq_lens, block_size, num_blocks, gen):
    """Like random_block_tables, but no physical block appears twice."""
    tables = random_block_tables(seq_lens, block_size, num_blocks, gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    for row, seq_len in enumerate(seq_lens):
        used = cdiv(seq_len, block_size)
        tables[row, :used] = torch.tensor(order[:used], dtype=torch.int32)
        order = order[used:]
    return tables
