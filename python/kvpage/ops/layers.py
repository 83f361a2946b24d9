"""The model's small per-token layers and greedy sampling, fused for CPUs.

Each op replaces a chain of torch ops (RMSNorm is six: pow, mean, add, rsqrt, mul, mul) with one pass
over the rows in `kvpage._C`. On a CPU at decode's tens of tokens per step, every torch op costs a
dispatch and a thread fork for a few microseconds of arithmetic, so chains like these add up across
30 layers. The fused kernels are fp32 on CPU; anything else (GPU tensors, bf16) takes the plain torch
formula of ops/reference.py, so callers never need to check.
"""
from __future__ import annotations

import torch

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
    if not _fused(gate, up) or gate.dim() > 2 and not (gate.is_contiguous() and up.is_contiguous()):
        result = reference.silu_and_mul(gate, up)
        return result if out is None else out.copy_(result)
    out = torch.empty_like(gate, memory_format=torch.contiguous_format) if out is None else out
    ops.silu_and_mul(out, gate, up)
    return out


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
