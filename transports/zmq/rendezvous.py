"""Connecting the ranks of a ZeroMQ group: sockets, addresses and keys.

Each rank binds one PULL socket (the OS picks the port; for ipc a Linux
abstract-namespace name, ``ipc://@numcoll-...``, which no file backs, so a
killed rank leaves nothing in the temp directory) and publishes its *card* --
endpoint, session nonce, CURVE or not -- in the store as ``addr/{rank}`` (with
CURVE, its public key as ``curve/{rank}`` first); it connects one PUSH socket
to every peer's PULL.

Every socket is bounded before anyone is authenticated: no frame longer than
:data:`~transports.zmq.wire.MAX_WIRE_FRAME_NBYTES` is accepted
(``ZMQ_MAXMSGSIZE``: libzmq checks the declared size of every frame, the
handshake's included, and hangs up instead of buffering it), and a connection
must finish its handshake within :data:`HANDSHAKE_IVL_MS`. Who is admitted
at all is :mod:`transports.zmq.auth`'s business.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import sys
import tempfile
import uuid

import zmq

from ..base import Rendezvous, TransportError
from ..refusals import RefusalLog
from . import auth
from .wire import MAX_WIRE_FRAME_NBYTES

__all__ = ["Sockets", "open_sockets", "HANDSHAKE_IVL_MS"]

#: How long ZeroMQ may keep flushing queued messages (BYE included) after close.
LINGER_MS = 1000
#: A connection that has not finished its ZMTP handshake by then is dropped.
HANDSHAKE_IVL_MS = 10_000
#: TCP keepalive, so a vanished host (no RST) is noticed: idle, interval (s), probes.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 10, 5, 3
#: Bind addresses that peers cannot connect to: publish this host's address instead.
WILDCARD_HOSTS = ("*", "0.0.0.0", "")
#: A peer refusing our handshake: the ranks do not share a token or CURVE setting.
REFUSED_EVENTS = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
MONITOR_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | REFUSED_EVENTS
#: Refusals by libzmq on the listening socket (ZAP refusals are logged by the handler).
HANDSHAKE_EVENTS = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
#: What the listening socket's monitor reports: connections, and how their
#: handshakes end (see transports.zmq.progress.IOThread._read_pull_monitor).
PULL_EVENTS = (zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED |
               zmq.EVENT_HANDSHAKE_FAILED_AUTH | HANDSHAKE_EVENTS)
#: Linux abstract-namespace ipc endpoints (no file); elsewhere a private temp dir.
ABSTRACT_IPC = sys.platform.startswith("linux")


@dataclasses.dataclass
class Sockets:
    """A rank's sockets once connected. ``push``/``monitors``: per peer."""

    pull: zmq.Socket | None = None
    pull_monitor: zmq.Socket | None = None
    endpoint: str = ""
    push: dict[int, zmq.Socket] = dataclasses.field(default_factory=dict)
    monitors: dict[int, zmq.Socket] = dataclasses.field(default_factory=dict)
    peer_nonces: dict[int, int] = dataclasses.field(default_factory=dict)
    door: "auth._Door | None" = None
    ipc_dir: str | None = None

    def close(self) -> None:
        """Close everything from the constructing thread (before any I/O thread
        owns the sockets), and remove what the door and the ipc dir hold."""
        for peer in list(self.push):
            if peer in self.monitors:
                close_peer(self, peer, linger_ms=0)
            else:
                self.push.pop(peer).close(linger=0)
        if self.pull is not None:
            close_pull(self)
        self.release()

    def release(self) -> None:
        """What outlives the sockets: the door's registration, the ipc dir."""
        if self.door is not None:
            self.door.close()
            self.door = None
        if self.ipc_dir is not None:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
            self.ipc_dir = None


def open_sockets(scheme: str, rank: int, size: int, store: Rendezvous, *, host: str,
                 nonce: int, security: auth.Security, refusals: RefusalLog) -> Sockets:
    """Bind, publish this rank's card, read the peers' and connect to them."""
    ctx = zmq.Context.instance()
    s = Sockets()
    try:
        s.pull = ctx.socket(zmq.PULL)
        s.pull.setsockopt(zmq.RCVHWM, 0)
        s.pull.setsockopt(zmq.LINGER, 0)
        _bound(s.pull)
        s.door = security.serve(s.pull, scheme, refusals)
        keys = _exchange_keys(rank, size, store, security, s.door)
        # Handshakes libzmq itself rejects (a bad greeting, a mechanism other
        # than ours, a frame over the size limit) never reach the ZAP handler:
        # hear of them here (monitored before binding: no connection is missed).
        s.pull_monitor = s.pull.get_monitor_socket(PULL_EVENTS)
        s.endpoint = _bind(s, scheme, rank, host)
        mode = "curve" if security.curve else "-"
        store.set(f"addr/{rank}", f"{s.endpoint} {nonce:016x} {mode}".encode())
        for peer in range(size):
            if peer != rank:
                endpoint = _read_card(s, rank, peer, store.get(f"addr/{peer}"), security.curve)
                _connect(s, ctx, scheme, peer, endpoint, security, keys.get(peer, b""))
    except BaseException:
        s.close()
        raise
    return s


