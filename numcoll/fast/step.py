"""A small collective of one group, planned once and run as one compiled step.

:class:`FusedCall` holds everything a repeated small call needs -- the
arena's memory and layout, the call's stamp as two words, this rank's
payload, typed views of every rank's slot in both sets, the reduction's
code, the flight recorder's lane -- so that running it is: a few attribute
reads under the group's lock (nothing in flight, not poisoned; take the
sequence number), one compiled call (:mod:`numcoll.collectives.fused_step`),
and the lock once more to say it is done. No Work, Comm, Future or Record is
made.

The group stays in charge of order and failure. While a fused call is
published and not finished, the group holds it as ``_fast_held``; any other
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

import numpy as np

from transports.shm.arena import HEADER_NBYTES, _stamp_words

from ..collectives import fused_step
from ..work import Work

__all__ = ["FusedCall", "fusable_dtype", "promote"]

#: dtypes the fused step reduces (others -- 16-bit floats, bool, complex -- keep
#: the ordinary path, whose kernels know them).
_DTYPES = frozenset(np.dtype(t) for t in (np.float32, np.float64, np.int8, np.int16, np.int32,
                                          np.int64, np.uint8, np.uint16, np.uint32, np.uint64))
_NOTHING = np.empty(0, np.uint8)


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
    """

    __slots__ = ("pg", "call", "arena", "region", "plan", "rank", "size", "x", "slots", "op",
                 "root", "outs", "spin_ns", "yield_ns", "lane", "rows", "meta", "seq", "step",
                 "running", "pending", "work", "mailbox")

    def __init__(self, pg, call, x, op: int, root: int, outs: list, publishes: bool = True):
        self.pg, self.call, self.op, self.root, self.outs = pg, call, op, root, outs
        arena = self.arena = pg._transport.arena
        region, ctrl, first, stride, spin_ns, yield_ns = arena.layout()
        self.region = region
        self.rank, self.size = rank, size = arena.rank, arena.size
        self.spin_ns = spin_ns
        self.yield_ns = min(yield_ns, int(call.timeout_s * 1e9))
        self.x = x = _NOTHING if x is None else x
        recorder = pg._recorder
        nrows = recorder.lane_rows() if recorder is not None else 1
        self.plan = plan = np.zeros(fused_step.ROWS + 4 * nrows, np.int64)
        self.meta = plan[fused_step.META:fused_step.META + 2]
        self.rows = plan[fused_step.ROWS:].reshape(nrows, 4)
        self.lane = (recorder.lane(pg._pg_id, pg._global_rank, call, self.rows, self.meta)
                     if recorder is not None else None)
        plan[:fused_step.ROOT + 1] = (ctrl.nbytes, rank, size, first[0], first[1], stride,
                                      *_stamp_words(call.stamp), x.nbytes if publishes else 0,
                                      spin_ns, self.yield_ns, op, root)
        # Every rank's slot of both sets as (set, rank, element) of x's dtype.
        at, sets = first[0] + HEADER_NBYTES, first[1] - first[0]
        span = sets + (size - 1) * stride + x.nbytes
        typed = region[at:at + span - span % x.itemsize].view(x.dtype)
        self.slots = np.lib.stride_tricks.as_strided(typed, (2, size, x.size),
                                                     (sets, stride, x.itemsize), writeable=False)
        self.seq = self.step = -1
        self.running = self.pending = False
        self.work = None
        self.mailbox = pg._done.mailbox  # held_calls: messages of calls not yet taken

    # -- the fast path -------------------------------------------------------------
    def _claim(self, running: bool) -> bool:
        """Under the group's lock: whether the fused path may run now (nothing
        else in flight or held, the group usable, no message of a finished
        call waiting to be found out); if so take the sequence number and
        hold this call -- and, for a persistent start (not ``running``),
        publish it (a promotion must find the step published). Nothing is
        numbered otherwise."""
        pg = self.pg
        with pg._lock:
            if pg._inflight or pg._fast_held is not None or pg._poisoned is not None \
                    or pg._closed or self.mailbox.held_calls:
                return False
            self.seq = seq = pg._next_seq
            pg._next_seq = seq + 1
            pg._fast_held = self
            self.running = running
            self.work = None
            if not running:
                arena = self.arena
                self.step = step = arena._step
                fused_step.publish(self.region, self.plan, self.x, step, seq)
                arena._step = step + 1
                self.pending = True
        return True

    def run(self) -> bool:
        """The whole call on this thread (a blocking call). False (nothing
        done, nothing numbered) when the fused path cannot take it now;
        True once it completed; raises its error as a blocking call does."""
        # _claim(True) and end()'s usual case, inlined: this is the hot path.
        pg, arena = self.pg, self.arena
        with pg._lock:
            if pg._inflight or pg._fast_held is not None or pg._poisoned is not None \
                    or pg._closed or self.mailbox.held_calls:
                return False
            self.seq = seq = pg._next_seq
            pg._next_seq = seq + 1
            pg._fast_held = self
            self.running = True
            self.work = None
        self.step = step = arena._step
        got = self.compiled(step, seq)
        arena._step = step + 1
        if got == -1 and not self.mailbox.held_calls:
            with pg._lock:
                if pg._fast_held is self:
                    pg._fast_held = None
                    self.running = False
                    return True
        self.end(got)
        return True

    def publish(self) -> bool:
        """A persistent start's half: publish (never blocks) and hold the call
        until :meth:`finish`. False when the fused path cannot take it now."""
        return self._claim(False)

    def finish(self) -> None:
        """The rest of a :meth:`publish`: wait, combine (one compiled call)."""
        pg = self.pg
        with pg._lock:
            promoted = self.work is not None
            if not promoted:
                self.running = True
        if promoted:
            self.work.wait()
            return
        self.end(fused_step.complete(self.region, self.plan, self.x, self.slots, self.step,
                                     self.seq))

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
            if pg._fast_held is self:
                promote(pg)
        return self.work

    def end(self, got: int) -> None:
        """After the compiled step: done (the usual case), or hand the call to
        the group (promoted) to finish, check and report it."""
        pg = self.pg
        if got == -1 and not self.mailbox.held_calls:
            with pg._lock:
                if pg._fast_held is self:
                    pg._fast_held = None
                    self.running = False
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

    def compiled(self, step: int, seq: int) -> int:
        """The whole step as one compiled call: -1 done, else as ``arena._wait``."""
        return fused_step.step(self.region, self.plan, self.x, self.slots, step, seq)

    def combine(self, comm) -> None:
        """After a slow wait (a promoted call): what :meth:`compiled` does once every
        rank published."""
        fused_step.combine(self.x, self.slots[self.step & 1], self.rank, self.size,
                           self.op, self.root)

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
    pg._arena_order.ticket(work, queued=not fused.running)
    if not fused.running:
        work._queued(pg._execute, fused.rest)
    fused.work = work
