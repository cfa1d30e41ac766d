"""Single-copy reads: a rank reads a peer's memory where it lies (CMA).

The ``single_copy`` capability of :class:`~transports.shm.transport.ShmRingTransport`.
Linux's cross-memory attach (``process_vm_readv``, since 3.2) copies bytes
from another process's address space into this one's in one kernel copy,
with no memory shared beforehand: a collective can read a peer's *plain*
array (any NumPy array, not only one allocated in shared memory) straight
into its own output -- one copy where the shared arena needs two (into the
arena, out of it). Open MPI's shared-memory transport does the same
(``btl_vader_single_copy_mechanism = cma``). ``process_vm_writev`` copies the
other way, into a range the peer published for it; the kernel checks it as
it checks the read (:meth:`SingleCopy.write`).

Who may read whom
    The kernel lets a process read another's memory when it could ptrace
    it: the same user (and the target dumpable), and, with the Yama LSM,
    what ``/proc/sys/kernel/yama/ptrace_scope`` allows:

    - absent or 0: any process of the same user;
    - 1 (*restricted*): only an ancestor, or the one process the target
      named with ``prctl(PR_SET_PTRACER, pid)``. A rank of a two-rank group
      names its one peer -- the pid the kernel reported for the peer's
      socket at the rendezvous (``SO_PEERCRED``, checked against the pid the
      peer published: :mod:`transports.shm.rendezvous`), never "any
      process". Yama keeps a single named tracer per process, so a group of
      three or more ranks (or a second group naming another peer) cannot
      be served this way: those groups use the arena, and say why;
    - 2 or 3 (admin-only, or none): never; the arena.

    A seccomp filter (some container runtimes) or a peer in another pid
    namespace refuse it too.
Agreement
    Whether the group reads single-copy must be the same answer on every
    rank (every rank must choose the same algorithm). At set-up the ranks
    take two steps of the shared arena (:meth:`SingleCopy.agree`): each
    publishes the address of a probe word and its value, reads every peer's
    word with ``process_vm_readv`` and compares it, then publishes its
    verdict; the group reads single-copy only if every verdict is yes, and
    otherwise every rank holds the same reason (:attr:`SingleCopy.refused`).
    A read that fails later (``EPERM``: another group re-named this
    process's tracer) raises :class:`SingleCopyRefused`; the algorithms
    then finish the call through the arena, and every rank marks the reads
    failed (:meth:`SingleCopy.refuse`: later reads fail at once, so later
    calls go straight to the arena). The *choice* keeps reading
    :attr:`~SingleCopy.refused` only, the set-up's answer: a call is chosen
    on the caller's thread, maybe before an earlier call ran, and ranks must
    never choose differently.
Lifetime
    Nothing is kept but the peers' pids: no memory, file or descriptor.
    The ``PR_SET_PTRACER`` grant lasts as long as the process (a later
    group's grant replaces it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import threading

import numpy as np

from ..base import SingleCopyRefused, TransportError
from . import single_copy_steps
from .arena import _stamp_cache, _stamp_words

__all__ = ["SingleCopy", "SingleCopyRefused", "ptrace_scope"]

#: Where the Yama LSM publishes its ptrace scope (absent without Yama).
YAMA_SCOPE_PATH = "/proc/sys/kernel/yama/ptrace_scope"
PR_SET_PTRACER = 0x59616D61  # "Yama"
#: Marks the probe step's payload (b"ncsingle" as a little-endian word).
_MAGIC = int.from_bytes(b"ncsingle", "little")
#: The probe steps' sequence number and stamp (no collective uses sequence 0).
PROBE_SEQ = 0
PROBE_STAMP = b"numcoll/cma-prob"
#: A verdict's reason is at most this many bytes (UTF-8) in the arena.
_REASON_NBYTES = 512


class _IOVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _libc():
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        for call in (lib.process_vm_readv, lib.process_vm_writev):
            call.restype = ctypes.c_ssize_t
            call.argtypes = [ctypes.c_int, ctypes.POINTER(_IOVec), ctypes.c_ulong,
                             ctypes.POINTER(_IOVec), ctypes.c_ulong, ctypes.c_ulong]
        lib.prctl.restype = ctypes.c_int
        lib.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                              ctypes.c_ulong]
        return lib
    except (OSError, AttributeError):
        return None


_LIBC = _libc()


def _process_vm_readv(pid: int, local: int, remote: int, nbytes: int) -> int:
    """One ``process_vm_readv`` of ``nbytes`` from ``remote`` in ``pid`` to
    ``local`` here: the bytes read, or ``-errno``. (ctypes releases the GIL
    for the call.)"""
    lv, rv = _IOVec(local, nbytes), _IOVec(remote, nbytes)
    got = _LIBC.process_vm_readv(pid, ctypes.byref(lv), 1, ctypes.byref(rv), 1, 0)
    return got if got >= 0 else -ctypes.get_errno()


def _process_vm_writev(pid: int, local: int, remote: int, nbytes: int) -> int:
    """One ``process_vm_writev`` of ``nbytes`` from ``local`` here to ``remote``
    in ``pid``: the bytes written, or ``-errno``. (The kernel allows it where
    it allows the read: the same ptrace check.)"""
    lv, rv = _IOVec(local, nbytes), _IOVec(remote, nbytes)
    got = _LIBC.process_vm_writev(pid, ctypes.byref(lv), 1, ctypes.byref(rv), 1, 0)
    return got if got >= 0 else -ctypes.get_errno()


def ptrace_scope() -> int | None:
    """Yama's ptrace scope (0 to 3), or None where Yama is absent."""
    try:
        with open(YAMA_SCOPE_PATH) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _errno_text(code: int) -> str:
    return f"{errno.errorcode.get(code, str(code))} ({os.strerror(code)})"


