"""The work buffer of device-array collectives: the whole device buffer staged in pinned host memory.

:class:`DeviceBuffer` implements the :class:`~numcoll.algorithms.buffer.WorkBuffer`
protocol that every algorithm is written against, for a flat C-contiguous
device array, so the algorithms run unchanged on device data. It does so as
Gloo does for CUDA tensors, with whole buffers:

* at the first use, asynchronous copies bring the whole device array into a
  pinned host mirror (device -> host, on the collective's stream) in a fixed
  number of pieces (``cuda_staging_pieces``), each followed by an event; a
  protocol call waits only for the pieces it touches, so the host algorithm
  sends and reduces the first pieces while the later ones are still copying;
* every protocol call is then the host's: :class:`~numcoll.memory.host.HostBuffer`
  over the mirror, sends zero-copy from it, receives into it, and reduces in it
  with the op's compiled CPU kernel (the host path's own reduction: bfloat16
  and float16 widened to float32 before, rounded once after, exactly as there);
* :meth:`DeviceBuffer.flush` queues one asynchronous copy of the whole mirror
  back to the device (host -> device), if anything was written into it.

So the Python work a call spends on the device is a few copies and waits, as
many whatever the size: no copy, slice or kernel launch per segment (the host
algorithm's own per-segment steps remain, as on host arrays; each asks only
whether its piece has arrived).

Who flushes: :class:`~numcoll.cuda.memory.DeviceArrays`, which made the
buffer, before it queues anything else on the stream (a kernel that reads
the result, a copy out, the final synchronisation): the copy back is then
ahead of every reader on the stream, and the algorithms, which never see
the stream, need not know.

Why safe: a piece of the mirror is read or written by the algorithm only
after its event has passed, so no copy from the device lands on bytes the
algorithm sent or wrote; the mirror is written only by the algorithm, on this
thread, before the flush is queued (the flush follows every piece's copy on
the stream); a flush that is still queued when the algorithm writes
the mirror again (a buffer used by two algorithm runs) is waited for first. The
transport reads a zero-copy send from the mirror until the send completes,
and every algorithm completes its sends before it returns; the block goes
back to the pool only after the stream is synchronised.
"""

from __future__ import annotations

import numpy as np

from .. import config
from ..memory.host import HostBuffer
from . import ipc
from . import kernels as cuda_kernels
from .device import _new_event

__all__ = ["DeviceBuffer"]


