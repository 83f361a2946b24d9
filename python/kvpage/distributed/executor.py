"""The driver (rank 0), an Executor like a ModelRunner: each execute(step) packs the step (protocol.py),
broadcasts it, and runs rank 0's ModelRunner.execute on the unpacked tensors, as every worker does.

A dead worker (closed sockets) or a hung one (KVPAGE_TP_TIMEOUT_S) fails the step: the driver kills its
workers, destroys the process group and raises a RuntimeError naming the rank; that LLM is then closed.
"""
from __future__ import annotations

import copy
import itertools
import os
import shutil
import sys
import time
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kvpage.engine.executor_base import Executor
from kvpage.model.tensor_parallel import CommTimer, ShardPlan, check_shardable, set_process_group

from . import protocol
from .group import (WORKER_TIMEOUT_S, TPGroup, device_for, driver_timeout_s, init_group, rendezvous_store,
                    startup_timeout_s, torchrun_env, torchrun_store)
from .launcher import WorkerProcesses, WorkerSpec, model_source, threads_per_rank
from .worker import RankReport, allocate, exchange_reports, serve, shard_for_rank

SHUTDOWN_GRACE_S = 10.0  # how long a worker may take to leave its loop before it is killed
_instances = itertools.count()


@dataclass
class _Session:
    """What must be released when the LLM goes away: no reference to the model or the executor, so a
    weakref.finalize on the executor can hold it (and run it at interpreter exit)."""

    group: TPGroup | None = None
    workers: WorkerProcesses | None = None
    store: object = None  # the TCP store the workers rendezvous on (spawn mode; its server lives here)
    tmp_dir: str | None = None
    threads_before: int | None = None
    message: int = 0  # the next message number
    healthy: bool = True
    closed: bool = False

    def remove_tmp(self) -> None:
        if self.tmp_dir:
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
            self.tmp_dir = None

    def close(self, kill: bool = False) -> None:
        if self.closed:
            return
        self.closed = True
        if self.group is not None and self.healthy and not kill:
            try:
                protocol.broadcast_message(protocol.header(protocol.Kind.SHUTDOWN, self.message), None,
                                           self.group.control)
            except Exception:  # a worker already gone: it needs no message
                pass
        if self.workers is not None:
            self.workers.stop(0.0 if kill else SHUTDOWN_GRACE_S)
        if self.group is not None:
            self.group.destroy()
        self.store = None
        self.remove_tmp()
        if self.threads_before is not None:
            torch.set_num_threads(self.threads_before)


@dataclass
class StepRecord:
    """One step as the driver saw it (collected when TensorParallelExecutor.step_log is a list)."""

    num_seqs: int
    num_tokens: int
    broadcast_bytes: int
    pack_s: float  # SchedulerOutput -> header + payload
    broadcast_s: float
    model_s: float  # rank 0's unpack + forward pass + logits gather (its collectives included)
    comm_s: float = 0.0  # of model_s, inside the model's all-reduces and gather (when CommTimer is on)


