"""The shared arena of the ``shm`` transport: one synchronisation per step for
collectives whose ranks share memory.

Rings (:mod:`transports.shm.transport`) move messages between pairs of ranks. The
arena is for the collective algorithms that want what only shared memory
offers: every rank writing its contribution once, where every other rank can
read it, and each rank then reading (and reducing) straight from the others'
memory, with no message and no copy out first (the ``shared`` algorithms of
:mod:`numcoll.algorithms.shared`). It is the design of the shared-memory
allreduce Intel contributed to DeepSpeed and Gloo (copy in, publish a flag,
wait for the peers' flags, read), kept free of its two flaws: nobody spins in
a helper thread (the waiting thread polls, as the rings' waiters do), and the
flags rely only on acquire/release ordering, written as such (correct on
weakly ordered CPUs).

Layout (in rank 0's region, after its rings; rank 0 owns the memory, every
rank writes only its own parts)
    ``size`` control lines of 128 bytes: word 0 of line ``r`` is rank
    ``r``'s *step count*, the number of steps it has published (monotonic);
    words 1-3 and 4-6 are the sequence number and 16-byte stamp of the call
    whose step rank ``r`` last published in set 0 and in set 1.
    Then two *sets* of ``size`` slots: slot ``(s, r)`` is a 64-byte header
    (the call's sequence number, its 16-byte stamp, the payload size) and
    ``slot_nbytes`` of payload, written only by rank ``r``.

A step (:meth:`SharedArena.put` then :meth:`SharedArena.wait`)
    Step ``t`` uses set ``t % 2``. Rank ``r`` writes its header and payload
    into its slot of that set with plain stores, then publishes ``t + 1``
    with a *release* store of its step count; it waits until every rank's
    count, read with *acquire* loads, reaches ``t + 1``, and then reads any
    slot of the set. Release/acquire makes the slot's bytes visible before
    the count that announces them, on any CPU.
Why two sets and no closing barrier
    Rank ``r`` may overwrite its slot of set ``t % 2`` at step ``t`` once
    every peer has finished reading it at step ``t - 2``. Rank ``r`` reached
    step ``t`` by seeing every peer's count at ``t`` (end of step ``t - 1``),
    and a peer publishes step ``t - 1`` only after it finished step ``t - 2``,
    reads included (the release store orders those loads before it). So the
    wait that ends one step is also the barrier that frees the set two steps
    back: one synchronisation per step, as DeepSpeed's three-state flags.
Agreement
    Each step carries the call's sequence number and stamp (see
    :meth:`numcoll.call.Call.stamp`); a rank compares every peer's with its
    own after the wait, so ranks running different calls fail with
    :class:`~transports.base.StampMismatch` instead of reading each other's
    bytes. The waiters read them from the peers' control lines, which they
    just loaded the step counts from (the slot's header holds them too, for
    the error's report): the check costs no second transfer of a line
    between cores (2 ranks on the 2-core VM: a barrier's compiled step took
    0.50-0.51 us, 0.52-0.53 reading the slots' headers). A set's own words
    keep a slow reader's step ``t`` apart from its writer's step ``t + 1``,
    as the slots are kept apart. The step counts must agree too: every rank
    runs the same number of steps per call, in the same order (the caller's
    job: steps are taken in sequence-number order, see
    ``ProcessGroup._execute``).
Waiting, and dead peers
    The waiter spins without the GIL (``pause``), then polls with
    ``sched_yield``, as the rings' waiters do (the transport's ``spin_us`` and
    ``yield_us``), then sleeps between polls (backing off to
    :data:`SLEEP_MAX_S`), so an idle rank does not burn a core. Between
    polls it checks the transport: a peer whose process ended is known to the
    transport's helper within milliseconds (its socket's EOF), and the wait
    fails with :class:`~transports.base.PeerClosed` naming it; a peer that
    sent ring messages of another call at this sequence number fails it with
    ``StampMismatch``; the deadline fails it with
    :class:`~transports.base.TransportTimeout` naming the first rank that has
    not published.
"""

