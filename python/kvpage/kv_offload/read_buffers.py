"""The disk tier's read buffers (DiskTier.get_many): a load's files are read into one buffer, and its payloads
are views of it that the tier hands out. A buffer is reused for a later load only once none of those views is
alive, so a load writes into pages faulted in before, never under a payload someone still reads.

The lifetime rule: each load takes one lease, a fresh numpy view of the buffer, and every payload is a slice of
one memoryview of that lease, so each payload (and any slice or numpy view of it) holds the lease through their
shared buffer export. The buffer is idle once the lease is gone, which a weak reference tells."""
from __future__ import annotations

import weakref

import numpy as np


class ReadBuffer:
    """One uninitialised buffer that a load's reads are placed into, one after another."""

    def __init__(self, nbytes: int) -> None:
        self._array = np.empty(nbytes, dtype=np.uint8)
        self._lease: weakref.ref | None = None
        self._root: memoryview | None = None
        self._used = 0

    @property
    def nbytes(self) -> int:
        return len(self._array)

    def lease(self) -> None:
        """Start a load: the views taken until the next lease hold this one."""
        lease = self._array[:]
        self._lease = weakref.ref(lease)
        self._root = memoryview(lease)
        self._used = 0

    def take(self, nbytes: int) -> memoryview | None:
        """The next nbytes of the buffer; None once they do not fit."""
        if self._used + nbytes > len(self._array):
            return None
        view = self._root[self._used:self._used + nbytes]
        self._used += nbytes
        return view

    def release(self) -> None:
        """The load has taken its views: from now on only they hold the lease."""
        self._root = None

    def idle(self) -> bool:
        """No view of the last load is alive."""
        return self._root is None and (self._lease is None or self._lease() is None)


class ReadBuffers:
    """The read buffers kept for the next load: a load's tens of MB then go into pages faulted in before, not
    fresh pages the kernel must fault in and zero (as much as the read itself). Buffers over KEEP_BYTES are not
    kept (they are freed with their payloads)."""

    KEEP = 2  # a load in flight while the next sequence's blocks are matched
    KEEP_BYTES = 256 * 2**20

    def __init__(self) -> None:
        self._kept: list[ReadBuffer] = []

    def take(self, nbytes: int) -> ReadBuffer:
        """An idle kept buffer of at least nbytes, leased; else a new one (kept if there is room)."""
        idle = [b for b in self._kept if b.idle()]
        fits = [b for b in idle if b.nbytes >= nbytes]
        if fits:
            buffer = min(fits, key=lambda b: b.nbytes)
        else:
            buffer = ReadBuffer(nbytes)
            if nbytes <= self.KEEP_BYTES:
                if len(self._kept) >= self.KEEP and idle:
                    self._kept.remove(min(idle, key=lambda b: b.nbytes))  # too small for this load
                if len(self._kept) < self.KEEP:
                    self._kept.append(buffer)
        buffer.lease()
        return buffer
