"""Asks Linux for the AMX tile data state the way csrc/cpu/dispatch.cpp does (arch_prctl(2) through libc's
syscall, x86-64 only), independently of the extension. Run as a script it requests the state in a fresh
process and exits 0 where the kernel grants it: the request is per process, so the tests' own process keeps
only what the extension asked for."""
import ctypes
import platform
import subprocess
import sys

SYS_ARCH_PRCTL = 158  # x86-64
ARCH_GET_XCOMP_PERM, ARCH_REQ_XCOMP_PERM = 0x1022, 0x1023
XFEATURE_XTILEDATA = 18


def arch_prctl(code: int, arg) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc.syscall(ctypes.c_long(SYS_ARCH_PRCTL), ctypes.c_long(code), arg)


def tiles_permitted() -> bool:
    """Whether this process may already use the tile data state (without asking for it)."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    permitted = ctypes.c_uint64(0)
    return arch_prctl(ARCH_GET_XCOMP_PERM, ctypes.byref(permitted)) == 0 and bool(
        permitted.value >> XFEATURE_XTILEDATA & 1)


def kernel_grants_tiles() -> bool:
    """Whether the kernel grants the tile state to a process that asks: a kernel before 5.16 knows neither
    request (EINVAL), one whose XCR0 lacks the tiles (a VM hiding them) refuses it. Asked in a fresh process."""
    return subprocess.run([sys.executable, __file__], check=False).returncode == 0


if __name__ == "__main__":
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        sys.exit(1)
    granted = arch_prctl(ARCH_REQ_XCOMP_PERM, ctypes.c_ulong(XFEATURE_XTILEDATA)) == 0
    sys.exit(0 if granted and tiles_permitted() else 1)