from __future__ import annotations

import struct
import time
from typing import Callable

import numpy as np
from numba import njit

from ..base import (
    PeerClosed,
    StampMismatch,
    TransportClosed,
    TransportError,
    TransportTimeout,
)
from .ring import (
    _cpu_relax,
    _load_acquire,
    _memcpy,
    _monotonic_ns,
    _sched_yield,
    _store_release,
)

__all__ = ["SharedArena", "arena_nbytes"]

#: One control line per rank (128 bytes: the adjacent-line prefetcher pairs 64-byte lines).
LINE_WORDS = 16
#: Where in a control line the call's sequence number and stamp are (three
#: words for each set of slots, after the step count).
CALL_WORDS = 1
#: Slot header: sequence number, stamp (two words), payload bytes; padded to 64 bytes.
HEADER_NBYTES = 64
#: A stamp longer than this cannot travel in a header (numcoll's are 16 bytes).
STAMP_NBYTES = 16
#: After the yield phase, the waiter sleeps between polls, doubling up to this.
SLEEP_MIN_S = 50e-6
SLEEP_MAX_S = 1e-3
#: How often (seconds) a slow wait drains the rings to look for a mismatching call.
MISMATCH_POLL_S = 5e-3


def arena_nbytes(size: int, slot_nbytes: int) -> int:
    """Bytes of the arena of a group of ``size`` with ``slot_nbytes`` per slot."""
    return size * LINE_WORDS * 8 + 2 * size * (HEADER_NBYTES + slot_nbytes)


@njit(nogil=True, cache=True)
def _put(region, ctrl, rank, step, header, seq, stamp0, stamp1, payload, copy_nbytes, nbytes):
    """Write the header and the first ``copy_nbytes`` of ``payload`` into this
    rank's slot, then publish ``step + 1``."""
    words = region[header:header + HEADER_NBYTES].view(np.int64)
    words[0] = seq
    words[1] = stamp0
    words[2] = stamp1
    words[3] = nbytes
    if copy_nbytes > 0:
        _memcpy(region, header + HEADER_NBYTES, payload, 0, copy_nbytes)
    # The call's identity again, in this rank's control line (the set's own
    # words), where the waiters read it: on the line they load the step count
    # from, so checking it costs them no second transfer between cores.
    line = rank * LINE_WORDS + CALL_WORDS + 3 * (step & 1)
    ctrl[line] = seq
    ctrl[line + 1] = stamp0
    ctrl[line + 2] = stamp1
    _store_release(ctrl, rank * LINE_WORDS, step + 1)


@njit(nogil=True, cache=True)
def _wait(ctrl, size, step, seq, stamp0, stamp1, spin_until_ns, yield_until_ns):
    """Poll until every rank has published ``step + 1``, then compare headers.

    Returns -1 when done and every header agrees; ``r >= 0`` when rank ``r``
    (the first behind) has not published by ``yield_until_ns``; ``-2 - r``
    when rank ``r``'s header names another call.
    """
    target = step + 1
    r = 0
    i = 0
    now = 0
    while r < size:
        if _load_acquire(ctrl, r * LINE_WORDS) >= target:
            r += 1
            continue
        if (i & 15) == 0:
            now = _monotonic_ns()
            if now >= yield_until_ns:
                return r
        i += 1
        if now < spin_until_ns:
            _cpu_relax()
        else:
            _sched_yield()
    parity = CALL_WORDS + 3 * (step & 1)
    for p in range(size):
        line = p * LINE_WORDS + parity
        if ctrl[line] != seq or ctrl[line + 1] != stamp0 or ctrl[line + 2] != stamp1:
            return -2 - p
    return -1


@njit(nogil=True, cache=True)
def _step(region, ctrl, rank, size, step, header, seq, stamp0, stamp1, payload, copy_nbytes,
          nbytes, spin_until_ns, yield_until_ns):
    """:func:`_put` then :func:`_wait`, in one call (what :meth:`SharedArena.step` runs)."""
    _put(region, ctrl, rank, step, header, seq, stamp0, stamp1, payload, copy_nbytes, nbytes)
    return _wait(ctrl, size, step, seq, stamp0, stamp1, spin_until_ns, yield_until_ns)


