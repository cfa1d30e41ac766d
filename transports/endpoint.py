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

from typing import TYPE_CHECKING

from .base import (
    ANY_SOURCE,
    MAX_STAMP_NBYTES,
    MAX_TAG,
    Arena,
    PeerClosed,
    Rendezvous,
    TransportClosed,
)
from .pending import RECV, SEND, AllEvents, PendingRequest, describe  # re-exported

if TYPE_CHECKING:
    from .mailbox import Mailbox

__all__ = ["MailboxTransport", "PendingRequest", "AllEvents", "describe", "check_peer",
           "check_stamp", "byte_view", "forget", "Prefixed", "SEND", "RECV"]


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
    #: Whether the ranks are threads of this process (the inproc transport's are).
    in_process = False
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
