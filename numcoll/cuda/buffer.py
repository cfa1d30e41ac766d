"""The work buffer of device-array collectives: device memory staged through pinned host memory.

:class:`DeviceBuffer` implements the :class:`~numcoll.algorithms.buffer.WorkBuffer`
protocol that every algorithm is written against, for a flat C-contiguous
device array, so the algorithms run unchanged on device data:

* ``send_view(start, n)`` copies that range device -> host into the staging
  mirror, waits for the copy (the transport reads the bytes zero-copy) and
  returns the host view;
* ``recv_view(start, n)`` is the mirror's range, which the transport fills;
  ``recv_done(start, n)`` copies it host -> device, asynchronously;
* ``reduce_from(start, n, frame)`` copies the received bytes into the mirror,
  host -> device into a device scratch, and launches the reduction kernel
  into the range, asynchronously.

Why a mirror of the whole buffer (rather than a ring of segment slots): a
range of the mirror is only ever used for the same range of the device
buffer, so every rule that makes :class:`~numcoll.memory.host.HostBuffer` safe
holds unchanged -- a zero-copy send reads its range until it completes, and
the algorithms rewrite a range only after, causally, every send of it
completed. A ring of slots would need its own reasoning about which zero-copy
send still reads which slot. The cost is host memory equal to the buffer,
as Gloo's pinned copies of CUDA tensors; it comes from a process-wide pool
(:mod:`numcoll.cuda.pinned_pool`), so it is pinned once, not per call.

Overlap: every copy and kernel is queued on the collective's own stream;
the host thread waits for the stream only where it needs bytes on the host
(``send_view``), or before the host writes into a range of the mirror that
a queued host -> device copy may still be reading. So while the transport
moves one segment, the device copies or reduces the next, and a segment that
arrives is forwarded from the mirror without a copy back (the buffer tracks
which ranges of the mirror equal the device memory).
"""

from __future__ import annotations

from bisect import bisect_right, insort

import numpy as np
from numba import cuda as _cuda

from . import kernels as cuda_kernels

__all__ = ["DeviceBuffer"]

# More queued host->device copies than this are settled with one stream sync
# rather than tracked one by one.
_MAX_TRACKED_COPIES = 64


class _Ranges:
    """Disjoint [start, end) ranges, sorted: where the mirror equals the device."""

    __slots__ = ("_starts", "_ends")

    def __init__(self):
        self._starts: list[int] = []
        self._ends: dict[int, int] = {}

    def covers(self, start: int, end: int) -> bool:
        i = bisect_right(self._starts, start) - 1
        return i >= 0 and self._ends[self._starts[i]] >= end

    def discard(self, start: int, end: int) -> None:
        """Forget every range overlapping [start, end) (whole ranges: conservative)."""
        starts = self._starts
        i = max(0, bisect_right(starts, start) - 1)
        j = i
        while j < len(starts) and starts[j] < end:
            j += 1
        kept = []
        for s in starts[i:j]:
            if self._ends[s] > start:
                del self._ends[s]
            else:
                kept.append(s)
        starts[i:j] = kept

    def add(self, start: int, end: int) -> None:
        if start < end:
            self.discard(start, end)
            insort(self._starts, start)
            self._ends[start] = end


class DeviceBuffer:
    """A flat, C-contiguous device array, staged through a host mirror.

    Parameters
    ----------
    array : flat C-contiguous Numba device array
    stream : the numba.cuda stream every copy and kernel of this buffer runs on
    take_mirror : ``take_mirror(nbytes)`` -> host uint8 array of at least ``nbytes``
        bytes (pinned, from the pool); called at the first transfer, so a buffer
        the algorithm never touches (the root's own block in gather) takes none
    reduce : ``reduce(acc, x)`` on device arrays, queued on ``stream`` (None: no reductions)
    """

    __slots__ = ("array", "count", "itemsize", "dtype", "_stream", "_take_mirror", "_mirror",
                 "_reduce", "_scratch", "_fresh", "_reading")

    def __init__(self, array, stream, take_mirror, reduce=None):
        self.array = array
        self.count = array.size
        self.dtype = np.dtype(array.dtype)
        self.itemsize = self.dtype.itemsize
        self._stream = stream
        self._take_mirror = take_mirror
        self._mirror = None
        self._reduce = reduce
        self._scratch = None
        self._fresh = _Ranges()
        # (start, end) of host->device copies queued since the last stream sync:
        # the host must not write those ranges of the mirror until they ran.
        self._reading: list[tuple[int, int]] = []

    def send_view(self, start: int, count: int) -> np.ndarray:
        end = start + count
        host = self._host()[start:end]
        if count and not self._fresh.covers(start, end):
            cuda_kernels.to_host_async(self.array[start:end], host, self._stream)
            self._sync()
            self._fresh.add(start, end)
        return host

    def recv_view(self, start: int, count: int) -> np.ndarray:
        end = start + count
        self._before_host_writes(start, end)
        self._fresh.discard(start, end)
        return self._host()[start:end]

    def recv_done(self, start: int, count: int) -> None:
        end = start + count
        if count:
            cuda_kernels.to_device_async(self._host()[start:end], self.array[start:end],
                                         self._stream)
            self._reading.append((start, end))
            self._fresh.add(start, end)

    def reduce_from(self, start: int, count: int, incoming) -> None:
        end = start + count
        if not count:
            return
        host = self._host()[start:end]
        self._before_host_writes(start, end)
        # Through the pinned mirror, not straight from the frame: a copy from
        # pageable memory would be synchronous.
        host[...] = np.frombuffer(incoming, dtype=self.dtype, count=count)
        scratch = self._scratch_of(count)
        cuda_kernels.to_device_async(host, scratch, self._stream)
        self._reading.append((start, end))
        self._reduce(self.array[start:end], scratch)
        self._fresh.discard(start, end)

    # -- helpers --------------------------------------------------------------------
    def _host(self) -> np.ndarray:
        """The host mirror, as this buffer's dtype."""
        mirror = self._mirror
        if mirror is None:
            nbytes = self.count * self.itemsize
            block = self._take_mirror(nbytes) if nbytes else np.empty(0, np.uint8)
            mirror = self._mirror = block[:nbytes].view(self.dtype)
        return mirror

    def _sync(self) -> None:
        self._stream.synchronize()
        self._reading.clear()

    def _before_host_writes(self, start: int, end: int) -> None:
        """Wait for queued host->device copies that read [start, end) of the mirror."""
        reading = self._reading
        if len(reading) > _MAX_TRACKED_COPIES or any(s < end and start < e for s, e in reading):
            self._sync()

    def _scratch_of(self, count: int):
        """A device array of ``count`` elements to receive into before reducing."""
        if self._scratch is None or self._scratch.size < count:
            if self._scratch is not None:
                self._sync()      # the old scratch may still be read by a queued kernel
            self._scratch = _device_array(count, self.dtype)
        return self._scratch[:count]


# Bound once: host code never goes through the numba.cuda module while a
# simulated kernel may be running (the simulator swaps references to it).
_device_array = _cuda.device_array
