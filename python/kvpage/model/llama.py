"""kvpage's own forward for Llama-family decoders (Llama, Qwen2, Mistral), built once from a HF model.

Sliding windows (Mistral's on every layer, Qwen2's with use_sliding_window on the layers from
max_window_layers on) are each layer's own, from engine.model_config.layer_sliding_windows, applied by
the attention kernels; each layer reads its KV-cache group's block tables (AttentionMetadata.for_layer).

The runner calls it explicitly, `hidden = forward(input_ids, positions, attn_metadata, kv_caches)`, in
place of transformers' modules (as nano-vllm's models/qwen3.py and vLLM's models/llama.py own theirs):
every layer is pre-norm attention plus a gated-SiLU MLP, with q/k/v and gate/up each one matrix, and
the rotary tables computed by HF's formula from the loaded model's own inv_freq and attention_scaling
(so llama3 / linear / yarn scaling come out as HF computes them). Two backends, chosen once at build:
- float32 on a CPU with kvpage's slab GEMM (AVX2 / AVX-512): every linear packed into slabs
  (cpu_layout), each layer ONE C++ op, kvpage::llama_decoder_layer (csrc/cpu/decoder_layer.cpp), which
  runs the composed backend's kernels in the same order without ~45 Python dispatches a layer.
- everything else (bf16 / fp16 models, CUDA, tensor-parallel shards): composed ops in HF's arithmetic
  order (RMSNorm in fp32, rotate-half rotary, SiLU-and-mul) around kvpage's paged attention ops; the
  linears are the modules' own weights through F.linear (no copy: on a GPU memory is the KV cache's),
  or slabs on a float32 CPU shard, whose row-parallel o_proj / down_proj all-reduce (tensor_parallel).
Which models qualify is decided from the config alone (llama_family_mismatch); every other model keeps
transformers' modules with the "kvpage" attention function (attention.HFForward).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.nn.functional as F

from kvpage.ops import layers
from kvpage.ops._library import ops as _library_ops
from kvpage.ops.config import range_checks_enabled

from kvpage.engine.model_config import LAYER_TYPES, layer_sliding_windows

from .attention import attention_options, head_dim_of, paged_attention_forward
from .cpu_layout import pack_slabs, slab_kernel_available
from .metadata import AttentionMetadata, KVCache
from .tensor_parallel import ParallelLMHead, RowParallelLinear

LLAMA_FAMILY = ("llama", "qwen2", "mistral")
# RoPE types whose inv_freq HF recomputes from the sequence length inside the rotary module's forward.
DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")

_decoder_layer_op = _library_ops.llama_decoder_layer.default
_packed_linear_op = _library_ops.packed_linear.default


def llama_family_mismatch(config) -> str | None:
    """Why kvpage's own forward does not implement `config`'s model; None where it does."""
    model_type = getattr(config, "model_type", None)
    if model_type not in LLAMA_FAMILY:
        return f"model_type {model_type!r} is not one of {LLAMA_FAMILY}"
    if getattr(config, "hidden_act", None) != "silu":
        return f"hidden_act {getattr(config, 'hidden_act', None)!r} is not 'silu'"
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") in DYNAMIC_ROPE_TYPES:
        return f"rope_type {rope['rope_type']!r} changes its frequencies with the sequence length"
    if getattr(config, "is_heterogeneous", False):
        return "its layers differ from one another (a heterogeneous config)"
    others = sorted(set(getattr(config, "layer_types", None) or ()) - set(LAYER_TYPES))
    if others:
        return f"it has {others} layers"
    return None


class RotaryEmbedding:
    """cos / sin [T, head_dim] for a step's positions, by HF's formula and order from the loaded
    model's own rotary module's inv_freq and attention_scaling: the same bits as HF's tables."""

    def __init__(self, rotary_module: torch.nn.Module) -> None:
        self.inv_freq = rotary_module.inv_freq.detach().float()
        self.attention_scaling = rotary_module.attention_scaling

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


