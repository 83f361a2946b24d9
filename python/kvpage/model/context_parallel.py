"""Decode context parallelism on one rank: its share of the KV cache and its part of every attention layer.

The driver's step names virtual slots and virtual blocks (kvpage.core.context_parallel). Each rank of a DCP
group of D ranks, all holding the same KV heads, writes only the positions it keeps, and attends with the
whole group's query heads over its own keys; the partial results meet by their log-sum-exp:
  1. all-gather the query heads across the group ([T, h, d] -> [T, D*h, d]);
  2. paged attention over the local keys, returning the LSE;
  3. all-to-all: rank j receives every rank's partial output and LSE for its own h heads;
  4. merge exactly (ops.merge_attention_states).
Every query token is one row of the decode kernel, its local key count the positions at or before its own
that this rank keeps: causal prefill, chunked prefill and decode all take that one path (prefill costs more
than the varlen kernel would; DCP is for long decodes). Per layer a rank receives (D-1)/D of the group's
query and of its partial outputs (vLLM's all-to-all variant, not its all-gather + reduce-scatter one).

Per KV-cache group (a hybrid cache): each group's virtual slots and block tables become this rank's alike
(the rows' local lengths are the group's too). A sliding window W, a multiple of I * D (checked before the
model loads: core.context_parallel.check_dcp_attention), holds exactly W / D of this rank's positions, the
last W / D it keeps at or before the query, so the rank attends within a window of W / D local keys. Their
local blocks are never before the group's first kept virtual block: a virtual block holds block_size of each
rank's positions, so a position's local block index is its virtual block index.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvpage import ops
from kvpage.core.context_parallel import ContextParallelPlacement, check_dcp_attention

from .metadata import AttentionMetadata


@dataclass
class ContextParallelMetadata:
    """One step's layout on this rank, built once per step (localize) and read by every layer."""

    slot_mapping: torch.Tensor  # int64 [T]: this rank's slot of each new token; -1 where another rank keeps it
    block_tables: torch.Tensor  # int32 [T, W]: each query token's sequence's block table
    seq_lens: torch.Tensor  # int32 [T]: local keys at or before the token's position (at least 1, see empty)
    empty: torch.Tensor  # bool [T]: no local key at all (its row's partial result gets weight zero)


def local_slot_mapping(placement: ContextParallelPlacement, rank: int, slots: torch.Tensor) -> torch.Tensor:
    """ContextParallelPlacement.local_slot over a tensor of virtual slots (-1 stays -1)."""
    block, offset = slots.div(placement.virtual_block_size, rounding_mode="floor"), slots % placement.virtual_block_size
    chunk, within = offset.div(placement.interleave, rounding_mode="floor"), offset % placement.interleave
    local = block * placement.block_size + chunk.div(placement.size, rounding_mode="floor") * placement.interleave + within
    return torch.where((chunk % placement.size == rank) & (slots >= 0), local, -1)


def tokens_on_rank(placement: ContextParallelPlacement, rank: int, lengths: torch.Tensor) -> torch.Tensor:
    """ContextParallelPlacement.tokens_on_rank over a tensor of lengths."""
    cycle = placement.interleave * placement.size
    partial = (lengths % cycle - rank * placement.interleave).clamp(0, placement.interleave)
    return lengths.div(cycle, rounding_mode="floor") * placement.interleave + partial


def localize(placement: ContextParallelPlacement, rank: int, meta: AttentionMetadata,
             positions: torch.Tensor) -> ContextParallelMetadata:
    """This rank's slots and per-token attention rows for a step the driver laid out in virtual blocks
    (of meta's block tables and slot mapping: one KV-cache group's)."""
    seq_index, lens = _local_rows(placement, rank, meta, positions)
    return _localize_group(placement, rank, meta, seq_index, lens)


