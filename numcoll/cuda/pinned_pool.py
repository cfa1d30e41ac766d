"""Pinned host memory for staging device data, pooled per process.

Pinning (page-locking) host memory is slow: cudaHostAlloc costs about as much
as copying the bytes several times over, so allocating staging memory per
collective would cost more than the copies it enables. The pool keeps
released blocks and hands them out again: blocks come in sizes rounded up to
eighths of a power of two (at most 12.5 % slack), and a request takes the
smallest idle block that fits and is at most twice its size. Idle blocks are
kept up to :data:`IDLE_NBYTES` in all (``NUMCOLL_CUDA_STAGING_IDLE_NBYTES``),
least recently used evicted first, but the most recently released block is
always kept, however large, so a loop of equal large collectives pins once.

One pool serves the whole process (every group and every rank-thread): pinned
memory belongs to the process, and blocks are handed out exclusively, so
concurrent collectives never share one.
"""

from __future__ import annotations

import threading

import numpy as np

from .. import config
from . import kernels as cuda_kernels

__all__ = ["IDLE_NBYTES", "StagingPool", "POOL", "release_idle"]

#: Idle pinned bytes the pool keeps (beyond the most recent block).
IDLE_NBYTES = config.Config.cuda_staging_idle_nbytes
#: Smallest block: small collectives share a few blocks rather than pin many tiny ones.
MIN_BLOCK_NBYTES = 64 << 10


def _idle_limit() -> int:
    return config.get("cuda_staging_idle_nbytes")


def block_nbytes(nbytes: int) -> int:
    """The block size serving a request of ``nbytes``: rounded up to an eighth
    of its power of two, and at least :data:`MIN_BLOCK_NBYTES`."""
    if nbytes <= MIN_BLOCK_NBYTES:
        return MIN_BLOCK_NBYTES
    step = 1 << max(0, nbytes.bit_length() - 4)        # an eighth of the octave
    return -(-nbytes // step) * step


class StagingPool:
    """Pinned host blocks (uint8 arrays), taken and given back.

    ``pin(nbytes)`` makes a block; ``idle_limit()`` is how many idle bytes
    to keep. The same pool, with a device allocator, keeps the collectives'
    device temporaries (:data:`numcoll.cuda.memory.DEVICE_POOL`).
    """

    def __init__(self, pin=cuda_kernels.pinned_empty, idle_limit=None):
        self._pin = pin
        self._idle_limit = idle_limit or _idle_limit
        self._lock = threading.Lock()
        self._idle: list[np.ndarray] = []        # least recently released first
        self._idle_nbytes = 0
        self.pinned_nbytes = 0                   # everything ever pinned (for tests, stats)

    def take(self, nbytes: int) -> np.ndarray:
        """A block of at least ``nbytes`` bytes, for the caller's exclusive use."""
        with self._lock:
            best = None
            for i, block in enumerate(self._idle):
                if nbytes <= block.size <= max(2 * nbytes, MIN_BLOCK_NBYTES) and (
                        best is None or block.size < self._idle[best].size):
                    best = i
            if best is not None:
                block = self._idle.pop(best)
                self._idle_nbytes -= block.size
                return block
        size = block_nbytes(nbytes)
        block = self._pin(size)
        with self._lock:
            self.pinned_nbytes += size
        return block

    def give(self, block: np.ndarray) -> None:
        """Return a block that nothing reads or writes any more."""
        limit = self._idle_limit()
        with self._lock:
            self._idle.append(block)
            self._idle_nbytes += block.size
            while self._idle_nbytes > limit and len(self._idle) > 1:
                self._idle_nbytes -= self._idle.pop(0).size

    def release_idle(self) -> int:
        """Drop every idle block (the memory is unpinned when freed); the bytes dropped."""
        with self._lock:
            dropped, self._idle, self._idle_nbytes = self._idle_nbytes, [], 0
        return dropped


#: The process's pool.
POOL = StagingPool()


def release_idle() -> int:
    """Unpin the idle staging memory of this process; returns the bytes released."""
    return POOL.release_idle()
