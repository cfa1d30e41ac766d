"""Work: the handle a collective call returns, and the order in which a
group's shared-arena calls must run.

Work wraps the Future that its group completes (:meth:`ProcessGroup._execute
<numcoll.process_group.ProcessGroup._execute>`); ``wait()`` re-raises the
collective's error, ``result()`` is the output arrays.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any, Callable

from .errors import CollectiveTimeoutError, GroupPoisonedError, NumcollError
from .futures import Future, FutureTimeoutError

__all__ = ["Work", "ArenaOrder", "wait_for_earlier"]


class Work:
    """One enqueued collective. Completed by a ProcessGroup worker thread."""

    __slots__ = ("op_name", "seq", "call", "record", "order", "arena_ticket", "future",
                 "_source_rank", "_claim_lock", "_execute", "_run")

    def __init__(self, op_name: str, seq: int, future: Future | None = None, call=None):
        self.op_name = op_name
        #: The collective's number in its group (from 1; -1 for sends and receives).
        self.seq = seq
        #: The :class:`numcoll.call.Call` this work runs, and its flight-recorder record.
        self.call = call
        self.record = None
        self.order = -1  # position in this rank's queue (collectives and p2p alike)
        self.arena_ticket = -1  # place in the shared arena's order (shared algorithms)
        #: The :class:`~numcoll.futures.Future` completed with the result (``get_future()``).
        self.future = future if future is not None else Future()
        self._source_rank: int | None = None
        # Set when the work is queued (see _queued); a blocking caller that
        # runs it at once needs none of them.
        self._claim_lock = None
        self._execute = self._run = None

    def _queued(self, execute, run) -> None:
        """The work is in its group's queue; ``execute(self, run)`` runs it.

        Kept as two references, not a closure over this Work: a Work that
        refers to itself is a reference cycle, and a cycle per call keeps the
        garbage collector busy.
        """
        # Whoever acquires this runs the work: a worker thread, or the caller
        # of wait() if no worker has started it yet.
        self._claim_lock = threading.Lock()
        self._execute, self._run = execute, run

    def _claim(self) -> bool:
        return self._claim_lock.acquire(blocking=False)

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        """Block until the collective completes; raise its error. Returns True.

        ``timeout`` (timedelta or seconds) bounds only this wait; the
        collective has its own deadline from its options or the group.
        """
        if isinstance(timeout, timedelta):
            timeout = timeout.total_seconds()
        # The caller is about to block anyway: if no worker has picked the work
        # up yet, run it on this thread and save two thread hand-offs (most of
        # a small collective's latency). Not with a wait timeout, which must
        # be able to return before the work's own deadline.
        if timeout is None and self._execute is not None and self._claim():
            self._execute(self, self._run)
        self.future.wait(timeout)
        return True

    def is_completed(self) -> bool:
        """Whether the collective has finished, successfully or not."""
        return self.future.done()

    def is_success(self) -> bool:
        """Whether the collective has finished without an error."""
        return self.future.done() and self.future.exception() is None

    def exception(self) -> BaseException | None:
        """The collective's error, if it failed; None otherwise."""
        return self.future.exception()

    def result(self) -> Any:
        """The output arrays (the future's value); waits for completion."""
        return self.future.wait()

    def source_rank(self) -> int:
        """For recv/recv_anysource: the rank the message came from."""
        if self._source_rank is None:
            raise ValueError(f"{self.op_name}: source_rank() is only known for a completed recv")
        return self._source_rank

    def get_future(self) -> Future:
        """The Future completed with the collective's result."""
        return self.future

    def __repr__(self):
        return f"<numcoll.Work {self.op_name} seq={self.seq} {self.future!r}>"


