"""kvpage.PagedCache: transformers' `Cache` on kvpage's paged KV cache, so HF `generate` runs on it.

Existing code changes two lines:

    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="kvpage")
    model.generate(**inputs, cache=kvpage.PagedCache(model.config))

How a forward pass runs on it. Each HF attention layer calls `cache.update(key, value, layer_idx,
kwargs=...)` with the new tokens' K/V (RoPE already applied), then the attention function. `update`
stores nothing yet: it leaves the cache in the layer's attention kwargs (the in-place contract
transformers' own paged cache uses) and returns the new K/V as they are. The "kvpage" attention
function then calls `attend`. At the first layer of a pass, `attend` lays the step out once: which
tokens are real (from HF's 2D padding mask), blocks for them (copy-on-write where a row appends to a
block it shares), slot mapping, block tables, lengths. Every layer then writes its K/V by slot mapping
(`reshape_and_cache`) and attends with `paged_attention` / `paged_prefill_attention` over each row's
real tokens; no dense copy of the cache is ever made.

Rows hold real tokens only: the padding of a left-padded batch gets no slot and no block, so memory
follows what each row holds, not batch x longest. Beam search's reorder is a block-table permutation
with ref counts (kvpage.core.BlockPool), not a copy: beams share blocks until one appends to a shared,
partly filled block, which is copied first (`ops.copy_blocks`).
"""
from __future__ import annotations

import operator

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache

from kvpage import ops
from kvpage.ops import memory
from kvpage.core import BlockPool
from kvpage.model.attention import (ATTN_IMPLEMENTATION, PAGED_CACHE_KWARG, head_dim_of, paged_attention_forward,
                                    validate_config)
from kvpage.model.metadata import AttentionMetadata, KVCache
from kvpage.model.runner import kv_cache_dtype_from_name

from .paged_cache_args import as_device, check_args, decoder_config, index_list
from .paged_cache_state import PagedCacheStats, PassLayout, PassUndo
from .paged_layer import PagedLayer
from .row_tables import OutOfBlocks, RowTables

# With num_blocks=None the pool has this many block ids and grows its tensors on demand. The pool hands
# out the lowest free id first, so the ids in use stay packed at the bottom and the tensors only ever
# need to span the peak number of blocks held (4M tokens at block_size 16: more than any memory).
_GROWABLE_BLOCK_IDS = 1 << 18
_GROWTH = 1.25  # each growth is a full copy: geometric growth amortises it, allocated <= 1.25x peak used


