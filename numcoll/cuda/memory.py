"""Device memory for one collective: its stream, staging, temporaries, and
the reduction steps on the GPU.

:class:`DeviceArrays` is the device twin of
:class:`numcoll.memory.host.HostArrays`: the collectives call the same
few methods (``empty``, ``flat``, ``assign``, ``write``, ``pack``, ``buffer``,
``steps``) and never branch on where the arrays live. One instance serves
one call; everything it queues runs on its own stream, which is synchronised
before the Work completes (:meth:`DeviceArrays.wrap`).
"""

from __future__ import annotations

import numpy as np
from numba import cuda as _cuda

from ..dtypes import is_half
from . import kernels as cuda_kernels
from .. import config
from .buffer import DeviceBuffer
from .pinned_pool import POOL, StagingPool

__all__ = ["DeviceArrays", "DeviceSteps"]

from .device import _SIMULATED, _device_pointer, _new_event
# Bound once (see buffer.py): host code never goes through the numba.cuda module.
_device_array = _cuda.device_array
_new_stream = _cuda.stream
_U16 = np.dtype(np.uint16)
# The first elements of a filled array come from the host; the rest are
# doubled on the device (log2 copies instead of a host array of full size).
_FILL_SEED_COUNT = 1024


def _device_block(nbytes: int):
    return _device_array(nbytes, np.uint8)


#: The process's device temporaries (work buffers, widened copies, scratch),
#: handed out per call and kept for reuse: an allocation per call would cost
#: a cudaMalloc/cudaFree each time, and peers reading a rank's work buffer
#: through CUDA IPC open each allocation once (:mod:`.ipc`).
DEVICE_POOL = StagingPool(pin=_device_block,
                          idle_limit=lambda: config.get("cuda_device_idle_nbytes"))


def _bits(a):
    """float16/bfloat16 device arrays as uint16 (same layout), others as they are."""
    return a.view(_U16) if is_half(np.dtype(a.dtype)) else a


