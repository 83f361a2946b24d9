"""paged_attention / paged_prefill_attention with sliding_window, softcap and sinks: against
reference.py, against torch SDPA over contiguous K/V with an explicit mask (softcap through a manual
softmax, sinks as one more key), on every CPU ISA; the table entries and blocks a window cannot see are
never read (garbage ids, NaN blocks); lse carries the sink once, so merges compose; bad arguments named."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from kvpage import ops
from kvpage.ops import reference
from paged_data import (ALL_BLOCK_SIZES, DTYPES, HEAD_CONFIGS, attention_shapes, block_tables_for, cdiv, generator,
                        int32, query_start_loc, randn, random_block_tables, random_kv_cache)
from tolerances import assert_attention_close, assert_lse_close

SINGLE_PASS = 1 << 20
BAD_ID = 1 << 30  # a block id far outside any cache: reading it would fault or raise


def sinks_for(num_heads, seed=0):
    """Sinks around the scores' size (some above every score, some below), as trained ones are."""
    return torch.randn(num_heads, generator=generator(seed)) * 2


def first_block(first_pos, block_size, window):
    return reference.first_visible_block(first_pos, block_size, window)


def hide_blocks_before_window(block_tables, first_positions, block_size, window, fill):
    """Writes fill into each row's entries before its earliest query's first visible block."""
    tables = block_tables.clone()
    for row, pos in enumerate(first_positions):
        tables[row, : first_block(pos, block_size, window)] = fill
    return tables