class DeviceBuffer:
    """A flat, C-contiguous device array, staged whole through a pinned host mirror.

    Parameters
    ----------
    array : flat C-contiguous Numba device array
    stream : the numba.cuda stream the two copies run on
    take_mirror : ``take_mirror(nbytes)`` -> host uint8 array of at least ``nbytes``
        bytes (pinned, from the pool); called at the first use, so a buffer
        the algorithm never touches (the root's own block in gather) takes none
    reduce : ``reduce(acc, x)`` on device arrays of the buffer's dtype, whose
        ``host`` attribute is the same op's CPU kernel (the staged mirror
        reduces with it), or None for collectives that only move data
    """

    __slots__ = ("array", "count", "itemsize", "dtype", "_stream", "_take_mirror", "_host",
                 "_reduce", "_device_reduce", "_dirty", "_queued", "_piece_count",
                 "_arrivals")

    def __init__(self, array, stream, take_mirror, reduce=None):
        self.array = array
        self.count = array.size
        self.dtype = np.dtype(array.dtype)
        self.itemsize = self.dtype.itemsize
        self._stream = stream
        self._take_mirror = take_mirror
        self._host: HostBuffer | None = None
        # reduce(acc, x) on device arrays, queued on the stream; its .host twin
        # reduces NumPy arrays (the staged mirror).
        self._device_reduce = reduce
        self._reduce = None if reduce is None else reduce.host
        self._dirty = False     # the mirror holds bytes the device does not
        self._queued = False    # a flush may still be reading the mirror
        self._piece_count = 0   # elements per piece of the copy into the mirror
        self._arrivals = None   # per piece, its event until the host has waited for it

    # -- the WorkBuffer protocol: the host's, on the mirror -------------------------
    def send_view(self, start: int, count: int) -> np.ndarray:
        host = self._staged()
        if self._arrivals is not None:
            self._arrived(start, count)
        return host.send_view(start, count)

    def recv_view(self, start: int, count: int) -> np.ndarray:
        host = self._writing()
        if self._arrivals is not None:
            self._arrived(start, count)     # else the piece's copy could land on the message
        return host.recv_view(start, count)

    def recv_done(self, start: int, count: int) -> None:
        """Nothing to do: the whole mirror goes back in :meth:`flush`."""

    def reduce_from(self, start: int, count: int, incoming) -> None:
        host = self._writing()
        if self._arrivals is not None:
            self._arrived(start, count)
        host.reduce_from(start, count, incoming)

    # -- staging --------------------------------------------------------------------
    @property
    def staged(self) -> bool:
        """Whether the mirror was taken (the algorithm used this buffer)."""
        return self._host is not None

    def flush(self) -> None:
        """Queue the copy of the mirror back into the device array, if it was written."""
        if self._dirty:
            self._dirty = False
            self._queued = True
            cuda_kernels.to_device_async(self._host.array, self.array, self._stream)

    def _staged(self) -> HostBuffer:
        host = self._host
        if host is None:
            nbytes = self.count * self.itemsize
            block = self._take_mirror(nbytes) if nbytes else np.empty(0, np.uint8)
            mirror = block[:nbytes].view(self.dtype)
            if nbytes:
                self._fetch(mirror, nbytes)
            host = self._host = HostBuffer(mirror, self._reduce)
        return host

    def _fetch(self, mirror: np.ndarray, nbytes: int) -> None:
        """Queue the copy of the device array into ``mirror``, piece by piece,
        an event after each (:meth:`_arrived` waits for them)."""
        pieces = max(1, min(config.get("cuda_staging_pieces"),
                            nbytes // config.get("cuda_staging_piece_min_nbytes")))
        per = self._piece_count = -(-self.count // pieces)
        arrivals = []
        for start in range(0, self.count, per):
            end = min(start + per, self.count)
            cuda_kernels.to_host_async(self.array[start:end], mirror[start:end], self._stream)
            event = _new_event()
            event.record(self._stream)
            arrivals.append(event)
        self._arrivals = arrivals

    def _arrived(self, start: int, count: int) -> None:
        """Wait until the pieces holding elements ``start:start + count`` are in the mirror."""
        arrivals, per = self._arrivals, self._piece_count
        last = min((start + max(count, 1) - 1) // per, len(arrivals) - 1)
        waited = False
        for i in range(start // per, last + 1):
            event = arrivals[i]
            if event is not None:
                event.synchronize()
                arrivals[i] = None
                waited = True
        if waited and all(event is None for event in arrivals):
            self._arrivals = None       # everything is here: no more questions

    def _writing(self) -> HostBuffer:
        host = self._staged()
        if self._queued:            # a flush queued earlier may still read the mirror
            self._stream.synchronize()
            self._queued = False
        self._dirty = True
        return host

    # -- peers' device memory (the ``ipc`` algorithms) ------------------------------
    def peer_export(self) -> bytes:
        """What peers need to read this buffer in place (:func:`numcoll.cuda.ipc.describe`),
        once everything queued on it has run: peers read it as soon as they have this."""
        self._stream.synchronize()
        return ipc.describe(self.array)

    def peer_views(self, described: list, op: str) -> tuple[list, str | None]:
        """Each rank's buffer as a device array here (None for this rank's own,
        and for empty ones), from what every rank's :meth:`peer_export` said;
        and None, or why some peer's memory cannot be reached from here."""
        from ..errors import NumcollError

        try:
            return [None if data is None else ipc.PEERS.view(data, self.dtype, op, peer)
                    for peer, data in enumerate(described)], None
        except NumcollError as exc:
            return [], str(exc)

    def reduce_peers(self, peers: list, start: int, count: int) -> None:
        """Elements ``start:start + count`` := op(themselves, every peer's same
        elements), reading the peers' memory directly; done when this returns."""
        if count:
            acc = self.array[start:start + count]
            for other in peers:
                if other is not None:
                    self._device_reduce(acc, other[start:start + count])   # on the stream
        self._stream.synchronize()

    def copy_from_peers(self, peers: list, chunks: list) -> None:
        """Chunk r (``chunks[r] = (start, count)``) copied from rank r's buffer,
        for every peer r; done when this returns."""
        self.copy_peer_ranges(peers, [(r, start, start, count)
                                      for r, (start, count) in enumerate(chunks)])

    def copy_peer_ranges(self, peers: list, moves, wait: bool = True) -> None:
        """For each ``(r, src, dst, count)`` of ``moves``: elements ``dst:dst + count``
        of this buffer := elements ``src:src + count`` of rank r's buffer (device
        to device, on the stream). ``wait``: done when this returns; else only
        queued (a later call with ``wait``, or :meth:`settle`, on a buffer of
        the same stream finishes them)."""
        for r, src, dst, count in moves:
            other = peers[r]
            if other is not None and count:
                mine = self.array[dst:dst + count].view(np.uint8)
                mine.copy_to_device(other[src:src + count].view(np.uint8), stream=self._stream)
        if wait:
            self._stream.synchronize()

    def settle(self) -> None:
        """Wait until everything queued on this buffer's stream has run."""
        self._stream.synchronize()
