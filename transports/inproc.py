"""In-process transport: the ranks are threads of one process.

The ranks of a group share a *fabric*: one :class:`~transports.mailbox.Mailbox`
per rank, found through a process-global registry under an id that rank 0
publishes in the store. A send copies the bytes into the receiver's mailbox
(straight into a posted buffer when there is one) and completes at once.
"""

from __future__ import annotations

import threading
import uuid

from .base import PeerClosed, Rendezvous, TransportError
from .endpoint import MailboxTransport, PendingRequest, forget
from .mailbox import Mailbox

__all__ = ["InprocTransport"]

#: Store key under which rank 0 publishes the fabric id.
FABRIC_KEY = "inproc/fabric"


class _Fabric:
    def __init__(self, size: int):
        self.mailboxes = [Mailbox(rank, size) for rank in range(size)]
        self.open_count = size  # dropped from the registry when every rank has closed
        self.found = 0  # ranks that found it; the last one removes its id from the store


_registry_lock = threading.Lock()
_fabrics: dict[str, _Fabric] = {}


class InprocTransport(MailboxTransport):
    """Transport between ranks that are threads of this process.

    Parameters
    ----------
    rank, size : int
        This rank and the group size.
    store : Rendezvous
        Already prefixed for the group; rank 0 sets :data:`FABRIC_KEY`, the others get it.
    Every wait takes its own deadline.
    """

    in_process = True

    def __init__(self, rank: int, size: int, store: Rendezvous):
        if not 0 <= rank < size:
            raise ValueError(f"invalid rank {rank} for group size {size}")
        self.rank = rank
        self.size = size
        if rank == 0:
            self._fabric_id = uuid.uuid4().hex
            with _registry_lock:  # registered before it is published: others always find it
                _fabrics[self._fabric_id] = _Fabric(size)
            store.set(FABRIC_KEY, self._fabric_id.encode())
        else:
            self._fabric_id = store.get(FABRIC_KEY).decode()
        with _registry_lock:
            fabric = _fabrics.get(self._fabric_id)
            if fabric is not None:
                fabric.found += 1
                everyone = fabric.found == size
        if fabric is None:
            raise TransportError(
                f"rank {rank}: in-process fabric {self._fabric_id} not found "
                "(every rank had already closed, or rank 0 is in another process)")
        if everyone:  # every rank has read the id: a shared store need not keep it
            forget(store, FABRIC_KEY)
        self._fabric = fabric
        self._mailbox = fabric.mailboxes[rank]
        self._closed = False
        self._close_lock = threading.Lock()

    def _send(self, req: PendingRequest, peer: int, tag: int, data: memoryview,
              stamp: bytes) -> bool:
        if self._fabric.mailboxes[peer].deliver(self.rank, tag, data, stamp=stamp):
            return True  # copied (or taken straight into the receive's buffer)
        req.fail(PeerClosed(f"{req.describe()}: rank {peer} closed its transport", peer))
        return False

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            self._closed_why = "this transport is closed"
        self._mailbox.close(f"rank {self.rank}'s transport was closed")
        for mailbox in self._fabric.mailboxes:
            if mailbox is not self._mailbox:
                mailbox.peer_gone(self.rank, f"rank {self.rank} closed its transport")
        with _registry_lock:
            self._fabric.open_count -= 1
            if self._fabric.open_count == 0:
                _fabrics.pop(self._fabric_id, None)

    def __repr__(self) -> str:
        return f"<InprocTransport rank {self.rank}/{self.size}{' closed' if self._closed else ''}>"
