"""TCPStore: a key-value store served over TCP by the master rank.

The master runs a small single-threaded server (``selectors`` on a daemon
thread); every TCPStore, the master's included, is a client with one
connection guarded by a lock. Blocking ``get``/``wait`` are parked by the
server until the keys appear or the request's deadline passes, so clients
never poll.

Wire format: a frame is a big-endian u32 payload length and the payload. A
request's payload is an op code (u8) and fields; a reply's is a status (u8)
and fields; each field is a u32 length and its bytes.

Trust: the server greets every connection with a frame of its own
(:data:`GREETING_MAGIC`, whether a token is required, a 32-byte challenge), so
a client that reached something else fails with a clear error instead of
hanging: at once if it answers anything else or hangs up, after
``NUMCOLL_STORE_PROBE_S`` (5 s) if it says nothing. With a token
(``token=`` or ``NUMCOLL_AUTH_TOKEN``) the client answers the challenge with
an HMAC-SHA256 over both sides' random numbers and the server proves the same
back: neither side trusts a peer that does not know the token, the token
never travels, and a recorded handshake cannot be replayed. The server drops
(and logs, logger ``numcoll.bootstrap.store``) connections that fail; it caps the size
of a request frame (``max_frame_nbytes``, 64 MiB by default) and the bytes of
replies a connection has not read (a client that never reads is dropped), and
answers a malformed request with an error, never by dying. Clients bound
every call by a deadline and never hold their lock while reconnecting, so a
thread that gives a short deadline (``set(..., timeout=)``) returns in time
even while another is stuck on a dead store.
"""

from __future__ import annotations

import datetime
import enum
import hashlib
import heapq
import hmac
import itertools
import logging
import operator
import os
import selectors
import socket
import struct
import threading
import time

from .. import config as _config
from ..errors import NumcollError
from .store import (
    DEFAULT_STORE_TIMEOUT,
    Store,
    StoreTimeoutError,
    _added,
    _compare_set,
    _ms,
    _timeout_error,
)

__all__ = ["TCPStore", "StoreConnectionError", "StoreAuthError"]

#: Connection attempts are retried (the master may not be up yet) after this
#: many seconds, doubling up to CONNECT_RETRY_MAX_S, until the store's timeout.
CONNECT_RETRY_MIN_S = 0.01
CONNECT_RETRY_MAX_S = 0.5
#: The server answers a parked get/wait itself when its deadline passes; the
#: client waits this much longer before it gives up on an unresponsive server.
REPLY_GRACE_S = 1.0
#: Once a connection has this many reply bytes (beyond one frame) it has not
#: read, the server drops it.
MAX_UNREAD_REPLY_NBYTES = 4 << 20
#: After an established connection is lost, how long reconnecting may take
#: before the store is taken for dead; a refused reconnect fails at once
#: (connecting the first time may take the whole timeout: the master may not
#: be up yet).
RECONNECT_WINDOW_S = 1.0
#: An unauthenticated connection must finish the handshake within this many seconds.
HANDSHAKE_TIMEOUT_S = 10.0
GREETING_MAGIC = b"numcoll-store/1"
_CHALLENGE_NBYTES = 32
_MAC_NBYTES = 32
_AUTH_REQUIRED = 1
LISTEN_BACKLOG = 1024
RECV_CHUNK_NBYTES = 1 << 18
#: How long close() waits for the server thread to finish.
SERVER_JOIN_TIMEOUT_S = 5.0

# Bookkeeping keys for the world_size handshake; num_keys does not count them.
_RESERVED_PREFIX = "\0numcoll/"
_JOINED_KEY = _RESERVED_PREFIX + "joined"
_READY_KEY = _RESERVED_PREFIX + "ready"

_LENGTH = struct.Struct("!I")
_GREETING_NBYTES = len(GREETING_MAGIC) + 1 + _CHALLENGE_NBYTES

log = logging.getLogger("numcoll.bootstrap.store")


class _Op(enum.IntEnum):
    SET = 1
    GET = 2
    ADD = 3
    COMPARE_SET = 4
    WAIT = 5
    CHECK = 6
    DELETE = 7
    NUM_KEYS = 8


_OK, _TIMEOUT, _ERROR = 0, 1, 2


