"""How much memory a KV cache may still take on a device, asked before it is allocated (see
kvpage.core.host_memory for why: a CPU cache past the free memory is OOM-killed, not refused)."""
from __future__ import annotations

import torch

from kvpage.core.host_memory import available_host_bytes, gib

__all__ = ["available_bytes", "gib"]


def available_bytes(device: torch.device) -> int | None:
    """Bytes a new allocation on `device` can take; None if unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    if device.type != "cpu":
        return None
    return available_host_bytes()
