"""A send or a receive in flight (:class:`PendingRequest`) and how error messages name
it: the bottom of every transport, below the mailbox that completes receives
(:mod:`transports.mailbox`) and the prologue every transport shares
(:mod:`transports.endpoint`)."""

from __future__ import annotations

import threading
import time
from _thread import allocate_lock

from .base import ANY_SOURCE, TransportError, TransportTimeout

__all__ = ["PendingRequest", "AllEvents", "describe", "SEND", "RECV"]


#: ``what`` of a request: the words error messages use.
SEND = "send"
RECV = "recv"


def describe(what: str, rank: int, peer: int, tag: int) -> str:
    """Name a request in error messages: ``"recv from rank 1 (tag 7) on rank 0"``."""
    who = "any rank" if peer == ANY_SOURCE else f"rank {peer}"
    direction = "to" if what == SEND else "from"
    return f"{what} {direction} {who} (tag {tag}) on rank {rank}"


class PendingRequest:
    """A posted send or receive; implements :class:`transports.base.Request`.

    A zero-copy send completes in two steps: handed to ZeroMQ, then ``after``
    (ZeroMQ's tracker event) fires when ZeroMQ releases the buffer.
    """

    __slots__ = ("what", "rank", "peer", "tag", "buf", "stamp", "whole_call", "source", "seq",
                 "_finished", "_lock", "_after", "_result", "_error")

    def __init__(self, what: str, rank: int, peer: int, tag: int, buf: memoryview | None = None,
                 stamp: bytes = b"", whole_call: bool = False):
        self.what = what
        self.rank = rank
        self.peer = peer
        self.tag = tag
        self.buf = buf
        self.stamp = stamp
        self.whole_call = whole_call and bool(stamp) and peer != ANY_SOURCE
        self.source = None if peer == ANY_SOURCE else peer
        self.seq = 0
        # Completion is a lock held until the request finishes (as threading.Thread
        # does it): far cheaper to make than an Event, and this is made per message.
        self._finished = False
        self._lock = allocate_lock()
        self._lock.acquire()
        self._after: threading.Event | None = None
        self._result: memoryview | None = None
        self._error: TransportError | None = None

    def complete(self, result: memoryview | None = None, source: int | None = None,
                 after: threading.Event | None = None) -> None:
        """Mark done (``after``: an event still to fire before the buffer is free).

        Called once, by whoever owns the request (the mailbox, or the I/O thread).
        """
        if source is not None:
            self.source = source
        self._result = result
        self._after = after
        self._finished = True
        self._lock.release()

    def fail(self, exc: TransportError) -> None:
        """Fail the request, unless it already finished. Called by its owner.

        A zero-copy send already handed to ZeroMQ keeps waiting for ``after``:
        the caller must not reuse its buffer while ZeroMQ may still read it
        (whoever fails it also closes the socket, which releases the buffer).
        """
        if self._finished:
            after = self._after
            if after is not None and not after.is_set():
                self._error = exc
            return
        self._error = exc  # written before the release: the waiter's acquire orders it
        self._finished = True
        self._lock.release()

    def done(self) -> bool:
        if not self._finished:
            return False
        after = self._after
        return after is None or after.is_set()

    def wait(self, deadline: float | None) -> memoryview | None:
        start = time.monotonic()
        if not self._finished and not self._wait_lock(deadline):
            raise self._timeout(start)
        after = self._after
        if after is not None and not _wait_event(after, deadline):
            raise self._timeout(start, unreleased=True)
        if self._error is not None:
            raise self._error.with_traceback(None)  # raised again on every wait: don't grow the traceback
        return self._result

    def _wait_lock(self, deadline: float | None) -> bool:
        lock = self._lock
        if deadline is None:
            lock.acquire()
        else:
            remaining = min(deadline - time.monotonic(), threading.TIMEOUT_MAX)
            if remaining <= 0 or not lock.acquire(timeout=remaining):
                return False
        lock.release()  # let other waiters (and later waits) through
        return True

    def _timeout(self, start: float, unreleased: bool = False) -> TransportTimeout:
        waited_s = time.monotonic() - start
        taken = ": ZeroMQ took the message but did not release its buffer" if unreleased else ""
        return TransportTimeout(
            f"Timed out waiting {waited_s * 1000:.0f}ms for {self.describe()}{taken}",
            self.peer, self.tag, self.what, waited_s, unreleased)

    def describe(self) -> str:
        return describe(self.what, self.rank, self.peer, self.tag)

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else "done" if self.done() else "pending"
        return f"<PendingRequest {self.describe()}: {state}>"


def _wait_event(event: threading.Event, deadline: float | None) -> bool:
    if event.is_set():
        return True
    if deadline is None:
        return event.wait()
    remaining = min(deadline - time.monotonic(), threading.TIMEOUT_MAX)
    return remaining > 0 and event.wait(remaining)


class AllEvents:
    """Several events seen as one, set once all of them are (a zero-copy send
    cut into several frames frees its buffer when ZeroMQ released every one)."""

    __slots__ = ("_events",)

    def __init__(self, events):
        self._events = list(events)

    def is_set(self) -> bool:
        return all(e.is_set() for e in self._events)

    def wait(self, timeout: float | None = None) -> bool:
        end = None if timeout is None else time.monotonic() + timeout
        for event in self._events:
            if not _wait_event(event, end):
                return False
        return True