@dataclass(frozen=True)
class Linear:
    """x @ W.T + b of linears that read the same input, their outputs side by side (q|k|v, gate|up):
    F.linear over each module's own weight, or, once packed, one slab GEMM over all of them."""

    weights: tuple[torch.Tensor, ...]
    biases: tuple[torch.Tensor | None, ...]
    packed: torch.Tensor | None = None
    packed_bias: torch.Tensor | None = None

    @classmethod
    def of(cls, *modules: torch.nn.Module) -> "Linear":
        # A row-parallel shard's bias is added after its all-reduce (RowParallelLinear.reduce), not here.
        local = [m.local if isinstance(m, (RowParallelLinear, ParallelLMHead)) else m for m in modules]
        return cls(tuple(m.weight for m in local), tuple(m.bias for m in local))

    @property
    def widths(self) -> list[int]:
        return [w.shape[0] for w in self.weights]

    def matrix(self) -> torch.Tensor:
        return torch.cat(self.weights) if len(self.weights) > 1 else self.weights[0]

    def with_packed(self, packed: torch.Tensor) -> "Linear":
        bias = None
        if any(b is not None for b in self.biases):
            bias = torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in zip(self.weights, self.biases)])
        return replace(self, packed=packed, packed_bias=bias)

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.packed is None:
            return [F.linear(x, w, b) for w, b in zip(self.weights, self.biases)]
        out = x.new_empty((x.shape[0], sum(self.widths)))
        _packed_linear_op(out, x if x.is_contiguous() else x.contiguous(), self.packed, self.packed_bias)
        return list(out.split(self.widths, dim=-1)) if len(self.weights) > 1 else [out]


def _reduce_of(module: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A tensor-parallel shard's all-reduce (plus bias) after its partial product; None when unsharded."""
    return module.reduce if isinstance(module, RowParallelLinear) else None


@dataclass(frozen=True)
class DecoderLayer:
    """One pre-norm Llama decoder layer as composed ops (HF LlamaDecoderLayer's arithmetic, in its order)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    epsilons: tuple[float, float]
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear
    head_dim: int
    scale: float
    reduce_o: Callable[[torch.Tensor], torch.Tensor] | None = None  # tensor parallelism: the all-reduces
    reduce_down: Callable[[torch.Tensor], torch.Tensor] | None = None
    # Write + attend: the paged ops, or a DCP rank's share of the group's attention (context_parallel.py).
    attention: Callable[..., torch.Tensor] = paged_attention_forward
    sliding_window: int | None = None  # a query at p reads keys in (p - W, p]; None: the whole context

    @classmethod
    def of(cls, layer: torch.nn.Module, config, sliding_window: int | None = None) -> "DecoderLayer":
        attn, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        head_dim = head_dim_of(config)
        return cls(norms[0].weight, norms[1].weight, tuple(float(n.variance_epsilon) for n in norms),
                   Linear.of(attn.q_proj, attn.k_proj, attn.v_proj), Linear.of(attn.o_proj),
                   Linear.of(mlp.gate_proj, mlp.up_proj), Linear.of(mlp.down_proj), head_dim, head_dim**-0.5,
                   _reduce_of(attn.o_proj), _reduce_of(mlp.down_proj), sliding_window=sliding_window)

    def packed_weights(self) -> list[torch.Tensor]:
        return [lin.packed for lin in (self.qkv, self.o, self.gate_up, self.down) if lin.packed is not None]

    @property
    def is_sharded(self) -> bool:
        """Runs collectives, so it stays composed (FusedCpuLayer has none)."""
        return self.reduce_o is not None or self.reduce_down is not None or self.attention is not paged_attention_forward

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                 kv_cache: KVCache) -> torch.Tensor:
        """x [T, hidden] -> the layer's output [T, hidden]."""
        tokens = x.shape[0]
        q, k, v = (t.view(tokens, -1, self.head_dim) for t in self.qkv(layers.rms_norm(x, self.input_norm,
                                                                                     self.epsilons[0])))
        q, k = layers.rotary_embedding(q, k, cos, sin)
        attn = self.attention(q, k, v, *kv_cache, meta, scale=self.scale,
                              **attention_options(self.sliding_window, None, None))
        x = x + _reduced(self.o(attn.reshape(tokens, -1))[0], self.reduce_o)
        gate, up = self.gate_up(layers.rms_norm(x, self.post_norm, self.epsilons[1]))
        return x + _reduced(self.down(layers.silu_and_mul(gate, up))[0], self.reduce_down)


def _reduced(partial: torch.Tensor, reduce) -> torch.Tensor:
    return partial if reduce is None else reduce(partial)


@dataclass(frozen=True)
class FusedCpuLayer:
    """A DecoderLayer with slab-packed linears as one call of kvpage::llama_decoder_layer (float32 CPU)."""

    weights: list[torch.Tensor]  # [input_norm, qkv, o, post_norm, gate_up, down], the linears packed
    biases: list[torch.Tensor | None]  # [qkv, o, gate_up, down]
    widths: list[int]  # [q, k, v, head_size, intermediate]
    epsilons: list[float]
    scale: float
    sliding_window: int | None = None

    @classmethod
    def of(cls, layer: DecoderLayer) -> "FusedCpuLayer":
        linears = (layer.qkv, layer.o, layer.gate_up, layer.down)
        return cls([layer.input_norm, layer.qkv.packed, layer.o.packed, layer.post_norm, layer.gate_up.packed,
                    layer.down.packed], [lin.packed_bias for lin in linears],
                   [*layer.qkv.widths, layer.head_dim, layer.gate_up.widths[0]], list(layer.epsilons), layer.scale,
                   layer.sliding_window)

    def packed_weights(self) -> list[torch.Tensor]:
        return [self.weights[i] for i in (1, 2, 4, 5)]

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                 kv_cache: KVCache) -> torch.Tensor:
        key_cache, value_cache = kv_cache
        return _decoder_layer_op(x, self.weights, self.biases, self.widths, self.epsilons, self.scale, cos, sin,
                                 key_cache, value_cache, meta.slot_mapping, meta.block_tables, meta.seq_lens,
                                 meta.query_start_loc, meta.max_query_len, range_checks_enabled(x),
                                 **attention_options(self.sliding_window, None, None))


