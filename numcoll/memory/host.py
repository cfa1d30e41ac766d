"""Host (NumPy) memory as the collectives use it: the twin of
:mod:`numcoll.cuda.memory` and :mod:`numcoll.cuda.buffer`.

- :class:`HostArrays` (one stateless instance, :data:`HOST`): the few
  operations a collective needs on its arrays -- flat views, copies,
  packing -- so each collective is written once for host and device memory;
- :class:`HostSteps`: a :class:`~numcoll.memory.reduction.Reduction` applied to
  NumPy arrays (load the local reduction, finish AVG, store the result);
- :class:`HostBuffer` (and :class:`ShareBuffer`): the work buffer an algorithm
  runs on (:class:`numcoll.algorithms.buffer.WorkBuffer`).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..kernels import cpu

__all__ = ["HOST", "HostArrays", "HostSteps", "HostBuffer", "ShareBuffer"]


class HostBuffer:
    """A flat, C-contiguous NumPy array.

    ``reduce`` is ``reduce(acc, x)``: combine ``x`` into ``acc`` in place
    (a compiled kernel; ``None`` for collectives that only move data).
    """

    __slots__ = ("array", "count", "itemsize", "dtype", "_reduce", "_trusted")

    def __init__(self, array: np.ndarray, reduce: Callable | None = None):
        if array.ndim != 1 or not array.flags.c_contiguous:
            raise ValueError("HostBuffer needs a flat C-contiguous array")
        self.array = array
        self.count = array.size
        self.itemsize = array.itemsize
        self.dtype = array.dtype
        self._reduce = reduce
        # The kernel's entry point without its argument checks, where the
        # kernel offers one: this buffer makes both operands itself (flat,
        # contiguous, of its dtype), and checks their alignment below.
        self._trusted = getattr(reduce, "unchecked", None) or reduce

    @property
    def plain_sum(self) -> bool:
        """Whether this buffer's reduction is ``acc[i] += x[i]`` alone (its
        kernel's ``plain_sum``): compiled code may add into its elements."""
        return getattr(self._reduce, "plain_sum", False)

    def send_view(self, start: int, count: int) -> np.ndarray:
        return self.array[start:start + count]

    def recv_view(self, start: int, count: int) -> np.ndarray:
        return self.array[start:start + count]

    def recv_done(self, start: int, count: int) -> None:
        """The bytes of ``recv_view(start, count)`` have arrived (nothing to do on the host)."""

    def reduce_from(self, start: int, count: int, incoming) -> None:
        # ``incoming`` is typically the received message itself: reducing
        # straight from it saves a copy into a scratch buffer.
        x = np.frombuffer(incoming, dtype=self.dtype, count=count)
        acc = self.recv_view(start, count)
        if x.flags.aligned:
            self._trusted(acc, x)
        else:
            self._reduce(acc, x)


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


