"""Devices: bandwidths, FLOP rate, host link and its per-transfer overhead.

The GPU presets are data-sheet numbers (dense bf16 peak, HBM, nominal PCIe per direction) with a
stated achievable fraction of peak for prefill; the per-transfer overhead is an assumption (launch,
DMA set-up, synchronisation) that the seed says only has to be small. "this" is measured here by
`measure_this_machine()`: a matmul, a memcpy and kvpage's own swap_blocks over several sizes.
"""
from __future__ import annotations

import functools
import math
import os
import time
from dataclasses import dataclass, replace

GIB = 2**30


@dataclass(frozen=True)
class Device:
    name: str
    description: str
    memory_bytes: float  # device memory (HBM; DRAM on a CPU)
    memory_bandwidth: float  # bytes/s, device memory
    peak_flops: float  # dense FLOP/s in the compute dtype
    link_bandwidth: float  # bytes/s one way between device and host memory (the swap path)
    transfer_overhead_s: float  # fixed cost per swap transfer, independent of its size
    flops_efficiency: float = 0.5  # fraction of peak_flops a prefill achieves (MFU)
    dtype_bytes: int = 2  # the KV cache and weights dtype this device runs by default
    step_overhead_s: float = 0.0  # fixed cost of one engine step (framework, launches); 0 = not modelled

    def __post_init__(self) -> None:
        for name in ("memory_bytes", "memory_bandwidth", "peak_flops", "link_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if not 0 < self.flops_efficiency <= 1:
            raise ValueError(f"flops_efficiency must be in (0, 1], got {self.flops_efficiency!r}")
        for name in ("transfer_overhead_s", "step_overhead_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")

    @property
    def achievable_flops(self) -> float:
        return self.peak_flops * self.flops_efficiency

    @property
    def link_to_memory_ratio(self) -> float:
        """How many times slower the host link is than device memory (the seed: 50-60x on H100)."""
        return self.memory_bandwidth / self.link_bandwidth

    def with_overhead(self, transfer_overhead_s: float) -> "Device":
        return replace(self, transfer_overhead_s=transfer_overhead_s)


# Per-transfer overhead for the GPU presets: the same 20 us kvpage.core.PreemptionCostModel assumes.
_OVERHEAD_S = 20e-6

PRESETS: dict[str, Device] = {
    "h100": Device("h100", "H100 SXM5 80 GB, PCIe 5.0 x16 host link", memory_bytes=80 * GIB,
                   memory_bandwidth=3.35e12, peak_flops=989e12, link_bandwidth=64e9,
                   transfer_overhead_s=_OVERHEAD_S),
    "h200": Device("h200", "H200 SXM 141 GB, PCIe 5.0 x16 host link", memory_bytes=141e9,
                   memory_bandwidth=4.8e12, peak_flops=989e12, link_bandwidth=64e9,
                   transfer_overhead_s=_OVERHEAD_S),
    "a100": Device("a100", "A100 SXM4 80 GB, PCIe 4.0 x16 host link", memory_bytes=80 * GIB,
                   memory_bandwidth=2.039e12, peak_flops=312e12, link_bandwidth=32e9,
                   transfer_overhead_s=_OVERHEAD_S),
}
DEVICE_NAMES = (*PRESETS, "this")


def get_device(name) -> Device:
    """A preset ("h100", "h200", "a100"), "this" (measured now, once per process), or a Device."""
    if isinstance(name, Device):
        return name
    key = str(name).lower()
    if key == "this":
        return measure_this_machine()
    if key in PRESETS:
        return PRESETS[key]
    raise ValueError(f"device must be one of {list(DEVICE_NAMES)}, got {name!r}")


@dataclass(frozen=True)
class LinearFit:
    """seconds = intercept_s + bytes / bandwidth, least squares over (bytes, seconds) points."""

    intercept_s: float
    bandwidth: float  # bytes/s

    def __call__(self, num_bytes: float) -> float:
        return self.intercept_s + num_bytes / self.bandwidth


def fit_linear(xs: list[float], ys: list[float]) -> LinearFit:
    """Least squares of y = a + x / b with a >= 0 and 1/b >= 0: a negative intercept is noise around
    a tiny overhead (not a transfer that pays you back), a negative slope noise around a flat line."""
    n = len(xs)
    if n < 2 or len(ys) != n:
        raise ValueError(f"fit_linear needs >= 2 matching points, got {len(xs)} x and {len(ys)} y")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("fit_linear needs at least two distinct x values")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    if slope <= 0:
        # Time does not grow measurably with size: the best fit with a non-negative slope is flat.
        return LinearFit(my, math.inf)
    intercept = my - slope * mx
    if intercept < 0:  # likewise the best fit through a non-negative intercept is through the origin
        return LinearFit(0.0, sum(x * x for x in xs) / sum(x * y for x, y in zip(xs, ys)))
    return LinearFit(intercept, 1.0 / slope)


def fit_bandwidth(xs: list[float], ys: list[float], intercept_s: float) -> LinearFit:
    """Least squares of y - intercept = x / b with the intercept measured on its own (a near-empty
    transfer): with large transfers alone, noise in them swamps a microsecond intercept."""
    num = sum(x * x for x in xs)
    den = sum(x * (y - intercept_s) for x, y in zip(xs, ys))
    return LinearFit(intercept_s, num / den if den > 0 else math.inf)


def median_seconds(fn, repeats: int = 7, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def swap_fit(block_counts=(1, 4, 16, 64), num_layers: int = 30, num_kv_heads: int = 3, head_dim: int = 64,
             block_size: int = 16, repeats: int = 7) -> tuple[LinearFit, list[dict]]:
    """Time kvpage's ops.swap_blocks (one batched call over every layer's K and V) between two CPU
    pools shaped like the default model: the per-call overhead from a near-empty call (64 bytes per
    tensor), the bandwidth from the full-size calls. On a CPU this is a DRAM-to-DRAM copy: the
    "link" is memory itself."""
    import torch

    from kvpage import ops

    num_blocks = 2 * max(block_counts)
    num_tensors = 2 * num_layers
    pools = [[t for _ in range(num_layers)
              for t in ops.allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, torch.float32)]
             for _ in range(2)]
    tiny = [[ops.allocate_kv_cache(2, 1, 1, 16)[0] for _ in range(num_tensors)] for _ in range(2)]
    overhead = median_seconds(lambda: ops.swap_blocks(tiny[0], tiny[1], [(0, 1)]), repeats=2 * repeats + 1)
    block_bytes = 2 * num_layers * num_kv_heads * block_size * head_dim * 4
    points = []
    for n in block_counts:
        # Scattered destinations, as the block manager hands them out; sources contiguous.
        mapping = [(i, num_blocks - 1 - 2 * i) for i in range(n)]
        seconds = median_seconds(lambda: ops.swap_blocks(pools[0], pools[1], mapping), repeats=repeats)
        points.append({"blocks": n, "bytes": n * block_bytes, "seconds": seconds})
    return fit_bandwidth([p["bytes"] for p in points], [p["seconds"] for p in points], overhead), points


def matmul_flops(n: int = 1024, repeats: int = 7) -> float:
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / median_seconds(lambda: a @ b, repeats=repeats)


def memcpy_bandwidth(num_bytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes moved per second (read + write) by a large tensor copy."""
    import torch

    src = torch.ones(num_bytes // 4)
    dst = torch.empty_like(src)
    return 2 * num_bytes / median_seconds(lambda: dst.copy_(src), repeats=repeats)


@functools.lru_cache(maxsize=1)
def measure_this_machine() -> Device:
    """This machine as a Device (CPU, fp32 as kvpage runs here by default), measured once per process.

    A few seconds: an fp32 matmul (peak = achieved, so flops_efficiency = 1), a 256 MiB copy, and a
    swap_blocks fit. Timings on a shared machine are noisy; every number is a median of repeats.
    """
    import torch

    fit, _ = swap_fit()
    copy_bandwidth = memcpy_bandwidth()
    # On a loaded machine the swap times can be all overhead noise (no measurable size term); a swap
    # here is a DRAM-to-DRAM copy, so the memcpy rate (bytes copied, not read + written) stands in.
    link = fit.bandwidth if math.isfinite(fit.bandwidth) else copy_bandwidth / 2
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Device("this", f"this machine, measured ({torch.get_num_threads()} threads, fp32)",
                  memory_bytes=float(memory), memory_bandwidth=copy_bandwidth, peak_flops=matmul_flops(),
                  link_bandwidth=link, transfer_overhead_s=fit.intercept_s, flops_efficiency=1.0, dtype_bytes=4)
