"""Paged attention: decode (one query token per sequence) and varlen causal prefill."""
import torch

from kvpage.ops import _checks
from kvpage.ops._library import ops
from kvpage.ops.config import range_checks_enabled


def _prepare(query, key_cache, value_cache, out, names):
    for name, t in zip(names, (query, key_cache, value_cache)):
        _checks.require_tensor(t, name)
    if out is None:
        return torch.empty_like(query)
    return _checks.require_tensor(out, "out")


def _lse_for(query, return_lse):
    """The float32 [num_tokens, num_heads] tensor the op fills with log-sum-exps, or None."""
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    if not return_lse or query.dim() != 3:  # a bad query: the op's own check names its shape
        return None
    return torch.empty(query.shape[:2], dtype=torch.float32, device=query.device)


def _result(out, lse, return_lse):
    return (out, lse) if return_lse else out


def _options(sliding_window, softcap, sinks):
    """The attention options as the ops' trailing arguments (their types checked; the op checks values)."""
    return (_checks.sliding_window(sliding_window), _checks.softcap(softcap), _checks.sinks(sinks))


_OPTIONS_DOC = """sliding_window (a positive int W): a query at position p attends to keys in (p - W, p]; the
    kernels start at the block holding the first key the earliest query's window reaches, so the
    block-table entries before it are never read (they may hold any id, e.g. NULL_BLOCK; range
    checks skip them too). softcap (a positive float c): scores become c * tanh(s / c) after the
    scale (Gemma 2). sinks (float32 [num_heads] on query's device): one extra logit per query head
    in each softmax denominator, bringing no value (gpt-oss's s_aux). With return_lse the lse
    includes the sink term, so to merge partial results over disjoint keys
    (merge_attention_states) pass sinks to exactly one of the partial calls."""


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale=None, out=None, *,
                    partition_size=None, k_scale=1.0, v_scale=1.0, return_lse=False, sliding_window=None,
                    softcap=None, sinks=None):
    """Decode attention over the paged cache.

    query [num_seqs, num_heads, head_size]; block_tables int32 [num_seqs, max_blocks_per_seq];
    seq_lens int32 [num_seqs] (tokens in cache, >= 1); num_heads a multiple of num_kv_heads.
    scale defaults to head_size ** -0.5. Long contexts are split into partitions and merged by a
    log-sum-exp reduction when that keeps more cores busy; partition_size (a multiple of the block
    size) forces a split, a value >= the longest sequence forces a single pass. An fp8 cache is read
    as code * k_scale (keys) and code * v_scale (values); see reshape_and_cache.

    return_lse=True returns (out, lse): lse float32 [num_seqs, num_heads], the natural log of each
    row's softmax denominator, sum over its context of exp(scale * q.k) (keys dequantised for fp8),
    which merge_attention_states needs to combine results over disjoint parts of a context.

    {options}"""
    out = _prepare(query, key_cache, value_cache, out, ("query", "key_cache", "value_cache"))
    options = _options(sliding_window, softcap, sinks)
    lse = _lse_for(query, return_lse)
    _checks.require_tensor(block_tables, "block_tables")
    _checks.require_tensor(seq_lens, "seq_lens")
    scale = _checks.default_scale(scale, query.shape[-1] if query.dim() else 1)
    if partition_size is None:
        partition_size = 0
    elif isinstance(partition_size, bool) or not isinstance(partition_size, int) or partition_size <= 0:
        raise ValueError(f"partition_size must be a positive int, got {partition_size!r}")
    ops.paged_attention(out, query, key_cache, value_cache, block_tables, seq_lens, scale,
                        partition_size, range_checks_enabled(query), _checks.kv_scale(k_scale, "k_scale"),
                        _checks.kv_scale(v_scale, "v_scale"), lse, *options)
    return _result(out, lse, return_lse)


def paged_prefill_attention(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
                            scale=None, out=None, *, k_scale=1.0, v_scale=1.0, return_lse=False,
                            sliding_window=None, softcap=None, sinks=None):
    """Varlen causal attention over the paged cache (prefill, chunked prefill, prefix-cache hits).

    query [total_query_tokens, num_heads, head_size]; query_start_loc int32 [num_seqs + 1];
    seq_lens int32 [num_seqs] = cached context + this step's tokens, whose K/V are already in the
    cache. Query token i of sequence s sits at position seq_lens[s] - q_len[s] + i and attends to
    cache positions <= its own. fp8 caches and return_lse as in paged_attention (lse float32
    [total_query_tokens, num_heads], over each query token's causal context).

    {options}"""
    out = _prepare(query, key_cache, value_cache, out, ("query", "key_cache", "value_cache"))
    options = _options(sliding_window, softcap, sinks)
    lse = _lse_for(query, return_lse)
    for name, t in (("block_tables", block_tables), ("query_start_loc", query_start_loc),
                    ("seq_lens", seq_lens)):
        _checks.require_tensor(t, name)
    scale = _checks.default_scale(scale, query.shape[-1] if query.dim() else 1)
    ops.paged_prefill_attention(out, query, key_cache, value_cache, block_tables, query_start_loc,
                                seq_lens, scale, range_checks_enabled(query), _checks.kv_scale(k_scale, "k_scale"),
                                _checks.kv_scale(v_scale, "v_scale"), lse, *options)
    return _result(out, lse, return_lse)


for _op in (paged_attention, paged_prefill_attention):
    if _op.__doc__:  # None under python -OO
        _op.__doc__ = _op.__doc__.format(options=_OPTIONS_DOC)
