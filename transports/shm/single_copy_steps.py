"""A single-copy call's three phases in one compiled call.

The single-copy algorithms (:mod:`numcoll.algorithms.single_copy`) take two
steps of the shared arena around their copies: *where* (every rank publishes
the address and length of each range a peer reads or writes), the copies
(``process_vm_readv``/``writev``), and *done* (every rank publishes whether
its copies succeeded). :func:`exchange` takes all three in one call of
compiled code, the syscalls included (2 ranks, a repeated 64 KiB call:
60-70 us where step by step from Python, a ctypes call per copy, took
77-85), and publishes exactly the bytes the step-by-step path publishes, so
a rank here and a rank there meet at the same steps.

It does only the common case, and says where it stopped otherwise
(:data:`WHERE_OPEN`, :data:`COPIES_OPEN`, :data:`DONE_OPEN`): a peer slower
than the spin and yield phases, a peer whose *where* is not what this rank
expects, a copy the kernel refused or failed, a peer that published a
refusal. The caller then finishes the call step by step from that phase,
with the errors and messages of that path (a copy is only ever repeated
whole, into the same place: repeating it is harmless).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .arena import HEADER_NBYTES, _put, _wait
from .ring import _monotonic_ns

__all__ = ["READ", "WRITE", "DONE", "WHERE_OPEN", "COPIES_OPEN", "DONE_OPEN", "ARENA", "BEGIN",
           "STATES", "WHERE_HEADER_NBYTES", "exchange", "read_sum"]

#: A copy row's kind: read the peer's range into the local one, or write it.
READ, WRITE = 0, 1
#: Where the compiled call ended: every phase done and every rank's copies
#: made; the *where* step published but not seen complete; *where* complete,
#: the copies not (all) made; the *done* step published (empty: this rank's
#: copies were made) but not seen complete, or some rank published a refusal.
#: Or: rank 0's *where* said that this call goes through the arena (nothing
#: copied, no *done* step taken).
DONE, WHERE_OPEN, COPIES_OPEN, DONE_OPEN, ARENA = 0, 1, 2, 3, 4
#: :func:`_exchange` from its first phase (not going on with an earlier call's wait).
BEGIN = -1
#: :func:`exchange`'s answers for those, by name (callers above the transport
#: layer compare names, not this module's numbers).
STATES = ("done", "where", "copies", "verdict", "arena")
#: A *where*'s words: a magic word, the number of entries, rank 0's say
#: (non-zero: the arena, this time), a spare word, then an (address, nbytes)
#: pair per entry.
WHERE_HEADER_NBYTES = 32


def _vm_call(name: str):
    """An intrinsic calling libc's ``name`` (``process_vm_readv`` or
    ``process_vm_writev``) with one local and one remote iovec, given as the
    integer addresses of two (base, length) int64 pairs: the bytes copied, or
    -1. (Declared by name, as :mod:`.ring` declares ``sched_yield``, so the
    compiled code caches; a ctypes pointer would not.)"""

    @intrinsic
    def call(typingctx, pid, local_iov, remote_iov):
        sig = types.int64(pid, local_iov, remote_iov)

        def codegen(context, builder, sig, args):
            i64, ptr = ir.IntType(64), ir.IntType(8).as_pointer()
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(i64, [ir.IntType(32), ptr, i64, ptr, i64, i64]),
                name)
            pid_, local, remote = (context.cast(builder, a, t, types.int64)
                                   for a, t in zip(args, sig.args))
            one, zero = ir.Constant(i64, 1), ir.Constant(i64, 0)
            return builder.call(fn, [builder.trunc(pid_, ir.IntType(32)),
                                     builder.inttoptr(local, ptr), one,
                                     builder.inttoptr(remote, ptr), one, zero])

        return sig, codegen

    return call


_readv = _vm_call("process_vm_readv")
_writev = _vm_call("process_vm_writev")


@njit(nogil=True, cache=True)
def _copy(kind, pid, local, remote, nbytes, iov):
    """One whole copy of ``nbytes`` between ``local`` here and ``remote`` in
    ``pid`` (``kind``: READ or WRITE), repeating a partial one; True when
    every byte was copied."""
    done = 0
    while done < nbytes:
        iov[0], iov[1] = local + done, nbytes - done
        iov[2], iov[3] = remote + done, nbytes - done
        if kind == READ:
            got = _readv(pid, iov.ctypes.data, iov.ctypes.data + 16)
        else:
            got = _writev(pid, iov.ctypes.data, iov.ctypes.data + 16)
        if got <= 0:
            return False
        done += got
    return True


@njit(nogil=True, cache=True)
def read_sum(pids, peers, addresses, mine, scratch, piece, start):
    """Read each of ``peers``' ranges (at ``addresses``, one per peer, each
    as long as ``mine``) a piece of ``piece`` elements at a time into
    ``scratch`` (``piece`` elements a peer), and add each piece into ``mine``
    at once, in the order of ``peers``, while it is still in the cache; from
    element ``start``. Returns the elements of ``mine`` summed: ``mine.size``,
    or where a read failed (that piece not added: the caller repeats it, and
    learns why). (A sum only, the loop of the reduction kernels' SUM: this
    layer knows no kernels, and a kernel passed in would be compiled anew in
    every process, 0.5-1 s, where this one loads from Numba's disk cache.)"""
    iov = np.empty(4, np.int64)
    n, itemsize = mine.size, mine.itemsize
    for s in range(start, n, piece):
        m = min(piece, n - s)
        for k in range(peers.size):
            if not _copy(READ, pids[peers[k]], scratch[k * piece:].ctypes.data,
                         addresses[k] + s * itemsize, m * itemsize, iov):
                return s
        for k in range(peers.size):
            _add(mine[s:s + m], scratch[k * piece:k * piece + m])
    return n


@njit(nogil=True, cache=True)
def _add(acc, x):
    for i in range(acc.size):
        acc[i] += x[i]


@njit(nogil=True, cache=True)
def _where_of(region, first, stride, magic, peer):
    """Where ``peer``'s *where* lies in ``region`` (its payload's offset), or
    -1 if what it published is not a whole *where* of ``magic``."""
    at = first + peer * stride
    published = region[at:at + HEADER_NBYTES].view(np.int64)[3]
    at += HEADER_NBYTES
    if published < WHERE_HEADER_NBYTES:
        return -1
    words = region[at:at + 16].view(np.int64)
    if words[0] != magic or words[1] < 0 or published < WHERE_HEADER_NBYTES + 16 * words[1]:
        return -1
    return at


@njit(nogil=True, cache=True)
def _checked(region, first, stride, magic, copies):
    """True if rank 0 and every peer a row of ``copies`` names published a
    *where* of ``magic``, each with the row's entry, of the row's length."""
    if _where_of(region, first, stride, magic, 0) < 0:
        return False
    for i in range(copies.shape[0]):
        peer, entry, nbytes = copies[i, 1], copies[i, 2], copies[i, 4]
        at = _where_of(region, first, stride, magic, peer)
        if at < 0 or not 0 <= entry < region[at + 8:at + 16].view(np.int64)[0]:
            return False
        at += WHERE_HEADER_NBYTES + 16 * entry
        if region[at + 8:at + 16].view(np.int64)[0] != nbytes:
            return False
    return True


@njit(nogil=True, cache=True)
def _waited(ctrl, size, step, seq, s0, s1, spin_ns, yield_ns, deadline_ns):
    """True once every rank published ``step`` of this call within the spin
    and yield phases from now (and the deadline)."""
    now = _monotonic_ns()
    until = min(now + spin_ns + yield_ns, deadline_ns)
    return _wait(ctrl, size, step, seq, s0, s1, now + spin_ns, until) == -1


@njit(nogil=True, cache=True)
def _exchange(region, ctrl, rank, size, step, firsts, stride, seq, s0, s1, where, copies,
              pids, spin_ns, yield_ns, deadline_ns, begin=BEGIN):
    """See :func:`exchange`. ``begin``: BEGIN, or the state (WHERE_OPEN,
    DONE_OPEN) of an earlier call of this one on the same call and *where*
    ``step``, whose wait it goes on with (this rank's step is published)."""
    if begin == DONE_OPEN:
        return _done(region, ctrl, rank, size, step + 1, firsts, stride, seq, s0, s1, spin_ns,
                     yield_ns, deadline_ns, False)
    first = firsts[step & 1]
    if begin != WHERE_OPEN:
        _put(region, ctrl, rank, step, first + rank * stride, seq, s0, s1, where, where.size,
             where.size)
    if not _waited(ctrl, size, step, seq, s0, s1, spin_ns, yield_ns, deadline_ns):
        return WHERE_OPEN
    magic = where[:8].view(np.int64)[0]
    if not _checked(region, first, stride, magic, copies):
        return COPIES_OPEN
    said = first + HEADER_NBYTES + 16  # rank 0's say: copy, or the arena
    if region[said:said + 8].view(np.int64)[0] != 0:
        return ARENA
    iov = np.empty(4, np.int64)
    for i in range(copies.shape[0]):
        kind, peer, entry, local, nbytes = (copies[i, 0], copies[i, 1], copies[i, 2],
                                            copies[i, 3], copies[i, 4])
        if nbytes == 0:
            continue
        at = first + peer * stride + HEADER_NBYTES + WHERE_HEADER_NBYTES + 16 * entry
        remote = region[at:at + 8].view(np.int64)[0]
        if not _copy(kind, pids[peer], local, remote, nbytes, iov):
            return COPIES_OPEN
    return _done(region, ctrl, rank, size, step + 1, firsts, stride, seq, s0, s1, spin_ns,
                 yield_ns, deadline_ns, True)


@njit(nogil=True, cache=True)
def _done(region, ctrl, rank, size, step, firsts, stride, seq, s0, s1, spin_ns, yield_ns,
          deadline_ns, publish):
    """The *done* ``step``: published empty (``publish``: this rank's copies
    were made; else it was, by an earlier call), then waited for."""
    first = firsts[step & 1]
    if publish:
        _put(region, ctrl, rank, step, first + rank * stride, seq, s0, s1, region[:0], 0, 0)
    if not _waited(ctrl, size, step, seq, s0, s1, spin_ns, yield_ns, deadline_ns):
        return DONE_OPEN
    for q in range(size):
        if region[first + q * stride:first + q * stride + HEADER_NBYTES].view(np.int64)[3]:
            return DONE_OPEN
    return DONE


def exchange(arena, seq: int, stamps: tuple, where: np.ndarray, copies: np.ndarray,
             pids: np.ndarray, deadline_ns: int) -> tuple[str, int]:
    """The three phases of a single-copy call over ``arena`` (a
    :class:`~transports.shm.arena.SharedArena`): publish ``where`` (uint8:
    the *where* words), make every copy of ``copies`` (int64 rows ``(kind,
    peer, entry, local address, nbytes)``: READ or WRITE ``nbytes`` between
    ``local`` and the address of entry ``entry`` of ``peer``'s *where*), then
    publish an empty *done*. ``pids[q]``: rank ``q``'s pid; ``stamps``: the
    call's stamp as two words. Returns ``(state, step)``: ``"done"``, or the
    phase the caller finishes from (:data:`STATES`: ``"where"``, ``"copies"``,
    ``"verdict"``; see the module docstring), or ``"arena"``: rank 0 said so in
    its *where* (the caller runs the call through the arena); ``step``
    is the *where* step (the *done* step is the next one). The arena's step
    count is advanced past every step published."""
    region, ctrl, firsts, stride, spin_ns, yield_ns = arena.layout()
    step = arena.next_step
    state = _exchange(region, ctrl, arena.rank, arena.size, step, firsts, stride, seq,
                      stamps[0], stamps[1], where, copies, pids, spin_ns, yield_ns, deadline_ns)
    arena.advance(step + (0 if state in (WHERE_OPEN, COPIES_OPEN, ARENA) else 1))
    return STATES[state], step
