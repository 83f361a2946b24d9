"""KV offload tiers (issue 48): a second tier behind the pool's prefix cache, through a connector seam.

connector_api.py: the seam (scheduler side, pure Python); connector.py: OffloadingConnector, its implementation;
tiers.py: what every tier shares and the host-memory tier; disk_tier.py: the disk tier (pure Python); worker.py:
the worker side (torch) and the model fingerprint; tp.py: the same under tensor parallelism (each rank its own
shard of the blocks, in its own tier).
attach_offloading wires one engine's block manager, scheduler and runner to a tier.
"""
from __future__ import annotations

import atexit
import logging
import weakref

from kvpage.core.preemption_cost import MeasuredCostModel

from .connector import OffloadingConnector
from .connector_api import KVConnectorBase, KVConnectorMeta
from .disk_tier import DiskTier
from .tiers import HostMemoryTier

__all__ = ["DEFAULT_DISK_TIER_GIB", "DiskTier", "HostMemoryTier", "KVConnectorBase", "KVConnectorMeta",
           "OffloadingConnector", "attach_offloading", "check_offloading_options", "close_offloading",
           "persist_cached_blocks", "recompute_pricer"]

logger = logging.getLogger("kvpage")

# The disk tier's size when kv_offloading_dir is given without kv_offloading_size.
DEFAULT_DISK_TIER_GIB = 4.0


def check_offloading_options(kv_offloading_size, kv_offloading_dir, tensor_parallel_size: int = 1) -> None:
    """ValueError naming the argument for a value LLM(...) cannot take (checked before the model loads).
    Every tensor_parallel_size takes a tier (each rank keeps its own shard of the blocks: kv_offload.tp)."""
    if kv_offloading_size is not None and not (isinstance(kv_offloading_size, (int, float))
                                               and not isinstance(kv_offloading_size, bool)
                                               and 0 < kv_offloading_size < float("inf")):
        raise ValueError(f"kv_offloading_size must be a positive number of GiB or None, got {kv_offloading_size!r}")
    if kv_offloading_dir is not None and (not isinstance(kv_offloading_dir, (str, bytes)) and
                                          not hasattr(kv_offloading_dir, "__fspath__") or kv_offloading_dir == ""):
        raise ValueError(f"kv_offloading_dir must be a directory path or None, got {kv_offloading_dir!r}")


def attach_offloading(runner, tokenizer, block_manager, scheduler, kv_offloading_size, kv_offloading_dir):
    """Put a tier behind block_manager's prefix cache: a disk tier under kv_offloading_dir (of
    kv_offloading_size GiB, default DEFAULT_DISK_TIER_GIB), else a host-memory tier of kv_offloading_size
    GiB; under tensor parallelism each rank keeps its share of that size (its KV heads' bytes of each
    block) in its own tier (kv_offload.tp). Returns (the runner to execute steps with, the connector).
    Refuses, naming the option, what the tier does not support: decode context parallelism, prefix
    caching off."""
    check_offloading_options(kv_offloading_size, kv_offloading_dir)
    if block_manager.device.cache is None:
        raise ValueError("kv_offloading_size / kv_offloading_dir need enable_prefix_caching=True (the tier holds"
                         " the prefix cache's evicted blocks)")
    size_gib = kv_offloading_size if kv_offloading_size is not None else DEFAULT_DISK_TIER_GIB
    capacity = int(size_gib * 2**30)
    worker = _offload_worker(runner, tokenizer, block_manager.block_size, kv_offloading_dir, capacity)
    connector = OffloadingConnector(worker.tier, block_manager.block_size, save_now=worker.save,
                                    recompute_seconds=recompute_pricer(scheduler.config.cost_model),
                                    sliding_windows=block_manager.sliding_windows)
    connector.verify_remote = worker.probe  # tensor parallelism: the other ranks' checks (None otherwise)
    worker.load_cost = connector.load_cost
    block_manager.device.cache.on_evict = connector.on_evict
    scheduler.kv_connector = connector
    if isinstance(worker.tier, DiskTier):
        _persist_at_exit(worker, connector, block_manager)
    return worker, connector


def _offload_worker(runner, tokenizer, block_size: int, directory, capacity: int):
    """The worker side for `runner`: a ModelRunner's own cache, or a tensor-parallel driver's rank 0 plus
    the other ranks (each its capacity / world_size share)."""
    from kvpage.distributed.executor import TensorParallelExecutor  # torch, only where a tier is configured
    from kvpage.model.runner import ModelRunner

    from .tp import RankTierConfig, TPOffloadWorker, make_tier, rank_fingerprint
    from .worker import KVOffloadWorker, model_fingerprint

    if isinstance(runner, TensorParallelExecutor) and runner.dcp_size == 1:
        local, n = runner.runner, runner.world_size
        fingerprint = rank_fingerprint(local.model, tokenizer, local, None, 0, n, local.block_size,
                                       local.matmul_precision)
        config = RankTierConfig(None if directory is None else str(directory), capacity // n, fingerprint,
                                local.block_size, local.matmul_precision)
        return TPOffloadWorker(runner, make_tier(directory, fingerprint, capacity // n), config)
    if not isinstance(runner, ModelRunner) or runner.context_parallel is not None:
        raise ValueError(f"kv_offloading_size / kv_offloading_dir are not supported with decode context parallelism"
                         f" (decode_context_parallel_size > 1) nor on a {type(runner).__name__} runner")
    fingerprint = model_fingerprint(runner.model, tokenizer, runner, block_size, runner.matmul_precision)
    return KVOffloadWorker(runner, make_tier(directory, fingerprint, capacity))


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
        worker.flush_tier()
    return len(stores)


def close_offloading(worker, connector, block_manager) -> None:
    """A disk tier's end (LLM.shutdown, interpreter exit): persist the pool's cached blocks, then stop the
    writer; again: nothing. A host tier just ends."""
    tier = connector.tier
    if isinstance(tier, DiskTier) and not tier.closed:
        try:
            persist_cached_blocks(worker, connector, block_manager)
        finally:
            worker.close_tier()


def _persist_at_exit(worker, connector, block_manager) -> None:
    """close_offloading at interpreter exit, for an engine still alive then that nobody shut down."""
    refs = (weakref.ref(worker), weakref.ref(connector), weakref.ref(block_manager))

    def persist() -> None:
        objs = [r() for r in refs]
        if None not in objs:
            try:
                close_offloading(*objs)
            except RuntimeError as e:  # tensor-parallel workers already gone: what rank 0 holds is written
                logger.warning("kvpage: KV offload tier: not every cached block was persisted at exit: %s", e)

    atexit.register(persist)
