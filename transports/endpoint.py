"""The half of a transport every implementation shares: posting sends and
receives against a :class:`~transports.mailbox.Mailbox`.

A transport is two things: how bytes reach a peer (a function call, a
ZeroMQ socket, a shared-memory ring) and how arriving messages meet posted
receives (the mailbox). The second, and everything a send or a receive does
before any byte moves, is the same everywhere and lives here once:

- the arguments are checked (peer, tag, stamp, buffer) at the call;
- a send on a closed transport, or to a peer that has left, fails at once,
  naming why, and moves nothing;
- a send to this very rank is delivered into its own mailbox;
- a receive is posted in the mailbox, which matches it with what arrived.

A subclass supplies :meth:`MailboxTransport._send` (move the bytes of a send to
another rank, then complete or fail its request), sets ``_closed_why`` when it
closes, and, if its requests do more than wait (the shm transport's make progress while
they wait), ``_new_request``.
"""

from __future__ import annotations

from .base import (
    RECV,
    SEND,
    Arena,
    PeerClosed,
    TransportClosed,
    byte_view,
    check_peer,
    check_stamp,
)
from .mailbox import Mailbox
from .request import PendingRequest

__all__ = ["MailboxTransport"]


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
    #: Makes a request: ``(what, rank, peer, tag, buf=None, stamp=b"",
    #: whole_call=False) -> PendingRequest`` (a plain attribute, not a method:
    #: this runs for every message).
    _new_request = PendingRequest
    #: Why this transport takes no more sends (set when it closes); None while open.
    _closed_why: str | None = None

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
            gone = self._mailbox.gone_reason(peer)
            if gone is not None:
                req.fail(PeerClosed(f"{req.describe()}: {gone}", peer))
            else:
                self._send(req, peer, tag, data, stamp)
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
              stamp: bytes) -> None:
        """Move ``data`` (and ``stamp``) to ``peer`` (another rank, connected),
        completing ``req`` once the caller may reuse ``data``, or failing it."""
        raise NotImplementedError
