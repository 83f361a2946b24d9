"""Swap versus recompute, priced in seconds (the seed's preemption section).

swap      = 2 x (bytes / link bandwidth + fixed per-transfer overhead)   out now, back in later
recompute = prefill FLOPs / achievable FLOP rate,  FLOPs = 2 * n_params * T (+ causal attention)

Both linear terms grow with the sequence, so their ratio alone would pick one mode for every length;
the fixed transfer overhead is what makes recompute win below a few dozen tokens and swap above.
Defaults describe the embedded model (SmolLM2-135M: 30 layers, hidden 576, 3 KV heads of 64, bf16)
on an H100-class host link; the engine measures the link and FLOP rate at start-up and passes them
to `cost_model_from_measurements`.
"""
from __future__ import annotations

from dataclasses import dataclass

SMOLLM2_135M_KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 2  # K and V, layers, kv heads, head size, bf16


@dataclass(frozen=True)
class PreemptionCostModel:
    kv_bytes_per_token: float = SMOLLM2_135M_KV_BYTES_PER_TOKEN
    n_params: float = 135e6
    link_bandwidth: float = 25e9  # bytes/s, PCIe 4.0 x16 as achieved by pinned-memory copies
    transfer_overhead_s: float = 20e-6  # per swap_blocks call: launch, DMA set-up, synchronisation
    flops_per_s: float = 100e12  # achievable, not peak: a small model runs far below the roofline
    num_layers: int = 30
    hidden_size: int = 576
    attention_term: bool = True  # add the quadratic causal-attention FLOPs to recompute

    def __post_init__(self) -> None:
        for name in ("kv_bytes_per_token", "n_params", "link_bandwidth", "flops_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.transfer_overhead_s < 0:
            raise ValueError(f"transfer_overhead_s must be >= 0, got {self.transfer_overhead_s!r}")

    def swap_cost(self, num_blocks: int, block_size: int) -> float:
        """Seconds to move `num_blocks` whole blocks out to the host and back again."""
        if num_blocks == 0:
            return 0.0
        one_way = num_blocks * block_size * self.kv_bytes_per_token / self.link_bandwidth
        return 2 * (one_way + self.transfer_overhead_s)

    def prefill_flops(self, num_tokens: int) -> float:
        flops = 2.0 * self.n_params * num_tokens
        if self.attention_term:
            # QK^T and AV over the causal half: 2 * (2 * T^2 * hidden / 2) per layer.
            flops += 2.0 * self.num_layers * self.hidden_size * num_tokens * num_tokens
        return flops

    def recompute_cost(self, num_tokens: int) -> float:
        """Seconds to prefill `num_tokens` again."""
        return self.prefill_flops(num_tokens) / self.flops_per_s

    def choose(self, num_blocks: int, block_size: int, num_tokens: int) -> str:
        """'swap' or 'recompute', whichever costs less (recompute on a tie: it needs no host memory)."""
        return "swap" if self.swap_cost(num_blocks, block_size) < self.recompute_cost(num_tokens) else "recompute"

    def crossover_tokens(self, block_size: int, max_tokens: int = 1 << 20) -> int | None:
        """Smallest sequence length (tokens held in full blocks) at which swap wins; None if never."""
        lo, hi = 1, max_tokens
        if self.choose(-(-hi // block_size), block_size, hi) != "swap":
            return None
        while lo < hi:  # swap's advantage grows with length, so the choice flips once
            mid = (lo + hi) // 2
            if self.choose(-(-mid // block_size), block_size, mid) == "swap":
                hi = mid
            else:
                lo = mid + 1
        return lo


def cost_model_from_measurements(*, kv_bytes_per_token: float, n_params: float, link_bandwidth_gbs: float,
                                 transfer_overhead_us: float, achievable_tflops: float,
                                 num_layers: int = 0, hidden_size: int = 0) -> PreemptionCostModel:
    """The cost model from values measured at start-up (GB/s, microseconds, TFLOP/s); pure.

    num_layers and hidden_size enable the attention term; leave them 0 to price linear FLOPs only.
    """
    return PreemptionCostModel(
        kv_bytes_per_token=kv_bytes_per_token, n_params=n_params,
        link_bandwidth=link_bandwidth_gbs * 1e9, transfer_overhead_s=transfer_overhead_us * 1e-6,
        flops_per_s=achievable_tflops * 1e12, num_layers=num_layers, hidden_size=hidden_size,
        attention_term=bool(num_layers and hidden_size))