class StoreConnectionError(NumcollError, ConnectionError):
    """The TCPStore server could not be reached, or the connection was lost."""


class StoreAuthError(StoreConnectionError):
    """The other end of a TCPStore connection is not a numcoll store, or one
    side could not prove it knows the token."""


def _mac(token: bytes, side: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(token, b"numcoll-store/" + side + server_nonce + client_nonce,
                    hashlib.sha256).digest()


def _token_from(token) -> bytes | None:
    if token is None:
        token = os.environ.get("NUMCOLL_AUTH_TOKEN") or None
    if isinstance(token, str):
        token = token.encode()
    if token is not None and not isinstance(token, bytes):
        raise TypeError(f"TCPStore token must be str or bytes, got {type(token).__name__}")
    return token or None


def _frame(code: int, fields: list[bytes]) -> bytes:
    parts = [bytes([code])]
    for field in fields:
        parts += (_LENGTH.pack(len(field)), field)
    payload = b"".join(parts)
    return _LENGTH.pack(len(payload)) + payload


def _parse(payload: bytes) -> tuple[int, list[bytes]]:
    fields, pos = [], 1
    while pos < len(payload):
        (n,) = _LENGTH.unpack_from(payload, pos)
        pos += _LENGTH.size
        if pos + n > len(payload):
            raise ValueError("malformed frame: field runs past the end")
        fields.append(payload[pos:pos + n])
        pos += n
    return payload[0], fields


class _Waiter:
    """A parked get/wait: the connection, its keys and its deadline."""

    __slots__ = ("conn", "op", "keys", "missing", "deadline", "active")

    def __init__(self, conn, op, keys, missing, deadline):
        self.conn, self.op, self.keys, self.deadline = conn, op, keys, deadline
        self.missing = set(missing)
        self.active = True


class _Connection:
    __slots__ = ("sock", "inbuf", "outbuf", "waiter", "events", "open", "peer", "challenge",
                 "authed")

    def __init__(self, sock, peer, challenge: bytes, authed: bool):
        self.sock = sock
        self.peer = peer
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.waiter: _Waiter | None = None
        self.events = selectors.EVENT_READ
        self.open = True
        self.challenge = challenge
        self.authed = authed


class _Server:
    """The master's server: all state is owned by its one thread."""

    def __init__(self, host: str, port: int, token: bytes | None, max_frame_nbytes: int):
        self._token = token
        self._max_frame_nbytes = max_frame_nbytes
        self._max_outbuf_nbytes = max_frame_nbytes + MAX_UNREAD_REPLY_NBYTES
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                    flags=socket.AI_PASSIVE)[0][0]
        self._listener = socket.create_server((host, port), family=family,
                                              backlog=LISTEN_BACKLOG)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        # close() writes to this pair to wake the selector.
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._data: dict[bytes, bytes] = {}
        self._waiting: dict[bytes, list[_Waiter]] = {}
        self._deadlines: list = []  # heap of (deadline, seq, waiter); stale entries skipped
        self._seq = itertools.count()
        self._runnable: list[_Connection] = []
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"numcoll-tcpstore-server:{self.port}")
        self._thread.start()

    def stop(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(SERVER_JOIN_TIMEOUT_S)

    # -- event loop ---------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                for key, events in self._sel.select(self._next_timeout()):
                    if key.fileobj is self._wake_r:
                        return
                    if key.fileobj is self._listener:
                        self._accept()
                        continue
                    conn = key.data
                    try:
                        if events & selectors.EVENT_READ:
                            self._read(conn)
                        if conn.open and events & selectors.EVENT_WRITE:
                            self._flush(conn)
                    except Exception as exc:  # one bad client must not take the server down
                        self._drop(conn, f"error serving it: {exc!r}")
                self._expire()
                while self._runnable:
                    conn = self._runnable.pop()
                    try:
                        self._process(conn)
                    except Exception as exc:  # noqa: BLE001 - as above
                        self._drop(conn, f"error serving it: {exc!r}")
        finally:
            for key in list(self._sel.get_map().values()):
                key.fileobj.close()
            self._sel.close()
            self._wake_w.close()

    def _next_timeout(self) -> float | None:
        while self._deadlines and not self._deadlines[0][2].active:
            heapq.heappop(self._deadlines)
        if not self._deadlines:
            return None
        return max(0.0, self._deadlines[0][0] - time.monotonic())

    def _accept(self) -> None:
        try:
            sock, peer = self._listener.accept()
        except OSError:  # gone already, or out of fds: the others keep being served
            return
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        challenge = os.urandom(_CHALLENGE_NBYTES)
        conn = _Connection(sock, peer, challenge, authed=self._token is None)
        self._sel.register(sock, selectors.EVENT_READ, conn)
        flags = _AUTH_REQUIRED if self._token is not None else 0
        greeting = GREETING_MAGIC + bytes([flags]) + challenge
        conn.outbuf += _LENGTH.pack(len(greeting)) + greeting
        self._flush(conn)
        if not conn.authed:  # a stranger that never answers must not hold a socket forever
            self._park_handshake(conn)

    def _read(self, conn: _Connection) -> None:
        try:
            chunk = conn.sock.recv(RECV_CHUNK_NBYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:  # the client went away, perhaps mid-request
            self._drop(conn, None)
            return
        conn.inbuf += chunk
        self._process(conn)

    def _process(self, conn: _Connection) -> None:
        """Serve complete frames in order; a parked request holds back the rest."""
        while conn.open and conn.waiter is None and len(conn.inbuf) >= _LENGTH.size:
            (n,) = _LENGTH.unpack_from(conn.inbuf)
            if not conn.authed and n != _CHALLENGE_NBYTES + _MAC_NBYTES:
                # Before the handshake a stranger gets no buffer beyond the answer's size.
                self._drop(conn, f"a {n}-byte frame instead of the authentication answer")
                return
            if n == 0 or n > self._max_frame_nbytes:
                self._drop(conn, f"frame of {n} bytes (limit {self._max_frame_nbytes})")
                return
            if len(conn.inbuf) < _LENGTH.size + n:
                return
            payload = bytes(conn.inbuf[_LENGTH.size:_LENGTH.size + n])
            del conn.inbuf[:_LENGTH.size + n]
            if not conn.authed:
                self._authenticate(conn, payload)
                continue
            try:
                op, fields = _parse(payload)
                self._handle(conn, op, fields)
            except Exception as exc:  # noqa: BLE001 - a malformed request gets an error reply
                self._reply(conn, _ERROR, [f"malformed request: {exc!r}"[:500].encode()])

    def _authenticate(self, conn: _Connection, payload: bytes) -> None:
        """The client's answer to the greeting: its challenge and its MAC."""
        client_nonce, mac = payload[:_CHALLENGE_NBYTES], payload[_CHALLENGE_NBYTES:]
        if len(payload) != _CHALLENGE_NBYTES + _MAC_NBYTES or not hmac.compare_digest(
                mac, _mac(self._token, b"client", conn.challenge, client_nonce)):
            self._drop(conn, "failed authentication (wrong or no token)")
            return
        conn.authed = True
        proof = _mac(self._token, b"server", conn.challenge, client_nonce)
        conn.outbuf += _LENGTH.pack(len(proof)) + proof
        self._flush(conn)

    def _park_handshake(self, conn: _Connection) -> None:
        waiter = _Waiter(conn, None, [], [], time.monotonic() + HANDSHAKE_TIMEOUT_S)
        heapq.heappush(self._deadlines, (waiter.deadline, next(self._seq), waiter))

    def _drop(self, conn: _Connection, why: str | None) -> None:
        if not conn.open:
            return
        if why is not None:
            log.warning("TCPStore :%d dropped the connection from %s: %s", self.port,
                        conn.peer, why)
        conn.open = False
        if conn.waiter is not None:
            self._unpark(conn.waiter)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def _reply(self, conn: _Connection, status: int, fields: list[bytes] = ()) -> None:
        if conn.open:
            conn.outbuf += _frame(status, list(fields))
            if len(conn.outbuf) > self._max_outbuf_nbytes:
                self._drop(conn, f"{len(conn.outbuf)} bytes of replies it does not read")
                return
            self._flush(conn)

    def _flush(self, conn: _Connection) -> None:
        try:
            sent = conn.sock.send(conn.outbuf)
            del conn.outbuf[:sent]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._drop(conn, None)
            return
        # Ask for write readiness only while a reply is pending.
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.outbuf else 0)
        if events != conn.events:
            conn.events = events
            self._sel.modify(conn.sock, events, conn)

    # -- requests -----------------------------------------------------------
    def _handle(self, conn: _Connection, op: int, fields: list[bytes]) -> None:
        data = self._data
        if op == _Op.SET:
            key, value = fields
            data[key] = value
            self._notify(key)
            self._reply(conn, _OK)
        elif op == _Op.GET:
            key, timeout_ms = fields
            if key in data:
                self._reply(conn, _OK, [data[key]])
            else:
                self._park(conn, op, [key], int(timeout_ms))
        elif op == _Op.ADD:
            key, amount = fields
            data[key] = _added(data.get(key), int(amount), key.decode(errors="replace"))
            self._notify(key)
            self._reply(conn, _OK, [data[key]])
        elif op == _Op.COMPARE_SET:
            key, expected, desired = fields
            write, result = _compare_set(data.get(key), expected, desired)
            if write is not None:
                data[key] = write
                self._notify(key)
            self._reply(conn, _OK, [result])
        elif op == _Op.WAIT:
            timeout_ms, *keys = fields
            if all(k in data for k in keys):
                self._reply(conn, _OK)
            else:
                self._park(conn, op, keys, int(timeout_ms))
        elif op == _Op.CHECK:
            self._reply(conn, _OK, [b"1" if all(k in data for k in fields) else b"0"])
        elif op == _Op.DELETE:
            (key,) = fields
            self._reply(conn, _OK, [b"1" if data.pop(key, None) is not None else b"0"])
        elif op == _Op.NUM_KEYS:
            reserved = _RESERVED_PREFIX.encode()
            count = sum(1 for k in data if not k.startswith(reserved))
            self._reply(conn, _OK, [str(count).encode()])
        else:
            raise ValueError(f"unknown TCPStore op {op}")

    def _park(self, conn, op, keys, timeout_ms) -> None:
        missing = [k for k in keys if k not in self._data]
        waiter = _Waiter(conn, op, keys, missing, time.monotonic() + timeout_ms / 1000)
        conn.waiter = waiter
        for key in missing:
            self._waiting.setdefault(key, []).append(waiter)
        heapq.heappush(self._deadlines, (waiter.deadline, next(self._seq), waiter))

    def _unpark(self, waiter: _Waiter) -> None:
        waiter.active = False
        waiter.conn.waiter = None
        for key in waiter.missing:
            waiters = self._waiting.get(key, [])
            if waiter in waiters:
                waiters.remove(waiter)
            if not waiters:
                self._waiting.pop(key, None)

    def _notify(self, key: bytes) -> None:
        for waiter in self._waiting.pop(key, ()):
            waiter.missing.discard(key)
            if waiter.active and not waiter.missing:
                self._unpark(waiter)
                value = [self._data[waiter.keys[0]]] if waiter.op == _Op.GET else []
                self._reply(waiter.conn, _OK, value)
                # Frames queued behind the parked one are served by the loop,
                # not recursively from inside another client's request.
                self._runnable.append(waiter.conn)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, waiter = heapq.heappop(self._deadlines)
            if waiter.op is None:  # a handshake deadline
                if waiter.conn.open and not waiter.conn.authed:
                    self._drop(waiter.conn, f"no authentication within {HANDSHAKE_TIMEOUT_S}s")
                continue
            if waiter.active:
                missing = [k for k in waiter.keys if k in waiter.missing]
                self._unpark(waiter)
                self._reply(waiter.conn, _TIMEOUT, missing)
                self._runnable.append(waiter.conn)


class TCPStore(Store):
    """A store served over TCP by the master; every instance is a client.

    Parameters
    ----------
    host : str
        Where the master listens (and binds, when ``is_master``).
    port : int
        The server's port; 0 lets the OS pick one (master only) — read the
        real one from :attr:`port`.
    world_size : int, optional
        How many TCPStore instances will join. With ``wait_for_workers`` the
        master's constructor returns only once all have connected.
    is_master : bool
        Run the server in this process (on a daemon thread).
    timeout : datetime.timedelta or float
        Deadline for connecting, for the workers to join, and default
        deadline of ``get``/``wait``.
    wait_for_workers : bool
        See ``world_size``.
    token : str or bytes, optional
        Shared secret: the master's server admits only clients that prove it,
        and clients trust only a server that proves it (``None``:
        ``NUMCOLL_AUTH_TOKEN``, if set).
    max_frame_nbytes : int, optional
        Master only: the largest request the server accepts (``None``:
        ``NUMCOLL_STORE_MAX_FRAME_NBYTES``, else 64 MiB).

    Notes
    -----
    Threads may share one TCPStore, but its single connection serves one
    request at a time: a thread blocked in ``get`` delays the others. Threads
    that wait on *each other* should use their own TCPStore clients.
    """

    def __init__(self, host: str, port: int, world_size: int | None = None,
                 is_master: bool = False,
                 timeout: datetime.timedelta | float = DEFAULT_STORE_TIMEOUT,
                 wait_for_workers: bool = True, *, token: str | bytes | None = None,
                 max_frame_nbytes: int | None = None):
        super().__init__(timeout)
        self._token = _token_from(token)
        self._ever_connected = False
        self._sock: socket.socket | None = None
        self._server: _Server | None = None
        self._closed = False
        self._lock = threading.Lock()
        port = operator.index(port)
        self._host, self._port, self._is_master = host, port, is_master
        if world_size == -1:
            world_size = None
        if world_size is not None and world_size < 1:
            raise ValueError(f"TCPStore world_size must be positive, got {world_size}")
        if not 0 <= port <= 65535:
            raise ValueError(f"TCPStore port must be in 0..65535, got {port}")
        if port == 0 and not is_master:
            raise ValueError("TCPStore port 0 (let the OS pick) is only valid for the master")
        self._world_size = world_size
        if is_master:
            if max_frame_nbytes is None:
                max_frame_nbytes = _config.current().store_max_frame_nbytes
            if max_frame_nbytes < 1024:
                raise ValueError(f"TCPStore max_frame_nbytes must be at least 1024, got "
                                 f"{max_frame_nbytes}")
            self._server = _Server(host, port, self._token, max_frame_nbytes)
            port = self._server.port
        self._port = port
        try:
            sock = self._open(time.monotonic() + self.timeout.total_seconds())
            with self._lock:
                self._sock = sock
            if world_size is not None:
                self._join(world_size, wait=is_master and wait_for_workers)
        except BaseException:
            self.close()
            raise

    @property
    def host(self) -> str:
        return self._host

    @property
    def port(self) -> int:
        """The server's port (the one the OS picked, for port 0)."""
        return self._port

    @property
    def world_size(self) -> int | None:
        return self._world_size

    def __repr__(self) -> str:
        return f"TCPStore({self._host}:{self._port}, master={self._is_master})"

    def _where(self) -> str:
        return f"TCPStore at {self._host}:{self._port}"

    def _open(self, deadline: float) -> socket.socket:
        """A connected, greeted (and authenticated) socket; retries refused
        connections until ``deadline`` (the master may not be up yet), or for
        :data:`RECONNECT_WINDOW_S` once a connection has been lost. Called
        without the lock: other threads' calls are not held up meanwhile."""
        start = time.monotonic()
        if self._ever_connected:
            deadline = min(deadline, start + RECONNECT_WINDOW_S)
        delay, last_error = CONNECT_RETRY_MIN_S, None
        while True:
            if self._closed:
                raise NumcollError(f"{self._where()} is closed")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StoreConnectionError(
                    f"could not connect to TCPStore at {self._host}:{self._port} within "
                    f"{round((deadline - start) * 1000)}ms (last error: {last_error})")
            try:
                sock = socket.create_connection((self._host, self._port), timeout=remaining)
            except OSError as exc:
                if self._ever_connected and isinstance(exc, ConnectionRefusedError):
                    # It was up and now nothing listens: the store is gone, not late.
                    raise StoreConnectionError(
                        f"could not connect to TCPStore at {self._host}:{self._port}: it is "
                        f"gone (reconnecting was refused: {exc})") from exc
                last_error = exc
                time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(2 * delay, CONNECT_RETRY_MAX_S)
                continue
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._handshake(sock, deadline)
            except (ConnectionResetError, ConnectionAbortedError, BrokenPipeError) as exc:
                sock.close()  # e.g. a full listen backlog: try again
                last_error = exc
                continue
            except BaseException:
                sock.close()
                raise
            self._ever_connected = True
            return sock

    def _handshake(self, sock: socket.socket, deadline: float) -> None:
        """Read the server's greeting and, with a token, prove it both ways."""
        # How long a port that accepted may stay silent before it is not a store:
        # the rendezvous's rule (NUMCOLL_STORE_PROBE_S), one owner.
        probe_s = _config.current().store_probe_s
        sock.settimeout(max(0.001, min(probe_s, deadline - time.monotonic())))
        where = f"{self._host}:{self._port}"
        try:
            header = _recv_exact(sock, _LENGTH.size)
            (n,) = _LENGTH.unpack(header)
            greeting = _recv_exact(sock, n) if n == _GREETING_NBYTES else header
        except TimeoutError:
            raise StoreAuthError(
                f"{where} accepted the connection but did not answer like a numcoll "
                f"TCPStore: no greeting within {sock.gettimeout():g} s "
                "(NUMCOLL_STORE_PROBE_S); is another program using the port?") from None
        except ConnectionError as exc:
            raise StoreAuthError(
                f"{where} did not answer like a numcoll TCPStore: it closed the connection "
                f"without a greeting ({exc}); another program, or a store shutting down") from None
        if n != _GREETING_NBYTES or not greeting.startswith(GREETING_MAGIC):
            raise StoreAuthError(f"{where} did not answer like a numcoll TCPStore (it sent "
                                 f"{(header + greeting)[:40]!r})")
        flags, challenge = greeting[len(GREETING_MAGIC)], greeting[-_CHALLENGE_NBYTES:]
        if not flags & _AUTH_REQUIRED:
            if self._token is not None:
                raise StoreAuthError(f"TCPStore at {where} does not ask for the token: refusing "
                                     "to trust it (is the master started without it?)")
            return
        if self._token is None:
            raise StoreAuthError(f"TCPStore at {where} requires a token (set "
                                 "NUMCOLL_AUTH_TOKEN or pass token=)")
        client_nonce = os.urandom(_CHALLENGE_NBYTES)
        answer = client_nonce + _mac(self._token, b"client", challenge, client_nonce)
        try:
            sock.sendall(_LENGTH.pack(len(answer)) + answer)
            (n,) = _LENGTH.unpack(_recv_exact(sock, _LENGTH.size))
            proof = _recv_exact(sock, n) if n == _MAC_NBYTES else b""
        except (ConnectionError, TimeoutError):
            raise StoreAuthError(f"TCPStore at {where} refused this client's token") from None
        if not hmac.compare_digest(proof, _mac(self._token, b"server", challenge, client_nonce)):
            raise StoreAuthError(f"TCPStore at {where} could not prove it knows the token")

    def _join(self, world_size: int, wait: bool) -> None:
        # The instance that completes the count marks the store ready, so the
        # master waits on one key instead of polling the counter.
        if self.add(_JOINED_KEY, 1) == world_size:
            self.set(_READY_KEY, b"1")
        if not wait:
            return
        try:
            self._wait([_READY_KEY], self.timeout)
        except StoreTimeoutError:
            joined = self.add(_JOINED_KEY, 0)
            raise StoreTimeoutError(
                f"Timed out waiting {_ms(self.timeout)}ms for {world_size} workers to join "
                f"{self._where()}: {joined} joined", [_READY_KEY], self.timeout) from None

    def _request(self, op: _Op, fields: list[bytes], timeout_s: float,
                 keys: list[str] = (), wait_timeout: datetime.timedelta | None = None,
                 deadline: float | None = None):
        """Send one request and read its reply: ``(status, fields)``, all
        within ``deadline`` (default: ``timeout_s`` from now)."""
        if deadline is None:
            deadline = time.monotonic() + timeout_s
        self._checkout(deadline, op)
        try:
            sock = self._sock
            try:
                sock.settimeout(max(0.001, deadline - time.monotonic()))
                sock.sendall(_frame(op, fields))
                (n,) = _LENGTH.unpack(_recv_exact(sock, _LENGTH.size))
                status, reply = _parse(_recv_exact(sock, n))
            except TimeoutError:
                # The reply may still come; a fresh connection keeps replies in step.
                self._drop_connection()
                if wait_timeout is not None:
                    raise _timeout_error(wait_timeout, list(keys), self._where(),
                                         op.name.lower()) from None
                raise self._late(op, keys, timeout_s) from None
            except OSError as exc:
                self._drop_connection()
                state = "closed" if self._closed else "lost"
                raise StoreConnectionError(
                    f"connection to {self._where()} {state} during {op.name.lower()}: {exc}"
                ) from exc
        finally:
            self._lock.release()
        if status == _ERROR:
            raise ValueError(reply[0].decode(errors="replace"))
        if status == _TIMEOUT:
            missing = [k.decode(errors="replace") for k in reply]
            raise _timeout_error(wait_timeout, missing, self._where(), op.name.lower())
        return reply

    def _late(self, op: _Op, keys, timeout_s: float) -> StoreTimeoutError:
        return StoreTimeoutError(
            f"Timed out waiting {int(timeout_s * 1000)}ms for {self._where()} to "
            f"answer {op.name.lower()}", keys, datetime.timedelta(seconds=timeout_s))

    def _checkout(self, deadline: float, op: _Op) -> None:
        """Return holding the lock with a connection, by ``deadline``.

        Reconnecting happens without the lock, so one thread retrying a dead
        store never holds up another that gave a shorter deadline."""
        while True:
            if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                raise StoreTimeoutError(f"{op.name.lower()} on {self._where()}: the client was "
                                        "busy with another thread's request until the deadline")
            if self._closed:
                self._lock.release()
                raise NumcollError(f"{self._where()} is closed")
            if self._sock is not None:
                return
            self._lock.release()
            sock = self._open(deadline)
            if self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                if self._sock is None and not self._closed:
                    self._sock, sock = sock, None
                self._lock.release()
            if sock is not None:
                sock.close()

    def _drop_connection(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _simple(self, op: _Op, *fields: bytes) -> list[bytes]:
        return self._request(op, list(fields), self.timeout.total_seconds())

    def _blocking(self, op: _Op, fields: list[bytes], keys: list[str],
                  timeout: datetime.timedelta) -> list[bytes]:
        return self._request(op, fields, timeout.total_seconds() + REPLY_GRACE_S,
                             keys, timeout)

    def _set(self, key, value):
        self._simple(_Op.SET, key.encode(), value)

    def _set_within(self, key, value, timeout):
        seconds = timeout.total_seconds()
        self._request(_Op.SET, [key.encode(), value], seconds,
                      deadline=time.monotonic() + seconds)

    def _get(self, key, timeout):
        fields = [key.encode(), str(_ms(timeout)).encode()]
        return self._blocking(_Op.GET, fields, [key], timeout)[0]

    def _add(self, key, amount):
        return int(self._simple(_Op.ADD, key.encode(), str(amount).encode())[0])

    def _compare_set(self, key, expected, desired):
        return self._simple(_Op.COMPARE_SET, key.encode(), expected, desired)[0]

    def _wait(self, keys, timeout):
        fields = [str(_ms(timeout)).encode()] + [k.encode() for k in keys]
        self._blocking(_Op.WAIT, fields, keys, timeout)

    def _check(self, keys):
        return self._simple(_Op.CHECK, *(k.encode() for k in keys))[0] == b"1"

    def _delete_key(self, key):
        return self._simple(_Op.DELETE, key.encode())[0] == b"1"

    def _num_keys(self):
        return int(self._simple(_Op.NUM_KEYS)[0])

    def close(self) -> None:
        """Close the connection and, on the master, stop the server thread.

        Clients still connected to a closed master get a
        :class:`StoreConnectionError` on their next request.
        """
        self._closed = True
        sock = self._sock
        if sock is not None:
            try:  # wakes a thread blocked in get/wait on this connection
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        with self._lock:
            self._drop_connection()
        server, self._server = self._server, None
        if server is not None:
            server.stop()

    def __del__(self):
        if getattr(self, "_closed", True) is False:
            try:
                self.close()
            except Exception:  # best effort: never raise from a finalizer
                pass


def _recv_exact(sock: socket.socket, nbytes: int) -> bytes:
    buf = bytearray(nbytes)
    view = memoryview(buf)
    while view:
        got = sock.recv_into(view)
        if got == 0:
            raise ConnectionResetError("the server closed the connection")
        view = view[got:]
    return bytes(buf)
