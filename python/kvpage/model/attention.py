"""The "kvpage" attention function for transformers' AttentionInterface.

Any model whose attention layers dispatch through `ALL_ATTENTION_FUNCTIONS` (Llama, Qwen2, Mistral,
...) runs on the paged cache unmodified: each layer hands us its projected, rotated query/key/value
for the step's flat batch; we write the new K/V into the paged cache by slot mapping and attend over
the cache with the paged kernels, reading block tables and lengths from the forward context.

Two callers set up that context: kvpage's ModelRunner (one packed batch, metadata in the forward
context), and HF `generate` on a `kvpage.PagedCache`, whose `update` leaves the cache in the layer's
attention kwargs (transformers' in-place kwargs contract for paged caches), so the call lands in
`PagedCache.attend` with HF's padded [batch, heads, tokens, dim] tensors and the 2D padding mask.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from kvpage import ops
from kvpage.hf_registry import ATTN_IMPLEMENTATION

from .metadata import AttentionMetadata, get_forward_context, set_forward_context

# The attention kwarg through which a kvpage.PagedCache's update() hands itself to this function.
PAGED_CACHE_KWARG = "kvpage_paged_cache"
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def paged_attention_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            key_cache: torch.Tensor, value_cache: torch.Tensor, metadata: AttentionMetadata,
                            scale: float | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Write this step's K/V, then attend: the model-independent core (also for a PagedCache).

    query [T, num_heads, D], key/value [T, num_kv_heads, D] (strided views are fine); returns
    out [T, num_heads, D].
    """
    ops.reshape_and_cache(key, value, key_cache, value_cache, metadata.slot_mapping)
    if metadata.is_all_decode:
        # One query token per sequence: the decode kernel spreads long contexts over partitions,
        # which the varlen kernel does not.
        return ops.paged_attention(query, key_cache, value_cache, metadata.block_tables, metadata.seq_lens,
                                   scale=scale, out=out)
    return ops.paged_prefill_attention(query, key_cache, value_cache, metadata.block_tables,
                                       metadata.query_start_loc, metadata.seq_lens, scale=scale, out=out)


def kvpage_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, scaling: float | None = None,
                             dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    """HF signature: query [B, num_heads, T, D], key/value [B, num_kv_heads, T, D]. Returns
    ([B, T, num_heads, D], None), the layout of transformers' sdpa_attention_forward.

    Under ModelRunner, B is 1 (the runner's flat batch); under a PagedCache, B is HF's padded batch and
    attention_mask the 2D padding mask (see padding_mask)."""
    paged_cache = kwargs.get(PAGED_CACHE_KWARG)
    try:
        _check_supported(module, dropout, kwargs)
    except (ValueError, NotImplementedError):
        if paged_cache is not None:
            paged_cache.abort_pass()  # the cache stays as it was: the same call runs once the model is fixed
        raise
    if paged_cache is not None:
        out = paged_cache.attend(module.layer_idx, query, key, value, attention_mask, scale=scaling,
                                 sliding_window=kwargs.get("sliding_window"))
        return _no_backward(out, query, key, value), None
    if query.shape[0] != 1:
        raise ValueError(f"kvpage attention takes one flat batch of packed sequences (batch size 1),"
                         f" got query of shape {tuple(query.shape)}")
    try:
        context = get_forward_context()
    except RuntimeError as e:
        raise RuntimeError(f"{e}; for HF generate, pass past_key_values=kvpage.PagedCache(model.config)") from None
    check_sliding_window(kwargs.get("sliding_window"), context.attn_metadata)
    key_cache, value_cache = context.kv_caches[module.layer_idx]
    num_tokens, num_heads, head_size = query.shape[2], query.shape[1], query.shape[3]
    # HF reshapes our output to [1, T, hidden] next: writing the kernel's [T, H, D] result straight
    # into a [1, T, H, D] buffer makes that reshape free.
    out = query.new_empty((1, num_tokens, num_heads, head_size))
    paged_attention_forward(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                            key_cache, value_cache, context.attn_metadata, scale=scaling, out=out[0])
    return _no_backward(out, query, key, value), None


def check_sliding_window(window: int | None, metadata: AttentionMetadata) -> None:
    """A window no sequence outgrows is full causal attention (Mistral's 4096 default, say); past it,
    NotImplementedError rather than attention over tokens the model would not see."""
    if window is not None and metadata.max_seq_len > window:
        raise NotImplementedError(f"kvpage attention has no sliding window: a sequence of"
                                  f" {metadata.max_seq_len} tokens exceeds this layer's {window}")


def _check_supported(module: torch.nn.Module, dropout: float, kwargs: dict) -> None:
    """Reject what would change this layer's attention beyond causal softmax(q k^T * scale) v, which is
    all the paged kernels compute: ignoring it would give other outputs than the model's own attention."""
    if dropout:
        raise ValueError(f"kvpage attention is for inference: dropout must be 0, got {dropout} (call model.eval())")
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("kvpage attention does not support attention logit softcapping")
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise NotImplementedError("kvpage attention does not support attention sinks (s_aux / sinks)")
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError("kvpage attention does not support an additive position_bias")
    is_causal = kwargs.get("is_causal")
    if not (is_causal if is_causal is not None else getattr(module, "is_causal", True)):
        raise NotImplementedError(f"kvpage attention is causal only; {type(module).__name__} attends"
                                  f" bidirectionally (an encoder or cross-attention layer)")


class _NoBackward(torch.autograd.Function):
    """The paged kernels have no backward pass: with autograd recording, their output is tied to q/k/v through
    this, so backward raises instead of leaving the q/k/v projections silently without a gradient."""

    @staticmethod
    def forward(ctx, out, *inputs):
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("kvpage attention has no backward pass (it is for inference): train with"
                           " attn_implementation='sdpa' or 'eager'")


def _no_backward(out: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        return _NoBackward.apply(out, *inputs)
    return out


def padding_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """Causality and sequence boundaries come from query_start_loc and seq_lens, so HF must not
    build an O(T^2) mask. What reaches the attention layers is the padding mask as HF got it (None
    under ModelRunner, which passes none): a PagedCache reads from it which tokens of a left-padded
    batch are real, and rejects any mask that is not 2D [batch, past + new] rather than ignore it."""
    return attention_mask


@dataclass(frozen=True)
class HFForward:
    """The generic forward, for every model kvpage's own (llama.py) does not implement: transformers'
    modules over the flat batch [1, T], each attention layer calling kvpage_attention_forward, which
    reads the step's metadata and caches from the forward context."""

    model: torch.nn.Module

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                 kv_caches: list) -> torch.Tensor:
        """Final hidden states [T, hidden] of the flat batch input_ids / positions [T]."""
        with set_forward_context(attn_metadata, kv_caches):
            return self.model.base_model(input_ids=input_ids[None], position_ids=positions[None],
                                         use_cache=False).last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.get_output_embeddings()(hidden)


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def validate_config(config, dtype: torch.dtype) -> None:
    """Raise ValueError for a model or cache dtype the paged kernels cannot serve (at start-up,
    rather than from inside the first forward pass)."""
    head_size = head_dim_of(config)
    if head_size % 16 or head_size > 256:
        raise ValueError(f"kvpage attention needs head_size to be a multiple of 16 up to 256;"
                         f" this model's head_dim is {head_size}")
    num_heads, num_kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None)
    if num_kv_heads and num_heads % num_kv_heads:
        raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})")
    if dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of {_SUPPORTED_DTYPES}, got {dtype}")


def register() -> None:
    AttentionInterface.register(ATTN_IMPLEMENTATION, kvpage_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, padding_mask)


register()
