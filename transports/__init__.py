"""Moving bytes between the ranks of a group: the transport interface and its
implementations (in-process threads, ZeroMQ over ``tcp://`` and ``ipc://``,
shared-memory rings between the processes of one host).

This package never imports :mod:`numcoll`, and it is the only one that imports zmq.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

from .base import (
    ANY_SOURCE,
    Arena,
    CALL_SHIFT,
    MAX_TAG,
    MAX_STAMP_NBYTES,
    MessageSizeError,
    PeerClosed,
    Rendezvous,
    Request,
    SingleCopyRefused,
    StampMismatch,
    Transport,
    TransportClosed,
    TransportError,
    TransportTimeout,
)

__all__ = [
    "ANY_SOURCE",
    "CALL_SHIFT",
    "MAX_TAG",
    "Request",
    "Transport",
    "Arena",
    "Rendezvous",
    "TransportError",
    "TransportTimeout",
    "PeerClosed",
    "TransportClosed",
    "MessageSizeError",
    "StampMismatch",
    "SingleCopyRefused",
    "MAX_STAMP_NBYTES",
    "KINDS",
    "TransportOptions",
    "TransportFactory",
    "register",
    "create",
    "choose_kind",
    "host_key",
]

#: A transport factory: ``factory(rank, size, store, options) -> Transport``.
TransportFactory = Callable[[int, int, Rendezvous, "TransportOptions"], Transport]


@dataclasses.dataclass(frozen=True)
class TransportOptions:
    """What a group tells its transport. Every field has a default; a factory
    reads the fields that concern it.

    host : str
        Interface a network transport (tcp) listens on.
    peer_grace_s : float
        After a peer's connection drops, how long to keep draining what it sent
        before its pending receives fail (ZeroMQ transports).
    zero_copy_nbytes : int
        Sends at least this large go out without a copy (ZeroMQ transports).
    shm_slot_nbytes, shm_slots : int
        ``ipc`` only: payloads from ``zero_copy_nbytes`` up to ``shm_slot_nbytes``
        travel through ``shm_slots`` shared-memory slots per peer (one copy on
        each side instead of a socket's); ``shm_slots=0`` turns this off.
    token : str or bytes, optional
        A shared secret every connection must prove (``None``:
        ``NUMCOLL_AUTH_TOKEN``, if set): ZeroMQ transports see
        :mod:`transports.zmq.auth`, ``shm`` :mod:`transports.shm.rendezvous`.
    curve : bool, optional
        ZeroMQ transports: encrypt every connection with CURVE, admitting only
        the group's keys (``None``: ``NUMCOLL_CURVE=1``).
    max_unexpected_nbytes : int, optional
        ZeroMQ transports: bytes a peer may have waiting for receives not
        posted yet before it is cut off (``None``:
        ``NUMCOLL_MAX_UNEXPECTED_NBYTES``, else 512 MiB).
    arena_slot_nbytes : int
        ``shm`` only: payload bytes per rank and step of the shared arena
        (:mod:`transports.shm.arena`); 0: no arena.
    """

    host: str = "127.0.0.1"
    peer_grace_s: float = 0.25
    zero_copy_nbytes: int = 65536
    shm_slot_nbytes: int = 1 << 20
    shm_slots: int = 8
    token: str | bytes | None = dataclasses.field(default=None, repr=False)
    curve: bool | None = None
    max_unexpected_nbytes: int | None = None
    arena_slot_nbytes: int = 1 << 20


_REGISTRY: dict[str, TransportFactory] = {}
#: The registered kinds, in registration order (kept current by :func:`register`).
KINDS: tuple[str, ...] = ()


def register(kind: str, factory: TransportFactory, *, replace: bool = False) -> None:
    """Make ``create(kind, ...)`` (and ``ProcessGroup.Options(transport=kind)``)
    build transports with ``factory(rank, size, store, options)``.

    A new transport is one module and one call of this. ``ValueError`` if the
    kind exists already (unless ``replace``) or is not a non-empty str.
    """
    global KINDS
    if not isinstance(kind, str) or not kind:
        raise ValueError(f"register: kind must be a non-empty str, got {kind!r}")
    if not callable(factory):
        raise TypeError(f"register: factory for {kind!r} must be callable")
    if kind in _REGISTRY and not replace:
        raise ValueError(f"register: transport kind {kind!r} is already registered")
    _REGISTRY[kind] = factory
    KINDS = tuple(_REGISTRY)


def create(kind: str | TransportFactory, rank: int, size: int, store: Rendezvous,
           options: TransportOptions | None = None) -> Transport:
    """Connect this rank to the other ranks of a group.

    Every rank of the group calls this (concurrently) with the same ``kind``
    and a ``store`` already prefixed for the group.

    Parameters
    ----------
    kind : str or factory
        A registered kind (see :data:`KINDS`): ``inproc`` (ranks are threads of
        this process), ``tcp`` (any hosts), ``ipc`` (processes on one host:
        Unix domain sockets plus shared-memory slots), ``shm`` (processes on one
        Linux host: shared-memory rings polled by the waiting thread,
        :mod:`transports.shm.transport`), ``hier`` (several hosts: shm among
        each host's ranks, tcp across, :mod:`transports.hier`); or a factory.
    rank, size : int
        This rank and the group size.
    store : Rendezvous
        ``set``/``get`` of bytes; addresses are exchanged through it.
    options : TransportOptions

    Raises
    ------
    ValueError
        For an unknown ``kind`` or a rank outside ``[0, size)``.
    """
    options = options if options is not None else TransportOptions()
    if callable(kind):
        return kind(rank, size, store, options)
    try:
        factory = _REGISTRY[kind]
    except (KeyError, TypeError):
        raise ValueError(f"unknown transport {kind!r}; valid kinds are "
                         f"{', '.join(KINDS)}") from None
    return factory(rank, size, store, options)


def host_key() -> str:
    """What ranks that can share ipc (abstract Unix sockets, /dev/shm) have in
    common: the host name, and on Linux the network namespace and boot, since
    containers and namespaces often share a host name but not their sockets."""
    import socket

    key = socket.gethostname()
    try:
        key += f"/netns{os.stat('/proc/self/ns/net').st_ino}"
        with open("/proc/sys/kernel/random/boot_id") as f:
            key += f"/boot{f.read().strip()}"
    except OSError:  # not Linux: the host name alone
        pass
    return key


def choose_kind(here: str, places: list[str]) -> str:
    """The transport for a group whose ranks run at ``places`` ("host:pid" each,
    this rank's being ``here``): ``inproc`` when every rank is a thread of this
    process; when all share this host, ``shm`` where Linux offers what it needs
    (memfd_create, fd passing), else ``ipc``; over several hosts, ``hier``
    (shm within each host, tcp across: :mod:`transports.hier`) when some host
    has more than one rank and shm is available, else ``tcp``."""
    if all(p == here for p in places):
        return "inproc"
    hosts = [p.rsplit(":", 1)[0] for p in places]
    if len(set(hosts)) > 1:
        shared = len(set(hosts)) < len(hosts)
        return "hier" if shared and shm_available() else "tcp"
    return "shm" if shm_available() else "ipc"


def shm_available() -> bool:
    """Whether the ``shm`` transport can run here (Linux: memfd_create, SCM_RIGHTS)."""
    import os
    import socket

    return hasattr(os, "memfd_create") and hasattr(socket, "send_fds")


def _inproc(rank, size, store, options):
    from .inproc import InprocTransport

    return InprocTransport(rank, size, store)


def _zmq(scheme):
    def factory(rank, size, store, options):
        from .zmq import auth
        from .zmq.transport import MAX_UNEXPECTED_NBYTES, ZmqTransport

        token, curve = auth.from_env(options.token, options.curve)
        cap = options.max_unexpected_nbytes
        if cap is None:
            raw = os.environ.get("NUMCOLL_MAX_UNEXPECTED_NBYTES")
            cap = MAX_UNEXPECTED_NBYTES if raw is None else int(raw, 0)
        return ZmqTransport(scheme, rank, size, store, host=options.host,
                            peer_grace_s=options.peer_grace_s,
                            zero_copy_nbytes=options.zero_copy_nbytes,
                            shm_slot_nbytes=options.shm_slot_nbytes,
                            shm_slots=options.shm_slots, token=token, curve=curve,
                            max_unexpected_nbytes=cap)

    factory.__name__ = f"zmq_{scheme}"
    return factory


def _shm(rank, size, store, options):
    from . import tokens
    from .shm.transport import ShmRingTransport

    # Rings hold two of the largest messages the ipc slots would carry.
    return ShmRingTransport(rank, size, store, inline_nbytes=options.shm_slot_nbytes,
                            arena_slot_nbytes=options.arena_slot_nbytes,
                            token=tokens.resolve(options.token))


def _hier(rank, size, store, options):
    from .hier import HierTransport

    return HierTransport(rank, size, store, options)


register("inproc", _inproc)
register("tcp", _zmq("tcp"))
register("ipc", _zmq("ipc"))
register("shm", _shm)
register("hier", _hier)
