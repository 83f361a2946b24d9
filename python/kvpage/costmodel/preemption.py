"""Swap versus recompute for a model on a device: the seed's preemption arithmetic.

Built on kvpage.core.PreemptionCostModel (the scheduler's own model), so the plan and the engine
price a preemption the same way:
    swap      = 2 x (tokens x KV bytes/token / link bandwidth + per-transfer overhead)   out, then in
    recompute = FLOPs of a prefill over the tokens / achievable FLOP rate
Without the overhead both are linear in the tokens, so their ratio is the same at every length and
one mode wins everywhere; the fixed overhead is what makes short sequences cheaper to recompute.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kvpage.core.preemption_cost import PreemptionCostModel

from .device import Device
from .memory import kv_bytes_per_token
from .model import ModelShape


@dataclass(frozen=True)
class SwapRecompute:
    model: ModelShape
    device: Device
    dtype_bytes: int = 2
    attention_term: bool = False  # the seed's linear approximation leaves it out

    def core(self, with_overhead: bool = True) -> PreemptionCostModel:
        """The scheduler's cost model with this model's and device's constants."""
        return PreemptionCostModel(
            kv_bytes_per_token=kv_bytes_per_token(self.model, self.dtype_bytes),
            n_params=self.model.flops_per_token / 2, link_bandwidth=self.device.link_bandwidth,
            transfer_overhead_s=self.device.transfer_overhead_s if with_overhead else 0.0,
            flops_per_s=self.device.achievable_flops, num_layers=self.model.num_layers,
            hidden_size=self.model.q_dim, attention_term=self.attention_term)

    def swap_seconds(self, num_tokens: int, with_overhead: bool = True, block_size: int = 1) -> float:
        """Round trip of the sequence's KV, in whole blocks of block_size tokens."""
        return self.core(with_overhead).swap_cost(-(-num_tokens // block_size), block_size)

    def recompute_seconds(self, num_tokens: int) -> float:
        return self.core().recompute_cost(num_tokens)

    def ratio(self, num_tokens: int, with_overhead: bool = False) -> float:
        """recompute / swap: above 1, swap is cheaper; inf where a fitted link is so fast that the swap
        costs nothing measurable (a flat fit on a small model)."""
        swap = self.swap_seconds(num_tokens, with_overhead)
        return self.recompute_seconds(num_tokens) / swap if swap > 0 else math.inf

    def crossover_tokens(self, with_overhead: bool = True, block_size: int = 1) -> int | None:
        """Smallest sequence length at which swap is cheaper: 1 means from the first token (no
        crossover), None means never. block_size > 1 swaps whole blocks, as the engine does."""
        return self.core(with_overhead).crossover_tokens(block_size)

    def crossover_exact(self) -> float | None:
        """The continuous crossover T* = 2 x overhead / (recompute - swap per token), linear terms
        only; 0 without overhead, None if recompute is the cheaper per token (swap never wins)."""
        swap_per_token = 2 * kv_bytes_per_token(self.model, self.dtype_bytes) / self.device.link_bandwidth
        recompute_per_token = self.model.flops_per_token / self.device.achievable_flops
        if recompute_per_token <= swap_per_token:
            return None
        return 2 * self.device.transfer_overhead_s / (recompute_per_token - swap_per_token)

    def rows(self, lengths, block_size: int = 16) -> list[dict]:
        """One row per sequence length. Per token (the seed's model): swap without and with the
        overhead, recompute, their ratios. As the engine does it: swap in whole blocks with the
        overhead, recompute with the causal-attention FLOPs, and the mode the scheduler would pick."""
        with_attention = SwapRecompute(self.model, self.device, self.dtype_bytes, attention_term=True)
        out = []
        for n in lengths:
            linear, swap = self.swap_seconds(n, False), self.swap_seconds(n, True)
            recompute = self.recompute_seconds(n)
            blocks = self.swap_seconds(n, True, block_size)
            out.append({"tokens": n, "swap_no_overhead_s": linear, "swap_s": swap, "recompute_s": recompute,
                        "ratio_no_overhead": recompute / linear, "ratio": recompute / swap,
                        "swap_blocks_s": blocks, "recompute_attention_s": with_attention.recompute_seconds(n),
                        "engine_picks": with_attention.core().choose(-(-n // block_size), block_size, n)})
        return out
