"""The TCPStore server: one thread, ``selectors``, all state owned by it.

Blocking ``get``/``wait`` are parked until their keys appear (or, for
numcoll's requests, until their deadline), so clients never poll. A
connection first says which protocol it speaks (:mod:`.protocol`: numcoll's,
or torch.distributed's, served by :mod:`.torch_wire`); one that does not
within :data:`HANDSHAKE_TIMEOUT_S`, or says something else, is hung up on.

Nothing a client sends can take the server down or grow it without bound: a
request frame is capped (``max_frame_nbytes``), so are the reply bytes a
connection leaves unread, a malformed numcoll request gets an error reply,
and a connection that breaks the rules is dropped. Every drop is a refusal
in a :class:`~transports.refusals.RefusalLog` (logger ``numcoll.bootstrap.store``):
a few lines in full, the rest summed per reason and peer, on a timer and at close.
"""

from __future__ import annotations

import heapq
import hmac
import itertools
import logging
import os
import selectors
import socket
import threading
import time
from collections import deque

from transports.refusals import RefusalLog

from ..store import _added, _compare_set
from . import torch_wire
from .protocol import (AUTH_REQUIRED, CHALLENGE_NBYTES, ERROR, GREETING_MAGIC, LENGTH,
                       MAC_NBYTES, NOT_A_STORE, OK, OPENING, OPENING_NBYTES, RESERVED_PREFIX,
                       TIMEOUT,
                       TORCH_PING, VALIDATE_NBYTES, Op, frame, mac, parse)

__all__ = ["Server", "HANDSHAKE_TIMEOUT_S"]

#: Once a connection has this many reply bytes (beyond one frame) it has not
#: read, the server drops it.
MAX_UNREAD_REPLY_NBYTES = 4 << 20
#: A connection must say which protocol it speaks (and, with a token, finish
#: authenticating) within this many seconds.
HANDSHAKE_TIMEOUT_S = 10.0
LISTEN_BACKLOG = 1024
RECV_CHUNK_NBYTES = 1 << 18
#: How long stop() waits for the server thread to finish.
SERVER_JOIN_TIMEOUT_S = 5.0

log = logging.getLogger("numcoll.bootstrap.store")


class _Waiter:
    """A parked request: its connection, keys, deadline and what to send when
    the keys are there (``ready()``) or the deadline passes (``expired(missing)``).
    A handshake deadline is a waiter without ``ready``."""

    __slots__ = ("conn", "keys", "missing", "deadline", "active", "ready", "expired")

    def __init__(self, conn, keys, missing, deadline, ready, expired):
        self.conn, self.keys, self.deadline = conn, keys, deadline
        self.missing = set(missing)
        self.active = True
        self.ready, self.expired = ready, expired


class _Connection:
    __slots__ = ("sock", "inbuf", "outbuf", "waiter", "events", "open", "peer", "challenge",
                 "authed", "proto")

    def __init__(self, sock, peer, challenge: bytes):
        self.sock = sock
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.waiter: _Waiter | None = None
        self.events = selectors.EVENT_READ
        self.open = True
        self.challenge = challenge
        self.authed = False
        self.proto: str | None = None   # "numcoll" or "torch", once it has said