class PagedCache(Cache):
    """transformers' Cache API over kvpage blocks: pass it as `generate(..., cache=...)` (or by its older
    name, past_key_values=) to a model loaded with `attn_implementation="kvpage"`.

    config: the model's config (`model.config`). num_blocks: size of the block pool; None (default)
    grows it on demand. block_size: tokens per block (a power of two up to 256). dtype, device: of the
    K/V; None takes them from the model's first forward pass. kv_cache_dtype: "auto" stores K/V in
    that dtype, "fp8" (= "fp8_e4m3") as float8_e4m3fn with scales of 1.0 (a quarter of float32's
    memory; attention reads them back, so outputs differ slightly from the model's own cache), or
    "bfloat16" / "float16" in 16 bits under a float32 model on CPU (half the memory). One
    cache serves one batch (one `generate` call, or several that continue it); `reset()` empties it.
    """

    def __init__(self, config: PretrainedConfig, num_blocks: int | None = None, block_size: int = 16,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 kv_cache_dtype: str = "auto") -> None:
        config = decoder_config(config)
        check_args(num_blocks, block_size, dtype)
        self.kv_cache_dtype = kv_cache_dtype_from_name(kv_cache_dtype)  # None: the K/V dtype
        validate_config(config, dtype or torch.float32)
        self.config = config
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.head_size = head_dim_of(config)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.dtype = dtype
        self.device = as_device(device)
        if num_blocks is not None:
            self._check_pool_fits(num_blocks)
        self.pool = BlockPool(num_blocks if num_blocks is not None else _GROWABLE_BLOCK_IDS)
        self.tables = RowTables(self.pool, block_size)
        self.kv_caches: list[KVCache] = []  # per layer (key_cache, value_cache), from ops.allocate_kv_cache
        self._columns = torch.zeros((0, 0), dtype=torch.bool)  # [rows, columns HF has fed]: which are real
        self._step: PassLayout | None = None
        self._pending_layer: int | None = None  # updated, not yet attended: the check that "kvpage" attention runs
        self._peak_blocks = 0
        super().__init__(layers=[PagedLayer(self, i) for i in range(self.num_layers)])

    # -- transformers' Cache API -----------------------------------------------------------------

    def _check_pool_fits(self, num_blocks: int) -> None:
        """A fixed pool's K/V, at the smallest size its dtype could have, must fit in the free memory of
        its device (of any device, while that is not known yet): else a ValueError now, not an
        OOM kill (or a MemoryError from the pool's bookkeeping) later."""
        itemsize = (self.kv_cache_dtype or self.dtype or torch.float16).itemsize
        need = num_blocks * 2 * self.num_layers * self.num_kv_heads * self.block_size * self.head_size * itemsize
        devices = [self.device] if self.device is not None else [torch.device("cpu")] + (
            [torch.device("cuda")] if torch.cuda.is_available() else [])
        free = [memory.available_bytes(d) for d in devices]
        if None not in free and need > max(free):
            raise ValueError(f"num_blocks={num_blocks} needs at least {memory.gib(need)} of K/V, but only"
                             f" {memory.gib(max(free))} is free")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               kwargs: dict | None = None, *args, **unused) -> tuple[torch.Tensor, torch.Tensor]:
        """Hand this cache to the layer's attention function through its kwargs; return the new K/V as they
        are. The "kvpage" attention writes them into the blocks and attends over the paged cache."""
        if not isinstance(kwargs, dict):
            raise TypeError("PagedCache.update needs the attention layer's kwargs dict (transformers 5 models call"
                            " cache.update(key, value, layer_idx, kwargs=kwargs)); this model passes none")
        self._check_layer(layer_idx, key_states, value_states)
        if self._pending_layer is not None:
            pending = self._pending_layer
            self.abort_pass()
            raise RuntimeError(f"the attention of layer {pending} did not read the PagedCache: load the"
                               f" model with attn_implementation={ATTN_IMPLEMENTATION!r} (or call"
                               f" model.set_attn_implementation({ATTN_IMPLEMENTATION!r}))")
        self._pending_layer = layer_idx
        kwargs[PAGED_CACHE_KWARG] = self
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Columns HF has fed, padding included (HF slices its inputs by this); rows hold only real tokens."""
        return self._columns.shape[1]

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1  # no maximum: blocks are drawn as rows grow

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False  # block tables change shape every step

    @property
    def batch_size(self) -> int:
        return len(self.tables) if len(self.tables) else -1

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i continues row beam_idx[i]. Tables are re-pointed, blocks shared by ref count."""
        self._select_rows(index_list(beam_idx, "beam_idx", len(self.tables)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows(index_list(indices, "indices", len(self.tables)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"repeats must be a positive int, got {repeats!r}")
        self._select_rows([i for i in range(len(self.tables)) for _ in range(repeats)])

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last -tokens_to_remove columns (transformers 5 semantics: a negative count); blocks
        past each row's new length go back to the pool."""
        if isinstance(tokens_to_remove, bool):
            raise TypeError(f"tokens_to_remove must be an int, got {tokens_to_remove!r}")
        try:
            tokens_to_remove = operator.index(tokens_to_remove)
        except TypeError:
            raise TypeError(f"tokens_to_remove must be an int, got {tokens_to_remove!r}") from None
        if tokens_to_remove > 0:
            raise ValueError(f"Calling `crop` with a positive value (`{tokens_to_remove}`) is not supported. Please"
                             f" use a negative integer to remove that number of tokens from the cache instead.")
        self._check_last_pass()
        if tokens_to_remove == 0 or not len(self.tables):
            return
        keep = max(0, self.get_seq_length() + tokens_to_remove)
        self._columns = self._columns[:, :keep]
        for row, num_tokens in zip(self.tables.rows, self._columns.sum(1).tolist()):
            self.tables.truncate(row, num_tokens)
        self._step = None

    def reset(self) -> None:
        """Empty the cache (every block back to the pool); the pool tensors stay for reuse."""
        self.tables.clear()
        self._columns = torch.zeros((0, 0), dtype=torch.bool)
        self._step = None
        self._pending_layer = None

    def __repr__(self) -> str:
        return (f"PagedCache(rows={len(self.tables)}, columns={self.get_seq_length()}, block_size={self.block_size},"
                f" blocks_used={self.pool.num_used}, blocks_allocated={self._num_allocated})")

    # -- kvpage ----------------------------------------------------------------------------------

    def attend(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               padding_mask: torch.Tensor | None, scale: float | None = None, **options) -> torch.Tensor:
        """Write layer `layer_idx`'s new K/V into the blocks and attend over each row's cached tokens.

        query [B, H, T, D], key/value [B, KVH, T, D] as HF's attention layer hands them; padding_mask
        the 2D mask [B, past + T] or None (no padding). options: the layer's sliding_window / softcap /
        sinks (kvpage.model.attention.layer_options), as paged_attention_forward takes them; a row's window
        counts its real tokens, which under left padding are as far apart as HF's columns. Returns
        [B, T, H, D]; padding tokens get zeros.
        """
        if self._pending_layer != layer_idx:
            raise RuntimeError(f"PagedCache.attend for layer {layer_idx} without its update (pending:"
                               f" {self._pending_layer}): attend is called by the 'kvpage' attention function")
        self._pending_layer = None
        try:
            step = self._step_for(layer_idx, query, padding_mask)
            out = self._attend(step, layer_idx, query, key, value, scale, options)
        except BaseException:
            self.abort_pass()  # an error at layer 3 must not leave layers 0-2 holding this pass's K/V alone
            raise
        step.layers_done.add(layer_idx)
        return out

    def abort_pass(self) -> None:
        """Take back the forward pass in progress, if any (the "kvpage" attention calls this when it rejects a
        layer): the cache then holds what it held before that pass, and the same call may run again."""
        self._pending_layer = None
        step = self._step
        if step is not None and step.undo is not None and len(step.layers_done) < self.num_layers:
            self._undo(step.undo)

    def _attend(self, step: PassLayout, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                scale: float | None, options: dict) -> torch.Tensor:
        batch, num_heads, query_len, head_size = query.shape
        out = query.new_empty((batch, query_len, num_heads, head_size))
        if step.metadata is None:
            return out.zero_()
        # [B, H, T, D] is a transposed view of the projections' [B, T, H, D]: flattening it is free.
        q, k, v = (x.transpose(1, 2).reshape(batch * query_len, x.shape[1], head_size) for x in (query, key, value))
        key_cache, value_cache = self.kv_caches[layer_idx]
        flat_out = out.view(batch * query_len, num_heads, head_size)
        if step.token_index is None:
            paged_attention_forward(q, k, v, key_cache, value_cache, step.metadata, scale=scale, out=flat_out,
                                    **options)
        else:
            # Padding present: the kernels see only the real tokens, packed row after row.
            index = step.token_index
            packed = paged_attention_forward(q.index_select(0, index), k.index_select(0, index),
                                             v.index_select(0, index), key_cache, value_cache, step.metadata,
                                             scale=scale, **options)
            flat_out.zero_().index_copy_(0, index, packed)
        return out

    def stats(self) -> PagedCacheStats:
        return PagedCacheStats(block_size=self.block_size, bytes_per_block=self.bytes_per_block(),
                               num_blocks_allocated=self._num_allocated, num_blocks_used=self.pool.num_used,
                               peak_blocks_used=self._peak_blocks,
                               num_copy_on_write=self.tables.num_copy_on_write)

    def bytes_per_block(self) -> int:
        itemsize = (self.kv_cache_dtype or self.dtype or torch.float32).itemsize
        return 2 * self.num_layers * self.num_kv_heads * self.block_size * self.head_size * itemsize

    def row_lengths(self) -> list[int]:
        """Real tokens each row holds (what its block table covers)."""
        return [row.num_tokens for row in self.tables.rows]

    def block_tables(self) -> list[list[int]]:
        return [list(row.block_table) for row in self.tables.rows]

    # -- steps -----------------------------------------------------------------------------------

    def _step_for(self, layer_idx: int, query: torch.Tensor, padding_mask: torch.Tensor | None) -> PassLayout:
        """The current pass's layout; a layer seen before in it means a new pass has begun."""
        step = self._step
        if step is None or layer_idx in step.layers_done:
            self._check_last_pass()
            self._step = None
            undo = PassUndo(not len(self.tables), self.get_seq_length(), self.tables.snapshot())
            try:
                step = self._begin_step(query.shape[0], query.shape[2], padding_mask, query.device)
            except BaseException:
                self._undo(undo)
                raise
            step.undo = undo
            self._step = step
        elif (query.shape[0], query.shape[2]) != (step.batch_size, step.query_len):
            raise ValueError(f"layer {layer_idx} got {query.shape[0]} rows x {query.shape[2]} tokens, the layers"
                             f" before it in this pass {step.batch_size} x {step.query_len}")
        return step

    def _check_last_pass(self) -> None:
        """Raise if the last forward pass stopped midway (an exception or interrupt outside the attention, e.g.
        in an MLP): its later layers never wrote their K/V. It is taken back first, so a second try runs."""
        step = self._step
        if step is None or step.undo is None or len(step.layers_done) == self.num_layers:
            return
        done = len(step.layers_done)
        self._undo(step.undo)
        raise RuntimeError(f"the last forward pass over this PagedCache stopped after {done} of its {self.num_layers}"
                           f" layers (an exception or interrupt), so its tokens were dropped: the cache holds"
                           f" {self.get_seq_length()} columns, as before that pass. Run the call again")

    def _undo(self, undo: PassUndo) -> None:
        if undo.started:
            self.tables.clear()
            self._columns = torch.zeros((0, 0), dtype=torch.bool)
        else:
            self.tables.restore(undo.tables)
            self._columns = self._columns[:, :undo.num_columns]
        self._step = None

    def _begin_step(self, batch_size: int, query_len: int, padding_mask: torch.Tensor | None,
                    device: torch.device) -> PassLayout:
        """Place this pass's real tokens: blocks (copy-on-write first), slots, block tables, lengths."""
        real = self._real_tokens(batch_size, query_len, padding_mask)
        if not len(self.tables):
            self.tables.start(batch_size)
            self._columns = torch.zeros((batch_size, 0), dtype=torch.bool)
        counts = [query_len] * batch_size if real is None else real.sum(1).tolist()
        try:
            slots, copies = self.tables.append(counts)
        except OutOfBlocks as e:
            raise OutOfBlocks(f"PagedCache {e}: build it with a larger num_blocks (now num_blocks={self.num_blocks}),"
                              f" or num_blocks=None to grow on demand") from None
        new_columns = torch.ones((batch_size, query_len), dtype=torch.bool) if real is None else real
        self._columns = torch.cat([self._columns, new_columns], dim=1)
        self._fit_pool()
        if copies:
            keys, values = zip(*self.kv_caches)
            ops.copy_blocks(list(keys), list(values), copies)
        self._peak_blocks = max(self._peak_blocks, self.pool.num_used)
        rows = [(row, n) for row, n in zip(self.tables.rows, counts) if n]
        if not rows:
            return PassLayout(batch_size, query_len, None, None)
        metadata = AttentionMetadata.build([n for _, n in rows], [row.num_tokens for row, _ in rows],
                                           [row.block_table for row, _ in rows], slots, device)
        token_index = None if real is None else real.flatten().nonzero().squeeze(1).to(device)
        return PassLayout(batch_size, query_len, metadata, token_index)

    def _real_tokens(self, batch_size: int, query_len: int, padding_mask: torch.Tensor | None) -> torch.Tensor | None:
        """Which of this pass's tokens are real, bool [B, T] on the CPU; None when all are."""
        if padding_mask is None:
            return None
        expected = (batch_size, self.get_seq_length() + query_len)
        if tuple(padding_mask.shape) != expected:
            raise ValueError(f"attention_mask has shape {tuple(padding_mask.shape)}; with {self.get_seq_length()}"
                             f" columns cached and {query_len} new, the PagedCache expects {expected}"
                             + _use_cache_hint(padding_mask.shape, query_len, self.get_seq_length()))
        real = padding_mask[:, -query_len:].to("cpu", torch.bool)
        return None if bool(real.all()) else real

    def _select_rows(self, indices: list[int]) -> None:
        if self._pending_layer is not None:
            raise RuntimeError("cannot reorder a PagedCache in the middle of a forward pass")
        self._check_last_pass()
        if not len(self.tables):
            return
        self.tables.select(indices)
        self._columns = self._columns[indices]
        self._step = None

    # -- the pool tensors ------------------------------------------------------------------------

    @property
    def _num_allocated(self) -> int:
        return self.kv_caches[0][0].shape[0] if self.kv_caches else 0

    def _fit_pool(self) -> None:
        """Grow the pool tensors to reach every block id handed out (fixed pools are allocated whole)."""
        have, top = self._num_allocated, self.tables.top_block
        if top < have:
            return
        size = self.num_blocks if self.num_blocks is not None else max(top + 1, int(have * _GROWTH))
        grown = [ops.allocate_kv_cache(size, self.block_size, self.num_kv_heads, self.head_size,
                                       dtype=self.kv_cache_dtype or self.dtype, device=self.device)
                 for _ in range(self.num_layers)]
        for (key, value), (old_key, old_value) in zip(grown, self.kv_caches):
            key[:have].copy_(old_key)
            value[:have].copy_(old_value)
        self.kv_caches = grown

    def _check_layer(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """The model must be the one this cache was built for: same layers, KV heads, head size, dtype, device."""
        if not isinstance(layer_idx, int) or not 0 <= layer_idx < self.num_layers:
            raise ValueError(f"layer_idx {layer_idx!r} is out of range: this PagedCache was built for a config with"
                             f" {self.num_layers} layers (is the cache being reused with another model?)")
        shape = (self.num_kv_heads, self.head_size)
        if key.dim() != 4 or tuple(key.shape[1:2]) + tuple(key.shape[3:]) != shape or value.shape != key.shape:
            raise ValueError(f"layer {layer_idx} gives key/value states of shapes {tuple(key.shape)} and"
                             f" {tuple(value.shape)}; this PagedCache was built for a config with {self.num_kv_heads}"
                             f" KV heads of size {self.head_size} ([batch, kv_heads, tokens, head_size]): build it"
                             f" from this model's config")
        if len(self.tables) and key.shape[0] != len(self.tables):
            raise ValueError(f"this forward pass has batch size {key.shape[0]}, but the PagedCache holds"
                             f" {len(self.tables)} rows: one cache serves one batch (use a fresh PagedCache, or"
                             f" reset() this one)")
        if self.dtype is None:
            self.dtype = key.dtype
            validate_config(self.config, self.dtype)
        if self.device is None:
            self.device = key.device
        if key.dtype != self.dtype or key.device != self.device:
            raise ValueError(f"layer {layer_idx} gives {key.dtype} key states on {key.device}; this PagedCache holds"
                             f" {self.dtype} on {self.device} (pass dtype=/device= to match the model, or None)")


def _use_cache_hint(mask_shape: torch.Size, query_len: int, cached: int) -> str:
    """A 2D mask of the new tokens only, over a cache that holds some: what a call with use_cache=False
    gives (each step re-feeds the whole sequence, which the cache already holds)."""
    if cached and len(mask_shape) == 2 and mask_shape[1] == query_len:
        return (". This is what use_cache=False gives (every step feeds the whole sequence again): a PagedCache"
                " needs use_cache=True (generate's default)")
    return ""

