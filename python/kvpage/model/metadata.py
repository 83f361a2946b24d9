"""One step's paged-attention metadata, and the forward context that hands it to every attention layer.

HF calls the attention function once per layer with only (module, query, key, value, mask, ...), so
the step's block tables and slot mapping cannot travel as arguments: the runner sets them here around
the forward pass, and the attention function reads them (as vLLM's and nano-vllm's forward context).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch

KVCache = tuple[torch.Tensor, torch.Tensor]  # one layer's (key_cache, value_cache)


@dataclass
class AttentionMetadata:
    """The flat batch's layout: T tokens of num_seqs sequences, packed back to back without padding."""

    slot_mapping: torch.Tensor  # int64 [T]: cache slot of each new token (-1: don't write)
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]: padded with 0 past each table's end
    seq_lens: torch.Tensor  # int32 [num_seqs]: cached context + this step's tokens
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]: sequence s owns tokens [qsl[s], qsl[s + 1])
    max_query_len: int  # the longest sequence's share of this step's tokens
    max_seq_len: int  # the longest seq_lens entry (kept as an int: reading the tensor would sync)
    # Decode context parallelism: this rank's slots and attention rows (model/context_parallel.py), else None.
    context_parallel: object | None = None
    # A hybrid KV cache (kvpage.core.kv_cache_groups, more than one group): every group's block tables and
    # slot mapping, in layout order (block_tables / slot_mapping above are group 0's), and each layer's group.
    # None with one group: every layer reads the fields above.
    group_block_tables: torch.Tensor | None = None  # int32 [G, num_seqs, max_blocks]
    group_slot_mappings: torch.Tensor | None = None  # int64 [G, T]
    layer_groups: tuple[int, ...] | None = None  # layer id -> group index
    _per_group: list = field(default_factory=list, init=False, repr=False, compare=False)

    @property
    def num_groups(self) -> int:
        return 1 if self.group_block_tables is None else self.group_block_tables.shape[0]

    def for_group(self, group: int) -> "AttentionMetadata":
        """The metadata of KV-cache group `group`: its block tables and slot mapping, the step's lengths
        (the same tensors). Built once per step and group."""
        if self.group_block_tables is None:
            if group != 0:
                raise ValueError(f"group {group}: this step's metadata has one KV-cache group")
            return self
        if not self._per_group:
            self._per_group[:] = [replace(self, block_tables=tables, slot_mapping=slots, group_block_tables=None,
                                          group_slot_mappings=None, layer_groups=None)
                                  for tables, slots in zip(self.group_block_tables, self.group_slot_mappings)]
        return self._per_group[group]

    def for_layer(self, layer_id: int) -> "AttentionMetadata":
        """The metadata attention layer `layer_id` reads: itself with one KV-cache group (no cost), else
        the layer's group's (for_group)."""
        if self.group_block_tables is None:
            return self
        if self.layer_groups is None:
            raise RuntimeError("metadata with several KV-cache groups but no layer_groups: the runner sets"
                               " them from its KVCacheLayout (ModelRunner.execute)")
        return self.for_group(self.layer_groups[layer_id])

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @property
    def is_all_decode(self) -> bool:
        """Every sequence brings exactly one token: the decode kernel applies."""
        return self.max_query_len == 1

    @classmethod
    def build(cls, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
              slot_mapping: list[int], device: torch.device | str = "cpu") -> "AttentionMetadata":
        """From per-sequence Python lists, through one host tensor: pinned for a GPU, which it reaches in
        one asynchronous copy (four tensors would be four synchronous ones); the fields are views of it."""
        device = torch.device(device)
        width = max((len(t) for t in block_tables), default=0) or 1
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        tables = [b for t in block_tables for b in (*t, *[0] * (width - len(t)))]
        host = torch.tensor(list(slot_mapping) + list(seq_lens) + starts + tables, dtype=torch.int64,
                            pin_memory=device.type == "cuda")
        flat = host.to(device, non_blocking=True)  # the host tensor itself on the CPU
        num_seqs, num_tokens = len(seq_lens), len(slot_mapping)
        lens, qsl, table = flat[num_tokens:].int().split([num_seqs, num_seqs + 1, num_seqs * width])
        return cls(slot_mapping=flat[:num_tokens], block_tables=table.view(num_seqs, width), seq_lens=lens,
                   query_start_loc=qsl, max_query_len=max(query_lens, default=0), max_seq_len=max(seq_lens, default=0))


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata
    kv_caches: list[KVCache]  # indexed by the attention module's layer_idx


_forward_context: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _forward_context is None:
        raise RuntimeError("the 'kvpage' attention ran outside a kvpage step: run the model through"
                           " kvpage.model.ModelRunner.execute (or inside kvpage.model.set_forward_context)")
    return _forward_context


@contextmanager
def set_forward_context(attn_metadata: AttentionMetadata, kv_caches: list[KVCache]):
    """Make this step's metadata and caches visible to the attention layers of a forward pass."""
    global _forward_context
    previous = _forward_context
    _forward_context = ForwardContext(attn_metadata, kv_caches)
    try:
        yield _forward_context
    finally:
        _forward_context = previous
