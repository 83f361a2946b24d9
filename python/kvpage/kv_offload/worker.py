"""The KV connector's worker side: block bytes between the runner's KV cache and a tier, and the model
fingerprint the disk tier is keyed by.

KVOffloadWorker wraps a ModelRunner as the engine's Executor (kvpage.engine.executor_base: execute() is its own,
the rest of the interface and any other attribute the runner's):
before each step's own swaps, copies and forward pass it saves the blocks the step's scheduling evicted
(copied out synchronously: this very step may reuse them) and loads the tier hits into their fresh
device blocks. A block's payload is every cache tensor's slice of that block (K then V of each of the
runner's cache pairs), as raw bytes: the tier never interprets it.
"""
from __future__ import annotations

import hashlib
import json
import time

import numpy as np
import torch

import kvpage
from kvpage import _C
from kvpage.core.hashing import TOKEN_BYTES
from kvpage.engine.executor_base import Executor

from .connector_api import KVConnectorMeta, KVLoadError
from .disk_tier import DiskBlock

_SAMPLED_ELEMENTS = 1024  # elements hashed at each end of every parameter


class KVOffloadWorker(Executor):
    # probe(epoch, [(tier hash, key)]) -> [bool]: the other ranks' checks of their entries (kv_offload.tp's
    # TPOffloadWorker); a single process has no other rank to ask.
    probe = None

    def __init__(self, runner, tier, cache_runner=None) -> None:
        """runner: the Executor steps run on; cache_runner: the ModelRunner whose KV cache this process's
        blocks are in (default runner; under tensor parallelism the driver's rank-0 runner: kv_offload.tp)."""
        self._runner = runner
        self.tier = tier
        self._tensors = [t for kv in (cache_runner or runner).kv_cache_pairs for t in kv]
        self._nbytes = [t[0].numel() * t.element_size() for t in self._tensors]
        self.bytes_per_block = sum(self._nbytes)
        # ops.allocate_kv_cache's layout: [num_blocks, kv heads, block_size, head_size]
        self._block_size = self._tensors[0].shape[2]
        self._device = self._tensors[0].device
        # Behind a CPU pool, the cache tensors' bytes as numpy arrays (num_blocks, bytes of one block), sharing
        # memory: a batch of blocks moves in one kvpage._C call (plain memcpys, GIL released), no torch op per
        # tensor and no staging copy.
        self._host_views = None
        if self._device.type == "cpu" and all(t.is_contiguous() for t in self._tensors):
            self._host_views = [t.view(t.shape[0], -1).view(torch.uint8).numpy() for t in self._tensors]
        self._pending_loads: list[tuple[int, bytes]] = []
        self.load_cost = None  # the connector's LoadCost: each load's copy time is reported to it

    def __getattr__(self, name):
        return getattr(self._runner, name)

    # The Executor interface the runner already provides (declared, so __getattr__ is not asked for it).
    @property
    def vocab_size(self) -> int:
        return self._runner.vocab_size

    def kv_cache_bytes_per_block(self) -> int:
        return self._runner.kv_cache_bytes_per_block()

    def kv_cache_bytes_per_rank(self) -> list[int]:
        return self._runner.kv_cache_bytes_per_rank()

    def local_kv_caches(self) -> list[torch.Tensor]:
        return self._runner.local_kv_caches()

    def check_open(self) -> None:
        self._runner.check_open()

    def shutdown(self) -> None:
        self._runner.shutdown()

    def execute(self, batch):
        meta: KVConnectorMeta | None = getattr(batch, "kv_connector_meta", None)
        if meta is not None:
            if meta.stores:
                self.save(meta.stores)
            if meta.loads:
                self.start_load(meta.loads)
                self.wait_for_load()
        return self._runner.execute(batch)

    # -- the worker side of the seam -----------------------------------------------------------

    @torch.inference_mode()
    def save(self, stores) -> None:
        """Copy the stored blocks' bytes out now (one gather per cache tensor), then hand them to the tier
        (the disk tier writes on its own thread)."""
        rows = self.read_blocks([block_id for _, _, block_id in stores])
        for (block_hash, key, _), row in zip(stores, rows):
            num_tokens = len(key.token_bytes) // TOKEN_BYTES
            if num_tokens < self._block_size:
                self._zero_past(row, num_tokens)
            self.tier.put(block_hash, key, row)

    def _zero_past(self, row, num_tokens: int) -> None:
        """A partial block's payload (kv_offload.connector: its key holds num_tokens tokens) keeps only those
        tokens' K/V: its later token rows (a former owner's, or never written) are zeroed, in every cache
        tensor ([kv heads, block_size, head_size] per block). A loading sequence computes those rows itself."""
        data = np.frombuffer(row, dtype=np.uint8)
        offset = 0
        for t, nbytes in zip(self._tensors, self._nbytes):
            data[offset:offset + nbytes].reshape(t.shape[1], t.shape[2], -1)[:, num_tokens:] = 0
            offset += nbytes

    def start_load(self, loads) -> None:
        """The payloads are already verified host bytes (read when the scheduler matched them)."""
        self._pending_loads.extend(loads)

    @torch.inference_mode()
    def wait_for_load(self) -> None:
        """Write the pending loads into their blocks; KVLoadError (after every other load is written) where a
        disk tier's payload failed its checks when read: the step must not run on those blocks."""
        loads, self._pending_loads = self._pending_loads, []
        if loads:
            start = time.perf_counter()
            failed = self.load_blocks([block_id for block_id, _ in loads], [payload for _, payload in loads])
            if self.load_cost is not None:
                self.load_cost.add_copy(len(loads), time.perf_counter() - start)
            if failed:
                raise KVLoadError(failed)

    def load_blocks(self, block_ids: list[int], payloads: list) -> list[int]:
        """Write each payload into its block: bytes as they are; a disk tier's DiskBlock read now, behind a CPU
        pool straight into the cache's rows (no host copy in between). Returns the blocks whose read failed."""
        ready = [(b, p) for b, p in zip(block_ids, payloads) if not isinstance(p, DiskBlock)]
        lazy = [(b, p) for b, p in zip(block_ids, payloads) if isinstance(p, DiskBlock)]
        failed = []
        if lazy and self._host_views is not None:
            ok = self.tier.load_into([p for _, p in lazy], [b for b, _ in lazy], self._host_views)
            failed = [b for (b, _), good in zip(lazy, ok) if not good]
        else:
            for b, p in lazy:
                data = self.tier.read(p)
                if data is None:
                    failed.append(b)
                else:
                    ready.append((b, data))
        if ready:
            self.write_blocks([b for b, _ in ready], [p for _, p in ready])
        return failed

    def flush_tier(self) -> None:
        """Wait until every block handed to the tier is stored (a disk tier writes on its own thread)."""
        self.tier.flush()

    def close_tier(self) -> None:
        """Write what is queued and stop the tier's writer."""
        self.tier.close()

    # -- block bytes ---------------------------------------------------------------------------

    def read_blocks(self, block_ids: list[int]) -> list[bytes]:
        """Each block's payload (every cache tensor's slice of it, in order)."""
        if self._host_views is not None:
            staging = np.empty((len(block_ids), self.bytes_per_block), dtype=np.uint8)
            rows = list(staging)
            _C.read_kv_blocks(rows, block_ids, self._host_views)
            return [row.data for row in rows]
        ids = torch.tensor(block_ids, dtype=torch.long, device=self._device)
        parts = [t.index_select(0, ids).reshape(len(block_ids), -1).view(torch.uint8) for t in self._tensors]
        staging = torch.cat(parts, dim=1).cpu().numpy()
        # Views of this step's own staging buffer (no copy; the disk writer holds it until written).
        return [staging[i].data for i in range(len(block_ids))]

    def write_blocks(self, block_ids: list[int], payloads: list[bytes]) -> None:
        for payload in payloads:
            if len(payload) != self.bytes_per_block:
                raise ValueError(f"a KV block payload of {len(payload)} bytes; this cache's blocks take"
                                 f" {self.bytes_per_block}")
        if self._host_views is not None:
            # One call for the whole batch, not a Python slice assignment per (block, cache tensor).
            _C.write_kv_blocks(payloads, block_ids, self._host_views)
            return
        n = len(block_ids)
        # One host copy (the join), one copy into the cache per tensor (strided rows: no gather first).
        staging = torch.frombuffer(bytearray().join(payloads), dtype=torch.uint8).view(n, -1)
        staging = staging.to(self._device)
        ids = torch.tensor(block_ids, dtype=torch.long, device=self._device)
        offset = 0
        for t, nbytes in zip(self._tensors, self._nbytes):
            t.index_copy_(0, ids, staging[:, offset:offset + nbytes].view(t.dtype).unflatten(1, t.shape[1:]))
            offset += nbytes


