"""The executor interface: what LLM and LLMEngine may ask of whatever runs their steps.

Three classes implement it: kvpage.model.ModelRunner (one process), kvpage.distributed's
TensorParallelExecutor (rank 0 driving N ranks) and kvpage.kv_offload's KVOffloadWorker (a runner
with a KV tier in front). The engine reads only what is declared here, so a new executor knows what
it must provide and the engine never guesses what one offers.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class Executor(ABC):
    # The pools the executor allocated, in blocks (a tensor-parallel block id: one block on every rank).
    num_kv_blocks: int
    num_host_blocks: int
    # The model this process runs (a tensor-parallel driver: rank 0's shard), for its config and size.
    model: torch.nn.Module

    @abstractmethod
    def execute(self, step) -> torch.Tensor:
        """Run one step (a SchedulerOutput); float32 logits, one row per sampled sequence in step order,
        then each sequence's prompt_logit_positions rows (kvpage.core.scheduler_output.logits_rows)."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """The rows of the LM head: every token id a request may name lies below it."""

    @abstractmethod
    def kv_cache_bytes_per_block(self) -> int:
        """One block id's KV-cache bytes, every layer and every rank together."""

    @abstractmethod
    def kv_cache_bytes_per_rank(self) -> list[int]:
        """The device KV pool each rank allocated, in bytes, measured on that rank."""

    def local_kv_caches(self) -> list[torch.Tensor]:
        """The device KV-cache tensors this process holds, each once (K and V of every cache pair), for a swap
        probe to time; [] where the caches live in other processes."""
        return []

    def check_open(self) -> None:
        """Raise RuntimeError if the executor cannot run steps any more (failed or shut down)."""

    def shutdown(self) -> None:
        """Release what the executor holds beyond this process's memory (idempotent)."""
