"""The TCPStore client: every :class:`TCPStore` -- the master's included -- is
one, with one connection guarded by a lock.

Every call is bounded by a deadline, and the lock is never held while
reconnecting, so a thread that gives a short deadline (``set(..., timeout=)``)
returns in time even while another is stuck on a dead store. Connecting
checks who answers (:mod:`.protocol`): a numcoll store greets, and with a
token both sides prove they know it; anything else fails with a clear error
-- at once if it answers otherwise (torch's own TCPStore, a web server) or
hangs up, after ``NUMCOLL_STORE_PROBE_S`` (5 s) if it says nothing.
"""

from __future__ import annotations

import datetime
import hmac
import operator
import os
import socket
import threading
import time

from ... import config as _config
from ...errors import NumcollError
from ..store import DEFAULT_STORE_TIMEOUT, Store, StoreTimeoutError, _ms, _timeout_error
from .protocol import (AUTH_REQUIRED, CHALLENGE_NBYTES, ERROR, GREETING_MAGIC,
                       GREETING_NBYTES, LENGTH, MAC_NBYTES, NUMCOLL_NONCE, OPENING,
                       RESERVED_PREFIX, TIMEOUT, Op, StoreAuthError, StoreConnectionError,
                       frame, mac, parse, recv_exact, token_from)
from .server import Server

__all__ = ["TCPStore"]

#: Connection attempts are retried (the master may not be up yet) after this
#: many seconds, doubling up to CONNECT_RETRY_MAX_S, until the store's timeout.
CONNECT_RETRY_MIN_S = 0.01
CONNECT_RETRY_MAX_S = 0.5
#: The server answers a parked get/wait itself when its deadline passes; the
#: client waits this much longer before it gives up on an unresponsive server.
REPLY_GRACE_S = 1.0
#: After an established connection is lost, how long reconnecting may take
#: before the store is taken for dead; a refused reconnect fails at once
#: (connecting the first time may take the whole timeout: the master may not
#: be up yet).
RECONNECT_WINDOW_S = 1.0

