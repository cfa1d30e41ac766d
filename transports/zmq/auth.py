"""Who may connect to a rank's ZeroMQ socket.

A rank's PULL socket is the door strangers knock on. Three locks, from the
weakest to the strongest, chosen by :class:`Security`:

- always, over ``ipc``: ZeroMQ's ZAP handler admits only processes of this
  user (the kernel tells libzmq the peer's uid; abstract-namespace sockets have
  no file permissions to do it);
- with a token (``NUMCOLL_AUTH_TOKEN``): the PLAIN mechanism, whose password is
  an HMAC-SHA256 of the token (:func:`transports.tokens.proof`, label
  ``transport``; the token itself never travels);
- with CURVE (``NUMCOLL_CURVE=1``): every connection is encrypted, and only the
  group's own public keys (exchanged through the store) are admitted.

Every refusal is counted and logged, rate-limited, through the transport's
:class:`~transports.refusals.RefusalLog`. Every frame that passes the door is
still checked (:mod:`transports.zmq.wire`).

One ZAP handler serves every socket of the process (ZeroMQ allows one per
context); each socket registers its policy under a ZAP domain of its own, and
the handler's thread exits when the last one unregisters.
"""

from __future__ import annotations

import dataclasses
import hmac
import itertools
import logging
import os
import sys
import threading
import time

import zmq
from zmq.utils import z85

from .. import tokens
from ..refusals import RefusalLog

__all__ = ["Security", "LOGGER_NAME", "transport_password", "from_env"]

LOGGER_NAME = "numcoll.transport"
log = logging.getLogger(LOGGER_NAME)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_VERSION = b"1.0"
PLAIN_USER = b"numcoll"
#: How long the ZAP thread sleeps in poll when nothing happens (it is woken on
#: unregister through an fd; this is only a safety net).
ZAP_POLL_MS = 1000
#: close() waits at most this long for the ZAP thread.
ZAP_JOIN_TIMEOUT_S = 2.0


def transport_password(token: bytes) -> bytes:
    """The PLAIN password derived from ``token``: a sniffer of an unencrypted
    connection learns this, never the token (which also guards the store)."""
    return tokens.proof(token, b"transport").hex().encode()


def from_env(token=None, curve=None) -> tuple[bytes | None, bool]:
    """``token`` and ``curve`` with ``None`` replaced by ``NUMCOLL_AUTH_TOKEN``
    and ``NUMCOLL_CURVE``."""
    if curve is None:
        curve = os.environ.get("NUMCOLL_CURVE", "0").strip().lower() in ("1", "true", "yes", "on")
    return tokens.resolve(token), bool(curve)


@dataclasses.dataclass
class Security:
    """How a rank's sockets authenticate. ``token``: shared secret (bytes) or
    None; ``curve``: encrypt with CURVE. :meth:`keypair` is this rank's CURVE
    key pair, made on construction when ``curve``."""

    token: bytes | None = None
    curve: bool = False
    public_key: bytes = b""
    secret_key: bytes = dataclasses.field(default=b"", repr=False)

    def __post_init__(self):
        if self.curve:
            if not zmq.has("curve"):
                raise RuntimeError("NUMCOLL_CURVE=1 needs libzmq built with CURVE (libsodium)")
            self.public_key, self.secret_key = zmq.curve_keypair()

    @property
    def mechanism(self) -> bytes:
        return b"CURVE" if self.curve else b"PLAIN" if self.token else b"NULL"

    def serve(self, sock: zmq.Socket, scheme: str, refused: RefusalLog) -> "_Door | None":
        """Configure the listening ``sock`` (before bind); the returned door
        must be closed with the socket. None if nothing is checked."""
        check_uid = scheme == "ipc" and sys.platform.startswith("linux")
        if not (self.curve or self.token or check_uid):
            return None
        door = _Door(self, os.getuid() if check_uid else None, refused)
        sock.setsockopt(zmq.ZAP_DOMAIN, door.domain.encode())
        if self.curve:
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret_key)
        elif self.token:
            sock.setsockopt(zmq.PLAIN_SERVER, 1)
        return door

    def connect(self, sock: zmq.Socket, server_public_key: bytes) -> None:
        """Configure a connecting ``sock`` (before connect) for a peer whose
        CURVE public key is ``server_public_key``."""
        if self.curve:
            sock.setsockopt(zmq.CURVE_SERVERKEY, server_public_key)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public_key)
            sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret_key)
        elif self.token:
            sock.setsockopt(zmq.PLAIN_USERNAME, PLAIN_USER)
            sock.setsockopt(zmq.PLAIN_PASSWORD, transport_password(self.token))


