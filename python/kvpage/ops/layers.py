"""The model's small per-token layers (RMSNorm, SiLU-and-multiply, rotary embedding, packed linear)
and greedy sampling, fused for CPUs.

Each op replaces a chain of torch ops (RMSNorm is six: pow, mean, add, rsqrt, mul, mul) with one pass
over the rows in `kvpage._C`. On a CPU at decode's tens of tokens per step, every torch op costs a
dispatch and a thread fork for a few microseconds of arithmetic, so chains like these add up across
30 layers. The fused kernels are fp32 on CPU; anything else (GPU tensors, bf16) takes the plain torch
formula of ops/reference.py, so callers never need to check.
"""
from __future__ import annotations

import torch

from kvpage import _C
from kvpage.ops import _checks, reference
from kvpage.ops._library import ops


def _fused(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.stride(-1) == 1 for t in tensors)


def rms_norm(input: torch.Tensor, weight: torch.Tensor, epsilon: float, out: torch.Tensor | None = None):
    """weight * input / sqrt(mean(input ** 2, -1) + epsilon), as HF's LlamaRMSNorm (fp32 math)."""
    _checks.require_tensor(input, "input")
    _checks.require_tensor(weight, "weight")
    if not _fused(input, weight) or input.dim() not in (1, 2) and not input.is_contiguous():
        result = reference.rms_norm(input, weight, epsilon)
        return result if out is None else out.copy_(result)
    out = torch.empty_like(input, memory_format=torch.contiguous_format) if out is None else out
    ops.rms_norm(out, input, weight, float(epsilon))
    return out


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up: a Llama MLP's activation, before the down projection."""
    _checks.require_tensor(gate, "gate")
    _checks.require_tensor(up, "up")
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have the same shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    gate_rows, up_rows = _as_rows(gate), _as_rows(up)
    if gate_rows is None or up_rows is None or not _fused(gate, up):
        result = reference.silu_and_mul(gate, up)
        return result if out is None else out.copy_(result)
    out = torch.empty_like(gate, memory_format=torch.contiguous_format) if out is None else out
    out_rows = _as_rows(out)
    if out_rows is None:
        return out.copy_(silu_and_mul(gate, up))
    ops.silu_and_mul(out_rows, gate_rows, up_rows)
    return out


def _as_rows(t: torch.Tensor) -> torch.Tensor | None:
    """[..., n] as a 2-D [rows, n] view (any row stride), or None where the leading dims do not merge
    (a gate/up slice of a fused [1, T, 2n] projection merges; a transposed tensor does not)."""
    if t.dim() == 0:
        return None
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return None


