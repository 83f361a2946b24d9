"""Decode steps replayed from CUDA graphs (vLLM's): a small model's GPU decode step is bound by launching
kernels, and a graph launches the whole forward at once. One graph per batch-size bucket (1, 2, 4, then
multiples of 8 up to max_num_seqs) over persistent input buffers; a step of n sequences fills n rows, pads
its bucket with rows that write nowhere, replays and reads n rows. Prefill, mixed and oversized steps run
eagerly. `DecodeGraphs(..., capture=False)` runs the padded buffers eagerly (how a CPU tests the padding).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kvpage.ops.config import range_checks

from .metadata import AttentionMetadata, KVCache

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, list[KVCache]], torch.Tensor]


@dataclass(frozen=True)
class CudaGraphConfig:
    """What the graphs are sized for: the batch (max_num_seqs) and the context (max_model_len)."""

    max_num_seqs: int
    max_model_len: int


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes a graph is captured for: 1, 2, 4, 8, 16, 24, ... up to max_num_seqs (vLLM's)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [s for s in (1, 2, 4) if s <= max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    return sizes if sizes[-1] == max_num_seqs else sizes + [max_num_seqs]


def bucket_for(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds num_seqs sequences; None past the largest."""
    return next((s for s in sizes if s >= num_seqs), None)


@dataclass
class DecodeBuffers:
    """The persistent inputs every graph reads: rows [0, max_batch), tables max_blocks wide."""

    input_ids: torch.Tensor  # int64 [max_batch]
    positions: torch.Tensor  # int64 [max_batch]
    slot_mapping: torch.Tensor  # int64 [max_batch]
    block_tables: torch.Tensor  # int32 [max_batch, max_blocks]
    seq_lens: torch.Tensor  # int32 [max_batch]
    query_start_loc: torch.Tensor  # int32 [max_batch + 1]: 0, 1, 2, ... (one token per sequence)
    max_seq_len: int  # the longest context a graph serves: max_model_len

    @classmethod
    def allocate(cls, max_batch: int, max_blocks: int, block_size: int, device) -> "DecodeBuffers":
        def zeros(*shape, dtype):
            return torch.zeros(shape, dtype=dtype, device=device)
        return cls(zeros(max_batch, dtype=torch.int64), zeros(max_batch, dtype=torch.int64),
                   torch.full((max_batch,), -1, dtype=torch.int64, device=device),
                   zeros(max_batch, max_blocks, dtype=torch.int32), torch.ones(max_batch, dtype=torch.int32,
                                                                               device=device),
                   torch.arange(max_batch + 1, dtype=torch.int32, device=device), max_blocks * block_size)

    def metadata(self, batch: int) -> AttentionMetadata:
        """The first `batch` rows as a decode step's metadata (views: what a graph captured reads)."""
        return AttentionMetadata(self.slot_mapping[:batch], self.block_tables[:batch], self.seq_lens[:batch],
                                 self.query_start_loc[:batch + 1], max_query_len=1, max_seq_len=self.max_seq_len)

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, batch: int) -> None:
        """A decode step's n rows, then padding up to `batch`: a padding row writes no slot and attends
        to one token of block 0, which any pool has, and its output is never read."""
        n, width = input_ids.shape[0], meta.block_tables.shape[1]
        if width > self.block_tables.shape[1]:
            raise ValueError(f"a block table of {width} blocks is wider than the graphs' {self.block_tables.shape[1]}"
                             " (max_model_len)")
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        self.block_tables[:n, width:].zero_()
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.input_ids[n:batch].zero_()
        self.positions[n:batch].zero_()
        self.slot_mapping[n:batch].fill_(-1)
        self.block_tables[n:batch].zero_()
        self.seq_lens[n:batch].fill_(1)


class DecodeGraphs:
    """Replays (or, with capture=False, runs eagerly over the same buffers) the decode steps it fits."""

    def __init__(self, forward: Forward, kv_caches: list[KVCache], max_num_seqs: int, max_model_len: int,
                 block_size: int, device, capture: bool = True) -> None:
        self.forward, self.kv_caches, self.capture = forward, kv_caches, capture
        self.sizes = capture_sizes(max_num_seqs)
        max_blocks = -(-max_model_len // block_size)
        self.buffers = DecodeBuffers.allocate(self.sizes[-1], max_blocks, block_size, device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        if capture:
            self._capture_all()

    def fits(self, meta: AttentionMetadata) -> bool:
        """A decode step (one token per sequence) of at most the largest bucket's sequences."""
        return (meta.is_all_decode and bucket_for(meta.num_seqs, self.sizes) is not None
                and meta.block_tables.shape[1] <= self.buffers.block_tables.shape[1])

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [n, hidden] of a step that fits()."""
        n = input_ids.shape[0]
        batch = bucket_for(n, self.sizes)
        self.buffers.fill(input_ids, positions, meta, batch)
        if not self.capture:
            return self._run(batch)[:n]
        graph, output = self._graphs[batch]
        graph.replay()
        return output[:n]

    def _run(self, batch: int) -> torch.Tensor:
        b = self.buffers
        return self.forward(b.input_ids[:batch], b.positions[:batch], b.metadata(batch), self.kv_caches)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """Largest first, so the smaller graphs reuse its memory pool (vLLM's order). Range checks
        read the device, which a capture forbids; the runner builds these inputs itself."""
        with range_checks(False):
            for batch in reversed(self.sizes):
                self._run(batch)  # warm-up outside the graph: lazy initialisation, autotuning
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):
                    output = self._run(batch)
                if self._pool is None:
                    self._pool = graph.pool()
                self._graphs[batch] = (graph, output)
        torch.cuda.synchronize()
