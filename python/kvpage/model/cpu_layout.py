"""Linear weights prepacked for fast CPU matmuls: decode's small batches and prefill's long ones.

At decode's few rows per step (M = the batch, tens of tokens) a linear layer is bound by streaming its
weight from memory, and plain nn.Linear (sgemm) also repacks the weight into its panel format on every
call. Two packings, chosen by the CPU:

- AVX-512 or AVX2 (kvpage's own kernel, `kvpage.ops.layers.packed_linear`): weights in 48-column slabs that
  each thread streams once per call while prefetching the next. Layers that read the same input are
  packed as ONE matrix and computed in one call: q/k/v of an attention module, gate/up of an MLP (as
  vLLM's QKVParallelLinear and MergedColumnParallelLinear do); each member returns its slice.
  `python bench/linear.py` (a step's linears of SmolLM2, cold caches, 2 threads), ms per step at
  M = 8 / 32 / 64 / 128 rows: 33.6 / 55.3 / 96.5 / 124.1 vs MKL packed 41.0 / 64.8 / 100.4 / 152.6
  (AVX-512 VM); 32.4 / 82.3 / 147.8 / 224.8 vs 78.3 / 122.3 / 177.2 / 298.7 (AVX2 kernel, AMD EPYC VM).
- Otherwise MKL's packed sgemm (cblas_sgemm_pack through torch.ops.mkl, as torch.compile's CPU backend
  uses it), one matrix per layer: 49.8 vs 56.6 ms plain at M = 37, bit-identical to F.linear from M = 16.

The slab kernel also takes prefill's long batches, in blocks of 128 rows (csrc/cpu/linear_ops.cpp):
`python bench/linear.py --rows 64 512 2048` on a 2-core AMD EPYC VM (AVX-512, where MKL's sgemm runs
well below the CPU's peak): 100 / 794 / 3194 ms vs nn.Linear's 206 / 1237 / 4597 (1.44x at 2048 rows).

Either way the packed copy is extra memory (as much again as the linear weights); the modules keep
their weights, so state_dict, tied embeddings and everything else see no change.
"""
from __future__ import annotations

import math
import types
import weakref
from dataclasses import dataclass

import torch

from kvpage import ops
from kvpage.ops import layers
from kvpage.ops._library import ops as _library_ops
from kvpage.ops.huge_pages import huge_page_empty

_packed_linear_op = _library_ops.packed_linear.default
MKL_PACK_BATCH = 64  # the batch MKL tunes its packing for; any batch may use it
# Sibling layers fed the same input, packed and computed together.
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