class ArenaOrder:
    """The order in which one group's shared-arena calls run on this rank.

    Each shared-algorithm call runs a fixed number of arena steps, and the
    ranks match steps by count, so on every rank these calls must run in
    submission order; worker threads (and callers running their own work in
    ``Work.wait``) may otherwise start them in any order. A call takes a
    ticket when it is submitted; it runs when the turn reaches its ticket. A
    thread waiting for its turn runs the call whose turn it is if no thread
    has claimed it yet (else two workers could wait on calls queued behind
    them). Every operation is O(1), however many calls are queued.
    """

    def __init__(self, rank: int):
        self._rank = rank  # for messages
        # The lock alone (C code) where no one waits: a blocking call with
        # nothing in flight takes its ticket, finds it is its turn and ends it
        # without the condition's Python-level methods.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._waiting = 0  # threads in the condition's wait: only they need notifying
        self._tickets = 0
        self._turn = 0
        self._queued: dict[int, Work] = {}  # by ticket: what a waiting thread may run
        self._done: set[int] = set()  # finished out of turn (failed before theirs)

    def ticket(self, work: Work, queued: bool) -> None:
        """Give ``work`` the next ticket (under the group's submit lock)."""
        with self._lock:
            work.arena_ticket = self._tickets
            self._tickets += 1
            if queued:
                self._queued[work.arena_ticket] = work

    def take_turn(self, work: Work, unusable: Callable[[], str | None]) -> None:
        """Return when it is ``work``'s turn; fail if its deadline passes first
        or the group becomes unusable (``unusable()`` says why)."""
        ticket = work.arena_ticket
        with self._lock:
            if self._turn == ticket:
                self._queued.pop(ticket, None)
                return
        deadline = time.monotonic() + work.call.timeout_s
        cond = self._cond
        with cond:
            while self._turn != ticket:
                why = unusable()
                if why is not None:
                    raise GroupPoisonedError(f"{work.op_name} (collective #{work.seq}) on rank "
                                             f"{self._rank} was not run because {why}")
                turn = self._queued.get(self._turn)
                if turn is not None and turn._claim():
                    cond.release()
                    try:
                        turn._execute(turn, turn._run)
                    finally:
                        cond.acquire()
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    raise NumcollError(
                        f"{work.op_name} (collective #{work.seq}) on rank {self._rank} timed out "
                        f"waiting for this rank's earlier calls on the shared arena (turn "
                        f"{self._turn}, its ticket {ticket}) to finish")
                self._waiting += 1
                try:
                    cond.wait(left)
                finally:
                    self._waiting -= 1
            self._queued.pop(ticket, None)

    def end_turn(self, work: Work) -> None:
        """``work`` is done with the arena (or failed before its turn): the
        turn passes on, over every ticket that finished out of turn."""
        with self._lock:
            self._queued.pop(work.arena_ticket, None)
            if self._turn == work.arena_ticket and not self._done:
                self._turn += 1
            else:
                self._done.add(work.arena_ticket)
                while self._turn in self._done:
                    self._done.discard(self._turn)
                    self._turn += 1
            if self._waiting:
                self._cond.notify_all()

    def wake(self) -> None:
        """Wake every waiting thread (the group was aborted or shut down)."""
        with self._cond:
            self._cond.notify_all()


def wait_for_earlier(work: Work, earlier: list[Work], rank: int) -> None:
    """A barrier's rule: every call submitted before ``work`` (``earlier``) has
    finished. Each has its own deadline and its failure is its own; this waits
    at most ``work``'s deadline in all."""
    deadline = time.monotonic() + work.call.timeout_s
    for w in earlier:
        if w._claim_lock is not None and w._claim():
            w._execute(w, w._run)  # no thread has run it yet (a held persistent start, say)
        try:
            w.future.wait(max(0.0, deadline - time.monotonic()))
        except FutureTimeoutError:
            raise CollectiveTimeoutError(
                f"Timed out waiting {round(work.call.timeout_s * 1000)}ms for {work.op_name} "
                f"(collective #{work.seq}) on rank {rank}: {w.op_name} (collective "
                f"#{w.seq}), submitted before it, did not finish") from None
        except Exception:  # noqa: BLE001 - reported by that call's own Work
            pass
