"""KV-cache groups: which layers share a block table (vLLM's hybrid KV cache manager).

Layers are grouped by what their attention reads: the whole context, or a sliding window of W tokens.
Every group holds the same number of layers, so a block id means the same number of bytes in every
group and all groups draw from one pool: block id b names block b of `group_size` per-layer cache
tensors, and the j-th layer of every group uses tensor j. A full-attention group keeps every block of
a sequence; a sliding-window group keeps only the blocks its window can still read.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence as Seq


@dataclass(frozen=True)
class KVCacheGroup:
    sliding_window: int | None  # None: full attention; W: a query at p reads keys in (p - W, p]
    layer_ids: tuple[int, ...]


@dataclass(frozen=True)
class KVCacheLayout:
    groups: tuple[KVCacheGroup, ...]
    group_size: int  # layers per group: the per-layer cache tensors the pool's block ids index

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_layers(self) -> int:
        return sum(len(g.layer_ids) for g in self.groups)

    @property
    def is_hybrid(self) -> bool:
        """Some group frees blocks as sequences grow (a window group)."""
        return any(g.sliding_window is not None for g in self.groups)

    @property
    def sliding_windows(self) -> tuple[int | None, ...]:
        return tuple(g.sliding_window for g in self.groups)

    def layer_slot(self, layer_id: int) -> tuple[int, int]:
        """(group index, tensor index) of a layer."""
        for g, group in enumerate(self.groups):
            if layer_id in group.layer_ids:
                return g, group.layer_ids.index(layer_id)
        raise ValueError(f"layer_id {layer_id} is in no KV-cache group of {self.num_layers} layers")


def kv_cache_layout(layer_windows: Seq[int | None]) -> KVCacheLayout:
    """Group layers by their window (None: full attention), in groups of equal size.

    The group size is the smallest per-type layer count (vLLM's rule), so no type is padded by more
    than one partial group; each type splits into consecutive groups of that many layers."""
    if not layer_windows:
        raise ValueError("layer_windows must name at least one layer")
    for w in layer_windows:
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w <= 0):
            raise ValueError(f"a layer's sliding window must be a positive int or None, got {w!r}")
    by_type: dict[int | None, list[int]] = {}
    for layer, w in enumerate(layer_windows):
        by_type.setdefault(w, []).append(layer)
    group_size = min(len(layers) for layers in by_type.values())
    # Full attention first: group 0 is then the one every sequence's whole context lives in.
    order = sorted(by_type, key=lambda w: (w is not None, w or 0))
    groups = tuple(KVCacheGroup(w, tuple(by_type[w][i:i + group_size]))
                   for w in order for i in range(0, len(by_type[w]), group_size))
    return KVCacheLayout(groups, group_size)


# A block-table entry no block sits behind: a window group's blocks before its window. Not a pool id,
# so it is never ref-counted, copied, swapped or cached; the kernels never read it (they start at the
# first block the window can see).
NULL_BLOCK = -1

FULL_ATTENTION_LAYOUT = kv_cache_layout([None])  # one full group: the layout of a model without windows


def first_kept_block(num_computed_tokens: int, sliding_window: int | None, block_size: int) -> int:
    """The first logical block a group must still hold when the next query starts at
    `num_computed_tokens` (c): a window of W keeps positions >= max(0, c - W + 1), a full group all."""
    if sliding_window is None:
        return 0
    return max(0, num_computed_tokens - sliding_window + 1) // block_size


def _max_blocks_spanned(num_positions: int, block_size: int) -> int:
    """The most blocks `num_positions` consecutive positions can touch, wherever they start."""
    return (num_positions + block_size - 2) // block_size + 1 if num_positions > 0 else 0


def num_blocks_per_group(layout: KVCacheLayout, num_tokens: int, block_size: int,
                         max_step_tokens: int = 1) -> tuple[int, ...]:
    """The most blocks each group holds for one sequence growing to `num_tokens`, computing at most
    `max_step_tokens` per step (1: decode; a prefill chunk holds all its blocks while the step runs).

    A full group holds every block; a window group of W at most the blocks spanned by the window
    plus the step's tokens (a decode: W positions, ceil((W - 1) / block_size) + 1 blocks), never more than a
    full group."""
    if num_tokens < 0 or max_step_tokens < 1 or block_size < 1:
        raise ValueError(f"need num_tokens >= 0, max_step_tokens >= 1 and block_size >= 1, got {num_tokens},"
                         f" {max_step_tokens}, {block_size}")
    full = (num_tokens + block_size - 1) // block_size
    return tuple(full if w is None else min(full, _max_blocks_spanned(w - 1 + max_step_tokens, block_size))
                 for w in layout.sliding_windows)


def num_blocks_per_seq(layout: KVCacheLayout, num_tokens: int, block_size: int, max_step_tokens: int = 1) -> int:
    """Block ids (over all groups) one sequence of `num_tokens` holds at most: what KV sizing and
    `kvpage plan` divide the pool by. Each block id costs layout.group_size layers' block bytes."""
    return sum(num_blocks_per_group(layout, num_tokens, block_size, max_step_tokens))
