"""Loads the compiled extension (which registers torch.ops.kvpage.*) and its fake kernels.

Every op mutates its outputs in place and returns nothing, so the fake (meta) kernels that let
torch.compile trace them have nothing to compute."""
import torch

from kvpage import _C  # noqa: F401  (importing registers the ops)

OPS = ("reshape_and_cache", "paged_attention", "paged_prefill_attention", "copy_blocks", "swap_blocks")


def _register_fakes():
    for name in OPS:
        torch.library.register_fake(f"kvpage::{name}")(lambda *args, **kwargs: None)


_register_fakes()

ops = torch.ops.kvpage
cpu_isa = _C.cpu_isa
set_cpu_isa = _C.set_cpu_isa
available_cpu_isas = _C.available_cpu_isas
built_with_cuda = _C.built_with_cuda