class HostSteps:
    """A :class:`~numcoll.memory.reduction.Reduction` applied to NumPy arrays:
    the host twin of :class:`numcoll.cuda.memory.DeviceSteps`, with the same methods."""

    __slots__ = ("_red", "wire_dtype", "reduce")

    def __init__(self, red):
        self._red = red
        self.wire_dtype = red.wire_dtype
        #: acc = op(acc, x), elementwise, in the wire dtype: the plan's compiled kernel.
        self.reduce = red.kernel

    def to_wire(self, src: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """``src`` (any layout) as a flat wire-dtype array (a new one unless ``out``)."""
        red = self._red
        if out is None:
            out = np.empty(src.size, red.wire_dtype)
        if red.widen:
            cpu.widen_into(np.ascontiguousarray(src).reshape(-1), out)
        else:
            np.copyto(out, src.reshape(-1) if src.flags.c_contiguous else src.ravel())
        if red.factor is not None:
            np.multiply(out, red.factor, out=out)
        return out

    def load(self, arrays: list) -> tuple[np.ndarray, bool]:
        """The flat work buffer holding the local reduction of ``arrays``, and
        whether it *is* ``arrays[0]``'s memory (then results need no copy back)."""
        red = self._red
        first = arrays[0]
        if len(arrays) == 1 and not red.widen and first.flags.c_contiguous:
            work = first.reshape(-1)
            if red.factor is not None:
                np.multiply(work, red.factor, out=work)
            return work, True
        work = self.to_wire(first)
        if len(arrays) > 1:
            scratch = np.empty_like(work)
            for a in arrays[1:]:
                self.reduce(work, self.to_wire(a, scratch))
        return work, False

    def work_buffer(self, arrays: list) -> tuple[HostBuffer, bool]:
        """:meth:`load` as the buffer an algorithm reduces in (its ``array`` the
        flat work array), and whether that is ``arrays[0]``'s memory."""
        work, in_place = self.load(arrays)
        return HostBuffer(work, self.reduce), in_place

    def finish(self, work: np.ndarray) -> None:
        """Apply what comes after the sum (AVG's division)."""
        if self._red.divisor is not None and work.size:
            cpu.scale_into(work, self._red.divisor)

    def store(self, work: np.ndarray, out: np.ndarray) -> None:
        """Write the flat work buffer (or a slice of it) into ``out`` (any layout)."""
        red = self._red
        if red.widen:
            if out.flags.c_contiguous:
                cpu.narrow_into(work, out.reshape(-1))
            else:
                tmp = np.empty(out.size, red.dtype)
                cpu.narrow_into(work, tmp)
                np.copyto(out, tmp.reshape(out.shape))
        else:
            np.copyto(out, work.reshape(out.shape))


class HostArrays:
    """NumPy memory: flat views, copies and :class:`HostBuffer`."""

    is_device = False

    @staticmethod
    def contiguous(a) -> bool:
        return a.flags.c_contiguous

    @staticmethod
    def empty(count: int, dtype) -> np.ndarray:
        return np.empty(count, dtype)

    @staticmethod
    def flat(a: np.ndarray, copy_in: bool) -> np.ndarray:
        """``a``'s memory as a flat array, or a flat copy (filled from ``a`` if
        ``copy_in``) when ``a`` is not contiguous."""
        if a.flags.c_contiguous:
            return a.reshape(-1)
        return np.ascontiguousarray(a).reshape(-1) if copy_in else np.empty(a.size, a.dtype)

    @staticmethod
    def overlaps(a: np.ndarray, b: np.ndarray) -> bool:
        return bool(np.may_share_memory(a, b))

    @staticmethod
    def copy(a: np.ndarray) -> np.ndarray:
        return a.copy()

    @staticmethod
    def assign(dst: np.ndarray, src: np.ndarray) -> None:
        np.copyto(dst, src)

    @staticmethod
    def write(out: np.ndarray, flat: np.ndarray) -> None:
        np.copyto(out, flat.reshape(out.shape))

    @staticmethod
    def pack(arrays, buf: np.ndarray) -> None:
        """``arrays`` (one dtype) back to back at the start of ``buf``. A plain
        loop: a :class:`~numcoll.kernels.pack_plan.PackPlan` pays off only when
        reused (building one costs ~12 us for a single array, 37 us for 50 small
        ones, against 0.7 us and 24 us for this loop)."""
        start = 0
        for a in arrays:
            buf[start:start + a.size] = a.reshape(-1) if a.flags.c_contiguous else a.ravel()
            start += a.size

    @staticmethod
    def buffer(flat: np.ndarray, reduce=None) -> HostBuffer:
        return HostBuffer(flat, reduce)

    @staticmethod
    def steps(red) -> HostSteps:
        """The plan's steps on host memory (made once per plan: they hold no state)."""
        return red.host_steps

    @staticmethod
    def wrap(run):
        return run


#: The host memory (stateless, shared).
HOST = HostArrays()