def uses_slab_backend(model: torch.nn.Module) -> bool:
    """A float32 model on a CPU whose ISA runs the slab GEMM."""
    param = next(model.parameters())
    return param.dtype == torch.float32 and param.device.type == "cpu" and slab_kernel_available()


@dataclass(frozen=True)
class LlamaForward:
    """The base model's forward over one flat step, plus the LM head over the rows sampled."""

    embed_tokens: torch.nn.Module  # nn.Embedding, or a VocabParallelEmbedding shard (all-reduces)
    rotary: RotaryEmbedding
    layers: list[DecoderLayer | FusedCpuLayer]
    norm_weight: torch.Tensor
    norm_epsilon: float
    lm_head: Linear
    gather_logits: Callable[[torch.Tensor], torch.Tensor] | None  # a vocabulary-parallel head's gather
    # The widest layer window, None without one: the runner keeps CUDA graphs off windowed models.
    sliding_window: int | None

    @classmethod
    @torch.inference_mode()
    def build(cls, model: torch.nn.Module, slab_dtype: torch.dtype = torch.float32, bf16_dot: bool = False,
              fused_cpu_layers: bool = True, attention: Callable[..., torch.Tensor] | None = None) -> "LlamaForward":
        """From a Llama-family HF model (llama_family_mismatch(model.config) is None), or a tensor-parallel
        shard of one. slab_dtype / bf16_dot: the slabs' storage on the float32 CPU backend (pack_slabs).
        fused_cpu_layers=False keeps that backend's layers composed (each kernel its own op call, as a
        shard's are: for profiling, and for tests that hold the two to the same bits). attention: every
        layer's write + attend in place of the paged ops (a decode-context-parallel rank's)."""
        config, base = model.config, model.base_model
        head = model.get_output_embeddings()
        windows = layer_sliding_windows(config)
        decoder = [DecoderLayer.of(layer, config, window) for layer, window in zip(base.layers, windows)]
        if attention is not None:
            decoder = [replace(layer, attention=attention) for layer in decoder]
        lm_head = Linear.of(head)
        if uses_slab_backend(model):
            linears = [lin for layer in decoder for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [lm_head]
            packed = iter(lin.with_packed(p) for lin, p in zip(linears, pack_slabs([lin.matrix() for lin in linears],
                                                                                    slab_dtype, bf16_dot)))
            decoder = [replace(layer, qkv=next(packed), o=next(packed), gate_up=next(packed), down=next(packed))
                       for layer in decoder]
            lm_head = next(packed)
            decoder = [FusedCpuLayer.of(layer) if fused_cpu_layers and not layer.is_sharded else layer for layer in decoder]
        return cls(base.embed_tokens, RotaryEmbedding(base.rotary_emb), decoder, base.norm.weight,
                   float(base.norm.variance_epsilon), lm_head,
                   head.gather if isinstance(head, ParallelLMHead) else None,
                   max((w for w in windows if w is not None), default=None))

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                 kv_caches: list[KVCache]) -> torch.Tensor:
        """Final hidden states [T, hidden] of the flat batch input_ids / positions [T]."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            x = layer(x, cos, sin, attn_metadata.for_layer(i), kv_cache)
        return layers.rms_norm(x, self.norm_weight, self.norm_epsilon)

    def packed_weights(self) -> list[torch.Tensor]:
        """Every slab-packed matrix this forward multiplies with; none off the float32 CPU backend."""
        head = [self.lm_head.packed] if self.lm_head.packed is not None else []
        return [w for layer in self.layers for w in layer.packed_weights()] + head

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab] of hidden [rows, hidden] (on ranks other than 0 of a vocabulary-parallel
        head, this rank's slice)."""
        logits = self.lm_head(hidden)[0]
        return logits if self.gather_logits is None else self.gather_logits(logits)
