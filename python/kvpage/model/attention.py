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
from kvpage.engine.model_config import layer_sliding_windows
from kvpage.hf_registry import ATTN_IMPLEMENTATION

from .metadata import AttentionMetadata, get_forward_context, set_forward_context

# The attention kwarg through which a kvpage.PagedCache's update() hands itself to this function.
PAGED_CACHE_KWARG = "kvpage_paged_cache"
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def paged_attention_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            key_cache: torch.Tensor, value_cache: torch.Tensor, metadata: AttentionMetadata,
                            scale: float | None = None, out: torch.Tensor | None = None, *,
                            sliding_window: int | None = None, softcap: float | None = None,
                            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Write this step's K/V, then attend: the model-independent core (also for a PagedCache).

    query [T, num_heads, D], key/value [T, num_kv_heads, D] (strided views are fine); returns
    out [T, num_heads, D]. sliding_window W: a query at position p reads keys in (p - W, p]; softcap:
    scores become cap * tanh(s / cap) after the scale (Gemma 2); sinks: float32 [num_heads], one extra
    logit per head in the softmax denominator (gpt-oss's s_aux). None: plain causal attention.
    """
    ops.reshape_and_cache(key, value, key_cache, value_cache, metadata.slot_mapping)
    options = attention_options(sliding_window, softcap, sinks)
    if metadata.is_all_decode:
        # One query token per sequence: the decode kernel spreads long contexts over partitions,
        # which the varlen kernel does not.
        return ops.paged_attention(query, key_cache, value_cache, metadata.block_tables, metadata.seq_lens,
                                   scale=scale, out=out, **options)
    return ops.paged_prefill_attention(query, key_cache, value_cache, metadata.block_tables,
                                       metadata.query_start_loc, metadata.seq_lens, scale=scale, out=out, **options)


def attention_options(sliding_window: int | None, softcap: float | None, sinks: torch.Tensor | None) -> dict:
    """The kernels' keywords a layer sets: a layer with none of them calls the ops exactly as plain causal
    attention does."""
    options = {}
    if sliding_window is not None:
        options["sliding_window"] = sliding_window
    if softcap is not None:
        options["softcap"] = softcap
    if sinks is not None:
        options["sinks"] = sinks
    return options


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
        options = layer_options(module, query.shape[1], kwargs)
    except (ValueError, NotImplementedError):
        if paged_cache is not None:
            paged_cache.abort_pass()  # the cache stays as it was: the same call runs once the model is fixed
        raise
    if paged_cache is not None:
        out = paged_cache.attend(module.layer_idx, query, key, value, attention_mask, scale=scaling, **options)
        return _no_backward(out, query, key, value), None
    if query.shape[0] != 1:
        raise ValueError(f"kvpage attention takes one flat batch of packed sequences (batch size 1),"
                         f" got query of shape {tuple(query.shape)}")
    try:
        context = get_forward_context()
    except RuntimeError as e:
        raise RuntimeError(f"{e}; for HF generate, pass cache=kvpage.PagedCache(model.config)") from None
    key_cache, value_cache = context.kv_caches[module.layer_idx]
    num_tokens, num_heads, head_size = query.shape[2], query.shape[1], query.shape[3]
    # HF reshapes our output to [1, T, hidden] next: writing the kernel's [T, H, D] result straight
    # into a [1, T, H, D] buffer makes that reshape free.
    out = query.new_empty((1, num_tokens, num_heads, head_size))
    paged_attention_forward(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                            key_cache, value_cache, context.attn_metadata.for_layer(module.layer_idx), scale=scaling,
                            out=out[0], **options)
    return _no_backward(out, query, key, value), None


def layer_options(module: torch.nn.Module, num_heads: int, kwargs: dict) -> dict:
    """This layer's sliding window, logit softcap and attention sinks, as HF's layer hands them over.

    The window is the sliding_window kwarg (Gemma 2 / 3, Mistral, Qwen2, gpt-oss pass it), else the module's
    own sliding_window attribute: Qwen2-MoE's layers set it but apply it only through HF's mask, which
    kvpage does not read. Qwen2-MoE writes 0 for "no window"."""
    window = kwargs.get("sliding_window")
    if window is None:
        window = getattr(module, "sliding_window", None)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 0):
        raise ValueError(f"{type(module).__name__}: sliding_window must be a positive int or None, got {window!r}")
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = kwargs.get("sinks")
    if sinks is not None:
        if sinks.shape != (num_heads,):
            raise ValueError(f"{type(module).__name__}: attention sinks (s_aux) of shape {tuple(sinks.shape)}, expected"
                             f" one per query head ({num_heads},)")
        sinks = sinks.detach().float().contiguous()  # the kernels take float32 sinks
    return attention_options(window or None, kwargs.get("softcap"), sinks)


def _check_supported(module: torch.nn.Module, dropout: float, kwargs: dict) -> None:
    """Reject what would change this layer's attention beyond causal softmax(q k^T * scale) v, within an
    optional sliding window, with an optional logit softcap and attention sinks (what the paged kernels
    compute): ignoring it would give other outputs than the model's own attention."""
    if dropout:
        raise ValueError(f"kvpage attention is for inference: dropout must be 0, got {dropout} (call model.eval())")
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

    def __post_init__(self) -> None:
        check_layer_windows(self.model)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                 kv_caches: list) -> torch.Tensor:
        """Final hidden states [T, hidden] of the flat batch input_ids / positions [T]."""
        with set_forward_context(attn_metadata, kv_caches):
            return self.model.base_model(input_ids=input_ids[None], position_ids=positions[None],
                                         use_cache=False).last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return final_logits(self.model, self.model.get_output_embeddings()(hidden))


