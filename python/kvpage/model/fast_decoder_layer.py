"""A lean forward for Llama-style decoder layers during kvpage's CPU steps: the same kernels, in the
same order, as the module path, without the Python in between.

Once cpu_layout and fused_layers have packed a layer's linears and swapped its norms and MLP, a decode
step through HF's modules still costs ~15 module calls and ~40 small torch ops per layer (views,
transposes, the attention registry lookup, argument plumbing): ~10 ms a step for SmolLM2's 30 layers,
as much as the arithmetic of a small batch. Calling those ops from Python directly still cost ~45
dispatches a layer (~5 ms of a 64-sequence decode step); this forward hands the whole layer to one
C++ op, kvpage::llama_decoder_layer (csrc/cpu/decoder_layer.cpp: RMSNorm, packed q/k/v, rotary,
cache write, paged attention, o_proj + residual, RMSNorm, packed gate/up, SiLU, down + residual), so
its output is bit-identical to the module path's; a probe at install time checks exactly that on a
small prefill inside a forward context, and any call outside a kvpage step (or of a shape it does
not take) runs the layer's own forward.
"""
from __future__ import annotations

import types
import weakref
from dataclasses import dataclass

import torch

from kvpage import ops
from kvpage.ops._library import ops as _library_ops
from kvpage.ops.config import range_checks_enabled

from . import cpu_layout, metadata
from .metadata import AttentionMetadata, set_forward_context

_decoder_layer_op = _library_ops.llama_decoder_layer.default
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


@dataclass(frozen=True)
class _LayerArgs:
    """A layer's constant arguments to the fused op, gathered once at install."""

    weights: list[torch.Tensor]  # [input_norm, qkv, o, post_norm, gate_up, down], the linears packed
    biases: list[torch.Tensor | None]  # [qkv, o, gate_up, down]
    widths: list[int]  # [q, k, v, head_size, intermediate]
    epsilons: list[float]
    scale: float
    layer_idx: int


# layer -> its _LayerArgs; kept off the layer, like cpu_layout's slabs, so a deepcopy of the model finds
# no entry and runs HF's code rather than another model's packed weights.
_LAYER_ARGS: "weakref.WeakKeyDictionary[torch.nn.Module, _LayerArgs]" = weakref.WeakKeyDictionary()


def _layer_args(layer) -> _LayerArgs:
    """For a layer _shape_ok accepts (so every projection has its slab)."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv, o, gate_up, down = (_slab(m)[0] for m in (attn.q_proj, attn.o_proj, mlp.gate_proj, mlp.down_proj))
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    return _LayerArgs(
        weights=[norms[0].weight, qkv.packed, o.packed, norms[1].weight, gate_up.packed, down.packed],
        biases=[qkv.bias, o.bias, gate_up.bias, down.bias],
        widths=[attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features, attn.head_dim,
                mlp.gate_proj.out_features],
        epsilons=[float(n.variance_epsilon) for n in norms], scale=attn.scaling, layer_idx=attn.layer_idx)


def _fast_forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    context = metadata._forward_context
    position_embeddings = kwargs.get("position_embeddings")
    layer = _LAYER_ARGS.get(self)
    if (args or context is None or layer is None or position_embeddings is None or hidden_states.dim() != 3
            or hidden_states.shape[0] != 1 or hidden_states.dtype != torch.float32
            or hidden_states.device.type != "cpu" or not hidden_states.is_contiguous()
            or any(kwargs.get(k) is not None for k in ("cache", "past_key_values"))):
        return type(self).forward(self, hidden_states, *args, **kwargs)
    cos, sin = position_embeddings
    return run_layer(layer, hidden_states[0], cos[0], sin[0], context, range_checks_enabled()).unsqueeze(0)


def run_layer(layer: _LayerArgs, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              context: metadata.ForwardContext, check_ranges: bool) -> torch.Tensor:
    """One layer's fused op on the flat batch x [T, hidden], with rotary tables cos / sin [T, d]."""
    meta = context.attn_metadata
    key_cache, value_cache = context.kv_caches[layer.layer_idx]
    return _decoder_layer_op(x, layer.weights, layer.biases, layer.widths, layer.epsilons, layer.scale, cos, sin,
                             key_cache, value_cache, meta.slot_mapping, meta.block_tables, meta.seq_lens,
                             meta.query_start_loc, meta.max_query_len, check_ranges)


def scratch_prefill(tokens: int, num_layers: int, num_kv_heads: int, head_size: int, block_size: int = 16):
    """A forward context for a probe: a prefill of `tokens` positions into one scratch block, which
    every layer shares (each writes its K/V before attending over them)."""
    cache = ops.allocate_kv_cache(1, block_size, num_kv_heads, head_size, dtype=torch.float32)
    meta = AttentionMetadata.build([tokens], [tokens], [[0]], list(range(tokens)))
    return set_forward_context(meta, [cache] * num_layers)


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
        with scratch_prefill(tokens, layer.self_attn.layer_idx + 1, num_kv_heads, layer.self_attn.head_dim, block_size):
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
        _LAYER_ARGS[layer] = _layer_args(layer)
        try:
            same = _reproduces(model, layer)
        except Exception:  # a layer whose own forward wants other arguments: leave it to its code
            same = False
        if same:
            layer.forward = types.MethodType(_fast_forward, layer)
            installed += 1
        else:
            _LAYER_ARGS.pop(layer, None)
    return installed
