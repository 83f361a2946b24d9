"""KV offload tiers (issue 48): a second tier behind the pool's prefix cache, through a connector seam.

connector.py: the seam (scheduler side, pure Python) and OffloadingConnector; tiers.py: the host-memory
and disk tiers (pure Python); worker.py: the worker side (torch) and the model fingerprint.
attach_offloading wires one engine's block manager, scheduler and runner to a tier.
"""
from __future__ import annotations

import atexit
import weakref

from kvpage.core.preemption_cost import MeasuredCostModel

from .connector import KVConnectorBase, KVConnectorMeta, OffloadingConnector
from .tiers import DiskTier, HostMemoryTier

__all__ = ["DEFAULT_DISK_TIER_GIB", "DiskTier", "HostMemoryTier", "KVConnectorBase", "KVConnectorMeta",
           "OffloadingConnector", "attach_offloading", "check_offloading_options", "close_offloading",
           "persist_cached_blocks", "recompute_pricer"]

# The disk tier's size when kv_offloading_dir is given without kv_offloading_size.
DEFAULT_DISK_TIER_GIB = 4.0


def check_offloading_options(kv_offloading_size, kv_offloading_dir, tensor_parallel_size: int = 1) -> None:
    """ValueError naming the argument for a value LLM(...) cannot take (checked before the model loads)."""
    if kv_offloading_size is not None and not (isinstance(kv_offloading_size, (int, float))
                                               and not isinstance(kv_offloading_size, bool)
                                               and 0 < kv_offloading_size < float("inf")):
        raise ValueError(f"kv_offloading_size must be a positive number of GiB or None, got {kv_offloading_size!r}")
    if kv_offloading_dir is not None and (not isinstance(kv_offloading_dir, (str, bytes)) and
                                          not hasattr(kv_offloading_dir, "__fspath__") or kv_offloading_dir == ""):
        raise ValueError(f"kv_offloading_dir must be a directory path or None, got {kv_offloading_dir!r}")
    if tensor_parallel_size > 1 and (kv_offloading_size is not None or kv_offloading_dir is not None):
        raise ValueError(f"kv_offloading_size / kv_offloading_dir are not supported with tensor_parallel_size > 1"
                         f" (got {tensor_parallel_size})")


def attach_offloading(runner, tokenizer, block_manager, scheduler, kv_offloading_size, kv_offloading_dir):
    """Put a tier behind block_manager's prefix cache: a disk tier under kv_offloading_dir (of
    kv_offloading_size GiB, default DEFAULT_DISK_TIER_GIB), else a host-memory tier of kv_offloading_size
    GiB. Returns (the runner to execute steps with, the connector). Refuses, naming the option, what the
    tier does not support: a hybrid KV cache (several KV-cache groups), tensor / context parallelism (a
    runner without its own cache), prefix caching off."""
    check_offloading_options(kv_offloading_size, kv_offloading_dir)
    if block_manager.device.cache is None:
        raise ValueError("kv_offloading_size / kv_offloading_dir need enable_prefix_caching=True (the tier holds"
                         " the prefix cache's evicted blocks)")
    from kvpage.model.runner import ModelRunner  # torch, only where a tier is configured

    # A tensor-parallel driver holds no cache of its own: each rank's shard of a block is in its own process.
    if not isinstance(runner, ModelRunner) or runner.context_parallel is not None:
        raise ValueError("kv_offloading_size / kv_offloading_dir are not supported with tensor_parallel_size > 1"
                         " or decode context parallelism")
    from .worker import KVOffloadWorker, model_fingerprint

    size_gib = kv_offloading_size if kv_offloading_size is not None else DEFAULT_DISK_TIER_GIB
    capacity = int(size_gib * 2**30)
    if kv_offloading_dir is not None:
        fingerprint = model_fingerprint(runner.model, tokenizer, runner, block_manager.block_size,
                                        runner.matmul_precision)
        tier = DiskTier(kv_offloading_dir, fingerprint, capacity)
    else:
        tier = HostMemoryTier(capacity)
    worker = KVOffloadWorker(runner, tier)
    connector = OffloadingConnector(tier, block_manager.block_size, save_now=worker.save,
                                    recompute_seconds=recompute_pricer(scheduler.config.cost_model),
                                    sliding_windows=block_manager.sliding_windows)
    worker.load_cost = connector.load_cost
    block_manager.device.cache.on_evict = connector.on_evict
    scheduler.kv_connector = connector
    if isinstance(tier, DiskTier):
        _persist_at_exit(worker, connector, block_manager)
    return worker, connector


def recompute_pricer(cost_model):
    """recompute_seconds(num_tokens) for OffloadingConnector from the scheduler's cost model: a measured
    model prices with its measured prefill rate only (None before a step was timed: its prior describes
    another machine, so a load is not declined on its word); a fixed model (tests, benches) with its own."""
    def recompute_seconds(num_tokens: int) -> float | None:
        if isinstance(cost_model, MeasuredCostModel):
            rate = cost_model.prefill_tokens_per_s
            return num_tokens / rate if rate else None
        return cost_model.recompute_cost(num_tokens)

    return recompute_seconds


def persist_cached_blocks(worker, connector, block_manager) -> int:
    """Store every block the pool's prefix cache indexes that the tier lacks, and wait for the writes:
    what a restart finds warm beyond the blocks the pool had evicted. Returns the blocks stored."""
    cache = block_manager.device.cache
    stores = [(h, cache.key_of(b), b) for h, b in cache.indexed() if not connector.tier.contains(h)]
    for i in range(0, len(stores), 64):  # the disk tier's write queue takes a bounded number at a time
        worker.save(stores[i:i + 64])
        connector.tier.flush()
    return len(stores)


def close_offloading(worker, connector, block_manager) -> None:
    """A disk tier's end (LLM.shutdown, interpreter exit): persist the pool's cached blocks, then stop the
    writer; again: nothing. A host tier just ends."""
    tier = connector.tier
    if isinstance(tier, DiskTier) and not tier.closed:
        try:
            persist_cached_blocks(worker, connector, block_manager)
        finally:
            tier.close()


def _persist_at_exit(worker, connector, block_manager) -> None:
    """close_offloading at interpreter exit, for an engine still alive then that nobody shut down."""
    refs = (weakref.ref(worker), weakref.ref(connector), weakref.ref(block_manager))

    def persist() -> None:
        objs = [r() for r in refs]
        if None not in objs:
            close_offloading(*objs)

    atexit.register(persist)