@dataclass(eq=False)
class _Fused:
    """One packed matrix for num_members layers that share an input. Called through the member modules
    (output), the first member computes and the others, called with the same tensor, take their slice
    of the kept output; the last of them to read it lets it go, so a long prefill's outputs are not held
    past their layer (1.2 GB over SmolLM2's 121 matrices after a 2000-token prefill when they were)."""

    packed: torch.Tensor
    bias: torch.Tensor | None
    out_features: int
    num_members: int = 1
    last_input: torch.Tensor | None = None
    last_output: torch.Tensor | None = None
    reads_left: int = 0

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        # The op itself, not layers.packed_linear: this runs ~100 times a step, and the C++ op
        # checks every argument anyway.
        rows = x.reshape(-1, x.shape[-1])
        out = rows.new_empty((rows.shape[0], self.out_features))
        _packed_linear_op(out, rows if rows.is_contiguous() else rows.contiguous(), self.packed, self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def output(self, x: torch.Tensor) -> torch.Tensor:
        if x is not self.last_input:
            self.last_input, self.last_output, self.reads_left = x, self.compute(x), self.num_members
        out = self.last_output
        self.reads_left -= 1
        if self.reads_left <= 0:
            self.last_input = self.last_output = None
        return out


# module -> (its packed matrix, its columns there). Kept off the module: a packed tensor would be
# copied by deepcopy and pickling; a copy of the module finds no entry and runs F.linear.
_SLABS: "weakref.WeakKeyDictionary[torch.nn.Linear, tuple[_Fused, int]]" = weakref.WeakKeyDictionary()
_MKL: "weakref.WeakKeyDictionary[torch.nn.Linear, torch.Tensor]" = weakref.WeakKeyDictionary()


def mkl_packing_available() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def slab_kernel_available() -> bool:
    """The slab layout pays where a register-blocked kernel runs it (gemm_impl.h): AVX-512 and AVX2."""
    return ops.cpu_isa() in ("avx512", "avx2")


def _slab_forward(self, x: torch.Tensor) -> torch.Tensor:
    entry = _SLABS.get(self)
    if entry is None or x.dtype != torch.float32 or x.device.type != "cpu":
        return torch.nn.functional.linear(x, self.weight, self.bias)
    fused, start = entry
    out = fused.output(x)
    return out if out.shape[-1] == self.out_features else out[..., start:start + self.out_features]


def _mkl_forward(self, x: torch.Tensor) -> torch.Tensor:
    packed = _MKL.get(self)
    if packed is None or x.dtype != torch.float32 or x.device.type != "cpu":
        return torch.nn.functional.linear(x, self.weight, self.bias)
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    y = torch.ops.mkl._mkl_linear(rows, packed, self.weight, self.bias, rows.shape[0])
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _packable(module: torch.nn.Module) -> bool:
    return (isinstance(module, torch.nn.Linear) and module.weight.dtype == torch.float32
            and module.weight.device.type == "cpu" and "forward" not in vars(module))


def _fusable_groups(model: torch.nn.Module) -> list[list[torch.nn.Linear]]:
    """Sibling layers of FUSED_GROUPS with one input width; every other packable layer alone."""
    groups, grouped = [], set()
    for parent in model.modules():
        for names in FUSED_GROUPS:
            members = [getattr(parent, n, None) for n in names]
            if (all(m is not None and _packable(m) for m in members)
                    and len({m.in_features for m in members}) == 1
                    and len({m.bias is None for m in members}) == 1):
                groups.append(members)
                grouped.update(id(m) for m in members)
    singles = [[m] for m in model.modules() if _packable(m) and id(m) not in grouped]
    return groups + singles


def _pack_slabs(model: torch.nn.Module, dtype: torch.dtype, bf16_dot: bool) -> int:
    groups = _fusable_groups(model)
    if not groups:
        return 0
    dtype = torch.bfloat16 if bf16_dot else dtype
    sizes = [(sum(m.out_features for m in members), members[0].in_features) for members in groups]
    arena = SlabArena(sizes, dtype, bf16_dot)
    changed = 0
    for i, members in enumerate(groups):
        weight = torch.cat([m.weight.detach() for m in members]) if len(members) > 1 else members[0].weight.detach()
        bias = None if members[0].bias is None else torch.cat([m.bias.detach() for m in members])
        packed = layers.pack_linear_weight(weight, out=arena.view(i), dtype=dtype, bf16_dot=bf16_dot)
        fused = _Fused(packed, bias, weight.shape[0], len(members))
        start = 0
        for m in members:
            _SLABS[m] = (fused, start)
            start += m.out_features
            m.forward = types.MethodType(_slab_forward, m)
            changed += 1
    return changed


class SlabArena:
    """Every packed matrix of a model in one buffer on huge pages (ops.huge_pages): a decode step
    streams all of them, and with 4 KiB pages each page of a slab costs a TLB miss and restarts the
    hardware prefetcher (`python bench/linear.py`, SmolLM2's linears on a Zen 5 VM: 1.00-1.12x at
    1-16 rows, level from 32, where the GEMM is compute-bound). One buffer also gives the small
    matrices (576 x 576: 1.3 MiB) huge pages."""

    def __init__(self, sizes: list[tuple[int, int]], dtype: torch.dtype = torch.float32, bf16_dot: bool = False) -> None:
        """sizes: (out_features, in_features) of each packed matrix; dtype: what the slabs store;
        bf16_dot: pair-interleaved bf16 slabs (layers.pack_linear_weight's bf16_dot)."""
        shape_of = layers.packed_pairs_shape if bf16_dot else layers.packed_linear_shape
        self.shapes = [shape_of(n, k) for n, k in sizes]
        self.offsets = [0]
        for shape in self.shapes:
            self.offsets.append(self.offsets[-1] + math.prod(shape))
        self.buffer = huge_page_empty(self.offsets[-1] * dtype.itemsize).view(dtype)

    def view(self, i: int) -> torch.Tensor:
        return self.buffer[self.offsets[i]:self.offsets[i + 1]].view(self.shapes[i])


def _pack_mkl(model: torch.nn.Module) -> int:
    changed = 0
    for module in model.modules():
        if _packable(module):
            _MKL[module] = torch.ops.mkl._mkl_reorder_linear_weight(module.weight.detach(), MKL_PACK_BATCH)
            module.forward = types.MethodType(_mkl_forward, module)
            changed += 1
    return changed


@torch.inference_mode()
def prepack_linear_weights(model: torch.nn.Module, weight_dtype: torch.dtype = torch.float32,
                           bf16_dot: bool = False) -> int:
    """Give every fp32 CPU nn.Linear of `model` a packed weight its forward multiplies with (kvpage's
    slabs on AVX-512 and AVX2 CPUs, else MKL's); returns how many changed (0 where neither is available).
    weight_dtype: what the slabs store (float32, or bfloat16 / float16 for weights that are already
    representable in it: see round_weights); MKL's packing keeps float32. bf16_dot: bf16 dot-product
    slabs (weights and inputs rounded to bf16, fp32 sums), where layers.bf16_dot_available()."""
    if slab_kernel_available():
        return _pack_slabs(model, weight_dtype, bf16_dot and layers.bf16_dot_available())
    return _pack_mkl(model) if mkl_packing_available() else 0


def has_packed_weights(model: torch.nn.Module) -> bool:
    """Whether some linear of `model` already multiplies with a packed copy of its weight (another
    runner prepared this model): rounding its weights now would leave those copies unrounded."""
    return any(m in _SLABS or m in _MKL for m in model.modules())


@torch.no_grad()
def round_weights(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Round every floating-point parameter of `model` to `dtype` precision in place, keeping its
    fp32 storage: the model then computes what model.to(dtype) would hold, in fp32 arithmetic, and
    16-bit slabs of its linears (prepack_linear_weights) lose nothing. Raises ValueError, changing
    nothing, where a weight is beyond float16's range (it would become inf)."""
    params = [p for p in model.parameters() if p.is_floating_point()]
    if dtype == torch.float16:
        limit = torch.finfo(torch.float16).max
        too_large = [n for n, p in model.named_parameters() if p.is_floating_point() and p.abs().max() > limit]
        if too_large:
            raise ValueError(f"weight_dtype float16: {too_large[0]} holds values beyond float16's range"
                             f" (+-{limit:g}); use bfloat16")
    for param in params:
        param.copy_(param.to(dtype))