class DeviceArrays:
    """Where a device-array collective's memory comes from, and how it is copied.

    Made at the call, on the caller's thread, with the call's ``arrays``: for
    each stream those arrays are bound to (a Numba array's ``stream``:
    ``arr.bind(s)``, ``cuda.to_device(x, stream=s)``, or the stream a foreign
    array exported), an event is recorded there now, and the collective's
    stream waits for it, so work queued on those streams before the call
    comes first without the host waiting for it.
    """

    is_device = True

    def __init__(self, arrays=(), pool=POOL, device_pool=DEVICE_POOL):
        self._pool = pool
        self._device_pool = device_pool
        self._stream = None
        self._blocks: list[np.ndarray] = []
        self._device_blocks: list = []
        self._buffers: list[DeviceBuffer] = []
        self._after = []
        seen = set()
        for a in arrays:
            producer = getattr(a, "stream", 0)
            if producer and id(producer) not in seen:
                seen.add(id(producer))
                event = _new_event()
                event.record(producer)
                self._after.append(event)

    @property
    def stream(self):
        """The collective's stream (made on the thread that runs it, at first use).

        Everything this call queues goes through here, so here is where the
        staged buffers' results are queued back to the device first: whatever
        is queued next (a kernel reading the result, a copy out, the final
        synchronisation) runs after them (see :mod:`.buffer`)."""
        if self._stream is None:
            stream = _new_stream()
            for event in self._after:
                event.wait(stream)
            self._stream = stream
        for buf in self._buffers:
            buf.flush()
        return self._stream

    # -- lifecycle -------------------------------------------------------------------
    def wrap(self, run):
        """``run(comm, work)`` that completes only once the device holds the
        result: the stream is synchronised before the value is returned."""

        def run_on_device(comm, work):
            try:
                value = run(comm, work)
                if self._stream is not None:
                    self.stream.synchronize()       # the property flushes staged buffers
            except BaseException:
                self._close(reuse_staging=False)
                raise
            self._close(reuse_staging=True)
            return value

        return run_on_device

    def _close(self, reuse_staging: bool) -> None:
        blocks, self._blocks = self._blocks, []
        device_blocks, self._device_blocks = self._device_blocks, []
        self._buffers = []
        if not reuse_staging:
            # After a failure a zero-copy send may still hold a block, or a copy may
            # still be queued: let those blocks go with their last reference.
            try:
                if self._stream is not None:
                    self._stream.synchronize()
            except Exception:  # noqa: BLE001 - the collective's own error is raised
                pass
            return
        for block in blocks:
            self._pool.give(block)
        for block in device_blocks:
            self._device_pool.give(block)

    # -- memory ----------------------------------------------------------------------
    @staticmethod
    def contiguous(a) -> bool:
        return a.is_c_contiguous()

    def empty(self, count: int, dtype):
        """A device temporary of ``count`` elements, from :data:`DEVICE_POOL`
        (given back when the collective completes)."""
        dtype = np.dtype(dtype)
        nbytes = count * dtype.itemsize
        if not nbytes:
            return _device_array(count, dtype)
        block = self._device_pool.take(nbytes)
        self._device_blocks.append(block)
        return block[:nbytes].view(dtype)

    def flat(self, a, copy_in: bool):
        """``a``'s memory as a flat array, or a flat copy (filled from ``a`` if
        ``copy_in``) when ``a`` is not C-contiguous."""
        if a.is_c_contiguous():
            return a.reshape(a.size)
        flat = self.empty(a.size, a.dtype)
        if copy_in:
            self.assign(flat.reshape(a.shape), a)
        return flat

    @staticmethod
    def overlaps(a, b) -> bool:
        """Whether two device arrays' memory ranges (from first to last byte) meet."""
        if not a.size or not b.size:
            return False
        lo_a, lo_b = _device_pointer(a), _device_pointer(b)
        return lo_a < lo_b + b.nbytes and lo_b < lo_a + a.nbytes

    def copy(self, a):
        """A contiguous device copy of the contiguous ``a``, on the stream."""
        out = self.empty(a.size, a.dtype)
        self.assign(out, a)
        return out

    def assign(self, dst, src) -> None:
        """``dst[...] = src`` for same-shape device arrays of any layout, on the stream."""
        if dst.size == 0:
            return
        stream = self.stream        # first: staged buffers are flushed ahead of this copy
        # 16-bit floats are copied as their bits: Numba cannot type ml_dtypes'
        # bfloat16, and the simulator's copies lose it (to NumPy it is "V2").
        dst, src = _bits(dst), _bits(src)
        if dst.is_c_contiguous() and src.is_c_contiguous():
            dst.reshape(dst.size).copy_to_device(src.reshape(src.size), stream=stream)
        elif _SIMULATED:
            dst[...] = src
        else:
            # Numba's strided assignment kernel.
            dst.setitem((slice(None),) * dst.ndim, src, stream=stream)

    def write(self, out, flat) -> None:
        """Store the flat contiguous ``flat`` into ``out`` (any layout)."""
        self.assign(out, flat.reshape(out.shape))

    def pack(self, arrays, buf) -> None:
        """Copy ``arrays`` back to back into the flat ``buf``."""
        start = 0
        for a in arrays:
            self.assign(buf[start:start + a.size].reshape(a.shape), a)
            start += a.size

    def buffer(self, flat, reduce=None) -> DeviceBuffer:
        """The work buffer over the flat device array ``flat``; ``reduce``: a
        :class:`DeviceSteps`' ``reduce`` (the buffer applies its host twin)."""
        buf = DeviceBuffer(flat, self.stream, self._staging, reduce)
        self._buffers.append(buf)
        return buf

    def _staging(self, nbytes: int) -> np.ndarray:
        """A pinned block from the pool, given back when the collective completes."""
        block = self._pool.take(nbytes)
        self._blocks.append(block)
        return block

    def steps(self, red) -> DeviceSteps:
        return DeviceSteps(red, self)

    def filled(self, count: int, value, dtype):
        """A new device array of ``count`` copies of ``value``."""
        out = self.empty(count, dtype)
        seed = min(count, _FILL_SEED_COUNT)
        if seed:
            # From pageable memory: the call returns once the bytes are staged.
            cuda_kernels.to_device_async(np.full(seed, value, dtype), out[:seed], self.stream)
        done = seed
        while done < count:
            n = min(done, count - done)
            self.assign(out[done:done + n], out[:n])
            done += n
        return out