class _Door:
    """One listening socket's admission policy, registered with the ZAP handler."""

    _ids = itertools.count()

    def __init__(self, security: Security, uid: int | None, refused: RefusalLog):
        self.domain = f"numcoll-{os.getpid()}-{next(self._ids)}"
        self.security = security
        self.uid = uid
        self.curve_keys: set[bytes] = set()  # z85 public keys of the group
        self.refused = refused
        _Handler.register(self)

    def allow_keys(self, z85_keys) -> None:
        self.curve_keys.update(z85_keys)

    def admit(self, address: str, mechanism: bytes, credentials: list[bytes]) -> str | None:
        """None to admit; else why not (a short phrase: it keys the refusal log)."""
        if mechanism != self.security.mechanism:
            return f"mechanism {mechanism.decode(errors='replace')}"
        if self.uid is not None:
            # libzmq appends the peer's credentials to an ipc address: "...:uid:gid:pid".
            parts = address.rsplit(":", 3)
            if len(parts) == 4 and parts[1].isdigit() and int(parts[1]) != self.uid:
                return "ipc peer of another user"
        if mechanism == b"PLAIN":
            if len(credentials) != 2 or not hmac.compare_digest(
                    credentials[1], transport_password(self.security.token)):
                return "wrong token"
        elif mechanism == b"CURVE":
            key = z85.encode(credentials[0]) if credentials else b""
            if key not in self.curve_keys:
                return "CURVE key not of this group"
        return None

    def close(self) -> None:
        _Handler.unregister(self)


class _Handler:
    """The process's ZAP handler thread (ZeroMQ RFC 27) and its registry."""

    _lock = threading.Lock()
    _doors: dict[str, _Door] = {}
    _thread: threading.Thread | None = None
    _wake_r = _wake_w = -1
    _pid = os.getpid()

    @classmethod
    def register(cls, door: _Door) -> None:
        if cls._pid != os.getpid():
            # A forked child: its parent's handler thread and context did not come
            # along, and sockets whose ZAP handler is missing would admit anyone.
            cls._lock, cls._doors, cls._thread, cls._pid = (threading.Lock(), {}, None,
                                                            os.getpid())
        with cls._lock:
            cls._doors[door.domain] = door
            if cls._thread is None:
                ctx = zmq.Context.instance()
                sock = ctx.socket(zmq.REP)
                sock.setsockopt(zmq.LINGER, 0)
                try:
                    _bind_soon(sock, ZAP_ENDPOINT)
                except zmq.ZMQError as exc:
                    sock.close()
                    del cls._doors[door.domain]
                    raise RuntimeError(f"numcoll cannot serve ZeroMQ authentication: another "
                                       f"ZAP handler owns {ZAP_ENDPOINT} ({exc})") from exc
                cls._wake_r, cls._wake_w = os.pipe()
                cls._thread = threading.Thread(target=cls._run, args=(sock, cls._wake_r),
                                               name="numcoll-zap", daemon=True)
                cls._thread.start()

    @classmethod
    def unregister(cls, door: _Door) -> None:
        with cls._lock:
            cls._doors.pop(door.domain, None)
            if cls._doors or cls._thread is None:
                return
            thread, cls._thread = cls._thread, None
            wake_r, wake_w = cls._wake_r, cls._wake_w
        # Joined without the lock: the thread may be answering a request, which
        # takes it. A handler started meanwhile waits for the endpoint (_bind_soon).
        os.write(wake_w, b"x")
        thread.join(ZAP_JOIN_TIMEOUT_S)
        os.close(wake_w)
        if not thread.is_alive():
            os.close(wake_r)

    @classmethod
    def _run(cls, sock: zmq.Socket, wake_fd: int) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(wake_fd, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll(ZAP_POLL_MS))
                if wake_fd in ready:
                    return
                if sock in ready:
                    request = sock.recv_multipart()
                    try:
                        cls._answer(sock, request)
                    except Exception:  # noqa: BLE001 - refuse that peer, serve the next
                        log.exception("numcoll ZAP handler: bad request %r", request[:6])
                        sock.send_multipart([ZAP_VERSION, request[1] if len(request) > 1
                                             else b"", b"500", b"internal error", b"", b""])
        finally:
            try:  # at once, so that a handler started next can bind the endpoint
                sock.unbind(ZAP_ENDPOINT)
            except zmq.ZMQError:
                pass
            sock.close(linger=0)

    @classmethod
    def _answer(cls, sock: zmq.Socket, msg: list[bytes]) -> None:
        if len(msg) < 6:
            sock.send_multipart([ZAP_VERSION, msg[1] if len(msg) > 1 else b"", b"400",
                                 b"malformed", b"", b""])
            return
        version, request_id, domain, address, _identity, mechanism = msg[:6]
        with cls._lock:
            door = cls._doors.get(domain.decode(errors="replace"))
        why = "unknown ZAP domain" if door is None else \
            door.admit(address.decode(errors="replace"), mechanism, msg[6:])
        if version != ZAP_VERSION:
            why = "ZAP version"
        if why is None:
            sock.send_multipart([ZAP_VERSION, request_id, b"200", b"OK", b"numcoll", b""])
        else:
            if door is not None:
                door.refused.refuse(why, _who(address.decode(errors="replace")))
            sock.send_multipart([ZAP_VERSION, request_id, b"400", why.encode()[:200], b"", b""])


def _who(address: str) -> str:
    """A ZAP address for the log: "127.0.0.1", or for ipc "uid 0 pid 123"."""
    parts = address.rsplit(":", 3)
    if len(parts) == 4 and parts[1].isdigit() and parts[3].isdigit():
        return f"uid {parts[1]} pid {parts[3]}"
    return address


def _bind_soon(sock: zmq.Socket, endpoint: str, within_s: float = 1.0) -> None:
    """Bind, retrying briefly: a handler that just stopped may still hold the
    endpoint while ZeroMQ finishes closing its socket."""
    give_up = time.monotonic() + within_s
    while True:
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > give_up:
                raise
            time.sleep(0.01)