def make_decode(seq_lens, block_size, num_heads, num_kv_heads, head_size=64, dtype=torch.float32, num_blocks=None,
                seed=0):
    gen = generator(seed)
    num_blocks = num_blocks or max(4, sum(cdiv(n, block_size) for n in seq_lens) // 2 + 1)
    key_cache, value_cache = random_kv_cache(num_blocks, block_size, num_kv_heads, head_size, dtype, gen)
    block_tables = random_block_tables(seq_lens, block_size, num_blocks, gen)
    query = randn((len(seq_lens), num_heads, head_size), dtype, gen)
    return query, key_cache, value_cache, block_tables, int32(seq_lens)


def make_prefill(lens, block_size, num_heads, num_kv_heads, head_size=64, dtype=torch.float32, num_blocks=None,
                 seed=0):
    """lens: (cached context, query length) per sequence."""
    gen = generator(seed)
    seq_lens = [c + q for c, q in lens]
    num_blocks = num_blocks or max(4, sum(cdiv(n, block_size) for n in seq_lens) // 2 + 1)
    key_cache, value_cache = random_kv_cache(num_blocks, block_size, num_kv_heads, head_size, dtype, gen)
    block_tables = random_block_tables(seq_lens, block_size, num_blocks, gen)
    query = randn((sum(q for _, q in lens), num_heads, head_size), dtype, gen)
    return query, key_cache, value_cache, block_tables, query_start_loc([q for _, q in lens]), int32(seq_lens)


def check_decode(args, lse=True, **kwargs):
    out, got_lse = ops.paged_attention(*args, return_lse=True, **kwargs)
    options = {k: v for k, v in kwargs.items() if k != "partition_size"}
    want, want_lse = reference.paged_attention(*args, return_lse=True, **options)
    assert_attention_close(out, want)
    if lse:
        assert_lse_close(got_lse, want_lse)
    return out


def check_prefill(args, **kwargs):
    out, got_lse = ops.paged_prefill_attention(*args, return_lse=True, **kwargs)
    want, want_lse = reference.paged_prefill_attention(*args, return_lse=True, **kwargs)
    assert_attention_close(out, want)
    assert_lse_close(got_lse, want_lse)
    return out


OPTION_SETS = {
    "window": dict(sliding_window=True),
    "softcap": dict(softcap=True),
    "sinks": dict(sinks=True),
    "window+softcap": dict(sliding_window=True, softcap=True),
    "window+sinks": dict(sliding_window=True, sinks=True),
    "all": dict(sliding_window=True, softcap=True, sinks=True),
}


def options(which, window, num_heads):
    """Concrete options for an OPTION_SETS entry; softcap 3 bites (scores here reach ~5)."""
    return {"sliding_window": window if "sliding_window" in which else None,
            "softcap": 3.0 if "softcap" in which else None,
            "sinks": sinks_for(num_heads) if "sinks" in which else None}


# -- decode -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", OPTION_SETS.values(), ids=OPTION_SETS.keys())
@pytest.mark.parametrize("heads", HEAD_CONFIGS.values(), ids=HEAD_CONFIGS.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_options(cpu_isa, dtype, heads, which):
    # Windows smaller than, equal to and larger than the contexts; 37 ends mid-block.
    seq_lens = [1, 15, 16, 37, 38, 100, 700]
    args = make_decode(seq_lens, 16, *heads, dtype=dtype, num_blocks=60)
    for window in (1, 16, 37, 1000):
        for partition_size in (None, 64, SINGLE_PASS):
            check_decode(args, partition_size=partition_size, **options(which, window, heads[0]))


@pytest.mark.parametrize("block_size", ALL_BLOCK_SIZES)
def test_decode_window_every_block_size(cpu_isa, block_size):
    seq_lens = [1, block_size, block_size + 1, 3 * block_size + 2, 300]
    args = make_decode(seq_lens, block_size, 9, 3, num_blocks=max(4, 700 // block_size))
    for window in (1, block_size - 1 or 1, block_size + 3, 2 * block_size, 299, 300, 301):
        check_decode(args, partition_size=None, sliding_window=window, sinks=sinks_for(9))
        check_decode(args, partition_size=block_size, sliding_window=window, softcap=2.5)


@pytest.mark.parametrize("dtype", DTYPES + (torch.float8_e4m3fn,), ids=str)
@pytest.mark.parametrize("fill", [BAD_ID, -1], ids=["huge-id", "minus-one"])
def test_decode_never_reads_entries_before_the_window(cpu_isa, dtype, fill):
    """Table entries before the window's first block hold ids no cache has (what the block manager's
    NULL_BLOCK may be): range checks must skip them and the kernel must not read them, in every path."""
    compute = torch.float32 if dtype == torch.float8_e4m3fn else dtype
    seq_lens = [5, 40, 333, 1100]
    window = 50
    query, key_cache, value_cache, tables, lens = make_decode(seq_lens, 16, 8, 2, dtype=compute, num_blocks=100)
    if dtype == torch.float8_e4m3fn:
        key_cache, value_cache = (reference.quantize_fp8(c) for c in (key_cache, value_cache))
    tables = hide_blocks_before_window(tables, [n - 1 for n in seq_lens], 16, window, fill)
    args = (query, key_cache, value_cache, tables, lens)
    for checks in (True, False):
        with ops.range_checks(checks):
            for partition_size in (None, 32, SINGLE_PASS):
                check_decode(args, partition_size=partition_size, sliding_window=window, sinks=sinks_for(8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_never_reads_blocks_before_the_window(cpu_isa, dtype):
    """Every block only out-of-window entries name is NaN: one read would reach the output."""
    seq_lens, window, block_size = [64, 200, 517], 70, 16
    query, key_cache, value_cache, _, lens = make_decode(seq_lens, block_size, 6, 2, dtype=dtype, num_blocks=60)
    used = [cdiv(n, block_size) for n in seq_lens]
    order = torch.randperm(60, generator=generator(4)).tolist()
    tables = torch.zeros(len(seq_lens), max(used), dtype=torch.int32)
    for row, n in enumerate(used):
        tables[row, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
    for row, n in enumerate(seq_lens):
        hidden = tables[row, : first_block(n - 1, block_size, window)].long()
        key_cache[hidden] = float("nan")
        value_cache[hidden] = float("nan")
    args = (query, key_cache, value_cache, tables, lens)
    for partition_size in (None, 16, 64, SINGLE_PASS):
        out = ops.paged_attention(*args, partition_size=partition_size, sliding_window=window)
        assert not out.isnan().any()
        clean = hide_blocks_before_window(tables, [n - 1 for n in seq_lens], block_size, window, 0)
        assert_attention_close(out, reference.paged_attention(query, key_cache, value_cache, clean, lens,
                                                              sliding_window=window))


def draw_random_step(data, shape, seq_lens, first_positions, num_queries, max_window, fill):
    """Hypothesis-drawn options, and (query, caches, block tables) whose entries before each window
    hold fill."""
    block_tables = data.draw(block_tables_for(seq_lens, shape.block_size, shape.num_blocks))
    opts = {"sliding_window": data.draw(st.one_of(st.none(), st.integers(1, max_window))),
            "softcap": data.draw(st.one_of(st.none(), st.floats(0.5, 50.0))),
            "sinks": sinks_for(shape.num_heads, shape.seed) if data.draw(st.booleans()) else None}
    gen = generator(shape.seed)
    caches = random_kv_cache(shape.num_blocks, shape.block_size, shape.num_kv_heads, shape.head_size, shape.dtype,
                             gen)
    query = randn((num_queries, shape.num_heads, shape.head_size), shape.dtype, gen)
    block_tables = hide_blocks_before_window(block_tables, first_positions, shape.block_size,
                                             opts["sliding_window"], fill)
    return opts, (query, *caches, block_tables)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(shape=attention_shapes(), seq_lens=st.lists(st.integers(1, 300), min_size=1, max_size=4), data=st.data())
def test_decode_random_options(cpu_isa, shape, seq_lens, data):
    partition_size = data.draw(st.sampled_from([None, shape.block_size, 4 * shape.block_size, SINGLE_PASS]))
    opts, args = draw_random_step(data, shape, seq_lens, [n - 1 for n in seq_lens], len(seq_lens), 320, -1)
    check_decode((*args, int32(seq_lens)), partition_size=partition_size, **opts)


# -- prefill ------------------------------------------------------------------------------------------


def window_lens(block_size):
    """(context, q_len): a fresh prompt several windows long, a chunk starting mid-block after a long
    context, single tokens, a chunk shorter than the window after a context longer than it."""
    return [(0, 3 * block_size + 5), (5 * block_size + 3, 2 * block_size + 1), (2 * block_size, 1), (0, 1),
            (7 * block_size - 2, 9), (block_size - 1, 0)]


@pytest.mark.parametrize("which", OPTION_SETS.values(), ids=OPTION_SETS.keys())
@pytest.mark.parametrize("heads", HEAD_CONFIGS.values(), ids=HEAD_CONFIGS.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_options(cpu_isa, dtype, heads, which):
    args = make_prefill(window_lens(16), 16, *heads, dtype=dtype, num_blocks=40)
    for window in (1, 16, 21, 60, 1000):
        check_prefill(args, **options(which, window, heads[0]))


@pytest.mark.parametrize("block_size", ALL_BLOCK_SIZES)
def test_prefill_window_every_block_size(cpu_isa, block_size):
    lens = [(0, 70), (block_size + 1, 4), (130, 50), (3, 0)]
    args = make_prefill(lens, block_size, 9, 3, num_blocks=max(4, 400 // block_size))
    for window in (1, block_size + 3, 2 * block_size, 64, 181, 500):
        check_prefill(args, sliding_window=window, sinks=sinks_for(9))
        check_prefill(args, sliding_window=window, softcap=4.0)


@pytest.mark.parametrize("heads", [(4, 4), (32, 2)], ids=["mha", "group16"])
def test_prefill_long_tiles_with_window(cpu_isa, heads):
    """Query tiles (64 rows) longer than the window: rows of one tile start reading at different
    blocks; row and wide (rows across lanes) layouts alike."""
    lens = [(0, 300), (200, 129), (1000, 65)]
    args = make_prefill(lens, 16, *heads, num_blocks=60)
    for window in (7, 33, 64, 100):
        check_prefill(args, sliding_window=window, softcap=3.0, sinks=sinks_for(heads[0]))


@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn], ids=["float16", "fp8"])
@pytest.mark.parametrize("fill", [BAD_ID, -1], ids=["huge-id", "minus-one"])
def test_prefill_never_reads_entries_before_the_window(cpu_isa, fill, cache_dtype):
    lens = [(0, 40), (300, 20), (150, 1), (700, 130)]
    window = 45
    query, key_cache, value_cache, tables, loc, lens_t = make_prefill(lens, 16, 6, 2, dtype=torch.float16,
                                                                      num_blocks=80)
    if cache_dtype is not None:
        key_cache, value_cache = (reference.quantize_fp8(c, 0.5) for c in (key_cache, value_cache))
    tables = hide_blocks_before_window(tables, [c for c, _ in lens], 16, window, fill)
    scales = dict(k_scale=0.5, v_scale=0.5) if cache_dtype is not None else {}
    for checks in (True, False):
        with ops.range_checks(checks):
            check_prefill((query, key_cache, value_cache, tables, loc, lens_t), sliding_window=window,
                          sinks=sinks_for(6), **scales)


def test_prefill_never_reads_blocks_before_the_window(cpu_isa):
    lens, window, block_size = [(100, 30), (400, 64)], 50, 16
    seq_lens = [c + q for c, q in lens]
    query, key_cache, value_cache, _, loc, lens_t = make_prefill(lens, block_size, 6, 2, num_blocks=60)
    tables = torch.arange(60, dtype=torch.int32)[torch.randperm(60, generator=generator(2))][:2 * 30].view(2, 30)
    for row, (context, _) in enumerate(lens):
        hidden = tables[row, : first_block(context, block_size, window)].long()
        key_cache[hidden] = float("nan")
        value_cache[hidden] = float("nan")
    out = ops.paged_prefill_attention(query, key_cache, value_cache, tables, loc, lens_t, sliding_window=window)
    assert not out.isnan().any()
    clean = hide_blocks_before_window(tables, [c for c, _ in lens], block_size, window, 0)
    assert_attention_close(out, reference.paged_prefill_attention(query, key_cache, value_cache, clean, loc, lens_t,
                                                                  sliding_window=window))
    assert max(seq_lens) <= 30 * block_size


def test_chunked_prefill_with_window_matches_whole_prompt(cpu_isa):
    """Chunks that start mid-block, each attending to the window behind it, give the whole prompt's
    rows; and the decode kernel agrees with a one-token chunk."""
    block_size, window = 16, 37
    query, key_cache, value_cache, tables, _, _ = make_prefill([(0, 150)], block_size, 8, 2, num_blocks=20)
    sinks = sinks_for(8)
    whole = ops.paged_prefill_attention(query, key_cache, value_cache, tables, int32([0, 150]), int32([150]),
                                        sliding_window=window, softcap=3.0, sinks=sinks)
    done = 0
    for chunk in (37, 1, 50, 12, 49, 1):
        rows = slice(done, done + chunk)
        done += chunk
        got = check_prefill((query[rows], key_cache, value_cache, tables, int32([0, chunk]), int32([done])),
                            sliding_window=window, softcap=3.0, sinks=sinks)
        assert_attention_close(got, whole[rows])
    decode = ops.paged_attention(query[-1:], key_cache, value_cache, tables, int32([150]), sliding_window=window,
                                 softcap=3.0, sinks=sinks)
    assert_attention_close(decode, whole[-1:])


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(shape=attention_shapes(), lens=st.lists(st.tuples(st.integers(0, 150), st.integers(0, 70)), min_size=1,
                                               max_size=4), data=st.data())
def test_prefill_random_options(cpu_isa, shape, lens, data):
    seq_lens = [c + q for c, q in lens]
    q_lens = [q for _, q in lens]
    opts, args = draw_random_step(data, shape, seq_lens, [c for c, _ in lens], sum(q_lens), 240, BAD_ID)
    check_prefill((*args, query_start_loc(q_lens), int32(seq_lens)), **opts)


# -- torch SDPA over contiguous K/V ---------------------------------------------------------------------


def sdpa_expected(query, key, value, positions, scale, sliding_window=None, softcap=None, sinks=None):
    """query [q, Hq, D] at positions, key/value [k, Hkv, D] at 0..k-1: torch's SDPA with an explicit
    mask; softcap through a manual softmax; sinks as one more key per head, scoring the sink exactly
    (an extra head dimension: 1 in every query, sink / scale in that key, 0 in the others) with a
    zero value."""
    group = query.shape[1] // key.shape[1]
    q = query.double().transpose(0, 1)
    k = key.double().repeat_interleave(group, dim=1).transpose(0, 1)
    v = value.double().repeat_interleave(group, dim=1).transpose(0, 1)
    key_pos = torch.arange(key.shape[0])
    mask = key_pos[None, :] <= positions[:, None]
    if sliding_window is not None:
        mask &= key_pos[None, :] > positions[:, None] - sliding_window
    mask = mask.expand(q.shape[0], -1, -1)
    if sinks is not None:
        heads, rows, d = q.shape
        q = torch.cat([q, q.new_ones(heads, rows, 1)], dim=-1)
        k = torch.cat([k, k.new_zeros(heads, k.shape[1], 1)], dim=-1)
        sink_key = torch.cat([k.new_zeros(heads, 1, d), sinks.double()[:, None, None] / scale], dim=-1)
        k = torch.cat([k, sink_key], dim=1)
        v = torch.cat([v, v.new_zeros(heads, 1, v.shape[2])], dim=1)
        mask = torch.cat([mask, mask.new_ones(heads, rows, 1)], dim=-1)
    if softcap is None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    else:
        scores = q @ k.transpose(1, 2) * scale
        real = slice(0, key.shape[0])  # the sink's logit is not capped
        scores[..., real] = softcap * torch.tanh(scores[..., real] / softcap)
        scores = scores.masked_fill(~mask, float("-inf"))
        weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
        out = (weights / weights.sum(dim=-1, keepdim=True)) @ v
    return out.transpose(0, 1).to(query.dtype)


def cache_sequence(key, value, block_size, num_blocks, gen, dtype):
    """key/value [n, Hkv, D] written by reshape_and_cache into random distinct blocks; (caches, table row)."""
    caches = ops.allocate_kv_cache(num_blocks, block_size, key.shape[1], key.shape[2], dtype)
    for c in caches:
        c.fill_(float("nan"))
    blocks = torch.randperm(num_blocks, generator=gen)[: cdiv(key.shape[0], block_size)]
    slots = (blocks[torch.arange(key.shape[0]) // block_size] * block_size + torch.arange(key.shape[0]) % block_size)
    ops.reshape_and_cache(key, value, *caches, slots)
    return caches, blocks.to(torch.int32)[None, :]


@pytest.mark.parametrize("which", OPTION_SETS.values(), ids=OPTION_SETS.keys())
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_and_decode_match_sdpa(cpu_isa, dtype, block_size, which):
    gen = generator(5)
    seq_len, q_len, num_heads, num_kv_heads, d = 203, 75, 8, 2, 64
    key, value = (randn((seq_len, num_kv_heads, d), dtype, gen) for _ in range(2))
    query = randn((q_len, num_heads, d), dtype, gen)
    (key_cache, value_cache), table = cache_sequence(key, value, block_size, cdiv(seq_len, block_size) + 3, gen,
                                                     dtype)
    positions = torch.arange(seq_len - q_len, seq_len)
    for window in (1, 29, 75, 203, 500):
        opts = options(which, window, num_heads)
        want = sdpa_expected(query, key, value, positions, d ** -0.5, **opts)
        got = ops.paged_prefill_attention(query, key_cache, value_cache, table, int32([0, q_len]), int32([seq_len]),
                                          **opts)
        assert_attention_close(got, want)
        decode = ops.paged_attention(query[-1:], key_cache, value_cache, table, int32([seq_len]), **opts)
        assert_attention_close(decode, want[-1:])


# -- lse and merges -------------------------------------------------------------------------------------


def test_lse_with_sinks_merges_over_disjoint_keys(cpu_isa):
    """Attention over a context split in two (its first blocks, then the rest as a sequence of its own)
    merges to the whole when the sinks go to exactly one part: lse counts the sink once."""
    block_size, split_blocks, seq_len, heads = 16, 5, 230, (8, 2)
    query, key_cache, value_cache, tables, _ = make_decode([seq_len], block_size, *heads, num_blocks=30)
    sinks = sinks_for(8)
    whole, whole_lse = ops.paged_attention(query, key_cache, value_cache, tables, int32([seq_len]),
                                           return_lse=True, sinks=sinks, softcap=4.0)
    first = ops.paged_attention(query, key_cache, value_cache, tables[:, :split_blocks],
                                int32([split_blocks * block_size]), return_lse=True, sinks=sinks, softcap=4.0)
    rest = ops.paged_attention(query, key_cache, value_cache, tables[:, split_blocks:].contiguous(),
                               int32([seq_len - split_blocks * block_size]), return_lse=True, softcap=4.0)
    out, lse = ops.merge_attention_states([first[0], rest[0]], [first[1], rest[1]])
    assert_attention_close(out, whole)
    assert_lse_close(lse, whole_lse)


# -- bad arguments ------------------------------------------------------------------------------------------


BAD_OPTIONS = [
    (dict(sliding_window=0), ValueError, "sliding_window"),
    (dict(sliding_window=-3), ValueError, "sliding_window"),
    (dict(sliding_window=2.0), TypeError, "sliding_window"),
    (dict(sliding_window=True), TypeError, "sliding_window"),
    (dict(sliding_window=1 << 40), ValueError, "sliding_window"),
    (dict(softcap=0.0), ValueError, "softcap"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(softcap=float("inf")), ValueError, "softcap"),
    (dict(softcap=float("nan")), ValueError, "softcap"),
    (dict(softcap=1e39), ValueError, "softcap"),
    (dict(softcap="3"), TypeError, "softcap"),
    (dict(sinks=[0.0] * 4), TypeError, "sinks"),
    (dict(sinks=torch.zeros(4, dtype=torch.float16)), TypeError, "sinks"),
    (dict(sinks=torch.zeros(3)), ValueError, "sinks"),
    (dict(sinks=torch.zeros(1, 4)), ValueError, "sinks"),
    (dict(sinks=torch.zeros(4, device="meta")), ValueError, "sinks"),
]


@pytest.mark.parametrize("kwargs,error,words", BAD_OPTIONS, ids=[str(k) for k, _, _ in BAD_OPTIONS])
@pytest.mark.parametrize("op", ["decode", "prefill"])
def test_bad_options_are_named(op, kwargs, error, words):
    if op == "decode":
        args = make_decode([20, 3], 16, 4, 2)
        call = ops.paged_attention
    else:
        args = make_prefill([(10, 5)], 16, 4, 2)
        call = ops.paged_prefill_attention
    with pytest.raises(error, match=words):
        call(*args, **kwargs)


@pytest.mark.parametrize("kwargs,error,words", [
    (dict(sliding_window=0), ValueError, "sliding_window"),
    (dict(softcap=float("inf")), ValueError, "softcap"),
    (dict(sinks=torch.zeros(4, dtype=torch.float64)), TypeError, "sinks"),
    (dict(sinks=torch.zeros(5)), ValueError, "sinks"),
    (dict(sinks=torch.zeros(8)[::2]), ValueError, "sinks"),
])
def test_bad_options_are_named_by_the_ops_themselves(kwargs, error, words):
    """torch.ops.kvpage.* called directly (torch.compile's path) checks the same things."""
    from kvpage.ops._library import ops as library_ops

    query, key_cache, value_cache, tables, lens = make_decode([20, 3], 16, 4, 2)
    out = torch.empty_like(query)
    with pytest.raises(error, match=words):
        library_ops.paged_attention(out, query, key_cache, value_cache, tables, lens, 0.125, **kwargs)


def test_out_must_not_overlap_sinks():
    from kvpage.ops._library import ops as library_ops

    query, key_cache, value_cache, tables, lens = make_decode([20, 3], 16, 4, 2, head_size=16)
    out = torch.empty_like(query)
    with pytest.raises(ValueError, match="sinks"):
        library_ops.paged_attention(out, query, key_cache, value_cache, tables, lens, 0.25, sinks=out[0, 0, :4])
