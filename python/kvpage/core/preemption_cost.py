"""Swap versus recompute, priced in seconds: the scheduler's per-victim choice (the seed's preemption section).

swap      = 2 x (bytes / link bandwidth + fixed per-transfer overhead)   out now, back in later
recompute = prefill FLOPs / achievable FLOP rate,  FLOPs = 2 * n_params * T (+ causal attention),
            or T / prefill_tokens_per_s where that rate was measured

Both linear terms grow with the sequence, so their ratio alone would pick one mode for every length;
the fixed transfer overhead is what makes recompute win for short sequences and swap for long ones.
PreemptionCostModel's defaults describe the embedded model (SmolLM2-135M: 30 layers, hidden 576, 3 KV
heads of 64, bf16) on an H100-class host link; the engine prices with a MeasuredCostModel instead,
whose numbers it measures on the machine it runs on (kvpage.engine.cost_measurement).
(Not to be confused with kvpage.costmodel: the seed's arithmetic for `kvpage plan`, built on this.)
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace
from statistics import median

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
    # Measured tokens per second of a forward pass; when set, it prices recompute (the FLOP terms are unused).
    prefill_tokens_per_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("kv_bytes_per_token", "n_params", "link_bandwidth", "flops_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.prefill_tokens_per_s is not None and not self.prefill_tokens_per_s > 0:
            raise ValueError(f"prefill_tokens_per_s must be positive or None, got {self.prefill_tokens_per_s!r}")
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
        if self.prefill_tokens_per_s is not None:
            return num_tokens / self.prefill_tokens_per_s
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


@dataclass
class MeasuredCostModel:
    """The scheduler's cost model priced with this machine's numbers, which the engine measures and
    hands over: the host link from a swap probe at start-up (`set_link`) and the time of each step's
    forward pass (`record_step`). Until a number is measured, the prior's stands in. Pure (no clock,
    no torch), so tests feed it made-up timings.

    Recompute is priced by the marginal seconds per token of a step (seconds = fixed + per_token x
    tokens), not the average: re-prefilling a victim adds its tokens to steps that pay their fixed
    cost anyway. The slope is Theil-Sen's, the median of the slopes between pairs of the recent steps,
    so a step stretched by another process on the machine (the noise is all one way) moves nothing.
    """

    prior: PreemptionCostModel = field(default_factory=PreemptionCostModel)
    window: int = 32  # recent steps fitted: follows a change of load, and the fit's pairs stay few
    swap_bytes_per_s: float | None = None
    swap_overhead_s: float | None = None
    _steps: deque = field(init=False, repr=False)  # (tokens, seconds) of the recent steps
    _slope: float | None = field(default=None, init=False, repr=False)  # fitted once per new step, when asked

    def __post_init__(self) -> None:
        if not isinstance(self.window, int) or self.window < 2:
            raise ValueError(f"window must be an int >= 2, got {self.window!r}")
        self._steps = deque(maxlen=self.window)

    def set_link(self, bytes_per_s: float, overhead_s: float) -> None:
        """The host link as measured: one-way bandwidth and fixed seconds per swap call."""
        if not 0 < bytes_per_s < math.inf:
            raise ValueError(f"bytes_per_s must be positive and finite, got {bytes_per_s!r}")
        if not 0 <= overhead_s < math.inf:
            raise ValueError(f"overhead_s must be >= 0 and finite, got {overhead_s!r}")
        self.swap_bytes_per_s, self.swap_overhead_s = float(bytes_per_s), float(overhead_s)

    def record_step(self, num_tokens: int, seconds: float) -> None:
        """One forward pass over num_tokens tokens took seconds (an empty step teaches nothing)."""
        if num_tokens < 0 or not 0 <= seconds < math.inf:
            raise ValueError(f"a step needs num_tokens >= 0 and finite seconds >= 0, got {num_tokens!r}, {seconds!r}")
        if num_tokens:
            self._slope = None
            self._steps.append((num_tokens, float(seconds)))

    @property
    def seconds_per_token(self) -> float | None:
        """The fitted marginal seconds per token; None before any step."""
        if self._slope is None and self._steps:
            self._slope = _theil_sen_slope(list(self._steps))
        return self._slope

    @property
    def prefill_tokens_per_s(self) -> float | None:
        seconds = self.seconds_per_token
        return 1.0 / seconds if seconds else None  # None too where every step took no measurable time

    def current(self) -> PreemptionCostModel:
        """The prior with every measured number in place of its own."""
        p = self.prior
        return replace(p, link_bandwidth=self.swap_bytes_per_s or p.link_bandwidth,
                       transfer_overhead_s=p.transfer_overhead_s if self.swap_overhead_s is None
                       else self.swap_overhead_s,
                       prefill_tokens_per_s=self.prefill_tokens_per_s or p.prefill_tokens_per_s)

    def choose(self, num_blocks: int, block_size: int, num_tokens: int) -> str:
        return self.current().choose(num_blocks, block_size, num_tokens)

    def crossover_tokens(self, block_size: int, max_tokens: int = 1 << 20) -> int | None:
        return self.current().crossover_tokens(block_size, max_tokens)


def _theil_sen_slope(points: list[tuple[int, float]]) -> float:
    """Median slope between pairs of (tokens, seconds) points of different sizes; where there is no
    such pair, or the slope is not positive (time flat in size), the median seconds per token: the
    average cost, an upper bound of the marginal one."""
    slopes = [(t2 - t1) / (n2 - n1) for i, (n1, t1) in enumerate(points) for n2, t2 in points[i + 1:] if n2 != n1]
    slope = median(slopes) if slopes else 0.0
    return slope if slope > 0 else median(t / n for n, t in points)
