"""What every transport shares, written once: argument checks, requests, and
posting sends and receives against a :class:`~transports.mailbox.Mailbox`.

A transport is two things: how bytes reach a peer (a function call, a
ZeroMQ socket, a shared-memory ring) and how arriving messages meet posted
receives (the mailbox). The second, and everything a send or a receive does
before any byte moves, is the same everywhere and lives here:

- the arguments are checked (peer, tag, stamp, buffer) at the call;
- a send on a closed transport, or to a peer that has left, fails at once,
  naming why, and moves nothing;
- a send to this very rank is delivered into its own mailbox;
- a receive is posted in the mailbox, which matches it with what arrived;
- a request (:class:`PendingRequest`) is completed or failed once by its
  owner (the mailbox, an I/O thread, the thread that pushed the bytes), and
  any number of threads may wait on it, each with its own deadline.

A subclass of :class:`MailboxTransport` supplies :meth:`MailboxTransport._send`
(move the bytes of a send to another rank; say whether its buffer is free now),
sets ``_closed_why`` when it closes, and, if its requests do more than wait
(the shm transport's make progress while they wait), ``_new_request``.
"""

from __future__ import annotations

import threading
import time
from _thread import allocate_lock
from typing import TYPE_CHECKING

from .base import (
    ANY_SOURCE,
    MAX_STAMP_NBYTES,
    MAX_TAG,
    Arena,
    PeerClosed,
    Rendezvous,
    TransportClosed,
    TransportError,
    TransportTimeout,
)

if TYPE_CHECKING:
    from .mailbox import Mailbox

__all__ = ["MailboxTransport", "PendingRequest", "AllEvents", "describe", "check_peer",
           "check_stamp", "byte_view", "forget", "Prefixed", "SEND", "RECV"]


#: ``what`` of a request: the words error messages use.
SEND = "send"
RECV = "recv"


def forget(store: Rendezvous, key: str) -> None:
    """Delete ``key`` from ``store``, if the store can (see :class:`Rendezvous`)."""
    delete = getattr(store, "delete_key", None)
    if delete is not None:
        delete(key)


class Prefixed:
    """``store`` with keys under ``prefix``: the keys of one rendezvous (a
    transport inside another, an allocation), apart from any other's. The
    Rendezvous subset, and ``delete_key`` where ``store`` has it."""

    def __init__(self, store: Rendezvous, prefix: str):
        self._store, self._prefix = store, prefix

    def set(self, key: str, value: bytes) -> None:
        self._store.set(self._prefix + key, value)

    def get(self, key: str) -> bytes:
        return self._store.get(self._prefix + key)

    def delete_key(self, key: str) -> None:
        forget(self._store, self._prefix + key)


def describe(what: str, rank: int, peer: int, tag: int) -> str:
    """Name a request in error messages: ``"recv from rank 1 (tag 7) on rank 0"``."""
    who = "any rank" if peer == ANY_SOURCE else f"rank {peer}"
    direction = "to" if what == SEND else "from"
    return f"{what} {direction} {who} (tag {tag}) on rank {rank}"


def check_peer(what: str, rank: int, size: int, peer, tag) -> None:
    """Raise ``ValueError`` unless ``peer`` is a rank of the group (or, for a
    receive, :data:`ANY_SOURCE`) and ``tag`` fits in 64 unsigned bits."""
    if not isinstance(peer, int) or not (0 <= peer < size or (what == RECV and peer == ANY_SOURCE)):
        raise ValueError(f"{what} on rank {rank}: invalid peer rank {peer!r} (group size {size})")
    if not isinstance(tag, int) or not 0 <= tag <= MAX_TAG:
        raise ValueError(f"{what} on rank {rank}: invalid tag {tag!r} (must be in [0, 2**64))")


def check_stamp(stamp) -> bytes:
    """``stamp`` as bytes; ``ValueError`` if it is not bytes or is too long."""
    if not isinstance(stamp, (bytes, bytearray)) or len(stamp) > MAX_STAMP_NBYTES:
        raise ValueError(f"stamp must be at most {MAX_STAMP_NBYTES} bytes, got {stamp!r:.80}")
    return bytes(stamp)


