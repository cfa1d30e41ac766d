"""A small collective of one group, planned once and run as one compiled step.

:class:`FusedCall` holds everything a repeated small call needs -- the
arena's memory and layout, the call's stamp as two words, this rank's
payload, the reduction's code, the flight recorder's lane, all as one plan
of int64 words -- so that running it is one call into compiled code
(:mod:`numcoll.collectives.fused_step`) that checks the group's words
(nothing in flight or held, not poisoned or closed: the group keeps them
true under its lock, :func:`update_blocked`), takes the sequence number and
the arena's step from them, publishes, waits for the peers through the
arena's spin phase and combines. No Work, Comm, Future or Record is made,
and the group's lock is not taken: the compiled start holds the GIL from its
check to its return, so no other thread comes between its check and its
claim, and a call that did not end there stays *claimed* (a word every
other call waits on under the lock, :func:`settle`) until the group holds it.

The group stays in charge of order and failure. A fused call whose peers
are not there within the spin phase (or a persistent start, which only looks
once) is *held*: the group keeps it as ``_fast_held``, and the lock is let go
while it waits; any other
call submitted meanwhile (another thread's, or this thread's next
non-fused call) first *promotes* it (:func:`promote`): it
becomes an ordinary Work, with a record, an arena ticket and a place in the
in-flight table, and everything after it waits for it as for any call.
A fused call that does not finish within the arena's spin and yield phases
(a slow or dead peer, a mismatch, a message of an earlier call held in the
mailbox) is promoted too and finished by the group's ``_execute`` -- the
ordinary slow wait, error translation, poisoning and flight-recorder
states -- so failures read exactly as on the ordinary path.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from transports.shm.arena import _stamp_words

from ..collectives import fused_step
from ..work import Work

__all__ = ["HAS_GIL", "FusedCall", "fusable_dtype", "promote", "settle", "take_back",
           "update_blocked"]

#: Whether this interpreter has a GIL: a fused call's claim counts on it
#: (:meth:`FusedCall.run`), so a free-threaded build plans none.
HAS_GIL = getattr(sys, "_is_gil_enabled", lambda: True)()

#: dtypes the fused step reduces (others -- 16-bit floats, bool, complex -- keep
#: the ordinary path, whose kernels know them).
_DTYPES = frozenset(np.dtype(t) for t in (np.float32, np.float64, np.int8, np.int16, np.int32,
                                          np.int64, np.uint8, np.uint16, np.uint32, np.uint64))
_NOTHING = np.empty(0, np.uint8)
#: How long a persistent start waits for the peers (ns), at most the arena's
#: spin phase. Ranks in a loop start within a microsecond or two of each
#: other: a start that waits that long usually finishes the whole call, and
#: its wait() has nothing left to do -- one compiled call and one lock per
#: call instead of two and three. A start whose peers are later returns (it
#: never waits longer than this) and wait() finishes it.
START_SPIN_NS = 3000
#: How long a blocking fused call's start polls with ``sched_yield`` (ns) in
#: a group with more ranks than CPUs, whose arena does not spin: the ranks
#: sharing a CPU arrive within a few time slices of each other, and a start
#: that returns at once sends every call down the held path (a lock, a
#: second compiled call, 2-3 us more).
CROWDED_WAIT_NS = 50_000


def fusable_dtype(dtype) -> bool:
    """Whether the fused step reduces arrays of ``dtype``."""
    return dtype in _DTYPES


class FusedCall:
    """One small collective of group ``pg`` (its :class:`~numcoll.call.Call`
    ``call``) as a fused arena step.

    Parameters
    ----------
    pg : ProcessGroup
        The group (its transport has a shared arena).
    call : Call
        The call every run stamps (made by the ordinary builder, which checked
        the arguments).
    x : numpy.ndarray or None
        The flat, C-contiguous array the step reduces into or copies into
        (None: a barrier).
    op : int
        What this rank does with the slots: a :data:`fused_step.OPS` code,
        ``NO_REDUCE`` (a barrier; a reduce's non-root) or ``BROADCAST``.
    root : int
        The broadcast's root (else unused).
    outs : list
        What the call's future would hold (the caller's arrays).
    publishes : bool
        Whether this rank publishes ``x`` (not a broadcast's non-root).
    source : numpy.ndarray or None
        What this rank publishes instead of ``x`` (an allgather's input,
        C-contiguous; ``x`` is then the output's bytes).
    """

    __slots__ = ("pg", "call", "arena", "region", "plan", "address", "rank", "size", "x", "op",
                 "root", "outs", "spin_ns", "start_spin_ns", "lane", "rows", "meta", "words",
                 "running", "pending", "work", "mailbox", "source", "_start", "_finish",
                 "_combine")

    def __init__(self, pg, call, x, op: int, root: int, outs: list, publishes: bool = True,
                 source=None):
        self.pg, self.call, self.op, self.root, self.outs = pg, call, op, root, outs
        arena = self.arena = pg._transport.arena
        # (the plan holds the region's address: this reference keeps it mapped)
        region, ctrl, first, stride, spin_ns, yield_ns = arena.layout()
        self.region = region
        self.rank, self.size = rank, size = arena.rank, arena.size
        # The start's wait: the arena's spin phase, or, where the group has more
        # ranks than CPUs and no spin phase, CROWDED_WAIT_NS of yielding polls;
        # none (one look) where a peer is a thread of this process, which needs
        # the GIL the start holds to arrive at all.
        self.spin_ns = 0 if getattr(pg._transport, "peers_in_this_process", False) \
            else spin_ns if spin_ns > 0 else CROWDED_WAIT_NS
        self.start_spin_ns = min(self.spin_ns, START_SPIN_NS)
        x = _NOTHING if x is None else x
        # What the compiled functions take as their array: a barrier passes 0
        # (an int costs their entry point less than an array; fused_step._bytes_of)
        self.x = 0 if call.name == "barrier" else x
        recorder = pg._recorder
        nrows = recorder.lane_rows() if recorder is not None else 1
        self.plan = plan = np.zeros(fused_step.ROWS + 4 * nrows, np.int64)
        self.meta = plan[fused_step.META:fused_step.META + 2]
        self.rows = plan[fused_step.ROWS:].reshape(nrows, 4)
        self.lane = (recorder.lane(pg._pg_id, pg._global_rank, call, self.rows, self.meta)
                     if recorder is not None else None)
        nbytes = (x if source is None else source).nbytes if publishes else 0
        plan[:fused_step.WORDS + 1] = (
            ctrl.nbytes, rank, size, first[0], first[1], stride, *_stamp_words(call.stamp),
            nbytes, spin_ns, min(yield_ns, int(call.timeout_s * 1e9)), op, root,
            region.ctypes.data, region.nbytes, plan.size)
        # (the plan holds the source's address: this reference keeps it alive)
        self.source = source
        if source is not None:
            plan[fused_step.SOURCE] = source.ctypes.data
            plan[fused_step.OWN] = source.ctypes.data != x.ctypes.data + rank * source.nbytes
        self.mailbox = mailbox = pg._done.mailbox  # held_calls: messages of calls not yet taken
        # What the compiled step claims from and checks: the group's words, the
        # mailbox's count of held messages, the arena's step count (each kept
        # alive by the group, the mailbox and the arena this call holds).
        plan[fused_step.GROUP] = pg._fast_words.ctypes.data
        plan[fused_step.HELD] = mailbox.held_word.ctypes.data
        plan[fused_step.STEPS] = arena.step_word().ctypes.data
        plan[fused_step.NOW_SEQ] = plan[fused_step.NOW_STEP] = -1
        self.words = memoryview(plan)
        self.address = plan.ctypes.data
        self._start, self._finish, self._combine = self._entries(self.x)
        self.running = self.pending = False
        self.work = None

    @property
    def seq(self) -> int:
        """The sequence number of the last run (or start)."""
        return self.words[fused_step.NOW_SEQ]

    @property
    def step(self) -> int:
        """The arena step of the last run (or start)."""
        return self.words[fused_step.NOW_STEP]

    def _entries(self, x) -> tuple:
        """The compiled start, finish and combine this call runs (for arrays of
        ``x``'s type): :mod:`~numcoll.collectives.fused_step`'s entry points."""
        start = fused_step.barrier if self.call.name == "barrier" else fused_step.start
        return (fused_step.entry(start, x), fused_step.entry(fused_step.finish, x),
                fused_step.entry(fused_step.combine, x))

    # -- the fast path -------------------------------------------------------------
    def run(self) -> bool:
        """The whole call on this thread (a blocking call). False (nothing
        done, nothing numbered) when the fused path cannot take it now:
        something else in flight or held, the group unusable, a message of a
        call not yet taken waiting to be found out. True once it completed;
        raises its error as a blocking call does."""
        # Without the group's lock (0.1 us of a 0.6 us barrier): the compiled
        # start checks the group's words, claims the number and the step and
        # runs the spin phase holding the GIL, so no other thread comes between
        # (the group's Python changes the words under its lock, and a submit
        # shuts fused calls out before it numbers: settle). In the usual case
        # the call is done there and lets go of its claim; else the claim keeps
        # every other call waiting (settle) until hold().
        got = self._start(self.address, self.x, self.spin_ns)
        return got == -1 or got != fused_step.NOT_TAKEN and self.hold(got)

    def hold(self, got: int) -> bool:
        """The rest of :meth:`run` whose compiled start answered ``got`` (not
        done, or done while a message of a call not yet taken is held): the
        group holds the call, then it waits (the lock let go) and ends."""
        with self.pg._lock:
            self._hold(got)
            self.running = True
        self.end(self._finish(self.address, self.x, self.step, self.seq) if self.pending
                 else -1)
        return True

    def _hold(self, got: int) -> None:
        """Make the group hold this call, whose compiled start answered
        ``got`` (not done, or done while a message of a call not yet taken is
        held), so that any other call promotes it first; its claim is let go.
        Under the lock."""
        pg = self.pg
        pg._fast_held = self
        pg._word[fused_step.GROUP_BLOCKED] = 1
        pg._word[fused_step.GROUP_CLAIMED] = 0
        self.work = None
        self.pending = got != fused_step.DONE_HELD

    def started(self, got: int) -> None:
        """A persistent start whose compiled start (``_start`` with
        ``start_spin_ns``, no lock: see :meth:`run`; the request calls it
        itself, one frame fewer) took the call and answered ``got``: it
        published, and finished at once if every rank was there within
        :data:`START_SPIN_NS` (-1; then :meth:`finish` has nothing to do);
        else the call is held until :meth:`finish`. Never waits longer."""
        self.work = None
        if got != -1:  # held (a promotion must find it published), finished by finish()
            with self.pg._lock:
                self._hold(got)
                self.running = False

    def finish(self) -> None:
        """The rest of a held persistent start (:meth:`started`): wait, combine
        (one compiled call)."""
        pg = self.pg
        with pg._lock:
            promoted = self.work is not None
            if not promoted:
                self.running = True
        if promoted:
            self.work.wait()
            return
        self.end(self._finish(self.address, self.x, self.step, self.seq) if self.pending
                 else -1)

    def is_open(self) -> bool:
        """Whether the last run (or start) has not completed yet."""
        work = self.work
        if work is not None:
            return not work.future._completed
        return self.pg._fast_held is self

    def promote(self):
        """The last start as the group's Work (made now if it is still held)."""
        pg = self.pg
        with pg._lock:
            settle(pg, self.call.name)
            if pg._fast_held is self:
                promote(pg)
            else:
                update_blocked(pg)  # (settle set it)
        return self.work

    def end(self, got: int) -> None:
        """After the compiled wait of a held call: done (the usual case), or
        hand the call to the group (promoted) to finish, check and report it."""
        pg = self.pg
        if got == -1 and not self.mailbox.held_calls:
            with pg._lock:
                if pg._fast_held is self:
                    pg._fast_held = None
                    update_blocked(pg)
                    self.running = self.pending = False
                    return
        self.pending = got != -1
        with pg._lock:
            if pg._fast_held is self:
                promote(pg)
            self.running = False
        self.moved()
        error = pg._execute(self.work, self.rest)
        if error is not None:
            raise error

    def combine(self, comm) -> None:
        """After a slow wait (a promoted call): what the compiled step does once
        every rank published. ``comm``: the promoted call's, for its errors."""
        self._combine(self.address, self.x, self.step)

    # -- the group's side ------------------------------------------------------------
    def moved(self) -> None:
        """This call's lane row now lives as a Record (it was promoted)."""
        self.rows[self.meta[1], 3] = fused_step.MOVED

    def rest(self, comm, work):
        """``run(comm, work)`` of the promoted call: wait (the ordinary slow
        wait, with its errors) and combine, unless the compiled step did."""
        self.moved()
        if self.pending:
            comm.shared_wait(self.step)
            self.combine(comm)
            self.pending = False
        return self.outs


def promote(pg) -> None:
    """Make ``pg``'s held fused call (``pg._fast_held``) an ordinary Work, in
    flight, with its record and arena ticket, so that what comes after it
    waits for it. Under the group's lock. A start whose thread is not
    finishing it is queued, for whoever needs it first (as a held
    persistent start); one whose thread is (``running``) is completed by that
    thread (:meth:`FusedCall.end`)."""
    fused, pg._fast_held = pg._fast_held, None
    work = Work(fused.call.name, fused.seq, call=fused.call)
    if pg._recorder is not None:
        work.record = pg._recorder.record(pg._pg_id, pg._global_rank, fused.seq, fused.call,
                                          started=True)
    fused.moved()
    work.order = order = pg._order
    pg._order = order + 1
    pg._inflight[order] = work
    update_blocked(pg)
    pg._arena_order.ticket(work, queued=not fused.running)
    if not fused.running:
        work._queued(pg._execute, fused.rest)
    fused.work = work


def take_back(pg, op: str, give_up_s: float | None = None) -> None:
    """What any call that is not fused (``op``) does first, under the group's
    lock: wait until no fused call is claimed and not yet held
    (:func:`settle`; with ``give_up_s``, at most that long, then go on
    without raising: shutdown), then promote the held one, if any
    (:func:`promote`)."""
    settle(pg, op, give_up_s)
    if pg._fast_held is not None:
        promote(pg)


def settle(pg, op: str, give_up_s: float | None = None) -> None:
    """Under the group's lock, before ``op`` looks at what it holds: refuse fused
    calls from now on (``GROUP_BLOCKED`` set: the caller puts it right,
    :func:`update_blocked`, or has something in flight), and wait -- the lock
    let go -- while one whose compiled start claimed its number and step
    without the lock, on another thread, is not held by the group yet
    (``GROUP_CLAIMED``: a few bytecodes of that thread's, unless something
    killed it there; then the group's deadline ends the wait with an error,
    or ``give_up_s`` ends it quietly)."""
    word, lock = pg._word, pg._lock
    deadline = None
    while True:
        # (set again after every wait: a thread that had the lock meanwhile
        # may have cleared it, and a claim is only kept off once it is set)
        word[fused_step.GROUP_BLOCKED] = 1
        if not word[fused_step.GROUP_CLAIMED]:
            return
        if deadline is None:
            deadline = time.monotonic() + (pg.context.timeout_s if give_up_s is None
                                           else give_up_s)
        elif time.monotonic() > deadline:
            if give_up_s is not None:
                return
            raise RuntimeError(
                f"{op} on rank {pg._rank} waited {pg.context.timeout_s:g} s for collective "
                f"#{word[fused_step.GROUP_SEQ] - 1}, which a fused call on another thread of "
                "this rank claimed and never handed to the group (was that thread interrupted?)")
        lock.release()
        try:
            time.sleep(0)  # (the claiming thread's turn: it needs the lock)
        finally:
            lock.acquire()


def update_blocked(pg) -> None:
    """Say, in the group's word that a fused call's compiled step checks
    (``GROUP_BLOCKED``), whether one may run now: nothing in flight or held,
    the group neither poisoned nor closed. Under the group's lock, after
    every change to any of these."""
    pg._word[fused_step.GROUP_BLOCKED] = bool(pg._inflight or pg._fast_held is not None
                                              or pg._poisoned is not None or pg._closed)
