"""Persistent requests whose start and wait are one compiled step each.

A persistent allreduce, broadcast or barrier that fits one arena step
(:func:`.repeat.fusable`) is a :class:`FusedRequest`: ``start()`` publishes
this rank's part (one compiled call: the arena header with the call's
number and stamp, the payload, the flight recorder's row), waits a few
microseconds at most (:data:`~numcoll.fast.step.START_SPIN_NS`) for every
rank's part and, if they are all there, combines them at once; it
returns a :class:`Started` -- a :class:`~numcoll.Work` made without a
Future. ``wait()`` after a start that finished is a few attribute reads;
otherwise it waits for the peers and combines their slots (one compiled
call). When the group has something else in flight, or another call is
submitted while the start is held, the request falls back to the ordinary
persistent path (:class:`~numcoll.collectives.persistent.PersistentRequest`)
for that start, with the same results and errors.
"""

from __future__ import annotations

from sys import getrefcount

from ..collectives.fused_step import NOT_TAKEN, NOW_SEQ
from ..collectives.persistent import PersistentRequest
from ..futures import Future
from ..work import Work
from .repeat import fused_call
from .step import FusedCall

__all__ = ["FusedRequest", "Started", "fused_request", "make_request"]

#: ``getrefcount`` of a handle only the request holds: its slot, the local
#: name, ``getrefcount``'s argument. Then the caller dropped the last start's
#: handle, and the next start reuses it rather than making one.
_UNSHARED = 3


class Started(Work):
    """The :class:`~numcoll.Work` of a fused start: its Future is made only if
    asked for (``get_future()``); ``wait()`` finishes the start on this thread."""

    __slots__ = ("_request", "_n")

    @classmethod
    def of(cls, request: "FusedRequest", n: int) -> "Started":
        self = cls.__new__(cls)
        self._request, self._n = request, n
        self.op_name, self.seq, self.call = request.op_name, request._fused.seq, \
            request._fused.call
        return self

    def _current(self) -> bool:
        """Whether this is still the request's last start."""
        return self._request._starts == self._n

    def _work(self):
        """The group's Work for this start, if it was promoted to one."""
        return self._request._fused.work if self._current() else None

    def wait(self, timeout=None) -> bool:
        if self._current():
            self._request.wait(timeout)
        return True

    def is_completed(self) -> bool:
        return not self._current() or self._request.is_completed()

    def is_success(self) -> bool:
        return self.is_completed() and self.exception() is None

    def exception(self):
        work = self._work()
        return None if work is None else work.exception()

    def result(self):
        self.wait()
        return self._request._fused.outs

    def get_future(self) -> Future:
        work = self._work()
        if work is not None:
            return work.future
        self.wait()
        future = Future()
        future.set_result(self._request._fused.outs)
        return future

    @property
    def future(self) -> Future:
        return self.get_future()

    def __repr__(self):
        state = "completed" if self.is_completed() else "started"
        return f"<numcoll.Work {self.op_name} seq={self.seq} {state}>"


