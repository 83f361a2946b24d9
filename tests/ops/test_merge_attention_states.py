"""merge_attention_states: partial (out, lse) pairs of the attention ops over disjoint parts of each
sequence's context merge into attention over all of it (a sequence's positions split at random
over P "ranks", each rank's share in a cache and block table of its own, as decode context
parallelism splits them); and the merge against the reference merge, -inf partials included."""
import pytest
import torch

from kvpage import ops
from kvpage.ops import reference
from paged_data import cdiv, generator, int32, query_start_loc, randn
from tolerances import assert_attention_close, assert_lse_close

HEAD_SIZE, BLOCK_SIZE = 64, 8


def paged(sequences, dtype, gen):
    """(key_cache, value_cache, block_tables, seq_lens) holding each sequence's (key, value) tokens
    [n, num_kv_heads, head_size] (n >= 1) in blocks scattered at random over a cache of their own."""
    block_counts = [cdiv(key.shape[0], BLOCK_SIZE) for key, _ in sequences]
    num_kv_heads = sequences[0][0].shape[1]
    caches = ops.allocate_kv_cache(sum(block_counts) + 1, BLOCK_SIZE, num_kv_heads, HEAD_SIZE, dtype)
    order = torch.randperm(sum(block_counts) + 1, generator=gen).to(torch.int32)
    tables = torch.zeros(len(sequences), max(block_counts), dtype=torch.int32)
    slots = []
    for row, ((key, _), count) in enumerate(zip(sequences, block_counts)):
        tables[row, :count], order = order[:count], order[count:]
        position = torch.arange(key.shape[0])
        slots.append(tables[row, position // BLOCK_SIZE].long() * BLOCK_SIZE + position % BLOCK_SIZE)
    keys, values = (torch.cat([kv[i] for kv in sequences]) for i in (0, 1))
    ops.reshape_and_cache(keys, values, *caches, torch.cat(slots))
    return *caches, tables, int32([key.shape[0] for key, _ in sequences])


def rank_partials(query, sequences, ranks, dtype, gen):
    """Each rank's (out, lse) over its random share of every sequence's positions: [P, S, H, D] and
    [P, S, H]. A sequence with no position on a rank gets lse -inf there and an output of NaNs."""
    owners = [torch.randint(0, ranks, (key.shape[0],), generator=gen) for key, _ in sequences]
    outs = torch.full((ranks, *query.shape), float("nan"), dtype=query.dtype)
    lses = torch.full((ranks, *query.shape[:2]), float("-inf"))
    for rank in range(ranks):
        mine = [s for s, owner in enumerate(owners) if (owner == rank).any()]
        if not mine:
            continue
        shares = [(key[owners[s] == rank], value[owners[s] == rank]) for s, (key, value) in enumerate(sequences)
                  if s in mine]
        outs[rank, mine], lses[rank, mine] = ops.paged_attention(query[mine], *paged(shares, dtype, gen),
                                                                 return_lse=True)
    return outs, lses


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_merge_of_random_position_splits_is_attention_over_all(dtype, ranks):
    gen, num_heads, num_kv_heads = generator(ranks), 6, 2
    sequences = [(randn((n, num_kv_heads, HEAD_SIZE), dtype, gen), randn((n, num_kv_heads, HEAD_SIZE), dtype, gen))
                 for n in (1, 2, 37, 200)]
    query = randn((len(sequences), num_heads, HEAD_SIZE), dtype, gen)
    outs, lses = rank_partials(query, sequences, ranks, dtype, gen)
    out, lse = ops.merge_attention_states(outs, lses)
    full = paged(sequences, dtype, gen)
    expected_out, expected_lse = reference.paged_attention(query, *full, return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_attention_close(out, expected_out)
    assert_lse_close(lse, expected_lse)
    assert_lse_close(lse, ops.paged_attention(query, *full, return_lse=True)[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_chunked_prefill_is_context_merged_with_chunk(dtype):
    """A chunk's queries over its cached context (decode, one row per query token) merged with the
    chunk's causal attention over itself (prefill) is the prefill over context and chunk."""
    gen, num_heads, num_kv_heads, context, chunk = generator(7), 4, 2, 45, 20
    key, value = (randn((context + chunk, num_kv_heads, HEAD_SIZE), dtype, gen) for _ in range(2))
    query = randn((chunk, num_heads, HEAD_SIZE), dtype, gen)
    starts = query_start_loc([chunk])
    key_cache, value_cache, table, _ = paged([(key[:context], value[:context])], dtype, gen)
    on_context = ops.paged_attention(query, key_cache, value_cache, table.expand(chunk, -1).contiguous(),
                                     int32([context] * chunk), return_lse=True)
    on_chunk = ops.paged_prefill_attention(query, *paged([(key[context:], value[context:])], dtype, gen)[:3],
                                           starts, int32([chunk]), return_lse=True)
    out, lse = ops.merge_attention_states([on_context[0], on_chunk[0]], [on_context[1], on_chunk[1]])
    full = ops.paged_prefill_attention(query, *paged([(key, value)], dtype, gen)[:3], starts,
                                       int32([context + chunk]), return_lse=True)
    assert_attention_close(out, full[0])
    assert_lse_close(lse, full[1])


def random_partials(num_parts, dtype, gen, tokens=5, heads=3):
    """Partials with about a third of their lses -inf (outputs NaN there), row 0 -inf in all."""
    outputs = randn((num_parts, tokens, heads, HEAD_SIZE), dtype, gen)
    lses = torch.randn((num_parts, tokens, heads), generator=gen) * 4
    empty = torch.rand((num_parts, tokens, heads), generator=gen) < 0.35
    empty[:, 0] = True
    lses[empty] = float("-inf")
    outputs[empty] = float("nan")
    return outputs, lses


@pytest.mark.parametrize("num_parts", [1, 2, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_merge_matches_reference_and_ignores_empty_partials(dtype, num_parts):
    outputs, lses = random_partials(num_parts, dtype, generator(num_parts))
    out, lse = ops.merge_attention_states(outputs, lses)
    expected_out, expected_lse = reference.merge_attention_states(outputs, lses)
    assert_attention_close(out, expected_out)
    assert_lse_close(lse, expected_lse)
    assert not out.isnan().any()
    assert torch.equal(out[0], torch.zeros_like(out[0])) and (lse[0] == float("-inf")).all()
    listed = ops.merge_attention_states(list(outputs), list(lses))
    assert torch.equal(listed[0], out) and torch.equal(listed[1], lse)


def test_merge_with_huge_lses_does_not_overflow():
    outputs = torch.stack([torch.ones(1, 1, HEAD_SIZE), torch.full((1, 1, HEAD_SIZE), 3.0)])
    lses = torch.tensor([[[1000.0]], [[1000.0 + torch.log(torch.tensor(3.0)).item()]]])
    out, lse = ops.merge_attention_states(outputs, lses)
    torch.testing.assert_close(out, torch.full((1, 1, HEAD_SIZE), 2.5))
    torch.testing.assert_close(lse, torch.tensor([[1000.0 + torch.log(torch.tensor(4.0)).item()]]))


GOOD = (torch.zeros(2, 3, 4, HEAD_SIZE), torch.zeros(2, 3, 4))


@pytest.mark.parametrize("outputs, lses, error, message", [
    (GOOD[0][0], GOOD[1], ValueError, "outputs must have 4 dims"),
    (GOOD[0], GOOD[1][0], ValueError, "lses must have 3 dims"),
    (GOOD[0], GOOD[1][:, :2], ValueError, r"lses shape \(2, 2, 4\) must be outputs' \[P, T, H\]"),
    (GOOD[0].int(), GOOD[1], TypeError, "outputs dtype must be"),
    (GOOD[0], GOOD[1].double(), TypeError, "lses dtype must be float32"),
    (GOOD[0][:0], GOOD[1][:0], ValueError, "outputs must hold at least one partial"),
    ([], GOOD[1], ValueError, "outputs must hold at least one partial"),
    ([GOOD[0][0], GOOD[0][1, :2]], GOOD[1], ValueError, "outputs: every partial must share one shape"),
    (GOOD[0], [GOOD[1][0], "x"], TypeError, r"lses\[1\] must be a torch.Tensor"),
    (GOOD[0], 3.0, TypeError, "lses must be a tensor or a list of tensors"),
], ids=["outputs-rank", "lses-rank", "lses-shape", "outputs-dtype", "lses-dtype", "no-partials", "empty-list",
        "ragged-list", "list-item", "lses-type"])
def test_merge_bad_inputs_name_the_argument(outputs, lses, error, message):
    with pytest.raises(error, match=message):
        ops.merge_attention_states(outputs, lses)
