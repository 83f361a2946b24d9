"""A lean forward for Llama-style decoder layers during kvpage's CPU steps: the same kernels, in the same
order, as the module path, without the Python in between.

Once cpu_layout and fused_layers have packed a layer's linears and swapped its norms and MLP, a decode
step through HF's modules still costs ~15 module calls and ~40 small torch ops per layer (views,
transposes, the attention registry lookup, argument plumbing): ~10 ms a step for SmolLM2's 30 layers,
as much as the arithmetic of a small batch. This forward calls the packed projections, the fused
RMSNorm / rotary / SiLU ops and the paged attention directly, so its output is bit-identical to the
module path's; a probe at install time checks exactly that on a small prefill inside a forward context,
and any call outside a kvpage step (or of a shape it does not take) runs the layer's own forward.
"""
from __future__ import annotations

import types

import torch

from kvpage import ops
from kvpage.ops._library import ops as _library_ops

from . import cpu_layout, metadata
from .attention import paged_attention_forward
from .fused_layers import _rms_norm_op, _silu_and_mul_op
from .metadata import AttentionMetadata, set_forward_context

_rotary_op = _library_ops.rotary_embedding.default
LAYER_CHILDREN = {"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"}


def _slab(module) -> tuple[cpu_layout._Fused, int] | None:
    # None: a layer without that projection (Phi-3's fused qkv_proj, say); weakrefs cannot take None.
    return None if module is None else cpu_layout._SLABS.get(module)


def _shape_ok(layer) -> bool:
    """A pre-norm Llama layer whose pieces kvpage has already swapped for its fused versions."""
    names = {n for n, _ in layer.named_children()}
    if names != LAYER_CHILDREN:
        return False
    attn, mlp = layer.self_attn, layer.mlp
    swapped = all("forward" in vars(m) for m in (layer.input_layernorm, layer.post_attention_layernorm, mlp))
    projections = [_slab(getattr(attn, n, None)) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    mlp_slabs = [_slab(getattr(mlp, n, None)) for n in ("gate_proj", "up_proj", "down_proj")]
    return (swapped and None not in projections and None not in mlp_slabs
            and projections[0][0] is projections[1][0] is projections[2][0]  # q/k/v: one fused matrix
            and mlp_slabs[0][0] is mlp_slabs[1][0]
            and isinstance(getattr(attn, "head_dim", None), int) and isinstance(getattr(attn, "scaling", None), float)
            and getattr(attn, "sliding_window", None) is None and not hasattr(attn, "q_norm")
            and isinstance(getattr(attn, "layer_idx", None), int))


def _fast_forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    context = metadata._forward_context
    position_embeddings = kwargs.get("position_embeddings")
    attn, mlp = self.self_attn, self.mlp
    qkv_slab, o_slab, gate_up_slab, down_slab = (_slab(attn.q_proj), _slab(attn.o_proj), _slab(mlp.gate_proj),
                                                 _slab(mlp.down_proj))
    if (args or context is None or position_embeddings is None or hidden_states.dim() != 3
            or hidden_states.shape[0] != 1 or hidden_states.dtype != torch.float32
            or hidden_states.device.type != "cpu" or not hidden_states.is_contiguous()
            or any(kwargs.get(k) is not None for k in ("cache", "past_key_values"))
            or None in (qkv_slab, o_slab, gate_up_slab, down_slab)):  # a deepcopy: no packed weights
        return type(self).forward(self, hidden_states, *args, **kwargs)
    x = hidden_states[0]
    tokens, d = x.shape[0], attn.head_dim
    h = torch.empty_like(x)
    _rms_norm_op(h, x, self.input_layernorm.weight, self.input_layernorm.variance_epsilon)
    qkv = qkv_slab[0].compute(h)
    widths = (attn.q_proj.out_features, attn.k_proj.out_features)
    q = qkv[:, :widths[0]].view(tokens, -1, d)
    k = qkv[:, widths[0]:widths[0] + widths[1]].view(tokens, -1, d)
    v = qkv[:, widths[0] + widths[1]:].view(tokens, -1, d)
    cos, sin = position_embeddings
    q_rot, k_rot = torch.empty(q.shape), torch.empty(k.shape)
    _rotary_op(q_rot, k_rot, q, k, cos[0], sin[0])
    key_cache, value_cache = context.kv_caches[attn.layer_idx]
    out = torch.empty(q.shape)
    paged_attention_forward(q_rot, k_rot, v, key_cache, value_cache, context.attn_metadata, scale=attn.scaling,
                            out=out)
    x = x + o_slab[0].compute(out.view(tokens, -1))
    h = torch.empty_like(x)
    _rms_norm_op(h, x, self.post_attention_layernorm.weight, self.post_attention_layernorm.variance_epsilon)
    gate_up = gate_up_slab[0].compute(h)
    width = mlp.gate_proj.out_features
    act = torch.empty((tokens, width))
    _silu_and_mul_op(act, gate_up[:, :width], gate_up[:, width:])
    return (x + down_slab[0].compute(act)).unsqueeze(0)


@torch.inference_mode()
def _reproduces(model, layer, block_size: int = 16, tokens: int = 5) -> bool:
    """The layer's own forward and the lean one, on a prefill of `tokens` random states into a
    scratch cache: bit-identical outputs."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, tokens, model.config.hidden_size, generator=g)
    positions = torch.arange(tokens).unsqueeze(0)
    position_embeddings = model.base_model.rotary_emb(x, positions)
    num_kv_heads = layer.self_attn.k_proj.out_features // layer.self_attn.head_dim
    outputs = []
    for forward in (type(layer).forward, _fast_forward):
        cache = ops.allocate_kv_cache(1, block_size, num_kv_heads, layer.self_attn.head_dim, dtype=torch.float32)
        caches = [cache] * (layer.self_attn.layer_idx + 1)
        meta = AttentionMetadata.build([tokens], [tokens], [[0]], list(range(tokens)))
        with set_forward_context(meta, caches):
            outputs.append(forward(layer, x, position_embeddings=position_embeddings, position_ids=positions))
    return torch.equal(outputs[0], outputs[1])


def install_fast_decoder_layers(model: torch.nn.Module) -> int:
    """Give each qualifying decoder layer of a CPU fp32 `model` (already through prepack_linear_weights
    and fuse_small_layers) the lean forward; returns how many."""
    if getattr(model.base_model, "rotary_emb", None) is None:
        return 0
    installed = 0
    for layer in model.modules():
        if "forward" in vars(layer) or not _shape_ok(layer):
            continue
        try:
            same = _reproduces(model, layer)
        except Exception:  # a layer whose own forward wants other arguments: leave it to its code
            same = False
        if same:
            layer.forward = types.MethodType(_fast_forward, layer)
            installed += 1
    return installed
