"""PagedCache's state between calls: one forward pass's layout (PassLayout), what undoes a pass that
failed midway (PassUndo), and the figures stats() reports (PagedCacheStats)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvpage.model.metadata import AttentionMetadata

__all__ = ["PagedCacheStats", "PassLayout", "PassUndo"]


@dataclass
class PassUndo:
    """What the cache held before a forward pass placed its tokens: a pass that fails or is interrupted
    midway (some layers never wrote their K/V) is taken back to this, never left half-written."""

    started: bool  # the pass began an empty cache: undo empties it again
    num_columns: int
    tables: list[tuple[list[int], int]]  # RowTables.snapshot()


@dataclass
class PassLayout:
    """One forward pass's layout, built at its first attention layer and read by every layer."""

    batch_size: int
    query_len: int
    metadata: AttentionMetadata | None  # None: no row has a real token in this pass
    token_index: torch.Tensor | None  # real tokens' places in the flat [batch * query_len]; None: all real
    undo: PassUndo | None = None
    layers_done: set[int] = field(default_factory=set)  # layers whose K/V this pass has written


@dataclass(frozen=True)
class PagedCacheStats:
    block_size: int
    bytes_per_block: int  # one block over all layers, K and V
    num_blocks_allocated: int  # the pool tensors' size (fixed with num_blocks=..., grown on demand otherwise)
    num_blocks_used: int
    peak_blocks_used: int
    num_copy_on_write: int

    @property
    def kv_bytes_used(self) -> int:
        return self.num_blocks_used * self.bytes_per_block

    @property
    def peak_kv_bytes(self) -> int:
        return self.peak_blocks_used * self.bytes_per_block

    @property
    def kv_bytes_allocated(self) -> int:
        return self.num_blocks_allocated * self.bytes_per_block