class SharedArena:
    """The arena of one rank (see the module docstring); implements
    :class:`transports.base.Arena`.

    Parameters
    ----------
    region : numpy.ndarray
        Rank 0's region (uint8, mapped by every rank), the arena at byte ``offset``.
    rank, size, slot_nbytes : int
    spin_ns, yield_ns : int
        How long a wait busy-polls, then polls with ``sched_yield``, before it
        sleeps between polls.
    peer_left : callable
        ``peer_left(peer)``: the error to raise if this rank's transport closed
        or ``peer`` left (a :class:`~transports.base.TransportError`), else None.
    conflicting_call : callable
        ``conflicting_call(peer, call, stamp)``: the stamp of a point-to-point
        message ``peer`` sent for call ``call`` that is not ``stamp``, or None.
    """

    def __init__(self, region: np.ndarray, offset: int, rank: int, size: int,
                 slot_nbytes: int, *, spin_ns: int, yield_ns: int,
                 peer_left: Callable[[int], TransportError | None],
                 conflicting_call: Callable[[int, int, bytes], bytes | None]):
        self.rank = rank
        self.size = size
        #: Payload bytes a rank can contribute per step.
        self.slot_nbytes = slot_nbytes
        self._spin_ns, self._yield_ns = spin_ns, yield_ns
        self._peer_left = peer_left
        self._conflicting_call = conflicting_call
        ctrl_nbytes = size * LINE_WORDS * 8
        self._region = region[offset:offset + arena_nbytes(size, slot_nbytes)]
        self._ctrl = self._region[:ctrl_nbytes].view(np.int64)
        self._stride = HEADER_NBYTES + slot_nbytes
        self._first_header = (ctrl_nbytes, ctrl_nbytes + size * self._stride)
        self._payloads = [[self._region[h + r * self._stride + HEADER_NBYTES:
                                        h + (r + 1) * self._stride]
                           for r in range(size)] for h in self._first_header]
        self._headers = [[self._region[h + r * self._stride:
                                       h + r * self._stride + HEADER_NBYTES].view(np.int64)
                          for r in range(size)] for h in self._first_header]
        #: Steps this rank has published (equal on every rank between calls):
        #: a word that the fused steps (numcoll.fast) advance from compiled
        #: code too (:meth:`step_word`), read and written here through a
        #: memoryview (a Python int either way, in 25 ns).
        self._steps = np.zeros(1, np.int64)
        self._step = memoryview(self._steps)

    # -- one step ------------------------------------------------------------------
    @property
    def next_step(self) -> int:
        """The step this rank publishes next (see :meth:`mine`)."""
        return self._step[0]

    def step_word(self) -> np.ndarray:
        """The one-word array holding :attr:`next_step`, for compiled code that
        publishes steps itself and advances it there (the caller keeps the
        array alive while it uses its address)."""
        return self._steps

    def layout(self) -> tuple:
        """``(region, ctrl, first_headers, stride, spin_ns, yield_ns)``: what a
        compiled step that publishes and waits as :meth:`step` does needs
        (``first_headers[s]``: the offset of set ``s``'s first header). Such a
        caller advances :attr:`next_step` itself (:meth:`advance`)."""
        if self._region is None:
            raise TransportClosed(f"rank {self.rank}'s transport was closed", None)
        return (self._region, self._ctrl, self._first_header, self._stride,
                self._spin_ns, self._yield_ns)

    def advance(self, step: int) -> None:
        """A compiled step published ``step`` (see :meth:`layout`)."""
        self._step[0] = step + 1

    def mine(self, step: int) -> np.ndarray:
        """This rank's payload of ``step`` (uint8, writable): fill it, then
        :meth:`put` with ``payload=None`` and the bytes written."""
        return self._open(self._payloads)[step & 1][self.rank]

    def put(self, payload: np.ndarray | None, seq: int, stamp: bytes,
            nbytes: int | None = None) -> int:
        """Publish this rank's part of the next step under ``seq`` and ``stamp``:
        ``payload`` (uint8, copied into the slot), or with ``payload=None`` the
        first ``nbytes`` (default 0) already written into :meth:`mine`. At
        most ``slot_nbytes``. Returns the step, for :meth:`wait` and :meth:`view`."""
        step = self._step[0]
        if self._region is None:
            raise TransportClosed(f"rank {self.rank}'s transport was closed", None)
        nbytes = self._nbytes_of(payload, nbytes)
        s0, s1 = _stamp_words(stamp)
        header = self._first_header[step & 1] + self.rank * self._stride
        _put(self._region, self._ctrl, self.rank, step, header, seq, s0, s1,
             _EMPTY if payload is None else payload, 0 if payload is None else nbytes,
             nbytes)
        self._step[0] = step + 1
        return step

    def nbytes(self, step: int, rank: int) -> int:
        """The payload size ``rank`` published for ``step``."""
        return int(self._open(self._headers)[step & 1][rank][3])

    def wait(self, step: int, seq: int, stamp: bytes, deadline: float | None,
             call: int | None = None) -> None:
        """Return once every rank has published ``step`` with the same ``seq``
        and ``stamp``; raise StampMismatch, PeerClosed, TransportClosed or
        TransportTimeout (see the module docstring). ``call``: the call's key
        in ring tags (``tag >> CALL_SHIFT``), to catch a peer that runs
        another call over the rings at this sequence number."""
        s0, s1 = _stamp_words(stamp)
        # Local references: close() may drop the arena's meanwhile (the mapping
        # stays alive while they do).
        region, ctrl = self._region, self._ctrl
        if region is None:
            raise TransportClosed(f"rank {self.rank}'s transport was closed", None)
        spin_until, until = self._spin_deadlines(deadline)
        got = _wait(ctrl, self.size, step, seq, s0, s1, spin_until, until)
        if got != -1:
            self._wait_slowly(got, step, seq, stamp, deadline, call)

    def step(self, payload: np.ndarray | None, seq: int, stamp: bytes, deadline: float | None,
             call: int | None = None, nbytes: int | None = None) -> int:
        """:meth:`put` then :meth:`wait`, in one compiled call while every rank
        publishes within the spin (the common case). Returns the step."""
        step = self._step[0]
        region, ctrl = self._region, self._ctrl
        if region is None:
            raise TransportClosed(f"rank {self.rank}'s transport was closed", None)
        if payload is not None and payload.size <= self.slot_nbytes:  # the busy case, inline
            nbytes = payload.size
        else:
            nbytes = self._nbytes_of(payload, nbytes)
        s0, s1 = _stamp_cache.get(stamp) or _stamp_words(stamp)
        first = self._first_header[step & 1]
        spin_until = time.monotonic_ns() + self._spin_ns
        until = spin_until + self._yield_ns
        if deadline is not None:
            until = min(until, int(deadline * 1e9))
        got = _step(region, ctrl, self.rank, self.size, step, first + self.rank * self._stride,
                    seq, s0, s1, _EMPTY if payload is None else payload,
                    0 if payload is None else nbytes, nbytes, spin_until, until)
        self._step[0] = step + 1
        if got != -1:
            self._wait_slowly(got, step, seq, stamp, deadline, call)
        return step

    def _nbytes_of(self, payload: np.ndarray | None, nbytes: int | None) -> int:
        """The bytes a step publishes: ``payload``'s, else ``nbytes`` (default 0),
        at most a slot."""
        if payload is not None:
            nbytes = payload.size
        elif nbytes is None:
            nbytes = 0
        if nbytes > self.slot_nbytes:
            raise ValueError(f"shared arena: {nbytes} bytes exceed the {self.slot_nbytes}-byte slot")
        return nbytes

    def _spin_deadlines(self, deadline: float | None) -> tuple[int, int]:
        """(end of the busy spin, end of the yield phase), in monotonic ns."""
        spin_until = time.monotonic_ns() + self._spin_ns
        until = spin_until + self._yield_ns
        if deadline is not None:
            until = min(until, int(deadline * 1e9))
        return spin_until, until

    def _wait_slowly(self, got: int, step: int, seq: int, stamp: bytes,
                     deadline: float | None, call: int | None) -> None:
        """The rest of :meth:`wait` once the spin and yield phases found rank
        ``got`` behind (or, ``got < -1``, a header of another call): sleep
        between polls, checking the peer, the rings and the deadline."""
        s0, s1 = _stamp_words(stamp)
        region, ctrl, headers = self._region, self._ctrl, self._headers
        if region is None:
            raise TransportClosed(f"rank {self.rank}'s transport was closed", None)
        sleep_s = SLEEP_MIN_S
        next_mismatch_poll = 0.0
        while True:
            if got == -1:
                return
            if got < -1:
                peer = -2 - got
                theirs = headers[step & 1][peer]
                raise StampMismatch(
                    f"shared-memory step on rank {self.rank}: rank {peer} published another "
                    "call", peer, stamp, theirs[1:3].tobytes(), remote_seq=int(theirs[0]))
            peer = got
            left = self._peer_left(peer)
            if left is not None:
                # The peer may have published, finished this step and closed
                # (its last call) since the poll that found it behind: look
                # again before blaming it.
                now = time.monotonic_ns()
                if _wait(ctrl, self.size, step, seq, s0, s1, now, now) == -1:
                    return
            if isinstance(left, PeerClosed):
                raise PeerClosed(f"shared-memory step on rank {self.rank}: {left}", peer)
            if left is not None:
                raise left
            now_s = time.monotonic()
            if call is not None and now_s >= next_mismatch_poll:
                next_mismatch_poll = now_s + MISMATCH_POLL_S
                theirs = self._conflicting_call(peer, call, stamp)
                if theirs is not None:
                    raise StampMismatch(
                        f"shared-memory step on rank {self.rank}: rank {peer} sent messages "
                        "of another call at this sequence number", peer, stamp, theirs)
            if deadline is not None and now_s >= deadline:
                raise TransportTimeout(
                    f"shared-memory step on rank {self.rank}: rank {peer} did not publish "
                    f"step {step}", peer, 0, "recv", 0.0)
            time.sleep(sleep_s)
            sleep_s = min(sleep_s * 2, SLEEP_MAX_S)
            # Look once (no spin), then sleep again, until the deadline.
            now = time.monotonic_ns()
            got = _wait(ctrl, self.size, step, seq, s0, s1, now, now)

    def view(self, step: int, rank: int, start: int = 0, nbytes: int | None = None) -> np.ndarray:
        """``rank``'s payload of ``step`` (uint8, read-only by convention), bytes
        ``start:start + nbytes``; valid until the step after next begins."""
        payload = self._open(self._payloads)[step & 1][rank]
        return payload[start:] if nbytes is None else payload[start:start + nbytes]

    def release(self) -> None:
        """Drop the views of the mapping (the transport is closing)."""
        self._region = self._ctrl = None
        self._payloads = self._headers = []

    def _open(self, views: list) -> list:
        if not views:
            raise TransportClosed(f"rank {self.rank}'s transport was closed", None)
        return views


_EMPTY = np.empty(0, np.uint8)
_STAMP_WORDS = struct.Struct("<qq")
_stamp_cache: dict[bytes, tuple[int, int]] = {}


def _stamp_words(stamp: bytes) -> tuple[int, int]:
    """A stamp as the two words of a header (cached: a call's stamp repeats)."""
    words = _stamp_cache.get(stamp)
    if words is None:
        if len(stamp) > STAMP_NBYTES:
            raise ValueError(f"shared arena: stamps are at most {STAMP_NBYTES} bytes")
        words = _STAMP_WORDS.unpack(stamp.ljust(STAMP_NBYTES, b"\0"))
        if len(_stamp_cache) < 4096:
            _stamp_cache[stamp] = words
    return words
