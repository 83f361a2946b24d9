"""kvpage's fused rotary embedding in place of HF's apply_rotary_pos_emb, during kvpage's own steps.

HF's attention layers call their modeling module's `apply_rotary_pos_emb(q, k, cos, sin)`: per layer
ten torch ops (two slices, a negation, a concatenation, four multiplies, two adds) for q and k, each
a pass over the activations with a dispatch and a thread fork; at decode's tens of tokens per step
that is more time than the arithmetic. `kvpage.ops.layers.rotary_embedding` does it in one pass,
bit-identical to HF's formula.

The function is a module global, not a method, so it can only be swapped in the modeling module.
RotarySwap does that only around the runner's forward pass (the module's own function is back
before anything else runs), only in modules where a probe shows the fused op reproduces the
module's function to the bit (a family with interleaved or partial rotary keeps its own), and the
replacement falls back to the original for any call that is not a kvpage step's (batch 1, CPU fp32).
"""
from __future__ import annotations

import sys
from contextlib import contextmanager

import torch

from kvpage.ops.layers import rotary_embedding

from .attention import head_dim_of

FUNCTION_NAME = "apply_rotary_pos_emb"


def _fused_version(original):
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        # HF's layout: q/k [batch, heads, tokens, d], cos/sin [batch, tokens, d], unsqueeze_dim=1.
        if (args or kwargs.keys() - {"unsqueeze_dim"} or kwargs.get("unsqueeze_dim", 1) != 1
                or q.dim() != 4 or k.dim() != 4 or q.shape[0] != 1 or k.shape[0] != 1
                or cos.shape != (1, q.shape[2], q.shape[3]) or sin.shape != cos.shape
                or k.shape[2:] != q.shape[2:]
                or any(t.dtype != torch.float32 or t.device.type != "cpu" for t in (q, k, cos, sin))):
            return original(q, k, cos, sin, *args, **kwargs)
        q_out, k_out = rotary_embedding(q[0].transpose(0, 1), k[0].transpose(0, 1), cos[0], sin[0])
        return q_out.unsqueeze(0).transpose(1, 2), k_out.unsqueeze(0).transpose(1, 2)

    apply_rotary_pos_emb.kvpage_original = original
    return apply_rotary_pos_emb


@torch.inference_mode()
def _reproduces(original, fused, head_dim: int) -> bool:
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 3, 5, head_dim, generator=g), torch.randn(1, 2, 5, head_dim, generator=g)
    cos, sin = torch.randn(1, 5, head_dim, generator=g), torch.randn(1, 5, head_dim, generator=g)
    try:
        expected = original(q, k, cos, sin)
    except Exception:  # a signature we do not know: leave the module alone
        return False
    return all(torch.equal(a, b) for a, b in zip(fused(q, k, cos, sin), expected))


class RotarySwap:
    """The modeling modules of `model`'s attention layers whose apply_rotary_pos_emb the fused op
    reproduces; `active()` swaps them in for the duration of a with-block."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.swaps: list[tuple[object, object]] = []  # (modeling module, fused function)
        head_dim = head_dim_of(model.config)
        seen = set()
        for layer in model.modules():
            module = sys.modules.get(type(layer).__module__)
            original = getattr(module, FUNCTION_NAME, None)
            if module is None or module in seen or not callable(original) or not hasattr(layer, "layer_idx"):
                continue
            seen.add(module)
            original = getattr(original, "kvpage_original", original)
            fused = _fused_version(original)
            if head_dim % 2 == 0 and _reproduces(original, fused, head_dim):
                self.swaps.append((module, fused))

    @contextmanager
    def active(self):
        originals = [(module, getattr(module, FUNCTION_NAME)) for module, _ in self.swaps]
        try:
            for module, fused in self.swaps:
                setattr(module, FUNCTION_NAME, fused)
            yield
        finally:
            for module, original in originals:
                setattr(module, FUNCTION_NAME, original)