def check_layer_windows(model: torch.nn.Module) -> None:
    """NotImplementedError where an attention module's own sliding_window differs from the one
    layer_sliding_windows gives its layer: the KV-cache groups (and the blocks a window group frees) follow
    the latter, the kernels the former, so a mismatch would read blocks already given back."""
    windows = layer_sliding_windows(model.config)
    for module in model.modules():
        layer, own = getattr(module, "layer_idx", None), getattr(module, "sliding_window", None)
        if isinstance(layer, int) and own is not None and 0 <= layer < len(windows) and (own or None) != windows[layer]:
            raise NotImplementedError(f"{type(module).__name__} of layer {layer} attends within a window of {own},"
                                      f" its config says {windows[layer]}: kvpage cannot tell which this model uses")


def final_logits(model: torch.nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """What the model's CausalLM forward does to the LM head's output before returning it, which calling the
    head alone skips: Gemma 2 / 3's final_logit_softcapping, Granite's logits_scaling, Cohere's logit_scale.
    (Greedy tokens do not change with them; sampling, penalties and logprobs do.)"""
    config = model.config.get_text_config(decoder=True)
    scaling = getattr(config, "logits_scaling", None)
    if scaling is not None and scaling != 1:
        logits = logits / scaling
    scale = getattr(model, "logit_scale", None)
    if isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale != 1:
        logits = logits * scale
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def validate_config(config, dtype: torch.dtype) -> None:
    """Raise ValueError for a model or cache dtype the paged kernels cannot serve, NotImplementedError for an
    attention they cannot compute (at start-up, rather than from inside the first forward pass)."""
    head_size = head_dim_of(config)
    if head_size % 16 or head_size > 256:
        raise ValueError(f"kvpage attention needs head_size to be a multiple of 16 up to 256;"
                         f" this model's head_dim is {head_size}")
    num_heads, num_kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None)
    if num_kv_heads and num_heads % num_kv_heads:
        raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})")
    if dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of {_SUPPORTED_DTYPES}, got {dtype}")
    if getattr(config, "use_bidirectional_attention", False):
        raise NotImplementedError(f"{config.model_type} with use_bidirectional_attention attends to later tokens;"
                                  f" kvpage's paged attention is causal only")
    layer_sliding_windows(config)  # NotImplementedError naming a layer type the kernels cannot run


def register() -> None:
    AttentionInterface.register(ATTN_IMPLEMENTATION, kvpage_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, padding_mask)


register()