def model_fingerprint(model, tokenizer, runner, block_size: int, matmul_precision: str = "highest",
                      extra: dict | None = None) -> str:
    """32 hex digits naming everything a block's bytes depend on: kvpage's version, the model's config, its
    weights (cheaply: every parameter's name, shape, dtype and its first and last 1024 elements' bytes,
    not a hash of every byte), dtype, KV-cache dtype and layout, block size, the linear layers' precision,
    and the tokenizer (its class, vocabulary size and the ids of a fixed text). extra: more that the bytes
    depend on (a tensor-parallel rank's place: kv_offload.tp), JSON-able."""
    h = hashlib.blake2b(digest_size=16)
    config = model.config.to_dict()
    config.pop("_name_or_path", None)
    config.pop("transformers_version", None)
    desc = {
        "kvpage": kvpage.__version__, "config": config, "dtype": str(runner.dtype),
        "kv_cache_dtype": str(runner.cache_dtype), "weight_dtype": str(runner.weight_dtype),
        "matmul_precision": matmul_precision, "block_size": block_size,
        "kv_cache_shape": [list(t.shape[1:]) for kv in runner.kv_cache_pairs for t in kv],
        "layout": [list(g.layer_ids) for g in runner.layout.groups], "tokenizer": _tokenizer_desc(tokenizer),
    }
    if extra:
        desc["extra"] = extra
    h.update(json.dumps(desc, sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, p in model.named_parameters():
            flat = p.detach().reshape(-1)
            h.update(f"{name}{tuple(p.shape)}{p.dtype}".encode())
            for part in (flat[:_SAMPLED_ELEMENTS], flat[-_SAMPLED_ELEMENTS:]):
                h.update(part.contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def _tokenizer_desc(tokenizer) -> list:
    if tokenizer is None:
        return ["none"]
    try:
        ids = list(tokenizer.encode("kvpage fingerprint: The quick brown fox jumps over the lazy dog. 0123456789"))
    except Exception:  # a tokenizer without encode(str): its class and size still tell models apart
        ids = []
    return [type(tokenizer).__name__, len(tokenizer) if hasattr(tokenizer, "__len__") else None, ids]