class SingleCopy:
    """Single-copy reads from the peers of one group (see the module docstring).

    Parameters
    ----------
    rank, size : int
        This rank and the group size.
    pids : dict[int, int]
        Every peer's pid as the kernel reported it for the peer's socket at the
        rendezvous (0: not visible from this pid namespace).

    Attributes
    ----------
    refused : str or None
        Why the group does not read single-copy (the same on every rank once
        :meth:`agree` returned); None where it does. The choice reads this.
    failed : str or None
        Why reads failed in a call since (see :meth:`refuse`); None while they work.
    """

    def __init__(self, rank: int, size: int, pids: dict[int, int]):
        self.rank, self.size = rank, size
        self._pids = dict(pids)
        self._pid_words = np.array([self._pids.get(q, 0) for q in range(size)], np.int64)
        #: What the algorithms above learn about this group's copies and keep
        #: with it (rank 0's times of single copy and of the arena, by kind of
        #: call): theirs, never read here.
        self.tuning: dict = {}
        self.refused: str | None = "not agreed yet"
        self.failed: str | None = None
        self._lock = threading.Lock()

    @property
    def pid_words(self) -> np.ndarray:
        """The ranks' pids as int64 words, in rank order: what compiled copies
        (:func:`.single_copy_steps.exchange`) name their peers by."""
        return self._pid_words

    # -- set-up ----------------------------------------------------------------------
    def _allow_peers(self) -> str | None:
        """Let exactly this group's peers read this process (Yama scope 1), or
        say why this rank cannot read single-copy."""
        if _LIBC is None:
            return "libc's process_vm_readv cannot be loaded"
        if any(pid <= 0 for pid in self._pids.values()):
            return "a peer runs in another pid namespace (its pid is not visible here)"
        scope = ptrace_scope()
        if scope in (2, 3):
            return (f"Yama's ptrace_scope is {scope} ({YAMA_SCOPE_PATH}): only an administrator "
                    "may read another process's memory")
        if scope == 1:
            if self.size != 2:
                return (f"Yama's ptrace_scope is 1 ({YAMA_SCOPE_PATH}): a process may name one "
                        f"reader, and this group has {self.size - 1} peers")
            (peer_pid,) = self._pids.values()
            if _LIBC.prctl(PR_SET_PTRACER, peer_pid, 0, 0, 0) != 0:
                return f"prctl(PR_SET_PTRACER) failed: {_errno_text(ctypes.get_errno())}"
        return None

    def agree(self, arena, deadline: float | None) -> str | None:
        """Find out, with every rank, whether the group reads single-copy: two
        steps of ``arena`` (the group's shared arena), every rank at once.
        Sets and returns :attr:`refused`. Raises the arena's errors (a peer
        that dies or does not come)."""
        why = self._allow_peers()
        probe = np.frombuffer(os.urandom(8), np.int64).copy()
        words = np.array([_MAGIC, probe.ctypes.data, int(probe[0]), why is None], np.int64)
        step = arena.step(words.view(np.uint8), PROBE_SEQ, PROBE_STAMP, deadline, PROBE_SEQ)
        if why is None:
            got = np.zeros(1, np.int64)
            for peer in range(self.size):
                if peer == self.rank:
                    continue
                theirs = np.frombuffer(arena.view(step, peer, 0, words.nbytes), np.int64)
                if theirs[0] != _MAGIC or not theirs[3]:
                    continue  # that rank says why itself
                n = _process_vm_readv(self._pids[peer], got.ctypes.data, int(theirs[1]), 8)
                if n < 0:
                    why = (f"rank {self.rank} cannot read rank {peer}'s memory (pid "
                           f"{self._pids[peer]}): process_vm_readv failed with "
                           f"{_errno_text(-n)}")
                    break
                if got[0] != theirs[2]:
                    why = (f"rank {self.rank} read another word than rank {peer} published "
                           f"from pid {self._pids[peer]}")
                    break
        # The verdict: every peer has finished reading our probe word once it
        # published this step, so the probe may go when the step is done.
        verdict = np.zeros(_REASON_NBYTES, np.uint8)
        text = (why or "").encode()[:_REASON_NBYTES]
        verdict[:len(text)] = np.frombuffer(text, np.uint8)
        step = arena.step(verdict, PROBE_SEQ, PROBE_STAMP, deadline, PROBE_SEQ)
        reasons = [bytes(arena.view(step, r, 0, _REASON_NBYTES)).rstrip(b"\0").decode(
            errors="replace") for r in range(self.size)]
        del probe
        self.refused = next((r for r in reasons if r), None)
        return self.refused

    # -- reading -----------------------------------------------------------------------
    def read(self, peer: int, address: int, out: np.ndarray) -> None:
        """Copy ``out.nbytes`` bytes from ``address`` in ``peer``'s memory into
        ``out`` (C-contiguous, writable). Raises :class:`SingleCopyRefused`
        when the kernel refuses (the caller falls back), :class:`TransportError`
        for anything else (the peer's buffer is not mapped: a bug, never a
        peer's choice)."""
        self._copy(_process_vm_readv, "process_vm_readv", "from", peer, address, out)

    def write(self, peer: int, address: int, data: np.ndarray) -> None:
        """:meth:`read`'s other direction: copy ``data`` (C-contiguous) to
        ``address`` in ``peer``'s memory (a range the peer published for it)."""
        self._copy(_process_vm_writev, "process_vm_writev", "to", peer, address, data)

    def _copy(self, syscall, name: str, way: str, peer: int, address: int, here) -> None:
        why = self.refused or self.failed
        if why is not None:
            raise SingleCopyRefused(f"single-copy copies are off on this group: {why}", peer)
        nbytes = here.nbytes
        local = here.ctypes.data
        done = 0
        while done < nbytes:  # the kernel may copy less than asked (a partial copy)
            n = syscall(self._pids[peer], local + done, address + done, nbytes - done)
            if n <= 0:
                code = -n if n < 0 else errno.EIO
                message = (f"rank {self.rank}: {name} of {nbytes - done} bytes {way} rank "
                           f"{peer} (pid {self._pids[peer]}) failed with {_errno_text(code)}")
                if code in (errno.EPERM, errno.EACCES, errno.ENOSYS, errno.ESRCH):
                    raise SingleCopyRefused(message, peer)
                raise TransportError(message, peer)
            done += n

    def read_sum(self, peers: np.ndarray, addresses: np.ndarray, mine: np.ndarray,
                 scratch: np.ndarray, piece: int, start: int) -> int:
        """Read ``peers``' ranges at ``addresses`` a piece at a time, adding each
        piece into ``mine`` from element ``start``, in one compiled call
        (:func:`.single_copy_steps.read_sum`). Returns the elements summed;
        fewer than ``mine.size`` where a read failed or copies are off on
        this group: the caller goes on with :meth:`read`, which says why."""
        if not self.usable:
            return start
        return single_copy_steps.read_sum(self._pid_words, peers, addresses, mine, scratch,
                                          piece, start)

    def exchange(self, arena, seq: int, stamp: bytes, where: np.ndarray, copies: np.ndarray,
                 deadline: float | None) -> tuple[str, int] | None:
        """A single-copy call's *where* step, copies and *done* step in one
        compiled call (:func:`.single_copy_steps.exchange`: ``(state,
        step)``), or None -- nothing published -- where copies are off on
        this group (the caller takes every phase step by step, and learns why)."""
        if not self.usable:
            return None
        stamps = _stamp_cache.get(stamp) or _stamp_words(stamp)
        deadline_ns = 1 << 62 if deadline is None else int(deadline * 1e9)
        return single_copy_steps.exchange(arena, seq, stamps, where, copies, self._pid_words,
                                          deadline_ns)

    @property
    def usable(self) -> bool:
        """Whether the ranks may read each other now: agreed at set-up
        (``refused`` None) and no call has found a read refused since
        (``failed`` None). Every rank of the group sees the same answer."""
        return self.refused is None and self.failed is None

    def refuse(self, reason: str) -> bool:
        """A read was refused in a call (every rank calls this in the same call,
        having agreed on it there): later reads fail at once. True the first time."""
        with self._lock:
            if self.failed is not None:
                return False
            self.failed = reason
            return True
