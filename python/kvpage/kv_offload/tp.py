"""KV offload tiers under tensor parallelism: every rank keeps its own shard of each block (its KV heads) in its
own tier; the driver's scheduler-side connector owns the lookup.

Driver (rank 0, the scheduler's process): the OffloadingConnector over rank 0's tier is the index (what is
held, LRU order, what to store and what to load where). TPOffloadWorker, the engine's Executor, wraps the
TensorParallelExecutor: rank 0's part of a step's stores and loads runs here on rank 0's ModelRunner, every
other rank's in its own process from one KV_CONNECTOR message sent just before the step's own message
(ranks take messages in order, so the blocks are stored and loaded before the forward pass).

Verification: the connector verifies rank 0's bytes when it matches a prompt and asks the other ranks to
verify theirs in the same schedule (probe: each reads and checks its entries, keeps the verified bytes for
the step message that loads them, and answers one flag per entry). An entry any rank lacks or fails
shortens the hit, as a local miss does, so no rank ever loads unverified bytes and a file damaged on one
rank costs only that hit. Each rank's tier is keyed by its own fingerprint (its shard's weights, its rank
and the TP size, and the driver's fingerprint: tokenizer, config, dtypes, block size), so a disk directory
holds one subdirectory per rank and a restart with another TP size finds nothing to load.
"""
from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass

from .disk_tier import DiskTier
from .tiers import HostMemoryTier
from .worker import KVOffloadWorker, model_fingerprint

logger = logging.getLogger("kvpage")


@dataclass(frozen=True)
class RankTierConfig:
    """What every rank builds its own tier from (sent once, pickled, by TPOffloadWorker)."""

    directory: str | None  # a disk tier's directory; None: host memory
    capacity_bytes: int  # each rank's share of kv_offloading_size
    driver_fingerprint: str
    block_size: int
    matmul_precision: str


def rank_fingerprint(model, tokenizer, runner, config: RankTierConfig | None, rank: int, world_size: int,
                     block_size: int, matmul_precision: str) -> str:
    """A rank's tier key: its shard's fingerprint with its place in the group (and, but on the driver, the
    driver's fingerprint, which covers the tokenizer the other ranks do not have)."""
    extra = {"tp_rank": rank, "tp_size": world_size}
    if config is not None:
        extra["driver"] = config.driver_fingerprint
    return model_fingerprint(model, tokenizer, runner, block_size, matmul_precision, extra=extra)


def make_tier(directory, fingerprint: str, capacity_bytes: int):
    return DiskTier(directory, fingerprint, capacity_bytes) if directory is not None else HostMemoryTier(capacity_bytes)


class TPOffloadWorker(KVOffloadWorker):
    """The driver's worker side: rank 0's blocks here, the other ranks' through KV_CONNECTOR messages."""

    def __init__(self, executor, tier, config: RankTierConfig) -> None:
        super().__init__(executor, tier, cache_runner=executor.runner)
        self._executor = executor
        failed = [rank for rank, (ok,) in enumerate(executor.kv_connector_call(("setup", config), 1), 1) if not ok]
        if failed:
            raise ValueError(f"kv_offloading_dir={config.directory!r}: tensor-parallel ranks {failed} could not open"
                             f" their KV offload tier (see their output above)")

    def execute(self, batch):
        meta = getattr(batch, "kv_connector_meta", None)
        if meta is not None:
            loads = [(block_id, block_hash, key) for (block_id, _), (block_hash, key) in zip(meta.loads, meta.load_keys)]
            self._executor.kv_connector_call(("step", meta.stores, loads, meta.touches))
            if meta.stores:
                KVOffloadWorker.save(self, meta.stores)
            if meta.loads:
                self.start_load(meta.loads)
                self.wait_for_load()
        return self._runner.execute(batch)

    def save(self, stores) -> None:
        self._executor.kv_connector_call(("save", stores))
        super().save(stores)

    def probe(self, epoch: int, items) -> list[bool]:
        """Whether every other rank holds and verified each (tier hash, key) of `items`; each keeps the
        verified bytes for this schedule's step message (`epoch`: the connector's schedule count)."""
        if not items:
            return []
        replies = self._executor.kv_connector_call(("probe", epoch, items), len(items))
        return [all(row[j] for row in replies) for j in range(len(items))]

    def flush_tier(self) -> None:
        self._executor.kv_connector_call(("flush",), 1)  # answered once the rank's writes are done
        self.tier.flush()

    def close_tier(self) -> None:
        try:
            self._executor.kv_connector_call(("close",), 1)
        except RuntimeError as e:  # the workers are gone (failed or shut down): nothing left to write there
            logger.warning("kvpage: KV offload tier: the tensor-parallel ranks' tiers were not closed: %s", e)
        finally:
            self.tier.close()


