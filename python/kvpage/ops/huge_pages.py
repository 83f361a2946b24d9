"""CPU tensors on transparent huge pages, for the big buffers kernels stream: KV caches, packed weights.

With 4 KiB pages nearly every KV tile attention reads, and every 4 KiB of a weight slab a linear layer
streams, costs a TLB miss, and the hardware prefetcher stops at each page boundary. A buffer that
starts on a 2 MiB boundary and is advised MADV_HUGEPAGE before its first touch gets 2 MiB pages where
the kernel allows them (transparent_hugepage "always" or "madvise"); elsewhere the advice is a no-op.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

import torch

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def huge_page_empty(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 CPU tensor of `nbytes` starting on a 2 MiB boundary, advised to use huge
    pages (nothing is touched yet, so the first writes fault them in)."""
    buffer = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    offset = -buffer.data_ptr() % HUGE_PAGE
    aligned = buffer[offset:offset + nbytes]
    _advise(aligned.data_ptr(), nbytes)
    return aligned


def huge_page_zeros(shape, dtype: torch.dtype) -> torch.Tensor:
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    return huge_page_empty(nbytes).zero_().view(dtype).view(shape)


def _advise(address: int, nbytes: int) -> None:
    if not sys.platform.startswith("linux") or nbytes < HUGE_PAGE:
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    length = nbytes // HUGE_PAGE * HUGE_PAGE
    libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), _MADV_HUGEPAGE)  # a hint: ignore failure
