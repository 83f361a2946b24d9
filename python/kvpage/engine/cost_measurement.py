"""The machine's numbers for the preemption cost model, measured by the engine (core has no clock).

At start-up a swap probe times ops.swap_blocks of 1 to 8 of the runner's own device blocks out to host
memory and back (milliseconds: on a CPU the "host link" is a memcpy, on a GPU pinned-memory DMA); then
every step's forward pass is timed (`record_step_time`), so the recompute price follows the model, batch
and machine actually running. kvpage.core.MeasuredCostModel turns the numbers into the choice.
"""
from __future__ import annotations

import math
import time

import torch

from kvpage import ops
from kvpage.core import MeasuredCostModel, PreemptionCostModel, SchedulerOutput
from kvpage.costmodel.device import fit_linear

from .executor_base import Executor

PROBE_BLOCK_COUNTS = (1, 2, 4, 8)


def measured_cost_model(runner: Executor, block_size: int) -> MeasuredCostModel:
    """A MeasuredCostModel for this runner: its prior from the model's shape and the cache's bytes per
    token, its link probed now where the runner holds its KV cache in this process (not the driver of
    tensor-parallel ranks: there the prior's link stands)."""
    cost_model = MeasuredCostModel(prior=_prior(runner, block_size))
    link = probe_swap(runner)
    if link is not None:
        cost_model.set_link(*link)
    return cost_model


def _prior(runner: Executor, block_size: int) -> PreemptionCostModel:
    model = runner.model
    config = model.config
    return PreemptionCostModel(kv_bytes_per_token=runner.kv_cache_bytes_per_block() / block_size,
                               n_params=float(sum(p.numel() for p in model.parameters())),
                               num_layers=config.num_hidden_layers, hidden_size=config.hidden_size)


def probe_swap(runner: Executor, repeats: int = 7) -> tuple[float, float] | None:
    """(one-way bytes/s, seconds of fixed overhead per swap_blocks call) of the runner's device cache
    to host memory, or None where there is no cache here to probe. Round trips of 1..8 blocks into a
    scratch host buffer and back: the device blocks end as they began and the host pool is untouched.
    On a CPU a few blocks fit in the last-level cache, so the bandwidth is an upper bound; it decides
    nothing there, where recompute costs orders of magnitude more per token than a copy."""
    caches = runner.local_kv_caches()
    if not caches:
        return None
    counts = [n for n in PROBE_BLOCK_COUNTS if n <= caches[0].shape[0]]
    if len(counts) < 2:
        return None
    cuda = caches[0].device.type == "cuda"
    scratch = [torch.empty((counts[-1], *t.shape[1:]), dtype=t.dtype, pin_memory=cuda) for t in caches]
    block_bytes = sum(t[0].numel() * t.element_size() for t in caches)

    def round_trip(n: int) -> None:
        pairs = [(i, i) for i in range(n)]
        ops.swap_blocks(caches, scratch, pairs)
        ops.swap_blocks(scratch, caches, pairs)
        if cuda:
            torch.cuda.synchronize(caches[0].device)

    round_trip(counts[-1])  # first touch of the scratch pages
    # The fastest of the repeats, which take turns across the sizes: time taken by other processes on
    # the machine only ever adds, and a burst of it then spoils one repeat of each size, not one size.
    seconds = [math.inf] * len(counts)
    for _ in range(repeats):
        for i, n in enumerate(counts):
            started = time.perf_counter()
            round_trip(n)
            seconds[i] = min(seconds[i], time.perf_counter() - started)
    # A round trip moves the bytes twice and pays the per-call overhead twice.
    fit = fit_linear([2 * n * block_bytes for n in counts], seconds)
    bandwidth = fit.bandwidth
    if not math.isfinite(bandwidth):  # time flat in size (a loaded machine): the largest call's average
        bandwidth = 2 * counts[-1] * block_bytes / seconds[-1]
    return bandwidth, fit.intercept_s / 2


def record_step_time(cost_model: MeasuredCostModel, out: SchedulerOutput, started: float, finished: bool) -> None:
    """The step's forward pass, from `started` (before runner.execute) to now. finished: the forward is
    known to be done (on a CPU it always is; on a GPU once sampling read tokens back), else the time
    is only its launch and is left out. So is a step that swapped, its time being partly the link's."""
    if finished and not (out.blocks_to_swap_out or out.blocks_to_swap_in):
        cost_model.record_step(out.num_batched_tokens, time.perf_counter() - started)


def cost_model_stats(cost_model: MeasuredCostModel, block_size: int, fixed_mode: str | None,
                     num_host_blocks: int, mean_sequence_tokens: float | None) -> dict:
    """The measured figures and what they decide (LLM.stats documents the keys)."""
    if num_host_blocks == 0:  # nowhere to swap to: every mode recomputes
        preferred = "recompute"
    elif fixed_mode is not None:
        preferred = fixed_mode
    elif mean_sequence_tokens:
        tokens = max(1, round(mean_sequence_tokens))
        preferred = cost_model.choose(-(-tokens // block_size), block_size, tokens)
    else:
        preferred = None
    return {"swap_bytes_per_s": cost_model.swap_bytes_per_s, "swap_overhead_s": cost_model.swap_overhead_s,
            "prefill_tokens_per_s": cost_model.prefill_tokens_per_s,
            "swap_preferred_from_tokens": cost_model.crossover_tokens(block_size),
            "preferred_preemption_mode": preferred}
