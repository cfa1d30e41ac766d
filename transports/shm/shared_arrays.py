"""Shared arrays: memory every rank of a ``shm`` group maps, allocated together.

The ``shared_memory`` capability of :class:`~transports.shm.transport.ShmRingTransport`
(the protocol: :class:`transports.base.SharedMemory`). An *allocation* gives
every rank a part of the same size: its own anonymous memory file, which it
hands to every peer exactly as it hands them its rings' file -- over the
checked rendezvous of :mod:`transports.shm.rendezvous` (the peer's user and
pid, the token when one is set), sealed against any change of size before it
travels and mapped by a peer only once its seals and size are checked
(:mod:`transports.shm.region`). So every rank maps every rank's part, and a
collective can read (or write) a peer's array where it lies: one copy where
messages need two (MPI's CMA / XPMEM single-copy paths).

Allocations are collective: every rank of the group allocates the same
number of bytes, in the same order (the n-th allocation of a group is
number ``n`` on every rank, its key). Each rank first publishes its size in
the group's store and compares the others', so ranks that disagree fail
with both sizes named instead of a failed handshake.

Lifetime
    A part is a memory file without a name (``memfd_create``), whose
    descriptors are closed as soon as every peer has mapped it: nothing can
    be left behind, not in ``/dev/shm``, not after SIGKILL. The memory lives
    while some process maps it. :meth:`Allocation.release` (the owner's
    array was dropped) and :meth:`SharedMemory.close` (the group ends) drop
    this rank's mappings of the peers' parts; its own part stays mapped for
    as long as the caller's arrays view it.
"""

from __future__ import annotations

import bisect
import mmap
import os
import threading
import time

import numpy as np

from ..base import Rendezvous, TransportError
from ..endpoint import Prefixed
from ..refusals import RefusalLog
from .region import create_region
from .rendezvous import connect_peers

__all__ = ["SharedMemory", "Allocation", "ALIGN"]

#: Parts are at least this long, in multiples of it (cache lines; any dtype's alignment).
ALIGN = 64
#: Store key of a rank's size for allocation ``key``.
SIZE_KEY = "shared/{key}/nbytes/{rank}"


class Allocation:
    """One allocation, ``key`` its number in the group: ``parts[r]`` is rank
    ``r``'s part (uint8, ``nbytes`` long) for every peer ``r``; this rank's own
    part is :meth:`take`-n once by the caller, and held here only weakly, so
    that it is unmapped when the caller's arrays are gone."""

    def __init__(self, key: int, nbytes: int, rank: int, maps: list[mmap.mmap]):
        self.key, self.nbytes, self.rank = key, nbytes, rank
        self._maps = [None if r == rank else m for r, m in enumerate(maps)]
        self.parts = [None if r == rank else np.frombuffer(m, np.uint8, nbytes)
                      for r, m in enumerate(maps)]
        self._own = np.frombuffer(maps[rank], np.uint8, nbytes)
        #: Where this rank's part starts in its address space.
        self.address = self._own.__array_interface__["data"][0]

    def take(self) -> np.ndarray:
        """This rank's own part (uint8): every view the caller makes of it keeps
        it mapped; once they are all gone, call :meth:`SharedMemory.release`."""
        own, self._own = self._own, None
        return own

    def release(self) -> None:
        """Drop this rank's mappings of the peers' parts (unmapped once no view
        of them remains)."""
        for m in self._maps:
            if m is not None:
                try:
                    m.close()
                except BufferError:  # a collective's view is alive: the GC unmaps it
                    pass
        self.parts = [None] * len(self.parts)
        self._maps = []


class SharedMemory:
    """The allocations of one group's ``shm`` transport (see the module docstring).

    ``store``, ``token``, ``refusals`` and ``timeout_s`` are the transport's:
    an allocation's rendezvous is checked like the transport's own.
    """

    def __init__(self, rank: int, size: int, store: Rendezvous, *, token: bytes | None,
                 refusals: RefusalLog, timeout_s: float):
        self.rank, self.size = rank, size
        self._store, self._token, self._refusals = store, token, refusals
        self.timeout_s = timeout_s
        self._count = 0
        self._live: dict[int, Allocation] = {}
        self._starts: list[int] = []  # sorted start addresses of this rank's parts
        self._by_start: dict[int, Allocation] = {}
        self._lock = threading.Lock()
        self._closed = False

    def allocate(self, nbytes: int) -> Allocation:
        """A new allocation of ``nbytes`` per rank: collective (every rank, the
        same size, in the same order). Raises :class:`TransportError` when a
        rank asks for another size, ``TimeoutError`` when one does not come."""
        if self._closed:
            raise TransportError(f"rank {self.rank}'s transport was closed", None)
        key = self._count
        self._count += 1
        deadline = time.monotonic() + self.timeout_s
        store = Prefixed(self._store, f"shared/{key}/")
        peers = [p for p in range(self.size) if p != self.rank]
        store.set(f"nbytes/{self.rank}", str(nbytes).encode())
        for p in peers:
            theirs = int(store.get(f"nbytes/{p}"))
            if theirs != nbytes:
                raise TransportError(f"shared memory #{key}: rank {p} allocates {theirs} bytes, "
                                     f"rank {self.rank} {nbytes}: every rank must ask for the "
                                     "same shape and dtype", p)
        file_nbytes = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        fd, mine = create_region(self.rank, file_nbytes)
        try:
            links = connect_peers(self.rank, self.size, store, fd,
                                  settings=(file_nbytes, self.size, 0),
                                  region_nbytes=lambda peer: file_nbytes, token=self._token,
                                  deadline=deadline, refusals=self._refusals) if peers else {}
        except BaseException:
            mine.close()
            raise
        finally:
            os.close(fd)  # every peer that needs it holds its own mapping now
        store.delete_key(f"nbytes/{self.rank}")  # every peer read it before connecting
        maps = []
        for r in range(self.size):
            if r == self.rank:
                maps.append(mine)
                continue
            link = links[r]
            link.out_sock.close()  # liveness is the transport's business, not ours
            link.in_sock.close()
            maps.append(link.region)
        allocation = Allocation(key, nbytes, self.rank, maps)
        with self._lock:
            self._live[key] = allocation
            bisect.insort(self._starts, allocation.address)
            self._by_start[allocation.address] = allocation
        return allocation

    def find(self, address: int, nbytes: int) -> tuple[int, int] | None:
        """``(key, offset)`` of this rank's part holding bytes ``address`` to
        ``address + nbytes``, or None."""
        starts = self._starts
        i = bisect.bisect_right(starts, address) - 1
        if i < 0:
            return None
        allocation = self._by_start.get(starts[i])
        if allocation is None:
            return None
        offset = address - allocation.address
        return (allocation.key, offset) if offset + nbytes <= allocation.nbytes else None

    def part(self, key: int, rank: int) -> np.ndarray | None:
        """Peer ``rank``'s part of allocation ``key`` (uint8), None if this
        rank has released it (or never had it)."""
        allocation = self._live.get(key)
        return None if allocation is None else allocation.parts[rank]

    def release(self, key: int) -> None:
        """This rank is done with allocation ``key`` (its array was dropped)."""
        with self._lock:
            allocation = self._live.pop(key, None)
            if allocation is None:
                return
            self._starts.remove(allocation.address)
            del self._by_start[allocation.address]
        allocation.release()

    def __len__(self) -> int:
        return len(self._live)

    def close(self) -> None:
        """Release every allocation (the group ends). Idempotent."""
        self._closed = True
        for key in list(self._live):
            self.release(key)
