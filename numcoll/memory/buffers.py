"""The buffer an algorithm works on.

Algorithms never touch arrays directly: they ask a buffer for the bytes of a
range to send, for a place to receive a range into, and to reduce received
bytes into a range. :class:`HostBuffer` does this for a flat NumPy array; the
CUDA buffer (:mod:`numcoll.cuda.buffer`) does the same for device memory through host
staging, so every algorithm runs unchanged on both.
"""

from __future__ import annotations

from typing import Callable, Protocol

import numpy as np

__all__ = ["WorkBuffer", "HostBuffer", "ShareBuffer"]


class WorkBuffer(Protocol):
    count: int
    itemsize: int

    def send_view(self, start: int, count: int): ...
    def recv_view(self, start: int, count: int): ...
    def recv_done(self, start: int, count: int) -> None: ...
    def reduce_from(self, start: int, count: int, incoming) -> None: ...


class HostBuffer:
    """A flat, C-contiguous NumPy array.

    ``reduce`` is ``reduce(acc, x)``: combine ``x`` into ``acc`` in place
    (a compiled kernel; ``None`` for collectives that only move data).
    """

    __slots__ = ("array", "count", "itemsize", "dtype", "_reduce")

    def __init__(self, array: np.ndarray, reduce: Callable | None = None):
        if array.ndim != 1 or not array.flags.c_contiguous:
            raise ValueError("HostBuffer needs a flat C-contiguous array")
        self.array = array
        self.count = array.size
        self.itemsize = array.itemsize
        self.dtype = array.dtype
        self._reduce = reduce

    def send_view(self, start: int, count: int) -> np.ndarray:
        return self.array[start:start + count]

    def recv_view(self, start: int, count: int) -> np.ndarray:
        return self.array[start:start + count]

    def recv_done(self, start: int, count: int) -> None:
        """The bytes of ``recv_view(start, count)`` have arrived (nothing to do on the host)."""

    def reduce_from(self, start: int, count: int, incoming) -> None:
        # ``incoming`` is typically the received ZeroMQ frame itself: reducing
        # straight from it saves a copy into a scratch buffer.
        x = np.frombuffer(incoming, dtype=self.dtype, count=count)
        self._reduce(self.recv_view(start, count), x)


class ShareBuffer(HostBuffer):
    """A reduce-scatter's buffer on the host without a copy of the input: reads
    (``send_view``) come from ``array``, the whole flat input, which is never
    written; this rank's share, elements ``start:start + own.size``, is
    written into ``own`` (the output), which must hold the input's share on
    entry. Only for algorithms that write nothing but this rank's share and
    read each piece of it before writing it (``reduce_scatter_shared``).
    """

    __slots__ = ("own", "start")

    def __init__(self, array: np.ndarray, own: np.ndarray, start: int, reduce: Callable):
        super().__init__(array, reduce)
        self.own, self.start = own, start

    def recv_view(self, start: int, count: int) -> np.ndarray:
        at = start - self.start
        if at < 0 or at + count > self.own.size:
            raise ValueError(f"ShareBuffer: elements {start}..{start + count} are outside "
                             f"this rank's share {self.start}..{self.start + self.own.size}")
        return self.own[at:at + count]