def _local_rows(placement: ContextParallelPlacement, rank: int, meta: AttentionMetadata,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each token's sequence index, its local key count at or before its position): the same in every group."""
    positions = positions.reshape(-1)
    query_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
    seq_index = torch.repeat_interleave(torch.arange(meta.num_seqs, device=positions.device), query_lens,
                                        output_size=positions.shape[0])
    return seq_index, tokens_on_rank(placement, rank, positions + 1)


def _localize_group(placement: ContextParallelPlacement, rank: int, meta: AttentionMetadata,
                    seq_index: torch.Tensor, lens: torch.Tensor) -> ContextParallelMetadata:
    return ContextParallelMetadata(local_slot_mapping(placement, rank, meta.slot_mapping),
                                   meta.block_tables.index_select(0, seq_index),
                                   lens.clamp(min=1).to(torch.int32), lens == 0)


def localize_groups(placement: ContextParallelPlacement, rank: int, meta: AttentionMetadata,
                    positions: torch.Tensor) -> AttentionMetadata:
    """meta with this rank's layout in every KV-cache group's view (for_group / for_layer read it)."""
    seq_index, lens = _local_rows(placement, rank, meta, positions)
    if meta.group_block_tables is None:
        return replace(meta, context_parallel=_localize_group(placement, rank, meta, seq_index, lens))
    local = replace(meta)  # a fresh per-group cache, so the views below are this copy's
    for group in range(local.num_groups):
        view = local.for_group(group)
        view.context_parallel = _localize_group(placement, rank, view, seq_index, lens)
    local.context_parallel = local.for_group(0).context_parallel
    return local


def local_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    cp: ContextParallelMetadata, scale: float, **options) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [T, H, d], lse float32 [T, H]) of each query row over this rank's keys; lse -inf on empty rows.
    options: the paged op's sliding_window (in local keys: the layer's window / D) and softcap."""
    out, lse = ops.paged_attention(query, key_cache, value_cache, cp.block_tables, cp.seq_lens, scale=scale,
                                   return_lse=True, **options)
    return out, lse.masked_fill(cp.empty[:, None], float("-inf"))


class ContextParallelAttention:
    """Write + attend for one rank of a DCP group (a DecoderLayer's attention in place of the plain one)."""

    def __init__(self, placement: ContextParallelPlacement, rank: int, group) -> None:
        """group: the DCP group's collectives (all_gather, all_to_all; kvpage.distributed.group.Collectives)."""
        self.placement, self.rank, self.group = placement, rank, group

    def localize(self, meta: AttentionMetadata, positions: torch.Tensor) -> AttentionMetadata:
        return localize_groups(self.placement, self.rank, meta, positions)

    def local_options(self, sliding_window: int | None, softcap: float | None, sinks) -> dict:
        """The paged op's options on this rank's keys: the window in local keys (W / D)."""
        size = self.placement.size
        check_dcp_attention(size, self.placement.interleave, [sliding_window], sinks is not None)
        options = {} if sliding_window is None else {"sliding_window": sliding_window // size}
        return options if softcap is None else {**options, "softcap": softcap}

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, meta: AttentionMetadata, scale: float, sliding_window: int | None = None,
                 softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """query [T, h, d] (this rank's heads), key/value [T, kv, d] -> out [T, h, d]. meta: the layer's
        KV-cache group's view (for_layer), localized (localize)."""
        cp = meta.context_parallel
        ops.reshape_and_cache(key, value, key_cache, value_cache, cp.slot_mapping)
        tokens, heads, dim = query.shape
        group_query = torch.cat(self.group.all_gather(query.contiguous()), dim=1)
        out, lse = local_attention(group_query, key_cache, value_cache, cp, scale,
                                   **self.local_options(sliding_window, softcap, sinks))
        # [T, D*h, ...] -> [D, T, h, ...]: slice j goes to rank j, which receives every rank's slice of its heads.
        size = self.placement.size
        send_out = out.view(tokens, size, heads, dim).transpose(0, 1).contiguous()
        send_lse = lse.view(tokens, size, heads).transpose(0, 1).contiguous()
        outs, lses = torch.empty_like(send_out), torch.empty_like(send_lse)
        self.group.all_to_all(outs, send_out)
        self.group.all_to_all(lses, send_lse)
        return ops.merge_attention_states(outs, lses)[0]