class RankOffload:
    """A worker rank's part: its tier, its shard of each block, and the bytes its last probes verified."""

    def __init__(self, runner, rank: int, world_size: int, config: RankTierConfig) -> None:
        fingerprint = rank_fingerprint(runner.model, None, runner, config, rank, world_size, config.block_size,
                                       config.matmul_precision)
        self.rank = rank
        self.worker = KVOffloadWorker(runner, make_tier(config.directory, fingerprint, config.capacity_bytes))
        self._pending: dict[bytes, bytes] = {}
        self._epoch = -1

    def probe(self, epoch: int, items) -> list[int]:
        if epoch != self._epoch:  # a new schedule: what an earlier one verified but did not load is dropped
            self._pending.clear()
            self._epoch = epoch
        # The entries not verified yet, read in batches (get_many: a disk tier's files in one kvpage._C call), each
        # batch up to and including its first miss; the next one starts after it.
        todo = [(block_hash, key) for block_hash, key in items if block_hash not in self._pending]
        while todo:
            payloads = self.worker.tier.get_many(todo)
            for (block_hash, _), payload in zip(todo, payloads):
                if payload is not None:
                    self._pending[block_hash] = payload
            todo = todo[len(payloads):]
        return [int(block_hash in self._pending) for block_hash, _ in items]

    def step(self, stores, loads, touches) -> None:
        """Stores first (this very step may reuse those blocks), then the driver's LRU touches, then loads."""
        if stores:
            self.worker.save(stores)
        for block_hash in touches:
            self.worker.tier.touch(block_hash)
        if loads:
            payloads = []
            for block_id, block_hash, key in loads:
                # Not popped: two sequences may load one entry in a step (a window group's pool hit fell short).
                payload = self._pending.get(block_hash)
                if payload is None:
                    # Never expected (the driver loads only what this rank verified in the same schedule).
                    raise RuntimeError(f"tensor-parallel rank {self.rank}: KV block {block_hash.hex()} to load into"
                                       f" block {block_id} was not verified by this rank")
                payloads.append(payload)
            self.worker.write_blocks([block_id for block_id, _, _ in loads], payloads)
        self._pending.clear()


def serve_kv_message(state: RankOffload | None, runner, group, obj, reply_len: int) -> RankOffload | None:
    """A worker rank's handling of one KV_CONNECTOR message (kvpage.distributed.worker.serve); returns the
    rank's state. Answers reply_len ints where the driver waits for them."""
    op, *args = obj
    reply = [1] * reply_len
    if op == "setup":
        try:
            state = RankOffload(runner, group.rank, group.world_size, *args)
        except (OSError, ValueError):
            traceback.print_exc()
            reply = [0]
    elif op == "probe":
        reply = state.probe(*args)
    elif op == "step":
        state.step(*args)
    elif op == "save":
        state.worker.save(*args)
    elif op == "flush":
        state.worker.flush_tier()
    elif op == "close":
        state.worker.close_tier()
    else:
        raise RuntimeError(f"tensor-parallel rank {group.rank}: unknown KV connector message {op!r}")
    if reply_len:
        import torch

        group.control.all_gather(torch.tensor(reply, dtype=torch.int64))
    return state
