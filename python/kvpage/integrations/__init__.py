"""kvpage inside other people's inference code: `PagedCache`, transformers' Cache on kvpage blocks, for
HF `model.generate(..., past_key_values=PagedCache(model.config))` with attn_implementation="kvpage"."""
from .hf_cache import PagedCache, PagedCacheStats
from .paged_layer import PagedLayer
from .row_tables import OutOfBlocks, RowTables

__all__ = ["OutOfBlocks", "PagedCache", "PagedCacheStats", "PagedLayer", "RowTables"]