def byte_view(buf, *, writable: bool = False) -> memoryview:
    """A flat unsigned-byte view of ``buf`` without copying.

    Accepts anything exporting the buffer protocol, and NumPy arrays whose
    dtype the buffer protocol cannot describe (``ml_dtypes.bfloat16``).
    Raises ``ValueError`` for non-contiguous or (when ``writable``) read-only
    buffers, since the bytes must move in place.
    """
    try:
        view = memoryview(buf)
    except (TypeError, ValueError):
        if not hasattr(buf, "__array_interface__"):
            raise
        import numpy  # only for dtypes the buffer protocol cannot describe

        array = numpy.asarray(buf)
        if not array.flags.c_contiguous:
            raise ValueError("buffer must be C-contiguous") from None
        view = memoryview(array.reshape(-1).view(numpy.uint8))
    if not view.c_contiguous:
        raise ValueError("buffer must be C-contiguous")
    if writable and view.readonly:
        raise ValueError("receive buffer must be writable")
    if view.format == "B" and view.ndim == 1:
        return view
    if view.nbytes == 0:  # memoryview cannot cast a shape containing 0
        return memoryview(bytearray() if writable else b"")
    return view.cast("B")


# --- requests -------------------------------------------------------------------------


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
            raise self._timeout(start)
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

    def _timeout(self, start: float) -> TransportTimeout:
        waited_s = time.monotonic() - start
        return TransportTimeout(
            f"Timed out waiting {waited_s * 1000:.0f}ms for {self.describe()}",
            self.peer, self.tag, self.what, waited_s)

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


# --- the prologue every transport shares --------------------------------------------


class MailboxTransport:
    """Base of the transports: the :class:`~transports.base.Transport` interface
    over a mailbox and one primitive, :meth:`_send`.

    Subclasses set ``rank``, ``size`` and ``_mailbox`` before the first post.
    """

    rank: int
    size: int
    _mailbox: Mailbox
    #: The shared arena (:class:`~transports.base.Arena`): None unless the
    #: transport's ranks share memory (the shm transport sets its own).
    arena: Arena | None = None
    #: Memory the ranks map together (:class:`~transports.base.SharedMemory`):
    #: None unless they share a host (the shm transport sets its own).
    shared_memory = None
    #: Single-copy reads from the peers (:class:`~transports.base.SingleCopy`):
    #: None unless they are processes of one host (the shm transport sets its own).
    single_copy = None
    #: Makes a request: ``(what, rank, peer, tag, buf=None, stamp=b"",
    #: whole_call=False) -> PendingRequest`` (a plain attribute, not a method:
    #: this runs for every message).
    _new_request = PendingRequest
    #: Why this transport takes no more sends (set when it closes); None while open.
    _closed_why: str | None = None

    @property
    def mailbox(self) -> Mailbox:
        """The matching engine, to read (never to post to): what arrived that no
        receive has taken yet -- a message of a call its receiver has finished
        proves that the two ranks ran different calls."""
        return self._mailbox

    # --- the Transport interface ------------------------------------------------------

    def isend(self, peer: int, tag: int, buf, stamp: bytes = b"") -> PendingRequest:
        check_peer(SEND, self.rank, self.size, peer, tag)
        data = byte_view(buf)
        stamp = check_stamp(stamp)
        req = self._new_request(SEND, self.rank, peer, tag)
        closed = self._closed_why
        if closed is not None:
            req.fail(TransportClosed(f"{req.describe()}: {closed}", peer))
        elif peer == self.rank:
            if self._mailbox.deliver(peer, tag, data, stamp=stamp):
                req.complete(None, source=peer)
            else:
                req.fail(TransportClosed(f"{req.describe()}: this transport is closed", peer))
        else:
            gone = self._mailbox.gone.get(peer)
            if gone is not None:
                req.fail(PeerClosed(f"{req.describe()}: {gone}", peer))
            elif self._send(req, peer, tag, data, stamp):
                req.complete(None, source=peer)
        return req

    def irecv(self, peer: int, tag: int, buf=None, stamp: bytes = b"",
              whole_call: bool = False) -> PendingRequest:
        check_peer(RECV, self.rank, self.size, peer, tag)
        view = None if buf is None else byte_view(buf, writable=True)
        req = self._new_request(RECV, self.rank, peer, tag, view, check_stamp(stamp), whole_call)
        self._mailbox.post(req)
        return req

    # --- what a subclass supplies --------------------------------------------------------

    def _send(self, req: PendingRequest, peer: int, tag: int, data: memoryview,
              stamp: bytes) -> bool:
        """Move ``data`` (and ``stamp``) to ``peer`` (another rank, connected).
        True: the caller may reuse ``data`` now (``req`` is completed for it);
        False: the transport completes or fails ``req`` itself, later or now."""
        raise NotImplementedError
