"""Free host memory, read before a large allocation (Linux; None where it cannot be read).

On Linux an allocation larger than the free memory usually succeeds (overcommit) and the process is
killed by the OOM killer only once the pages are touched: a crash, not an exception. Allocators that
may be asked for too much compare with this first and raise instead.
"""
from __future__ import annotations

from pathlib import Path

_CGROUP = Path("/sys/fs/cgroup")


def available_host_bytes() -> int | None:
    """Bytes a new allocation can take without swapping or an OOM kill: MemAvailable, or less where a
    cgroup (v2) memory limit leaves less."""
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
    try:
        limit = (_CGROUP / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((_CGROUP / "memory.current").read_text()))
    except (OSError, ValueError):
        return None


def gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"