class FusedRequest(PersistentRequest):
    """A :class:`PersistentRequest` that runs as a fused arena step when it can
    (see the module docstring); made by ``ProcessGroup.*_init``."""

    __slots__ = ("_fused", "_starts", "_last_fused", "_active", "_handle", "_array")

    def __init__(self, submit, plan, fused: FusedCall):
        super().__init__(submit, plan)
        self._fused = fused
        self._starts = 0
        self._last_fused = False
        # A fused start may have completed inside start(); it stays the active
        # one until waited for (wait(), or is_completed() saying so), as an
        # MPI request does, so start(); start() is refused however fast the
        # peers were.
        self._active = False
        self._handle = None  # the last Started given out
        # (array, shape, strides) of the guard's one array, None for a barrier:
        # its check, inlined in start() (a fused request has no other objects)
        arrays = plan.guard._arrays
        self._array = arrays[0] if arrays else None

    def start(self):
        """Start the collective; returns its :class:`~numcoll.Work` (see
        :meth:`PersistentRequest.start`). A fused start may complete inside
        this call; it counts as in flight until waited for (``wait()``, or
        ``is_completed()`` answering True), as an MPI request does."""
        if self._active:  # (only fused starts are ever active)
            raise RuntimeError(f"{self.op_name}: start() called while the previous start() is "
                               "still in flight; wait() for it first")
        if not self._last_fused:
            work = self._work
            if work is not None and not work.future._completed:
                raise RuntimeError(f"{self.op_name}: start() called while the previous "
                                   "start() is still in flight; wait() for it first")
        held = self._array
        if held is not None and (held[0].shape != held[1] or held[0].strides != held[2]):
            self._plan.guard.check()  # raises, saying what changed
        self._starts += 1
        fused = self._fused
        # the compiled start called here, not in a method of the FusedCall: one
        # frame fewer (a start is 1.3 us); no lock (see FusedCall.run)
        got = fused._start(fused.address, fused.x, fused.start_spin_ns)
        if got != NOT_TAKEN:
            if got == -1:
                fused.work = None  # done (the usual case): FusedCall.started's fast half
            else:
                fused.started(got)
            self._last_fused = self._active = True
            self._work = None
            handle = self._handle
            if handle is not None and getrefcount(handle) <= _UNSHARED:
                # nobody else holds it (the number read as FusedCall.seq does, less a frame)
                handle._n, handle.seq = self._starts, fused.words[NOW_SEQ]
            else:
                handle = self._handle = Started.of(self, self._starts)
            return handle
        self._last_fused = False
        self._work = work = self._submit(self._plan.call, self._plan.run,
                                         publish=self._plan.publish)
        return work

    def wait(self, timeout=None) -> bool:
        """Wait for the last start (see :meth:`PersistentRequest.wait`)."""
        if not self._last_fused:
            return super().wait(timeout)
        fused = self._fused
        if fused.work is None:
            if fused.pg._fast_held is not fused:  # finished (in start(), the usual case)
                self._active = False
                return True
            if timeout is None:
                self._active = False
                fused.finish()
                return True
            work = fused.promote()
            # A wait with a timeout does not run the work itself (it must be able
            # to return first): a worker does.
            fused.pg._queue.put((work, work._run))
        work = fused.work
        try:
            return work.wait(timeout)
        finally:
            if work.future._completed:  # (failed or not: a wait that timed out leaves it)
                self._active = False

    def is_completed(self) -> bool:
        if self._last_fused:
            done = not self._fused.is_open()
            if done:
                self._active = False
            return done
        return super().is_completed()

    @property
    def work(self):
        """The :class:`~numcoll.Work` of the last start (None before the first)."""
        if self._last_fused:
            handle = self._handle
            if handle is None or handle._n != self._starts:
                handle = self._handle = Started.of(self, self._starts)
            return handle
        return self._work

    def result(self):
        """The last start's value (its output arrays), waiting for it."""
        if self._last_fused:
            self.wait()
            return self._fused.outs
        return super().result()


def fused_request(pg, plan) -> FusedRequest | None:
    """A :class:`FusedRequest` for the persistent ``plan`` (made by
    :mod:`numcoll.collectives.persistent`) of group ``pg``, if one arena step
    does it (:func:`.repeat.fused_call`). Else None."""
    call, guard = plan.call, plan.guard
    if call.name not in ("allreduce", "reduce", "broadcast", "barrier") or guard._others:
        return None
    if call.name == "allreduce" and plan.publish is None:
        return None  # (the persistent allreduce's own test for one arena step)
    x = guard._arrays[0][0] if len(guard._arrays) == 1 else None
    fused = fused_call(pg, call, x)
    return None if fused is None else FusedRequest(pg.submit, plan, fused)


def make_request(pg, plan) -> PersistentRequest:
    """``ProcessGroup._make_request``: the persistent request of ``plan``, fused
    (:func:`fused_request`) where one arena step does it."""
    return fused_request(pg, plan) or PersistentRequest(pg.submit, plan)
