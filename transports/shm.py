"""Shared-memory payload slots between the processes of one host.

The ``ipc`` transport sends every message header over ZeroMQ, in order, but a
payload of ``[zero_copy_nbytes, slot_nbytes]`` bytes can travel through shared
memory instead: the sender copies it into a free slot of the slab it owns for
that peer and sends a header naming the slot; the receiver copies it out
(straight into the posted buffer when there is one) and sends a credit back,
which frees the slot. One user-space copy on each side, instead of the two
kernel copies (plus one on ``recv_into``) of a Unix-domain socket — on a
2-core machine, copies are what limits collectives.

Each ordered pair (sender -> receiver) has one slab: a file in ``/dev/shm``
that the sender creates and sizes, and the receiver maps and unlinks right
away, so nothing is left behind even if a process crashes after the
handshake (the sender also unlinks on close, in case the peer never came).
The sender reserves the slab's memory up front (``posix_fallocate``): on a
small ``/dev/shm`` that fails cleanly, the sender publishes ``none`` for that
peer, and payloads to it simply keep travelling through the socket — instead
of a SIGBUS when a sparse file's page could not be backed later.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import threading
import uuid
from collections import deque

import numpy as np

from .base import Rendezvous

__all__ = ["SharedSlabs"]

_SHM_DIR = "/dev/shm"
_NONE = b"none"


def _slab_dir() -> str:
    return _SHM_DIR if os.path.isdir(_SHM_DIR) and os.access(_SHM_DIR, os.W_OK) \
        else tempfile.gettempdir()


class SharedSlabs:
    """The slots this rank writes to each peer, and reads from each peer.

    Thread-safety: ``acquire``/``release`` may be called from any thread;
    ``write`` to a slot is done only by the thread that acquired it, and
    ``read`` of a slot only by the I/O thread that received its header.
    """

    def __init__(self, rank: int, size: int, store: Rendezvous, slot_nbytes: int, slots: int):
        self.slot_nbytes = slot_nbytes
        self._lock = threading.Lock()
        self._free: dict[int, deque[int]] = {}
        self._out: dict[int, mmap.mmap] = {}
        self._in: dict[int, mmap.mmap] = {}
        self._paths: list[str] = []
        nbytes = slot_nbytes * slots
        directory = _slab_dir()
        token = uuid.uuid4().hex
        try:
            for peer in range(size):
                if peer == rank:
                    continue
                path = os.path.join(directory, f"numcoll-{token}-{rank}to{peer}")
                if self._create(peer, path, nbytes):
                    self._free[peer] = deque(range(slots))
                    store.set(f"shm/{rank}/{peer}", path.encode())
                else:
                    store.set(f"shm/{rank}/{peer}", _NONE)
            for peer in range(size):
                if peer == rank:
                    continue
                path = store.get(f"shm/{peer}/{rank}").decode()
                if path == _NONE.decode():
                    continue  # that peer sends us everything through the socket
                fd = os.open(path, os.O_RDONLY)
                try:
                    self._in[peer] = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ)
                finally:
                    os.close(fd)
                _unlink(path)  # mapped: the name is no longer needed by anyone
        except BaseException:
            self.close()
            raise

    def _create(self, peer: int, path: str, nbytes: int) -> bool:
        """Create and reserve the slab towards ``peer``; False if there is no room."""
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        self._paths.append(path)
        try:
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError:  # no room (ENOSPC) or no fallocate here: use the socket
                _unlink(path)
                self._paths.remove(path)
                return False
            self._out[peer] = mmap.mmap(fd, nbytes)
            return True
        finally:
            os.close(fd)

    def has_slab(self, peer: int) -> bool:
        """Whether payloads to ``peer`` can use shared memory at all."""
        return peer in self._out

    # -- sender side -------------------------------------------------------------
    def acquire(self, peer: int) -> int | None:
        """A free slot towards ``peer``, or None if all are in flight."""
        with self._lock:
            free = self._free.get(peer)
            return free.popleft() if free else None

    def release(self, peer: int, slot: int) -> None:
        """``peer`` has copied slot ``slot`` out: it may be written again."""
        with self._lock:
            free = self._free.get(peer)
            if free is not None:
                free.append(slot)

    def write(self, peer: int, slot: int, data: memoryview) -> None:
        # NumPy releases the GIL for a large copy; a memoryview slice assignment would not.
        dst = np.frombuffer(self._out[peer], np.uint8, data.nbytes, slot * self.slot_nbytes)
        dst[...] = np.frombuffer(data, np.uint8)

    # -- receiver side -----------------------------------------------------------
    def read(self, peer: int, slot: int, nbytes: int, into: memoryview | None) -> memoryview:
        """Copy the payload in ``peer``'s slot into ``into``, or into a new buffer."""
        src = np.frombuffer(self._in[peer], np.uint8, nbytes, slot * self.slot_nbytes)
        if into is None:
            return memoryview(src.copy()).toreadonly()
        np.frombuffer(into, np.uint8)[...] = src
        return into

    def close(self) -> None:
        """Unmap everything and remove any slab file a peer never took."""
        for path in self._paths:
            _unlink(path)
        self._paths.clear()
        for m in (*self._out.values(), *self._in.values()):
            try:
                m.close()
            except BufferError:  # a view is still alive somewhere: the GC unmaps it later
                pass
        self._out.clear()
        self._in.clear()
        with self._lock:
            self._free.clear()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
