"""How much memory a KV cache may still take, asked before it is allocated.

On Linux a CPU allocation larger than the free memory usually succeeds (overcommit) and the process
is killed by the OOM killer only when the zero-fill touches the pages: a crash, not an exception. So
the cache allocators compare what they need with what is available first and raise instead.
"""
from __future__ import annotations

from pathlib import Path

import torch

_CGROUP = Path("/sys/fs/cgroup")


def available_bytes(device: torch.device) -> int | None:
    """Bytes a new allocation on `device` can take without swapping or an OOM kill; None if unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    if device.type != "cpu":
        return None
    limits = [x for x in (_meminfo_available(), _cgroup_available()) if x is not None]
    return min(limits) if limits else None


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_available() -> int | None:
    """What the cgroup (v2) memory limit leaves, where one is set: a container's own ceiling."""
    try:
        limit = (_CGROUP / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((_CGROUP / "memory.current").read_text()))
    except (OSError, ValueError):
        return None


def gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"
