"""paged_prefill_attention of a bfloat16 query over a bfloat16 cache (a bfloat16 model's prefill) against
reference.paged_prefill_attention, under every CPU kernel ISA: where the CPU has AMX-BF16, the kernel grants the
tile state and the build has the AMX translation unit, the avx512 kernels run it on AMX tiles
(csrc/cpu/attention_amx.h); elsewhere, and under generic / avx2, the widening FMA kernels do. Each test asserts
which path it ran, against an expectation the test derives itself (amx_expected), not the extension's own.

Tolerance: the bfloat16 one of tolerances.py (2e-2). The tile products multiply the bf16 operands exactly
and sum in fp32, as the reference's fp32 products of the same values do; the probabilities are rounded to
bf16 for the values' product (as FlashAttention does), a relative 2^-9 per probability, far inside the output's
own bf16 rounding (2^-8) and the 2e-2; the log-sum-exps come from the fp32 scores and sums, checked at the
fp32 LSE tolerance."""
import functools

import pytest
import torch

import kvpage._C
from kvpage import ops
from kvpage.ops import reference
from paged_data import (distinct_block_tables, generator, int32, poison_unused_slots, query_start_loc,
                        random_block_tables, random_kv_cache, randn)
import tile_permission
from tolerances import assert_attention_close, assert_lse_close

DTYPE = torch.bfloat16


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


# Asked once per test session (in a fresh process).
kernel_grants_tiles = functools.cache(tile_permission.kernel_grants_tiles)


def amx_expected(isa: str) -> bool:
    """Where the AMX path must run: the avx512 kernels, on a CPU with AMX-BF16, AMX-TILE and AVX512-BF16, whose
    kernel grants the tile state, in an extension compiled with the AMX translation unit (CMake leaves it out
    where the compiler lacks -mamx-tile -mamx-bf16 -mavx512bf16: _C.built_with_amx)."""
    return isa == "avx512" and cpu_has_amx() and kernel_grants_tiles() and kvpage._C.built_with_amx


def cpu_has_amx() -> bool:
    return {"amx_bf16", "amx_tile", "avx512_bf16"} <= cpu_flags()


@pytest.fixture
def attention_path(cpu_isa):
    """The path a bf16 prefill takes under this ISA ("amx" or the ISA's FMA kernels), checked against
    amx_expected."""
    active = kvpage._C.amx_attention_active()
    expected = amx_expected(cpu_isa)
    assert active == expected, (f"AMX attention active: {active} under {cpu_isa}, expected {expected} (CPU has "
                                f"AMX-BF16/AMX-TILE/AVX512-BF16: {cpu_has_amx()}, kernel grants the tiles: "
                                f"{kernel_grants_tiles()}, built with AMX: {kvpage._C.built_with_amx})")
    # The test process never asks for the tiles itself: the extension must have (dispatch.cpp).
    assert not active or tile_permission.tiles_permitted(), "AMX attention active but the tile state was never requested"
    path = "amx" if active else cpu_isa
    print(f"bf16 prefill attention path: {path}")
    return path


def make_inputs(lens, block_size, num_heads, num_kv_heads, head_size, num_blocks, seed=0, poison=False):
    """A varlen step of bf16 query and cache; lens: (cached context, query length) per sequence. poison: NaN
    in every slot no sequence reads (a block's tail, unused blocks), where stale data would sit."""
    gen = generator(seed)
    q_lens = [q for _, q in lens]
    seq_lens = [context + q for context, q in lens]
    key_cache, value_cache = random_kv_cache(num_blocks, block_size, num_kv_heads, head_size, DTYPE, gen)
    tables = (distinct_block_tables if poison else random_block_tables)(seq_lens, block_size, num_blocks, gen)
    if poison:
        poison_unused_slots([key_cache, value_cache], tables, int32(seq_lens))
    query = randn((sum(q_lens), num_heads, head_size), DTYPE, gen)
    return query, key_cache, value_cache, tables, query_start_loc(q_lens), int32(seq_lens)


def check(args, **options):
    out, lse = ops.paged_prefill_attention(*args, return_lse=True, **options)
    expected, expected_lse = reference.paged_prefill_attention(*args, return_lse=True, **options)
    assert_attention_close(out, expected)
    assert_lse_close(lse, expected_lse)


# Ragged steps: empty and one-token sequences, prompts around the 16-row tiles and the query tiles, chunks
# starting mid-block and on block edges, a long history (a chat turn's prefill).
def ragged_lens(block_size):
    return [(0, 0), (0, 1), (0, 17), (block_size - 1, 15), (block_size, 16), (3 * block_size + 5, 64),
            (0, 65), (2 * block_size, 0), (7, 130), (1300, 130)]


@pytest.mark.parametrize("heads", [(9, 3), (8, 1), (4, 4), (32, 8)], ids=["gqa9x3", "mqa", "mha", "gqa32x8"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_bf16_prefill_ragged_steps(attention_path, heads, block_size):
    check(make_inputs(ragged_lens(block_size), block_size, *heads, 64, num_blocks=2000 // block_size))


# 128 and 256 take the tiles; 96 three 32-element slices; 80 keeps the FMA kernels (not whole tiles).
@pytest.mark.parametrize("head_size", [80, 96, 128, 256])
def test_bf16_prefill_head_sizes(attention_path, head_size):
    check(make_inputs([(0, 40), (100, 70), (517, 33)], 16, 6, 2, head_size, num_blocks=64))


# Blocks of 8 keep the FMA kernels (a 16-token tile would span two blocks); 64 and 128 hold several tiles,
# 256 makes a chunk of its own.
@pytest.mark.parametrize("block_size", [8, 64, 128, 256])
def test_bf16_prefill_block_sizes(attention_path, block_size):
    check(make_inputs([(0, 50), (block_size + 3, 20), (2 * block_size - 1, 70)], block_size, 9, 3, 64,
                      num_blocks=max(8, 600 // block_size)))


def test_bf16_prefill_long_context(attention_path):
    """A long history (several 128-token chunks, causal diagonal in the last) after a cached 4k prefix."""
    check(make_inputs([(4000, 96), (2500, 300)], 16, 8, 2, 128, num_blocks=460))


def test_bf16_prefill_never_reads_slots_past_seq_len(attention_path):
    """NaN in every unused slot: the K tiles read a block's tail (masked) and the V tiles must not carry it
    into the sums (0 * NaN)."""
    check(make_inputs([(0, 1), (10, 7), (300, 45), (0, 0), (3, 0), (29, 35)], 16, 6, 2, 64, num_blocks=60,
                      poison=True))


def test_bf16_prefill_window_softcap_sinks(attention_path):
    """The options on the same path: a window's lower edge inside a chunk, a soft cap, per-head sinks."""
    args = make_inputs([(1300, 130), (255, 12), (0, 64)], 16, 9, 3, 64, num_blocks=120)
    sinks = torch.randn(9, generator=generator(1)) * 2
    check(args, sliding_window=200)
    check(args, softcap=3.0)
    check(args, sliding_window=33, softcap=3.0, sinks=sinks)


def test_bf16_prefill_scale(attention_path):
    """A scale that is not a power of two (the AMX path scales the fp32 scores, not the bf16 query)."""
    check(make_inputs([(200, 70), (0, 33)], 16, 4, 2, 128, num_blocks=40), scale=0.3)