class Server:
    """The master's server, on a daemon thread; :meth:`stop` ends it."""

    def __init__(self, host: str, port: int, token: bytes | None, max_frame_nbytes: int):
        self.token = token
        self.max_frame_nbytes = max_frame_nbytes
        self._max_outbuf_nbytes = max_frame_nbytes + MAX_UNREAD_REPLY_NBYTES
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                    flags=socket.AI_PASSIVE)[0][0]
        self._listener = socket.create_server((host, port), family=family,
                                              backlog=LISTEN_BACKLOG)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        # Made at the first refusal: a store nobody misuses starts no flusher thread.
        self._refusals: RefusalLog | None = None
        # stop() writes to this pair to wake the selector.
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self.data: dict[bytes, bytes] = {}
        self.queues: dict[bytes, deque] = {}   # torch's queue_push / queue_pop
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
        if self._refusals is not None:
            self._refusals.close()

    @property
    def refusals(self) -> RefusalLog:
        """What this server refused, counted (``count``, ``counts``) and logged."""
        if self._refusals is None:
            self._refusals = RefusalLog(f"numcoll TCPStore :{self.port}", log)
        return self._refusals

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
                        self.drop(conn, "error serving it", repr(exc))
                self._expire()
                while self._runnable:
                    conn = self._runnable.pop()
                    try:
                        self._process(conn)
                    except Exception as exc:  # noqa: BLE001 - as above
                        self.drop(conn, "error serving it", repr(exc))
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
        conn = _Connection(sock, peer, os.urandom(CHALLENGE_NBYTES))
        self._sel.register(sock, selectors.EVENT_READ, conn)
        # A stranger that never speaks (or never authenticates) must not hold
        # a socket forever.
        self._push_deadline(_Waiter(conn, [], [], time.monotonic() + HANDSHAKE_TIMEOUT_S,
                                    None, None))

    def _read(self, conn: _Connection) -> None:
        try:
            chunk = conn.sock.recv(RECV_CHUNK_NBYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:  # the client went away, perhaps mid-request
            self.drop(conn, None)
            return
        conn.inbuf += chunk
        self._process(conn)

    def _process(self, conn: _Connection) -> None:
        if conn.proto is None:
            self._identify(conn)
        if not conn.open or conn.proto is None:
            return
        if conn.proto == "torch":
            torch_wire.serve(self, conn)
            if conn.open and len(conn.inbuf) > self.max_frame_nbytes + (64 << 10):
                self.drop(conn, "oversized request", f"{len(conn.inbuf)} bytes unparsed")
            return
        self._serve_numcoll(conn)

    def _identify(self, conn: _Connection) -> None:
        """Which protocol the connection speaks, from its first bytes (see
        :mod:`.protocol`): numcoll's opening, torch's, or neither."""
        buf = conn.inbuf
        head = bytes(buf[:VALIDATE_NBYTES])
        if head != OPENING[:len(head)]:
            self._not_a_store(conn, bytes(buf[:24]))
            return
        if len(buf) < OPENING_NBYTES and (len(buf) <= VALIDATE_NBYTES
                                          or buf[VALIDATE_NBYTES] == TORCH_PING):
            return  # the rest of the opening is on its way
        if bytes(buf[:OPENING_NBYTES]) == OPENING:
            del buf[:OPENING_NBYTES]
            conn.proto = "numcoll"
            conn.authed = self.token is None
            flags = AUTH_REQUIRED if self.token is not None else 0
            greeting = GREETING_MAGIC + bytes([flags]) + conn.challenge
            self.send(conn, LENGTH.pack(len(greeting)) + greeting)
        else:
            del buf[:VALIDATE_NBYTES]   # torch's VALIDATE; its PING is served as a query
            conn.proto = "torch"
            conn.authed = self.token is None
            log.debug("TCPStore :%d: a torch.distributed client connected from %s",
                      self.port, conn.peer)

    def _not_a_store(self, conn: _Connection, first: bytes) -> None:
        self.send(conn, NOT_A_STORE)
        self.drop(conn, "not a TCPStore client", f"first bytes {first!r}")

    def _serve_numcoll(self, conn: _Connection) -> None:
        """Serve complete frames in order; a parked request holds back the rest."""
        while conn.open and conn.waiter is None and len(conn.inbuf) >= LENGTH.size:
            (n,) = LENGTH.unpack_from(conn.inbuf)
            if not conn.authed and n != CHALLENGE_NBYTES + MAC_NBYTES:
                # Before the handshake a stranger gets no buffer beyond the answer's size.
                self.drop(conn, "bad handshake",
                          f"a {n}-byte frame instead of the authentication answer")
                return
            if n == 0 or n > self.max_frame_nbytes:
                self.drop(conn, "oversized request",
                          f"frame of {n} bytes (limit {self.max_frame_nbytes})")
                return
            if len(conn.inbuf) < LENGTH.size + n:
                return
            payload = bytes(conn.inbuf[LENGTH.size:LENGTH.size + n])
            del conn.inbuf[:LENGTH.size + n]
            if not conn.authed:
                self._authenticate(conn, payload)
                continue
            try:
                op, fields = parse(payload)
                self._handle(conn, op, fields)
            except Exception as exc:  # noqa: BLE001 - a malformed request gets an error reply
                self._reply(conn, ERROR, [f"malformed request: {exc!r}"[:500].encode()])

    def _authenticate(self, conn: _Connection, payload: bytes) -> None:
        """The client's answer to the greeting: its challenge and its MAC."""
        client_nonce, proof = payload[:CHALLENGE_NBYTES], payload[CHALLENGE_NBYTES:]
        if len(payload) != CHALLENGE_NBYTES + MAC_NBYTES or not hmac.compare_digest(
                proof, mac(self.token, b"client", conn.challenge, client_nonce)):
            self.drop(conn, "wrong token", "failed authentication (wrong or no token)")
            return
        conn.authed = True
        self.send(conn, LENGTH.pack(MAC_NBYTES) +
                  mac(self.token, b"server", conn.challenge, client_nonce))

    # -- what the protocols share ------------------------------------------------
    def drop(self, conn: _Connection, reason: str | None, detail: str = "") -> None:
        """Close ``conn``; a ``reason`` makes it a refusal (counted and logged)."""
        if not conn.open:
            return
        if reason is not None:
            self.refusals.refuse(reason, conn.peer, detail)
        conn.open = False
        if conn.waiter is not None:
            self.unpark(conn.waiter)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def send(self, conn: _Connection, data: bytes) -> None:
        """Queue ``data`` to ``conn`` and write what the socket takes now."""
        if conn.open:
            conn.outbuf += data
            if len(conn.outbuf) > self._max_outbuf_nbytes:
                self.drop(conn, "unread replies",
                          f"{len(conn.outbuf)} bytes of replies it does not read")
                return
            self._flush(conn)

    def _reply(self, conn: _Connection, status: int, fields=()) -> None:
        self.send(conn, frame(status, list(fields)))

    def _flush(self, conn: _Connection) -> None:
        try:
            sent = conn.sock.send(conn.outbuf)
            del conn.outbuf[:sent]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self.drop(conn, None)
            return
        # Ask for write readiness only while a reply is pending.
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.outbuf else 0)
        if events != conn.events and conn.open:
            conn.events = events
            self._sel.modify(conn.sock, events, conn)

    def num_user_keys(self) -> int:
        return sum(1 for k in self.data if not k.startswith(RESERVED_PREFIX))

    def park(self, conn: _Connection, keys: list[bytes], ready, expired=None,
             timeout_s: float | None = None) -> None:
        """Hold ``conn``'s request until every key in ``keys`` is set: then
        ``ready()``; or, after ``timeout_s``, ``expired(missing keys)``."""
        missing = [k for k in keys if not self.present(k)]
        deadline = time.monotonic() + timeout_s if timeout_s is not None else None
        waiter = _Waiter(conn, keys, missing, deadline, ready, expired)
        conn.waiter = waiter
        for key in missing:
            self._waiting.setdefault(key, []).append(waiter)
        if deadline is not None:
            self._push_deadline(waiter)

    def present(self, key: bytes) -> bool:
        """A key is there when set, or (torch's queues) when its queue is not empty."""
        return key in self.data or bool(self.queues.get(key))

    def unpark(self, waiter: _Waiter) -> None:
        waiter.active = False
        waiter.conn.waiter = None
        for key in waiter.missing:
            waiters = self._waiting.get(key, [])
            if waiter in waiters:
                waiters.remove(waiter)
            if not waiters:
                self._waiting.pop(key, None)

    def notify(self, key: bytes, one: bool = False) -> None:
        """``key`` was written: answer the parked requests it completes (with
        ``one``, only the first, as torch's queue_push wakes one popper)."""
        waiters = self._waiting.get(key)
        if not waiters:
            return
        if one:
            for waiter in waiters:
                if waiter.active and waiter.missing == {key}:
                    self._complete(waiter)
                    return
            return
        del self._waiting[key]
        for waiter in waiters:
            waiter.missing.discard(key)
            if waiter.active and not waiter.missing:
                self._complete(waiter)

    def _complete(self, waiter: _Waiter) -> None:
        self.unpark(waiter)
        waiter.ready()
        # Requests queued behind the parked one are served by the loop, not
        # recursively from inside another client's request.
        self._runnable.append(waiter.conn)

    def _push_deadline(self, waiter: _Waiter) -> None:
        heapq.heappush(self._deadlines, (waiter.deadline, next(self._seq), waiter))

    def _expire(self) -> None:
        now = time.monotonic()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, waiter = heapq.heappop(self._deadlines)
            if waiter.ready is None:  # a handshake deadline
                if waiter.conn.open and not waiter.conn.authed:
                    self.drop(waiter.conn, "no handshake in time",
                              f"nothing valid within {HANDSHAKE_TIMEOUT_S}s")
                continue
            if waiter.active:
                missing = [k for k in waiter.keys if k in waiter.missing]
                self.unpark(waiter)
                waiter.expired(missing)
                self._runnable.append(waiter.conn)

    # -- numcoll's requests ----------------------------------------------------------
    def _handle(self, conn: _Connection, op: int, fields: list[bytes]) -> None:
        data = self.data
        if op == Op.SET:
            key, value = fields
            data[key] = value
            self.notify(key)
            self._reply(conn, OK)
        elif op == Op.GET:
            key, timeout_ms = fields
            if key in data:
                self._reply(conn, OK, [data[key]])
            else:
                self._park_numcoll(conn, [key], int(timeout_ms), get=True)
        elif op == Op.ADD:
            key, amount = fields
            data[key] = _added(data.get(key), int(amount), key.decode(errors="replace"))
            self.notify(key)
            self._reply(conn, OK, [data[key]])
        elif op == Op.COMPARE_SET:
            key, expected, desired = fields
            write, result = _compare_set(data.get(key), expected, desired)
            if write is not None:
                data[key] = write
                self.notify(key)
            self._reply(conn, OK, [result])
        elif op == Op.WAIT:
            timeout_ms, *keys = fields
            if all(k in data for k in keys):
                self._reply(conn, OK)
            else:
                self._park_numcoll(conn, keys, int(timeout_ms), get=False)
        elif op == Op.CHECK:
            self._reply(conn, OK, [b"1" if all(k in data for k in fields) else b"0"])
        elif op == Op.DELETE:
            (key,) = fields
            self._reply(conn, OK, [b"1" if data.pop(key, None) is not None else b"0"])
        elif op == Op.NUM_KEYS:
            self._reply(conn, OK, [str(self.num_user_keys()).encode()])
        else:
            raise ValueError(f"unknown TCPStore op {op}")

    def _park_numcoll(self, conn, keys, timeout_ms: int, get: bool) -> None:
        def ready():
            self._reply(conn, OK, [self.data[keys[0]]] if get else [])

        def expired(missing):
            self._reply(conn, TIMEOUT, missing)

        self.park(conn, keys, ready, expired, timeout_ms / 1000)
