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
