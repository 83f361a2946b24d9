"""A worker rank: hold a shard of the model and a shard of every KV block, run each step the driver
broadcasts, and nothing else (no scheduler, no block manager, no sampler).

Start-up, on every rank (the driver's side is executor.py):
  1. load and shard the model (spawned workers then set ready/<rank> in the store)
  2. join the process group; all_gather each rank's RankReport (the driver checks all ranks loaded the
     same model and sizes the KV cache from the reports)
  3. ALLOCATE message: build the ModelRunner; all_gather the bytes each rank allocated
  4. STEP messages until SHUTDOWN
"""
from __future__ import annotations

import json
import sys
import traceback
from dataclasses import astuple, dataclass

import torch
import torch.distributed as dist

from kvpage.model.tensor_parallel import ShardPlan

from . import protocol
from .group import TPGroup


@dataclass
class RankReport:
    free_device_bytes: int  # CUDA memory free after loading the model; 0 on CPU
    num_heads: int
    num_kv_heads: int
    vocab_rows: int
    num_layers: int


def exchange_reports(model, group: TPGroup) -> list[RankReport]:
    """Every rank's RankReport, in rank order (a collective)."""
    shard = model.kvpage_shard
    free = torch.cuda.mem_get_info(group.device)[0] if group.device.type == "cuda" else 0
    mine = RankReport(free, shard.num_heads, shard.num_kv_heads, len(shard.vocab), model.config.num_hidden_layers)
    return [RankReport(*row) for row in _all_gather_ints(list(astuple(mine)), group)]


def _all_gather_ints(values: list[int], group: TPGroup) -> list[list[int]]:
    return [r.tolist() for r in group.control.all_gather(torch.tensor(values, dtype=torch.int64))]


def allocate(model, h: torch.Tensor, group: TPGroup):
    """The ALLOCATE message on every rank: this rank's ModelRunner (or None if allocation failed), and
    [(device bytes, host bytes)] per rank, -1 for a rank that failed (a collective)."""
    from kvpage.model import ModelRunner

    runner, mine = None, [-1, -1]
    try:
        runner = ModelRunner(model, int(h[protocol.NUM_KV_BLOCKS]), int(h[protocol.BLOCK_SIZE]), model.dtype,
                             int(h[protocol.NUM_HOST_BLOCKS]), num_kv_heads=model.kvpage_shard.num_kv_heads,
                             kv_cache_dtype=protocol.cache_dtype_of(h), weight_dtype=protocol.weight_dtype_of(h),
                             matmul_precision=protocol.matmul_precision_of(h),
                             cuda_graphs=protocol.cuda_graphs_of(h), context_parallel=_context_parallel(group, h),
                             kv_cache_layout=_kv_cache_layout(model, h))
        mine = [_nbytes(runner.kv_cache_pairs), _nbytes(runner.host_kv_caches)]
    except (RuntimeError, ValueError, MemoryError):
        traceback.print_exc()
    return runner, [tuple(row) for row in _all_gather_ints(mine, group)]


def _kv_cache_layout(model, h: torch.Tensor):
    """The model's KV-cache groups where the driver lays its cache out in them, else None (one group)."""
    if not int(h[protocol.MODEL_KV_CACHE_GROUPS]):
        return None
    from kvpage.model.runner import model_kv_cache_layout

    return model_kv_cache_layout(model.config)


def _context_parallel(group: TPGroup, h: torch.Tensor):
    """This rank's part of its DCP group, or None without decode context parallelism."""
    if group.dcp_size == 1:
        return None
    from kvpage.core.context_parallel import ContextParallelPlacement
    from kvpage.model.context_parallel import ContextParallelAttention

    placement = ContextParallelPlacement(group.dcp_size, int(h[protocol.DCP_INTERLEAVE]), int(h[protocol.BLOCK_SIZE]))
    return ContextParallelAttention(placement, group.dcp_rank, group.dcp)


def _nbytes(caches) -> int:
    return sum(t.numel() * t.element_size() for kv in caches for t in kv)


def serve(model, group: TPGroup) -> None:
    """The worker loop; returns on SHUTDOWN. Raises if the driver goes away (its sockets close)."""
    exchange_reports(model, group)
    runner, expected = None, 0
    kv_tier = None  # [kv tier] this rank's part of a KV offload tier (kvpage.kv_offload.tp), once set up
    while True:
        h, payload = protocol.receive_message(group.control)
        kind, message = protocol.Kind(int(h[protocol.KIND])), int(h[protocol.MESSAGE])
        if message != expected:
            raise RuntimeError(f"rank {group.rank}: step message {message} arrived, expected {expected}")
        expected += 1
        if kind is protocol.Kind.SHUTDOWN:
            return
        if kind is protocol.Kind.ALLOCATE:
            runner, sizes = allocate(model, h, group)
            if runner is None or any(b < 0 for row in sizes for b in row):
                return  # the driver raises for every rank that failed
            continue
        if kind is protocol.Kind.KV_CONNECTOR:  # [kv tier]
            from kvpage.kv_offload.tp import serve_kv_message
            kv_tier = serve_kv_message(kv_tier, runner, group, *protocol.object_of(h, payload))
            continue
        runner.execute(protocol.unpack_step(h, payload, group.device))


def shard_for_rank(model, world_size: int, rank: int, device: torch.device):
    """Shard `model` in place for `rank` and move it to its device."""
    from kvpage.model.tensor_parallel import shard_model

    plan = ShardPlan.build(model.config, world_size, vocab_size=model.get_input_embeddings().weight.shape[0])
    return shard_model(model, plan, rank).to(device), plan


def main(argv: list[str] | None = None) -> int:
    """Entry point of a spawned worker (python -m kvpage.distributed SPEC_JSON)."""
    from kvpage.model import load_model
    from kvpage.model.tensor_parallel import set_process_group

    from .group import WORKER_TIMEOUT_S, device_for, init_group, rendezvous_store
    from .launcher import WorkerSpec, quiet_transformers, watch_parent

    spec = WorkerSpec(**json.loads((argv or sys.argv[1:])[0]))
    watch_parent(spec.parent_pid)
    torch.set_num_threads(spec.num_threads)
    tcp = rendezvous_store(spec.store_host, spec.store_port, spec.world_size, is_master=False,
                           timeout_s=spec.startup_timeout_s)
    store = dist.PrefixStore(spec.store_prefix, tcp)
    try:
        device = device_for(spec.device_type, spec.rank)
        with quiet_transformers():
            model, _ = load_model(spec.model, dtype=getattr(torch, spec.dtype))
        model, _ = shard_for_rank(model, spec.world_size, spec.rank, device)
    except BaseException:
        store.set(f"failed/{spec.rank}", traceback.format_exc())
        raise
    store.set(f"ready/{spec.rank}", "1")
    group = init_group(store, spec.rank, spec.world_size, device, WORKER_TIMEOUT_S, spec.dcp_size)
    set_process_group(model, group.model)
    try:
        with torch.inference_mode():
            serve(model, group)
    finally:
        group.destroy()
    return 0
