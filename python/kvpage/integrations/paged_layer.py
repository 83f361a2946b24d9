"""PagedLayer: the per-layer view transformers walks (`cache.layers`) of a kvpage.PagedCache."""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import CacheLayerMixin

if TYPE_CHECKING:
    from .hf_cache import PagedCache


class PagedLayer(CacheLayerMixin):
    """Layer `layer_idx` of a PagedCache, for transformers code that walks `cache.layers`.

    It owns nothing: K/V live in the cache's block pool, and updates, reordering and cropping go
    through the PagedCache, for all layers at once.
    """

    is_compileable = False
    is_croppable = True
    is_sliding = False
    supports_early_init = False

    def __init__(self, cache: PagedCache, layer_idx: int) -> None:
        super().__init__()
        self._cache = weakref.ref(cache)  # no cycle: the pool is freed as soon as the cache is dropped
        self.layer_idx = layer_idx
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, *args, **kwargs):
        raise TypeError("a PagedCache layer is updated through PagedCache.update(key, value, layer_idx, kwargs=...)")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._cache().get_mask_sizes(query_length, self.layer_idx)

    def get_seq_length(self) -> int:
        return self._cache().get_seq_length()

    def get_max_length(self) -> int:
        return -1

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise TypeError("reorder the PagedCache itself (cache.reorder_cache), not one of its layers")

    def crop(self, tokens_to_remove: int) -> None:
        raise TypeError("crop the PagedCache itself (cache.crop), not one of its layers")