def release_cards(store: Rendezvous, rank: int, size: int, curve: bool) -> None:
    """At a clean close: count this rank out; the last rank of the group to close
    deletes every rank's card (and CURVE key). By then every rank has read them
    all -- each read its peers' cards before its transport existed -- so a store
    shared by many groups keeps nothing of a closed one. Best effort: a store
    without ``add``/``delete_key``, or one that fails, keeps them."""
    add, delete = getattr(store, "add", None), getattr(store, "delete_key", None)
    if add is None or delete is None or size == 1:
        return
    try:
        if add("closed", 1) < size:
            return
        for peer in range(size):
            delete(f"addr/{peer}")
            if curve:
                delete(f"curve/{peer}")
        delete("closed")
    except Exception:  # noqa: BLE001 - the keys stay; closing goes on
        pass


def close_peer(s: Sockets, peer: int, linger_ms: int) -> None:
    """Close ``peer``'s PUSH socket and its monitor."""
    sock = s.push.pop(peer)
    mon = s.monitors.pop(peer)
    sock.disable_monitor()
    mon.close(linger=0)
    sock.close(linger=linger_ms)


def close_pull(s: Sockets) -> None:
    if s.pull_monitor is not None:
        s.pull.disable_monitor()
        s.pull_monitor.close(linger=0)
    s.pull.close(linger=0)


def _bound(sock: zmq.Socket) -> None:
    """Limits every socket has before it meets anyone (see the module docstring)."""
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_WIRE_FRAME_NBYTES)
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)


def _exchange_keys(rank: int, size: int, store: Rendezvous, security: auth.Security,
                   door) -> dict[int, bytes]:
    """With CURVE, every rank's public key, known to the door before anyone
    can connect (a key learnt later would refuse a legitimate peer)."""
    if not security.curve:
        return {}
    store.set(f"curve/{rank}", security.public_key)
    keys = {peer: store.get(f"curve/{peer}") for peer in range(size) if peer != rank}
    if door is not None:
        door.allow_keys(keys.values())
    return keys


def _read_card(s: Sockets, rank: int, peer: int, card: bytes, curve: bool) -> str:
    try:
        endpoint, nonce, mode = card.decode().split(" ")
        s.peer_nonces[peer] = int(nonce, 16)
    except ValueError:
        raise TransportError(f"rank {rank}: rank {peer} published a malformed "
                             f"address {card[:80]!r} (another numcoll version?)", peer) from None
    if (mode == "curve") != curve:
        raise TransportError(f"rank {rank} and rank {peer} disagree on CURVE "
                             "(set NUMCOLL_CURVE alike on every rank)", peer)
    return endpoint


def _bind(s: Sockets, scheme: str, rank: int, host: str) -> str:
    if scheme == "ipc" and ABSTRACT_IPC:
        # Abstract namespace: no file, so nothing is left behind, even on SIGKILL.
        endpoint = f"ipc://@numcoll-{os.getpid()}-{uuid.uuid4().hex}-{rank}"
        s.pull.bind(endpoint)
        return endpoint
    if scheme == "ipc":
        s.ipc_dir = tempfile.mkdtemp(prefix="numcoll-ipc-")  # 0700: this user's only
        path = os.path.join(s.ipc_dir, f"numcoll-{uuid.uuid4().hex}-{rank}.sock")
        s.pull.bind(f"ipc://{path}")
        return f"ipc://{path}"
    _set_keepalive(s.pull)
    s.pull.bind(f"tcp://{host or '*'}:0")
    endpoint = s.pull.getsockopt_string(zmq.LAST_ENDPOINT)
    if host in WILDCARD_HOSTS:
        port = endpoint.rsplit(":", 1)[1]
        endpoint = f"tcp://{socket.gethostbyname(socket.gethostname())}:{port}"
    return endpoint


def _connect(s: Sockets, ctx: zmq.Context, scheme: str, peer: int, endpoint: str,
             security: auth.Security, key: bytes) -> None:
    sock = ctx.socket(zmq.PUSH)
    s.push[peer] = sock
    _bound(sock)  # the peer's side speaks first in a handshake too
    security.connect(sock, key)
    # Unbounded queue, and no IMMEDIATE: messages wait for the connection
    # instead of being refused; the algorithms bound what is in flight.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    if scheme == "tcp":
        _set_keepalive(sock)
    # Monitor before connecting, so the first CONNECTED is not missed.
    s.monitors[peer] = sock.get_monitor_socket(MONITOR_EVENTS)
    sock.connect(endpoint)


def _set_keepalive(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, KEEPALIVE_IDLE_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, KEEPALIVE_INTERVAL_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, KEEPALIVE_PROBES)
