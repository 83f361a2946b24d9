"""Swap the forward of a model's RMSNorm and gated-SiLU MLP modules for kvpage's fused CPU ops.

The modules, their parameters and their names stay as they are; only `forward` is replaced, per
instance. A module is swapped only if it looks like Llama's (RMSNorm: `weight` + `variance_epsilon`;
MLP: gate/up/down projections and a SiLU) AND the fused forward reproduces its own forward on a probe
input: a family whose norm differs (Gemma's 1 + weight, say) fails the probe and keeps its code.
"""
from __future__ import annotations

import types

import torch

from kvpage.ops._library import ops
from kvpage.ops.layers import rms_norm, silu_and_mul

# Relative to the output's norm: rounding differs (the fused SiLU's exp, the RMSNorm's sum order) by
# ~1e-7; a different formula misses by O(1). An elementwise 1e-5 rejected most of SmolLM2's MLPs, whose
# outputs reach the tens.
PROBE_TOLERANCE = 1e-5


# The ops themselves on the engine's hot path (a step calls these ~90 times): the C++ ops check their
# arguments, and the kvpage.ops.layers wrappers, with their fallbacks, take every other case.
_rms_norm_op, _silu_and_mul_op = ops.rms_norm.default, ops.silu_and_mul.default


def _fast_case(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and x.device.type == "cpu"


def _rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if _fast_case(hidden_states) and hidden_states.is_contiguous() and self.weight.dtype == torch.float32:
        out = torch.empty_like(hidden_states)
        _rms_norm_op(out, hidden_states, self.weight, self.variance_epsilon)
        return out
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _gated_silu_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_proj(x), self.up_proj(x)
    if (_fast_case(gate) and gate.dim() == 3 and gate.shape[0] == 1 and gate.shape == up.shape
            and gate.stride(-1) == 1 and up.stride(-1) == 1):
        # The runner's [1, T, n] batch; the rows of gate and up may be slices of one fused projection.
        out = gate.new_empty(gate.shape)
        _silu_and_mul_op(out[0], gate[0], up[0])
        return self.down_proj(out)
    return self.down_proj(silu_and_mul(gate, up))


def _is_rms_norm(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (type(module).__name__.endswith("RMSNorm") and isinstance(weight, torch.Tensor) and weight.dim() == 1
            and isinstance(getattr(module, "variance_epsilon", None), float))


def _is_gated_silu_mlp(module: torch.nn.Module) -> bool:
    act = getattr(module, "act_fn", None)
    return (all(isinstance(getattr(module, n, None), torch.nn.Linear) for n in ("gate_proj", "up_proj", "down_proj"))
            and act is not None and "silu" in type(act).__name__.lower())


@torch.inference_mode()
def _swap_if_equivalent(module: torch.nn.Module, forward, width: int) -> bool:
    param = next(module.parameters())
    probe = torch.randn(3, width, generator=torch.Generator().manual_seed(0)).to(param.dtype)
    expected = module(probe)
    fused = types.MethodType(forward, module)
    if (fused(probe) - expected).norm() > PROBE_TOLERANCE * expected.norm():
        return False
    module.forward = fused
    return True


def fuse_small_layers(model: torch.nn.Module) -> int:
    """Swap every matching RMSNorm and MLP forward of a CPU fp32 model; returns how many changed."""
    swapped = 0
    for module in model.modules():
        if "forward" in vars(module):  # already swapped (or patched by someone else): leave it
            continue
        if _is_rms_norm(module) and module.weight.dtype == torch.float32:
            swapped += _swap_if_equivalent(module, _rms_norm_forward, module.weight.shape[0])
        elif _is_gated_silu_mlp(module) and module.gate_proj.weight.dtype == torch.float32:
            swapped += _swap_if_equivalent(module, _gated_silu_mlp_forward, module.gate_proj.in_features)
    return swapped
