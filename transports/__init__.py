"""Moving bytes between the ranks of a group: the transport interface and its
implementations (in-process threads, ZeroMQ over ``tcp://`` and ``ipc://``).

This package never imports :mod:`numcoll`, and it is the only one that imports zmq.
"""

from __future__ import annotations

from .base import (
    ANY_SOURCE,
    MAX_TAG,
    MAX_STAMP_NBYTES,
    MessageSizeError,
    PeerClosed,
    Rendezvous,
    Request,
    StampMismatch,
    Transport,
    TransportClosed,
    TransportError,
    TransportTimeout,
)

__all__ = [
    "ANY_SOURCE",
    "MAX_TAG",
    "Request",
    "Transport",
    "Rendezvous",
    "TransportError",
    "TransportTimeout",
    "PeerClosed",
    "TransportClosed",
    "MessageSizeError",
    "StampMismatch",
    "MAX_STAMP_NBYTES",
    "KINDS",
    "create",
]

#: The transports :func:`create` makes.
KINDS = ("inproc", "tcp", "ipc", "shm")


def create(kind: str, rank: int, size: int, store: Rendezvous, *, host: str = "127.0.0.1",
           timeout_s: float = 300.0, peer_grace_s: float = 0.25,
           zero_copy_nbytes: int = 65536, shm_slot_nbytes: int = 1 << 20,
           shm_slots: int = 8) -> Transport:
    """Connect this rank to the other ranks of a group.

    Every rank of the group calls this (concurrently) with the same ``kind``
    and a ``store`` already prefixed for the group.

    Parameters
    ----------
    kind : {"inproc", "tcp", "ipc", "shm"}
        ``inproc``: ranks are threads of this process. ``tcp``: any hosts.
        ``ipc``: processes on one host (Unix domain sockets). ``shm``: processes
        on one host (Linux), through shared-memory rings polled by the waiting
        thread (:mod:`transports.shmring`); messages up to ``shm_slot_nbytes``
        are one ring record.
    rank, size : int
        This rank and the group size.
    store : Rendezvous
        ``set``/``get`` of bytes; addresses are exchanged through it.
    host : str
        Interface the tcp transport listens on.
    timeout_s : float
        The group's timeout in seconds, kept on the transport as ``timeout_s``;
        each wait takes its own deadline.
    peer_grace_s : float
        After a peer's connection drops, how long to keep draining what it sent
        before its pending receives fail (ZeroMQ transports).
    zero_copy_nbytes : int
        Sends at least this large go out without a copy (ZeroMQ transports).
    shm_slot_nbytes, shm_slots : int
        ``ipc`` only: payloads from ``zero_copy_nbytes`` up to ``shm_slot_nbytes``
        travel through ``shm_slots`` shared-memory slots per peer (one copy on
        each side instead of a socket's); ``shm_slots=0`` turns this off.

    Returns
    -------
    Transport

    Raises
    ------
    ValueError
        For an unknown ``kind`` or a rank outside ``[0, size)``.
    """
    if kind == "inproc":
        from .inproc import InprocTransport

        return InprocTransport(rank, size, store, timeout_s=timeout_s)
    if kind in ("tcp", "ipc"):
        from .zmq_transport import ZmqTransport  # zmq is imported only when used

        return ZmqTransport(kind, rank, size, store, host=host, timeout_s=timeout_s,
                            peer_grace_s=peer_grace_s, zero_copy_nbytes=zero_copy_nbytes,
                            shm_slot_nbytes=shm_slot_nbytes, shm_slots=shm_slots)
    if kind == "shm":
        from .shmring import ShmRingTransport

        # Rings hold two of the largest messages the ipc slots would carry.
        return ShmRingTransport(rank, size, store, timeout_s=timeout_s,
                                inline_nbytes=shm_slot_nbytes)
    raise ValueError(f"unknown transport {kind!r}; valid kinds are {', '.join(KINDS)}")
