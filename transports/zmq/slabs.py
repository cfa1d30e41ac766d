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
that the sender creates and sizes, and the receiver maps, unlinks and
confirms through the store; the sender waits for that confirmation (the
store's deadline) before it uses, or forgets, the slab. So no rank can remove
a slab its peer has not mapped yet (a rank that finishes at once used to),
and once a group is made no name is left to leak. A slab the receiver cannot
find (its creator died) is no error: that peer's payloads travel through the
socket. A process killed mid-handshake can still leave a file behind: its
name carries the creator's pid (``numcoll-slab-{pid}-...``), and every later
group on the host removes the slabs whose creator is dead.
The sender reserves the slab's memory up front (``posix_fallocate``): on a
small ``/dev/shm`` that fails cleanly, the sender publishes ``none`` for that
peer, and payloads to it simply keep travelling through the socket — instead
of a SIGBUS when a sparse file's page could not be backed later.

A slab is created ``0600`` with ``O_EXCL``, and the receiver maps only a
file whose name is one SharedSlabs makes, that is no link, belongs to this
user, is readable by no one else and is large enough: a name planted in the
store cannot make it map another user's file (whose owner could truncate it
under the mapping: a SIGBUS). A process of the same user still could; see the
threat model (docs/guide/security.md). What is refused is counted in ``refusals``.
"""

from __future__ import annotations

import mmap
import os
import re
import stat
import tempfile
import threading
import uuid
from collections import deque

import numpy as np

from ..base import Rendezvous
from ..endpoint import forget
from ..refusals import RefusalLog

__all__ = ["SharedSlabs"]

_SHM_DIR = "/dev/shm"
_NONE = b"none"
_MAPPED = b"mapped"
_PREFIX = "numcoll-slab-"
#: A slab's name: creator pid, a random token, sender and receiver rank.
_NAME = re.compile(r"numcoll-slab-(\d+)-[0-9a-f]{32}-\d+to\d+")


def _slab_dir() -> str:
    return _SHM_DIR if os.path.isdir(_SHM_DIR) and os.access(_SHM_DIR, os.W_OK) \
        else tempfile.gettempdir()


class SharedSlabs:
    """The slots this rank writes to each peer, and reads from each peer.

    Thread-safety: ``acquire``/``release`` may be called from any thread;
    ``write`` to a slot is done only by the thread that acquired it, and
    ``read`` of a slot only by the I/O thread that received its header.
    """

    def __init__(self, rank: int, size: int, store: Rendezvous, slot_nbytes: int, slots: int,
                 refusals: RefusalLog | None = None):
        self.slot_nbytes = slot_nbytes
        self._refusals = refusals
        self._lock = threading.Lock()
        self._free: dict[int, deque[int]] = {}
        self._out: dict[int, mmap.mmap] = {}
        self._in: dict[int, mmap.mmap] = {}
        self._paths: list[str] = []
        self._slots = slots
        self._busy: dict[int, set[int]] = {}  # peer -> slots written, credit not back yet
        nbytes = slot_nbytes * slots
        directory = _slab_dir()
        reap_orphans(directory)
        token = uuid.uuid4().hex
        peers = [p for p in range(size) if p != rank]
        try:
            for peer in peers:
                path = os.path.join(directory, f"{_PREFIX}{os.getpid()}-{token}-{rank}to{peer}")
                if self._create(peer, path, nbytes):
                    store.set(f"shm/{rank}/{peer}", path.encode())
                else:
                    store.set(f"shm/{rank}/{peer}", _NONE)
            for peer in peers:
                path = store.get(f"shm/{peer}/{rank}")
                store.set(f"shm/{peer}/{rank}/state", _MAPPED if self._map(peer, path, nbytes)
                          else _NONE)
            for peer in peers:
                state = store.get(f"shm/{rank}/{peer}/state")  # its answer, slab or none
                if peer in self._out and state != _MAPPED:
                    self._out.pop(peer).close()  # it could not map it: use the socket
                # The peer has answered: neither key is read again, and a store
                # shared by many groups need not keep them.
                forget(store, f"shm/{rank}/{peer}/state")
                forget(store, f"shm/{rank}/{peer}")
                if peer in self._out:
                    self._free[peer] = deque(range(slots))
                    self._busy[peer] = set()
            # Every peer mapped (and unlinked) its slab, or never will: forget the names.
            for path in self._paths:
                _unlink(path)
            self._paths.clear()
        except BaseException:
            self.close()
            raise

    def _map(self, peer: int, path: bytes, nbytes: int) -> bool:
        """Map the slab ``peer`` made for us and unlink its name; False if there is none."""
        if path == _NONE:
            return False
        path = path.decode()
        if _NAME.fullmatch(os.path.basename(path)) is None:
            return self._refuse(peer, "not a slab's name", path)  # never open it
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:  # its creator is gone: nothing will come through it
            return False
        except OSError as exc:  # a link (ELOOP), or not ours to read
            return self._refuse(peer, "slab not openable", f"{path}: {exc.strerror}")
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
                return self._refuse(peer, "slab not this user's private file",
                                    f"{path}: uid {st.st_uid}, mode {st.st_mode & 0o7777:o}")
            if st.st_size < nbytes:
                return self._refuse(peer, "slab too small", f"{path}: {st.st_size} bytes")
            self._in[peer] = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        _unlink(path)  # mapped: the name is no longer needed by anyone
        return True

    def _refuse(self, peer: int, reason: str, detail: str) -> bool:
        if self._refusals is not None:
            self._refusals.refuse(reason, f"rank {peer}", detail)
        return False

    def _create(self, peer: int, path: str, nbytes: int) -> bool:
        """Create and reserve the slab towards ``peer``; False if there is no room."""
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_RDWR, 0o600)
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
            if not free:
                return None
            slot = free.popleft()
            self._busy[peer].add(slot)
            return slot

    def release(self, peer: int, slot: int) -> bool:
        """``peer`` has copied slot ``slot`` out: it may be written again.
        False (nothing changes) unless ``slot`` was in flight to ``peer``: a
        second credit for one slot must never let two payloads share it."""
        with self._lock:
            busy = self._busy.get(peer)
            if busy is None or slot not in busy:
                return False
            busy.discard(slot)
            self._free[peer].append(slot)
            return True

    def readable(self, peer: int, slot: int, nbytes: int) -> bool:
        """Whether a header naming ``slot`` of ``peer``'s slab for ``nbytes`` is possible."""
        return peer in self._in and 0 <= slot < self._slots and 0 <= nbytes <= self.slot_nbytes

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
            self._busy.clear()


def reap_orphans(directory: str) -> list[str]:
    """Remove the slabs in ``directory`` whose creating process is dead (it
    was killed before its peer could map them); returns their paths."""
    reaped = []
    try:
        names = os.listdir(directory)
    except OSError:
        return reaped
    for name in names:
        match = _NAME.fullmatch(name)
        if match is None or _alive(int(match.group(1))):
            continue
        path = os.path.join(directory, name)
        _unlink(path)
        reaped.append(path)
    return reaped


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's, or not a pid: leave it
        return True
    return True


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