class _DeviceReduce:
    """``reduce(acc, x)``: acc = op(acc, x) on device arrays, queued on the
    collective's stream; ``host``: the same op's CPU kernel, which a staged
    :class:`DeviceBuffer` applies to the bytes in its host mirror."""

    __slots__ = ("_kernel", "_xp", "host")

    def __init__(self, red, xp):
        self._kernel, self._xp, self.host = red.kernel, xp, red.host_kernel

    def __call__(self, acc, x) -> None:
        self._kernel(acc, x, stream=self._xp.stream)


class DeviceSteps:
    """The steps of a :class:`~numcoll.memory.reduction.Reduction`, run on the device.

    Same methods and semantics as the host ones (``reduce``, ``to_wire``,
    ``load``, ``finish``, ``store``), queued on the collective's stream.
    """

    def __init__(self, red, xp: DeviceArrays):
        self._red = red
        self._xp = xp
        self.wire_dtype = red.wire_dtype
        #: acc = op(acc, x), elementwise, in the wire dtype, on the stream.
        self.reduce = _DeviceReduce(red, xp)
        self._factors = None

    def to_wire(self, src, out=None):
        """``src`` (any layout) as a flat wire-dtype device array (new unless ``out``)."""
        xp, red = self._xp, self._red
        if out is None:
            out = xp.empty(src.size, red.wire_dtype)
        if red.widen:
            cuda_kernels.widen_into(xp.flat(src, copy_in=True), out, xp.stream)
        else:
            xp.assign(out.reshape(src.shape), src)
        if red.factor is not None:
            self._premultiply(out)
        return out

    def load(self, arrays):
        """The flat work buffer holding the local reduction of ``arrays``, and
        whether it *is* ``arrays[0]``'s memory."""
        xp, first = self._xp, arrays[0]
        if len(arrays) == 1 and not self._red.widen and xp.contiguous(first):
            work = first.reshape(first.size)
            if self._red.factor is not None:
                self._premultiply(work)
            return work, True
        work = self.to_wire(first)
        if len(arrays) > 1:
            scratch = xp.empty(work.size, self.wire_dtype)
            for a in arrays[1:]:
                self.reduce(work, self.to_wire(a, scratch))
        return work, False

    def work_buffer(self, arrays):
        """:meth:`load` as the buffer an algorithm reduces in (its ``array`` the
        flat work array), and whether that is ``arrays[0]``'s memory."""
        work, in_place = self.load(arrays)
        return self._xp.buffer(work, self.reduce), in_place

    def finish(self, work) -> None:
        if self._red.divisor is not None and work.size:
            cuda_kernels.scale_into(work, self._red.divisor, self._xp.stream)

    def store(self, work, out) -> None:
        """Write the flat work buffer (or a slice of it) into ``out`` (any layout)."""
        xp, red = self._xp, self._red
        if not red.widen:
            xp.write(out, work)
        elif xp.contiguous(out):
            cuda_kernels.narrow_into(work, out.reshape(out.size), xp.stream)
        else:
            tmp = xp.empty(out.size, red.dtype)
            cuda_kernels.narrow_into(work, tmp, xp.stream)
            xp.write(out, tmp)

    def _premultiply(self, work) -> None:
        """work *= factor: a PRODUCT with an array of factors (exactly x * factor,
        where dividing by 1/factor would round twice)."""
        if not work.size:
            return
        if self._factors is None or self._factors.size < work.size:
            self._factors = self._xp.filled(work.size, self._red.factor, self.wire_dtype)
        self._red.multiply(work, self._factors[:work.size], stream=self._xp.stream)
