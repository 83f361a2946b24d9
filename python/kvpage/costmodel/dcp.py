"""Decode context parallelism (DCP) on top of tensor parallelism: a rank's KV bytes, the context its
budget holds, and the bytes the attention merge moves.

Under TP=T each rank holds K/T of the model's K KV heads; past T = K a rank still holds one whole head,
so T/K ranks hold the same head and the cache stops growing with T (the KV-head ceiling). DCP=D turns
that replication into a split of the sequence: position p lives on rank (p // I) % D of its DCP group,
so each rank keeps 1/D of every sequence's K/V for its head. vLLM's names and rules throughout.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvpage.core.context_parallel import (ContextParallelPlacement, check_context_parallel, check_dcp_attention,
                                          kv_head_replication)
from kvpage.core.kv_cache_groups import num_blocks_per_seq

from .device import Device
from .memory import check_positive, expected_paged_blocks
from .model import ModelShape

LSE_BYTES = 4  # the log-sum-exp travels in float32 whatever the KV dtype


@dataclass(frozen=True)
class ParallelConfig:
    """TP x DCP for one model, checked against vLLM's rules (each refusal names its argument)."""

    model: ModelShape
    tensor_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    dcp_kv_cache_interleave_size: int = 1
    block_size: int = 16

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "decode_context_parallel_size", "dcp_kv_cache_interleave_size",
                     "block_size"):
            check_positive(name, getattr(self, name))
        self._check_tensor_parallel()
        self._check_decode_context_parallel()

    def _check_tensor_parallel(self) -> None:
        """Even head splits, so every rank's numbers are the same: query heads divide by T, and either
        T divides the KV heads or the KV heads divide T (each replicated T/K times)."""
        t, m = self.tensor_parallel_size, self.model
        if m.num_heads % t:
            raise ValueError(f"tensor_parallel_size={t} must divide the model's {m.num_heads} attention heads")
        if m.num_kv_heads % t and t % m.num_kv_heads:
            raise ValueError(f"tensor_parallel_size={t} must divide the model's {m.num_kv_heads} KV heads or be"
                             f" a multiple of them")

    def _check_decode_context_parallel(self) -> None:
        """The engine's own rules (kvpage.core.context_parallel), so the plan refuses what LLM refuses."""
        m = self.model
        check_context_parallel(self.tensor_parallel_size, self.decode_context_parallel_size,
                               self.dcp_kv_cache_interleave_size, self.block_size, m.num_heads, m.num_kv_heads)
        check_dcp_attention(self.decode_context_parallel_size, self.dcp_kv_cache_interleave_size, m.layer_windows,
                            has_sinks=False)

    @property
    def kv_head_replication(self) -> int:
        """Ranks holding copies of the same KV head: T/K once T exceeds the KV heads, else 1."""
        return kv_head_replication(self.tensor_parallel_size, self.model.num_kv_heads)

    @property
    def placement(self) -> ContextParallelPlacement:
        """Where positions live, as the engine's driver places them."""
        return ContextParallelPlacement(self.decode_context_parallel_size, self.dcp_kv_cache_interleave_size,
                                        self.block_size)

    @property
    def allowed_dcp_sizes(self) -> list[int]:
        """The decode_context_parallel_size values the rules accept at this TP: divisors of T up to T/K."""
        return [d for d in range(1, self.kv_head_replication + 1) if self.tensor_parallel_size % d == 0]

    @property
    def kv_heads_per_rank(self) -> int:
        return max(1, self.model.num_kv_heads // self.tensor_parallel_size)

    @property
    def q_heads_per_rank(self) -> int:
        return self.model.num_heads // self.tensor_parallel_size

    @property
    def virtual_block_tokens(self) -> int:
        """Tokens one block id covers: a block_size block on each rank of the DCP group (vLLM's layout)."""
        return self.placement.virtual_block_size

    def rank_block_bytes(self, dtype_bytes: int) -> int:
        """One physical block on one rank: block_size positions of this rank's KV heads, K and V, over the
        layers of one KV-cache group (all layers for a model without windows)."""
        return self._rank_position_bytes(dtype_bytes) * self.model.kv_cache_layout.group_size * self.block_size

    def kv_bytes_per_token_per_rank(self, dtype_bytes: int) -> float:
        """A rank's share of one token's KV: its heads' K and V over every layer, on 1/D of the positions."""
        return self._rank_position_bytes(dtype_bytes) * self.model.num_layers * self.block_size / self.virtual_block_tokens

    def _rank_position_bytes(self, dtype_bytes: int) -> int:
        """K and V of one position of one layer on one rank."""
        return 2 * self.kv_heads_per_rank * self.model.head_dim * dtype_bytes

    def tokens_on_rank(self, num_tokens: int, rank: int) -> int:
        """How many of positions 0..num_tokens-1 land on DCP rank `rank` ((p // I) % D == rank)."""
        return self.placement.tokens_on_rank(num_tokens, rank)

    def max_context_tokens(self, blocks_per_rank: int) -> int:
        """The longest single sequence blocks_per_rank blocks on each rank hold: every block id full."""
        return blocks_per_rank * self.virtual_block_tokens

    def sequences_that_fit(self, blocks_per_rank: int, seq_len: int) -> int:
        """Sequences of seq_len tokens that blocks_per_rank block ids hold, each taking whole virtual blocks."""
        return blocks_per_rank // -(-seq_len // self.virtual_block_tokens)

    def weight_bytes_per_rank(self, dtype_bytes: int) -> float:
        """Weights one rank holds: everything split T ways except the K/V projections (a rank keeps its
        whole KV heads, replicated past T = K) and the RMSNorms (replicated everywhere)."""
        m = self.model
        kv = 2 * m.hidden_size * m.head_dim * m.num_layers
        norms = m.hidden_size * (2 * m.num_layers + 1)
        split = m.num_params - kv * m.num_kv_heads - norms
        return (split / self.tensor_parallel_size + kv * self.kv_heads_per_rank + norms) * dtype_bytes


@dataclass(frozen=True)
class RankCapacity:
    kv_budget_bytes: float  # one rank's memory for KV after its weights
    blocks_per_rank: int
    max_context_tokens: int  # one sequence filling every block id
    seqs_paged: int  # sequences of the mean length, each wasting half a virtual block on average


def rank_capacity(pc: ParallelConfig, device: Device, dtype_bytes: int, mean_len: float,
                  memory_utilization: float = 0.9) -> RankCapacity:
    """What one rank's KV budget (the utilised share of its memory minus its weights) holds."""
    budget = device.memory_bytes * memory_utilization - pc.weight_bytes_per_rank(dtype_bytes)
    if budget <= 0:
        raise ValueError(f"{pc.model.name}'s weights per rank do not fit in {memory_utilization:.0%} of"
                         f" {device.name} at tensor_parallel_size={pc.tensor_parallel_size}")
    blocks = int(budget // pc.rank_block_bytes(dtype_bytes))
    layout = pc.model.kv_cache_layout
    if layout.is_hybrid:  # window groups hold their window's blocks only, counted in block ids (virtual blocks)
        return RankCapacity(budget, blocks, _longest_hybrid_context(layout, blocks, pc.virtual_block_tokens),
                            int(blocks // expected_paged_blocks(layout, mean_len, pc.virtual_block_tokens)))
    per_seq = mean_len + (pc.virtual_block_tokens - 1) / 2
    return RankCapacity(budget, blocks, pc.max_context_tokens(blocks), int(pc.max_context_tokens(blocks) // per_seq))


def _longest_hybrid_context(layout, blocks: int, block_size: int) -> int:
    """The longest single sequence `blocks` block ids hold: every full group's blocks full, each window group
    holding the most it ever does (core.num_blocks_per_seq for a sequence past every window)."""
    full_groups = sum(w is None for w in layout.sliding_windows)
    past_windows = max(w for w in layout.sliding_windows if w is not None) + block_size
    windows = num_blocks_per_seq(layout, past_windows, block_size) - full_groups * -(-past_windows // block_size)
    return max(0, (blocks - windows) // full_groups) * block_size if full_groups else 0


@dataclass(frozen=True)
class DcpTraffic:
    """Bytes one rank receives per decode step per layer for a batch of num_tokens decode tokens
    (the all-to-all variant: an all-gather of the query, then one all-to-all of outputs and LSEs)."""

    query_all_gather: int  # the other D-1 ranks' queries for this rank's heads
    output_all_to_all: int  # (D-1)/D of [T_tok, D*h_local, head_dim] outputs plus float32 LSEs

    @property
    def total(self) -> int:
        return self.query_all_gather + self.output_all_to_all


def dcp_traffic(pc: ParallelConfig, dtype_bytes: int, num_tokens: int = 1) -> DcpTraffic:
    others = pc.decode_context_parallel_size - 1
    rows = others * num_tokens * pc.q_heads_per_rank  # head-rows received from the other ranks
    head = pc.model.head_dim * dtype_bytes
    return DcpTraffic(query_all_gather=rows * head, output_all_to_all=rows * (head + LSE_BYTES))


def tp_all_reduce_bytes(pc: ParallelConfig, dtype_bytes: int, num_tokens: int = 1) -> float:
    """What TP already moves per layer for comparison: two ring all-reduces of [T_tok, hidden], each
    sending 2 (T-1)/T of it per rank."""
    t = pc.tensor_parallel_size
    return 2 * 2 * (t - 1) / t * num_tokens * pc.model.hidden_size * dtype_bytes
