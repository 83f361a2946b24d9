"""Linear weights packed for kvpage's CPU slab GEMM (`kvpage.ops.layers.packed_linear`), and the
rounding of a float32 model's weights to 16-bit storage.

At decode's few rows per step (M = the batch, tens of tokens) a linear layer is bound by streaming its
weight from memory, and plain nn.Linear (sgemm) also repacks the weight into its panel format on every
call. kvpage's own kernel (AVX-512 or AVX2) streams weights packed once into 48-column slabs, each
thread streaming its slabs once per call while prefetching the next; layers that read the same input
are packed as ONE matrix (q/k/v, gate/up; vLLM's QKVParallelLinear and MergedColumnParallelLinear).
The slab kernel also takes prefill's long batches, in blocks of 128 rows (csrc/cpu/linear_ops.cpp).
`python bench/linear.py` compares it with MKL and nn.Linear; docs/results.md has the figures.

The packed copies are extra memory (as much again as the linear weights): the model's modules keep
their weights untouched, and only kvpage's own forward (llama.py) multiplies with the copies.
"""
from __future__ import annotations

import math

import torch

from kvpage import ops
from kvpage.ops import layers
from kvpage.ops.huge_pages import huge_page_empty


def slab_kernel_available() -> bool:
    """The slab layout pays where a register-blocked kernel runs it (gemm_impl.h): AVX-512 and AVX2."""
    return ops.cpu_isa() in ("avx512", "avx2")


class SlabArena:
    """Every packed matrix of a model in one buffer on huge pages (ops.huge_pages): a decode step
    streams all of them, and with 4 KiB pages each page of a slab costs a TLB miss and restarts the
    hardware prefetcher. One buffer also gives the small matrices (576 x 576: 1.3 MiB) huge pages."""

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


@torch.inference_mode()
def pack_slabs(weights: list[torch.Tensor], dtype: torch.dtype = torch.float32,
               bf16_dot: bool = False) -> list[torch.Tensor]:
    """Each float32 [out, in] weight packed into slabs, all in one SlabArena. dtype: what the slabs
    store (float32, or bfloat16 / float16 for weights already representable in it: see
    round_weights). bf16_dot: bf16 dot-product slabs (weights and inputs rounded to bf16, fp32 sums),
    taken only where layers.bf16_dot_available(); elsewhere the slabs are `dtype` as without it."""
    bf16_dot = bf16_dot and layers.bf16_dot_available()
    dtype = torch.bfloat16 if bf16_dot else dtype
    arena = SlabArena([tuple(w.shape) for w in weights], dtype, bf16_dot)
    return [layers.pack_linear_weight(w.detach(), out=arena.view(i), dtype=dtype, bf16_dot=bf16_dot)
            for i, w in enumerate(weights)]


@torch.no_grad()
def round_weights(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Round every floating-point parameter of `model` to `dtype` precision in place, keeping its
    fp32 storage: the model then computes what model.to(dtype) would hold, in fp32 arithmetic, and
    16-bit slabs of its linears (pack_slabs) lose nothing. Raises ValueError, changing nothing, where
    a weight is beyond float16's range (it would become inf)."""
    params = [p for p in model.parameters() if p.is_floating_point()]
    if dtype == torch.float16:
        limit = torch.finfo(torch.float16).max
        too_large = [n for n, p in model.named_parameters() if p.is_floating_point() and p.abs().max() > limit]
        if too_large:
            raise ValueError(f"weight_dtype float16: {too_large[0]} holds values beyond float16's range"
                             f" (+-{limit:g}); use bfloat16")
    for param in params:
        param.copy_(param.to(dtype))