# Bookkeeping keys for the world_size handshake; num_keys does not count them.
_JOINED_KEY = RESERVED_PREFIX.decode() + "joined"
_READY_KEY = RESERVED_PREFIX.decode() + "ready"
_TORCH_ECHO = NUMCOLL_NONCE.to_bytes(4, "little")


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
        self._token = token_from(token)
        self._ever_connected = False
        self._sock: socket.socket | None = None
        self._server: Server | None = None
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
            self._server = Server(host, port, self._token, max_frame_nbytes)
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
        """Send the opening, read the server's greeting and, with a token,
        prove it both ways."""
        # How long a port that accepted may stay silent before it is not a store:
        # the rendezvous's rule (NUMCOLL_STORE_PROBE_S), one owner.
        probe_s = _config.current().store_probe_s
        sock.settimeout(max(0.001, min(probe_s, deadline - time.monotonic())))
        where = f"{self._host}:{self._port}"
        try:
            sock.sendall(OPENING)
            header = recv_exact(sock, LENGTH.size)
            if header == _TORCH_ECHO:
                raise StoreAuthError(
                    f"{where} is a torch.distributed TCPStore (it answered torch's ping), not "
                    "numcoll's: reach it with torch's client (under torchrun numcoll does, "
                    "with TORCHELASTIC_USE_AGENT_STORE=True), or serve the ranks with numcoll's "
                    "TCPStore, which speaks both protocols")
            (n,) = LENGTH.unpack(header)
            greeting = recv_exact(sock, n) if n == GREETING_NBYTES else header
        except StoreAuthError:
            raise
        except TimeoutError:
            raise StoreAuthError(
                f"{where} accepted the connection but did not answer like a numcoll "
                f"TCPStore: no greeting within {sock.gettimeout():g} s "
                "(NUMCOLL_STORE_PROBE_S); is another program using the port?") from None
        except ConnectionError as exc:
            raise StoreAuthError(
                f"{where} did not answer like a numcoll TCPStore: it closed the connection "
                f"without a greeting ({exc}); another program, or a store shutting down") from None
        if n != GREETING_NBYTES or not greeting.startswith(GREETING_MAGIC):
            older = greeting.startswith(b"numcoll-store/")
            raise StoreAuthError(
                f"{where} is a numcoll TCPStore of another version ({greeting[:15]!r}, this "
                f"client speaks {GREETING_MAGIC!r}): use one numcoll version on every host"
                if older else f"{where} did not answer like a numcoll TCPStore (it sent "
                f"{(header + greeting)[:40]!r})")
        flags, challenge = greeting[len(GREETING_MAGIC)], greeting[-CHALLENGE_NBYTES:]
        if not flags & AUTH_REQUIRED:
            if self._token is not None:
                raise StoreAuthError(f"TCPStore at {where} does not ask for the token: refusing "
                                     "to trust it (is the master started without it?)")
            return
        if self._token is None:
            raise StoreAuthError(f"TCPStore at {where} requires a token (set "
                                 "NUMCOLL_AUTH_TOKEN or pass token=)")
        client_nonce = os.urandom(CHALLENGE_NBYTES)
        answer = client_nonce + mac(self._token, b"client", challenge, client_nonce)
        try:
            sock.sendall(LENGTH.pack(len(answer)) + answer)
            (n,) = LENGTH.unpack(recv_exact(sock, LENGTH.size))
            proof = recv_exact(sock, n) if n == MAC_NBYTES else b""
        except (ConnectionError, TimeoutError):
            raise StoreAuthError(f"TCPStore at {where} refused this client's token") from None
        if not hmac.compare_digest(proof, mac(self._token, b"server", challenge, client_nonce)):
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

    def _request(self, op: Op, fields: list[bytes], timeout_s: float,
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
                sock.sendall(frame(op, fields))
                (n,) = LENGTH.unpack(recv_exact(sock, LENGTH.size))
                status, reply = parse(recv_exact(sock, n))
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
        if status == ERROR:
            raise ValueError(reply[0].decode(errors="replace"))
        if status == TIMEOUT:
            missing = [k.decode(errors="replace") for k in reply]
            raise _timeout_error(wait_timeout, missing, self._where(), op.name.lower())
        return reply

    def _late(self, op: Op, keys, timeout_s: float) -> StoreTimeoutError:
        return StoreTimeoutError(
            f"Timed out waiting {int(timeout_s * 1000)}ms for {self._where()} to "
            f"answer {op.name.lower()}", keys, datetime.timedelta(seconds=timeout_s))

    def _checkout(self, deadline: float, op: Op) -> None:
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

    def _simple(self, op: Op, *fields: bytes) -> list[bytes]:
        return self._request(op, list(fields), self.timeout.total_seconds())

    def _blocking(self, op: Op, fields: list[bytes], keys: list[str],
                  timeout: datetime.timedelta) -> list[bytes]:
        return self._request(op, fields, timeout.total_seconds() + REPLY_GRACE_S,
                             keys, timeout)

    def _set(self, key, value):
        self._simple(Op.SET, key.encode(), value)

    def _set_within(self, key, value, timeout):
        seconds = timeout.total_seconds()
        self._request(Op.SET, [key.encode(), value], seconds,
                      deadline=time.monotonic() + seconds)

    def _get(self, key, timeout):
        fields = [key.encode(), str(_ms(timeout)).encode()]
        return self._blocking(Op.GET, fields, [key], timeout)[0]

    def _add(self, key, amount):
        return int(self._simple(Op.ADD, key.encode(), str(amount).encode())[0])

    def _compare_set(self, key, expected, desired):
        return self._simple(Op.COMPARE_SET, key.encode(), expected, desired)[0]

    def _wait(self, keys, timeout):
        fields = [str(_ms(timeout)).encode()] + [k.encode() for k in keys]
        self._blocking(Op.WAIT, fields, keys, timeout)

    def _check(self, keys):
        return self._simple(Op.CHECK, *(k.encode() for k in keys))[0] == b"1"

    def _delete_key(self, key):
        return self._simple(Op.DELETE, key.encode())[0] == b"1"

    def _num_keys(self):
        return int(self._simple(Op.NUM_KEYS)[0])

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
