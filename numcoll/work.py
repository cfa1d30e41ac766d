"""Work: the handle a collective call returns.

Work wraps the Future that the worker thread completes; ``wait()`` re-raises
the collective's error, ``result()`` is the output arrays.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

from .futures import Future

__all__ = ["Work"]


class Work:
    """One enqueued collective. Completed by a ProcessGroup worker thread."""

    __slots__ = ("op_name", "seq", "call", "record", "order", "_future", "_source_rank",
                 "_claim_lock", "_execute", "_run")

    def __init__(self, op_name: str, seq: int, future: Future | None = None, call=None):
        self.op_name = op_name
        self.seq = seq
        #: The :class:`numcoll.call.Call` this work runs, and its flight-recorder record.
        self.call = call
        self.record = None
        self.order = -1  # position in this rank's queue (collectives and p2p alike)
        self._future = future if future is not None else Future()
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
        self._future.wait(timeout)
        return True

    def is_completed(self) -> bool:
        """Whether the collective has finished, successfully or not."""
        return self._future.done()

    def is_success(self) -> bool:
        """Whether the collective has finished without an error."""
        return self._future.done() and self._future.exception() is None

    def exception(self) -> BaseException | None:
        """The collective's error, if it failed; None otherwise."""
        return self._future.exception()

    def result(self) -> Any:
        """The output arrays (the future's value); waits for completion."""
        return self._future.wait()

    def source_rank(self) -> int:
        """For recv/recv_anysource: the rank the message came from."""
        if self._source_rank is None:
            raise ValueError(f"{self.op_name}: source_rank() is only known for a completed recv")
        return self._source_rank

    def get_future(self) -> Future:
        """The Future completed with the collective's result."""
        return self._future

    def __repr__(self):
        return f"<numcoll.Work {self.op_name} seq={self.seq} {self._future!r}>"
