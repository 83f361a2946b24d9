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
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvpage import ops
from kvpage.core.context_parallel import ContextParallelPlacement

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
    """This rank's slots and per-token attention rows for a step the driver laid out in virtual blocks."""
    positions = positions.reshape(-1)
    query_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
    seq_index = torch.repeat_interleave(torch.arange(meta.num_seqs, device=positions.device), query_lens,
                                        output_size=positions.shape[0])
    lens = tokens_on_rank(placement, rank, positions + 1)
    return ContextParallelMetadata(local_slot_mapping(placement, rank, meta.slot_mapping),
                                   meta.block_tables.index_select(0, seq_index),
                                   lens.clamp(min=1).to(torch.int32), lens == 0)


def local_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    cp: ContextParallelMetadata, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [T, H, d], lse float32 [T, H]) of each query row over this rank's keys; lse -inf on empty rows."""
    out, lse = ops.paged_attention(query, key_cache, value_cache, cp.block_tables, cp.seq_lens, scale=scale,
                                   return_lse=True)
    return out, lse.masked_fill(cp.empty[:, None], float("-inf"))


class ContextParallelAttention:
    """Write + attend for one rank of a DCP group (a DecoderLayer's attention in place of the plain one)."""

    def __init__(self, placement: ContextParallelPlacement, rank: int, group) -> None:
        """group: the DCP group's collectives (all_gather, all_to_all; kvpage.distributed.group.Collectives)."""
        self.placement, self.rank, self.group = placement, rank, group

    def localize(self, meta: AttentionMetadata, positions: torch.Tensor) -> AttentionMetadata:
        return replace(meta, context_parallel=localize(self.placement, self.rank, meta, positions))

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """query [T, h, d] (this rank's heads), key/value [T, kv, d] -> out [T, h, d]."""
        cp = meta.context_parallel
        ops.reshape_and_cache(key, value, key_cache, value_cache, cp.slot_mapping)
        tokens, heads, dim = query.shape
        group_query = torch.cat(self.group.all_gather(query.contiguous()), dim=1)
        out, lse = local_attention(group_query, key_cache, value_cache, cp, scale)
        # [T, D*h, ...] -> [D, T, h, ...]: slice j goes to rank j, which receives every rank's slice of its heads.
        size = self.placement.size
        send_out = out.view(tokens, size, heads, dim).transpose(0, 1).contiguous()
        send_lse = lse.view(tokens, size, heads).transpose(0, 1).contiguous()
        outs, lses = torch.empty_like(send_out), torch.empty_like(send_lse)
        self.group.all_to_all(outs, send_out)
        self.group.all_to_all(lses, send_lse)
        return ops.merge_attention_states(outs, lses)[0]
