"""ZeroMQ transport: ``tcp://`` between hosts, ``ipc://`` between processes on one host.

Each rank binds one PULL socket and connects one PUSH socket to every peer's
(:mod:`transports.zmq.rendezvous`); one I/O thread owns them all
(:mod:`transports.zmq.progress`); every arriving message is checked before
it is delivered (:mod:`transports.zmq.wire`), and who may connect at all is
:mod:`transports.zmq.auth`'s business (same user for ipc, token, CURVE).

A send takes one of three paths by size:

- below ``zero_copy_nbytes``: copied behind its header into one frame
  (``INLINE``), sent by the calling thread itself when nothing is queued
  ahead of it; the request completes at once;
- over ipc, up to the shared-memory slot size: copied into a slot shared with
  the peer (:mod:`transports.zmq.slabs`), its header naming the slot;
- otherwise a second frame sent without a copy (``DATA``; cut into several
  messages above :data:`~transports.zmq.wire.MAX_FRAME_NBYTES`), completing
  when ZeroMQ releases the caller's buffer.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings

from ..base import Rendezvous, TransportClosed
from ..endpoint import MailboxTransport, PendingRequest
from ..mailbox import Mailbox
from ..refusals import RefusalLog
from . import auth, rendezvous, wire
from .progress import JOIN_TIMEOUT_S, IOThread
from .slabs import SharedSlabs
from .wire import KIND_DATA, KIND_INLINE, KIND_MORE, KIND_SHM, MAX_FRAME_NBYTES

__all__ = ["ZmqTransport", "SCHEMES", "MAX_UNEXPECTED_NBYTES"]

SCHEMES = ("tcp", "ipc")
#: Default cap on bytes held per peer for receives not posted yet.
MAX_UNEXPECTED_NBYTES = 512 << 20
log = logging.getLogger(auth.LOGGER_NAME)


class ZmqTransport(MailboxTransport):
    """Point-to-point messaging over ZeroMQ (``tcp`` or ``ipc``).

    Parameters
    ----------
    scheme : {"tcp", "ipc"}
    rank, size : int
        This rank and the group size.
    store : Rendezvous
        Already prefixed for the group; carries ``addr/{rank}``. Its ``get``
        enforces the rendezvous deadline.
    host : str
        Interface the tcp PULL socket binds to (ignored for ipc).
    peer_grace_s : float
        How long a disconnected peer may stay silent before it is declared lost.
    zero_copy_nbytes : int
        Sends of at least this many bytes go out without a copy and complete
        when ZeroMQ releases the buffer; smaller ones are copied and complete at once.
    shm_slot_nbytes, shm_slots : int
        ipc only: shared-memory slots per peer, and their size (0 slots: none).
    token : bytes, optional
        Shared secret every connection must prove (ZeroMQ PLAIN, or CURVE keys
        exchanged through the store); see :mod:`transports.zmq.auth`.
    curve : bool
        Encrypt every connection with CURVE.
    max_unexpected_nbytes : int
        Bytes a peer may have waiting for receives not posted yet before it is cut off.

    ``refusals`` counts (and logs, rate-limited) every frame dropped and every
    connection refused.
    """

    def __init__(self, scheme: str, rank: int, size: int, store: Rendezvous, *,
                 host: str = "127.0.0.1",
                 peer_grace_s: float = 0.25, zero_copy_nbytes: int = 65536,
                 shm_slot_nbytes: int = 0, shm_slots: int = 0, token: bytes | None = None,
                 curve: bool = False, max_unexpected_nbytes: int = MAX_UNEXPECTED_NBYTES):
        if scheme not in SCHEMES:
            raise ValueError(f"unknown scheme {scheme!r}; expected one of {SCHEMES}")
        if not 0 <= rank < size:
            raise ValueError(f"invalid rank {rank} for group size {size}")
        self.rank = rank
        self.size = size
        self.scheme = scheme
        # No inline frame may outgrow what every socket accepts.
        self._inline_below = min(zero_copy_nbytes, MAX_FRAME_NBYTES)
        self._mailbox = Mailbox(rank, size, max_unexpected_nbytes, self._on_overflow)
        self._nonce = int.from_bytes(os.urandom(8), "little")
        self._security = auth.Security(token, curve)
        self.refusals = RefusalLog(f"numcoll {scheme} transport rank {rank}")
        self._close_lock = threading.Lock()
        self._close_called = False
        self._shm: SharedSlabs | None = None
        self._sockets = None
        self._store = store
        try:
            self._sockets = rendezvous.open_sockets(
                scheme, rank, size, store, host=host, nonce=self._nonce,
                security=self._security, refusals=self.refusals)
            if scheme == "ipc" and size > 1 and shm_slots > 0 and \
                    shm_slot_nbytes >= zero_copy_nbytes:
                self._shm = SharedSlabs(rank, size, store, shm_slot_nbytes, shm_slots,
                                        refusals=self.refusals)
        except BaseException:
            if self._sockets is not None:
                self._sockets.close()
            self.refusals.close()
            raise
        self.endpoint = self._sockets.endpoint
        self._io = IOThread(rank, size, self._sockets, self._mailbox, self._shm, self.refusals,
                            grace_s=peer_grace_s, header=self._header,
                            name=f"numcoll-{scheme}-io-rank{rank}")
        self._io.start()

    # --- MailboxTransport ---------------------------------------------------------------

    def _send(self, req: PendingRequest, peer: int, tag: int, data: memoryview,
              stamp: bytes) -> bool:
        io = self._io
        nbytes = data.nbytes
        if nbytes < self._inline_below:
            message = self._header(KIND_INLINE, tag, nbytes, stamp) + data
            # The copy frees the caller's buffer now.
            if io.send_now(peer, message) or io.post((peer, message, None, None, None)):
                return True
        elif self._shm is not None and nbytes <= self._shm.slot_nbytes and \
                self._shm.has_slab(peer):
            # Through a shared-memory slot: the request completes once the bytes
            # are copied in (here, or by the I/O thread when a slot frees up).
            header = self._header(KIND_SHM, tag, nbytes, stamp)
            if io.send_now(peer, header, data):
                return True
            if io.post((peer, header, data, req, None)):
                return False
        elif io.post(*self._data_ops(req, peer, tag, data, stamp)):
            # ZeroMQ reads the caller's buffer; the I/O thread completes the request
            # with ZeroMQ's tracker, which fires when the buffer is released.
            return False
        req.fail(self._closed_error(req))  # the transport is closing
        return False

    def _data_ops(self, req, peer: int, tag: int, data: memoryview, stamp: bytes) -> list:
        """The ops of a zero-copy send: one, or one per chunk (see :mod:`~transports.zmq.wire`)."""
        first = self._header(KIND_DATA, tag, data.nbytes, stamp)
        if data.nbytes <= MAX_FRAME_NBYTES:
            return [(peer, first, data, req, None)]
        parts = wire.chunks(data.nbytes)
        released: list = []  # every chunk's release event, for the request's completion
        more = self._header(KIND_MORE, tag, data.nbytes)
        return [(peer, first if i == 0 else more, data[start:stop],
                 req if i == len(parts) - 1 else None, released)
                for i, (start, stop) in enumerate(parts)]

    def _closed_error(self, req: PendingRequest) -> TransportClosed:
        return TransportClosed(f"{req.describe()}: {self._io.closed_reason}", req.peer)

    def _header(self, kind: int, tag: int, nbytes: int, stamp: bytes = b"") -> bytes:
        return wire.header(self._nonce, kind, self.rank, tag, nbytes, stamp)

    # --- what the I/O thread hands back ------------------------------------------------------

    def _on_overflow(self, peer: int, reason: str) -> None:
        """The mailbox holds too much from ``peer`` (called on the I/O thread)."""
        log.error("numcoll transport rank %d: %s", self.rank, reason)
        self._io.peer_left(peer, reason)

    # --- closing -----------------------------------------------------------------------------

    def close(self) -> None:
        with self._close_lock:
            if self._close_called:
                return
            self._close_called = True
            self._closed_why = f"rank {self.rank}'s transport was closed"
        self._mailbox.close(f"rank {self.rank}'s transport was closed")
        if not self._io.close():
            warnings.warn(f"rank {self.rank}: transport I/O thread did not stop within "
                          f"{JOIN_TIMEOUT_S}s", RuntimeWarning, stacklevel=2)
            return  # its sockets and fd are still in use: leave them to it
        self._sockets.release()
        if self._shm is not None:
            self._shm.close()
        if not self._io.lost:  # a crashed peer never counts itself out
            rendezvous.release_cards(self._store, self.rank, self.size, self._security.curve)
        self.refusals.close()

    def __repr__(self) -> str:
        return f"<ZmqTransport {self.endpoint} rank {self.rank}/{self.size}>"