def rotary_embedding(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding in HF's rotate-half form, x * cos + rotate_half(x) * sin, for query and
    key [tokens, heads, head_size] (any token/head strides) with cos/sin [tokens, head_size]; new
    contiguous tensors, as HF's apply_rotary_pos_emb returns."""
    for name, t in (("query", query), ("key", key), ("cos", cos), ("sin", sin)):
        _checks.require_tensor(t, name)
    if query.dim() != 3 or key.dim() != 3 or cos.dim() != 2 or cos.shape != sin.shape:
        raise ValueError(f"query/key must be [tokens, heads, head_size] and cos/sin one [tokens, head_size];"
                         f" got {tuple(query.shape)}, {tuple(key.shape)}, {tuple(cos.shape)}, {tuple(sin.shape)}")
    if not _fused(query, key, cos, sin):
        return reference.rotary_embedding(query, key, cos, sin)
    query_out, key_out = torch.empty_like(query, memory_format=torch.contiguous_format), torch.empty_like(
        key, memory_format=torch.contiguous_format)
    ops.rotary_embedding(query_out, key_out, query, key, cos, sin)
    return query_out, key_out


def greedy_sample(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of logits [rows, vocab]: the argmax token (the first on ties, as torch.argmax) and its
    log-probability under softmax, in one pass instead of argmax + gather + logsumexp."""
    _checks.require_tensor(logits, "logits")
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [rows, vocab], got shape {tuple(logits.shape)}")
    if not _fused(logits):
        return reference.greedy_sample(logits)
    tokens = torch.empty(logits.shape[0], dtype=torch.int64)
    logprobs = torch.empty(logits.shape[0], dtype=torch.float32)
    ops.greedy_sample(tokens, logprobs, logits)
    return tokens, logprobs


SLAB_COLUMNS = _C.linear_slab_columns  # the packed layout's slab width (csrc/cpu/kernels.h)


def packed_linear_shape(out_features: int, in_features: int) -> tuple[int, int, int]:
    """The packed layout of a [out_features, in_features] weight: [ceil(out / 48), in, 48]."""
    return -(-out_features // SLAB_COLUMNS), in_features, SLAB_COLUMNS


def packed_pairs_shape(out_features: int, in_features: int) -> tuple[int, int, int, int]:
    """The pair-interleaved bf16 layout for bf16 dot products: [ceil(out / 48), ceil(in / 2), 48, 2]."""
    return -(-out_features // SLAB_COLUMNS), -(-in_features // 2), SLAB_COLUMNS, 2


def bf16_dot_available() -> bool:
    """Whether packed_linear can compute in bf16 dot products here (AVX512-BF16, avx512 kernels active)."""
    return _C.bf16_dot_available()


# What a packed weight may be stored as: fp32, or 16 bits that the kernel widens to fp32 as it loads them.
PACKED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def pack_linear_weight(weight: torch.Tensor, out: torch.Tensor | None = None,
                       dtype: torch.dtype | None = None, bf16_dot: bool = False) -> torch.Tensor:
    """A linear layer's weight [out_features, in_features] (fp32, CPU) packed into the column slabs
    [ceil(out / 48), in, 48] that packed_linear streams; a copy, the weight itself is untouched.
    dtype: what the slabs store, float32 (the default) or bfloat16 / float16: each element is then
    weight.to(dtype) (round to nearest even), half the bytes to stream, and packed_linear computes in
    fp32 exactly as over fp32 slabs of those rounded weights. bf16_dot: instead, bf16 slabs interleaved
    in pairs of input features (packed_pairs_shape), for which packed_linear rounds its input to bf16
    too and multiplies with bf16 dot products (fp32 sums; twice the fp32 FMA rate; where
    bf16_dot_available()). out: a contiguous tensor of that shape and dtype to pack into (say, a view
    of one buffer holding a whole model's packed weights)."""
    _checks.require_tensor(weight, "weight")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [out_features, in_features], got shape {tuple(weight.shape)}")
    if bf16_dot and dtype not in (None, torch.bfloat16):
        raise ValueError(f"dtype must be bfloat16 (or None) with bf16_dot, got {dtype!r}")
    dtype = (torch.bfloat16 if bf16_dot else torch.float32) if dtype is None else dtype
    if dtype not in PACKED_DTYPES:
        raise ValueError(f"dtype must be one of {PACKED_DTYPES}, got {dtype!r}")
    shape = packed_pairs_shape(*weight.shape) if bf16_dot else packed_linear_shape(*weight.shape)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=weight.device)
    else:
        _checks.require_tensor(out, "out")
        if tuple(out.shape) != shape or out.dtype != dtype or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {dtype} tensor of shape {shape}, got"
                             f" {out.dtype} {tuple(out.shape)}{'' if out.is_contiguous() else ' (not contiguous)'}")
    ops.pack_linear_weight(out, weight.contiguous())
    return out


def packed_linear(input: torch.Tensor, packed: torch.Tensor, out_features: int,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """input [..., in_features] @ weight.T + bias from pack_linear_weight(weight): [..., out_features].
    Built for decode's few rows (weights streamed once per call); fp32 input and output on CPU, packed
    in fp32, bf16 or fp16."""
    _checks.require_tensor(input, "input")
    _checks.require_tensor(packed, "packed")
    if not isinstance(out_features, int) or out_features <= 0:
        raise ValueError(f"out_features must be a positive int, got {out_features!r}")
    rows = input.reshape(-1, input.shape[-1]).contiguous() if input.dim() else input
    out = torch.empty((rows.shape[0] if rows.dim() == 2 else 0, out_features), dtype=input.dtype,
                      device=input.device)
    ops.packed_linear(out, rows, packed, bias)
    return out.reshape(*input.shape[:-1], out_features)