class TensorParallelExecutor(Executor):
    def __init__(self, model, plan: ShardPlan, session: _Session, reports: list[RankReport]) -> None:
        for rank, (report, shard) in enumerate(zip(reports, plan.ranks)):
            expected = (shard.num_heads, shard.num_kv_heads, len(shard.vocab), model.config.num_hidden_layers)
            got = (report.num_heads, report.num_kv_heads, report.vocab_rows, report.num_layers)
            if got != expected:
                raise RuntimeError(f"tensor-parallel rank {rank} loaded a different model than rank 0: its shard has"
                                   f" (heads, kv heads, vocab rows, layers) = {got}, rank 0 expects {expected}")
        self.model = model  # rank 0's shard
        self.plan = plan
        self.reports = reports
        self.session = session
        self.device = session.group.device
        self.runner = None
        self.block_size = 0
        self.cache_dtype = self.model.dtype
        self.kv_cache_bytes: list[tuple[int, int]] = []  # per rank: (device pool, host pool) bytes
        self.step_log: list[StepRecord] | None = None
        self._failure: str | None = None
        self._finalizer = weakref.finalize(self, session.close)

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    @property
    def dcp_size(self) -> int:
        return self.session.group.dcp_size

    @property
    def vocab_size(self) -> int:
        return self.plan.vocab_size

    @property
    def num_kv_blocks(self) -> int:
        return self.runner.num_kv_blocks

    @property
    def num_host_blocks(self) -> int:
        return self.runner.num_host_blocks

    def kv_cache_bytes_per_rank(self) -> list[int]:
        return [device for device, _ in self.kv_cache_bytes]

    @property
    def worker_pids(self) -> dict[int, int]:
        """rank -> pid of the local worker processes (empty under torchrun)."""
        return self.session.workers.pids if self.session.workers else {}

    # -- sizing ----------------------------------------------------------------------------------

    def rank_bytes_per_block(self, block_size: int, cache_dtype: torch.dtype | None = None,
                             layout=None) -> list[int]:
        """cache_dtype: default the allocated caches' (before allocate: the model's). layout: the KV-cache
        groups (kvpage.core.KVCacheLayout), default the allocated caches' (before allocate: one group)."""
        from kvpage.model import kv_cache_bytes_per_block

        cache_dtype = cache_dtype or self.cache_dtype
        layout = layout or (self.runner.layout if self.runner is not None else None)
        return [kv_cache_bytes_per_block(self.model.config, block_size, cache_dtype, s.num_kv_heads, layout)
                for s in self.plan.ranks]

    def kv_cache_bytes_per_block(self) -> int:
        """All ranks together (LLM's log line); a rank's own share is rank_bytes_per_block."""
        return sum(self.rank_bytes_per_block(self.block_size // self.dcp_size))

    def min_free_device_bytes(self) -> int:
        return min(r.free_device_bytes for r in self.reports)

    def allocate(self, num_kv_blocks: int, block_size: int, num_host_blocks: int, cache_dtype: torch.dtype | None,
                 weight_dtype: torch.dtype | None, matmul_precision: str, dcp_interleave: int, layout,
                 cuda_graphs) -> None:
        """Every rank allocates its shard of num_kv_blocks blocks (and of the host swap pool), in
        cache_dtype: the model's dtype (None) or one of protocol.CACHE_DTYPES; weight_dtype: the
        ModelRunner's (None, or one of protocol.WEIGHT_DTYPES: each rank rounds and packs its shard), as
        is matmul_precision. block_size: a rank's physical block; under decode context parallelism the
        scheduler's blocks are block_size * dcp_size tokens (virtual_block_size), dcp_interleave
        positions at a time on each rank of the group. layout: None (one group of all layers) or the model's
        own KV-cache groups (model_kv_cache_layout), which every rank derives from its config. cuda_graphs: the
        ModelRunner's (a CudaGraphConfig, or None: eager), on every rank alike."""
        from kvpage.model.runner import model_kv_cache_layout

        if layout is not None and layout != model_kv_cache_layout(self.model.config):
            raise ValueError("layout: tensor-parallel ranks lay their caches out in the model's own KV-cache groups"
                             " (kvpage.model.runner.model_kv_cache_layout) or in one group (None)")
        own = None if cache_dtype == self.model.dtype else cache_dtype
        h = protocol.allocate_header(self._take_message(), num_kv_blocks, block_size, num_host_blocks, own,
                                     weight_dtype, matmul_precision, dcp_interleave, layout is not None, cuda_graphs)
        protocol.broadcast_message(h, None, self.session.group.control)
        self.runner, sizes = allocate(self.model, h, self.session.group)
        failed = [rank for rank, row in enumerate(sizes) if min(row) < 0]
        if failed:
            self.session.healthy = False
            self.shutdown()
            raise RuntimeError(f"tensor-parallel ranks {failed} could not allocate their KV cache of {num_kv_blocks}"
                               f" blocks (see their output above); try a smaller num_kv_blocks")
        self.block_size = block_size * self.dcp_size
        self.cache_dtype = self.runner.cache_dtype
        self.kv_cache_bytes = sizes

    # -- steps -----------------------------------------------------------------------------------

    def _take_message(self) -> int:
        message = self.session.message
        self.session.message += 1
        return message

    def execute(self, batch) -> torch.Tensor:
        """Run one step (a SchedulerOutput or ModelInput) on every rank; float32 logits
        [sequences with do_sample + prompt_logprobs rows, vocab] on rank 0, as ModelRunner.execute returns them."""
        self.check_open()
        t0 = time.perf_counter()
        h, payload = protocol.pack_step(batch, self.session.message, self.block_size)  # ValueError: nothing sent
        try:
            dead = self.session.workers.dead() if self.session.workers else None
            if dead:
                raise RuntimeError(dead)
            self._take_message()
            t1 = time.perf_counter()
            protocol.broadcast_message(h, payload, self.session.group.control)
            t2 = time.perf_counter()
            comm_before = CommTimer.seconds
            logits = self.runner.execute(protocol.unpack_step(h, payload, self.device))
            if self.step_log is not None and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # time the work, not its launch
            t3 = time.perf_counter()
        except BaseException as e:
            error = self._fail(e)
            if isinstance(e, Exception):
                raise error from e
            raise
        if self.step_log is not None:
            self.step_log.append(StepRecord(int(h[protocol.NUM_SEQS]), int(h[protocol.NUM_TOKENS]),
                                            protocol.message_bytes(h, payload), t1 - t0, t2 - t1, t3 - t2,
                                            CommTimer.seconds - comm_before))
        if not logits.shape[0]:  # rank 0's runner knows only its shard's vocabulary rows
            return torch.empty((0, self.vocab_size), dtype=torch.float32, device=self.device)
        return logits

    def kv_connector_call(self, obj, reply_len: int = 0) -> list[list[int]]:
        """[kv tier] Send every worker a KV connector message (kvpage.kv_offload.tp handles it there, in step
        order); with reply_len > 0, wait for each worker's reply_len ints (rank order, ranks 1..N-1). A dead or
        hung worker fails it as it fails a step."""
        self.check_open()
        h, payload = protocol.object_message(self.session.message, obj, reply_len)
        try:
            self._take_message()
            protocol.broadcast_message(h, payload, self.session.group.control)
            if not reply_len:
                return []
            rows = self.session.group.control.all_gather(torch.zeros(reply_len, dtype=torch.int64))
        except BaseException as e:
            error = self._fail(e)
            if isinstance(e, Exception):
                raise error from e
            raise
        return [row.tolist() for row in rows[1:]]

    def check_open(self) -> None:
        """Raise RuntimeError if this executor failed or was shut down."""
        if self._failure:
            raise RuntimeError(f"this LLM's tensor-parallel workers failed earlier ({self._failure}); it cannot run"
                               f" any more: create a new LLM")
        if self.session.closed:
            raise RuntimeError("this LLM has been shut down (LLM.shutdown); create a new LLM")

    def _fail(self, error: BaseException) -> RuntimeError:
        """Tear everything down after a broken step; the error to raise, naming the culprit if known."""
        self.session.healthy = False
        workers = self.session.workers
        reason = workers.wait_dead(2.0) if workers else None
        if reason is None and "timed out" in str(error).lower():
            reason = (f"a tensor-parallel worker did not answer within {driver_timeout_s():.0f} s (hung?"
                      f" KVPAGE_TP_TIMEOUT_S sets the limit)")
        if reason is None:
            reason = f"a tensor-parallel step failed: {type(error).__name__}: {error}"
        self._failure = reason
        self.session.close(kill=True)
        return RuntimeError(f"{reason}; the workers were shut down and this LLM cannot run any more: create a new"
                            f" LLM")

    # -- the end ---------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the workers (a shutdown message, then a kill after SHUTDOWN_GRACE_S), destroy the process
        group. Idempotent; also runs when the executor is garbage-collected and at interpreter exit."""
        self._finalizer()


def launch(model_arg, model, world_size: int, dcp_size: int = 1) -> TensorParallelExecutor:
    """Start tensor parallelism for an LLM whose (full) model is loaded in this process.

    Without a launcher: spawn world_size - 1 local workers. Under torchrun (RANK / WORLD_SIZE set): rank 0
    returns the executor; every other rank serves the driver's steps until it shuts down, then exits
    the process (SystemExit(0)) - so the rest of the script runs on rank 0 only. dcp_size: the
    decode-context-parallel group size (checked by the caller: kvpage.core.context_parallel).
    """
    check_shardable(model)
    env = torchrun_env()
    if env is not None and env.world_size > 1:
        if env.world_size != world_size:
            raise ValueError(f"tensor_parallel_size={world_size}, but torchrun started {env.world_size} processes"
                             f" (WORLD_SIZE); they must be equal")
        return _launch_torchrun(model_arg, model, world_size, env, dcp_size)
    return _launch_local(model_arg, model, world_size, dcp_size)


def _own_copy(model_arg, model):
    """Rank 0 shards in place: a model object the caller handed in is copied first, so it stays usable."""
    from transformers import PreTrainedModel

    return copy.deepcopy(model) if isinstance(model_arg, PreTrainedModel) else model


def _device_type(model) -> str:
    return next(model.parameters()).device.type


def _launch_local(model_arg, model, world_size: int, dcp_size: int) -> TensorParallelExecutor:
    device_type = _device_type(model)
    plan = ShardPlan.build(model.config, world_size, vocab_size=model.get_input_embeddings().weight.shape[0])
    session = _Session()
    try:
        source, session.tmp_dir = model_source(model_arg, model)
        threads = threads_per_rank(world_size) if device_type == "cpu" else torch.get_num_threads()
        startup = startup_timeout_s()
        prefix = f"kvpage/{next(_instances)}/"
        session.store = rendezvous_store("127.0.0.1", 0, world_size, is_master=True, timeout_s=startup)
        store = dist.PrefixStore(prefix, session.store)
        specs = [WorkerSpec(rank, world_size, "127.0.0.1", session.store.port, prefix, source,
                            str(model.dtype).removeprefix("torch."), device_type, threads, os.getpid(), startup,
                            dcp_size)
                 for rank in range(1, world_size)]
        session.workers = WorkerProcesses(specs)
        if device_type == "cpu":
            session.threads_before = torch.get_num_threads()
            torch.set_num_threads(threads)
        device = device_for(device_type, 0)
        shard, _ = shard_for_rank(_own_copy(model_arg, model), world_size, 0, device)
        session.workers.wait_ready(store, startup)
        session.remove_tmp()
        session.group = init_group(store, 0, world_size, device, driver_timeout_s(), dcp_size)
        set_process_group(shard, session.group.model)
        return TensorParallelExecutor(shard, plan, session, exchange_reports(shard, session.group))
    except BaseException:
        session.healthy = False
        session.close(kill=True)
        raise


def _launch_torchrun(model_arg, model, world_size: int, env, dcp_size: int) -> TensorParallelExecutor:
    device = device_for(_device_type(model), env.local_rank)
    own = _own_copy(model_arg, model) if env.rank == 0 else model
    shard, plan = shard_for_rank(own, world_size, env.rank, device)
    tcp = torchrun_store(env, startup_timeout_s())
    # The job's store outlives this LLM: a fresh namespace per LLM (ranks build their LLMs in the same order).
    store = dist.PrefixStore(f"kvpage/{next(_instances)}/", tcp)
    group = init_group(store, env.rank, world_size, device, driver_timeout_s() if env.rank == 0 else WORKER_TIMEOUT_S,
                       dcp_size)
    set_process_group(shard, group.model)
    if env.rank != 0:
        try:
            with torch.inference_mode():
                serve(shard, group)
        finally:
            group.destroy()
        sys.exit(0)
    session = _Session(group=group, store=tcp)
    try:
        return TensorParallelExecutor(shard, plan, session, exchange_reports(shard, group))
    except BaseException:
        session.healthy = False
        session.close(kill=True)
        raise
