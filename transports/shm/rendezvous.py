"""Connecting the ranks of a ``shm`` group, trusting nothing that was not checked.

Each rank owns one memory file (its inbound rings; on rank 0 also the shared
arena) and hands it to every peer over a Unix socket. Whoever holds the file
can write those rings and read what is sent there, and whoever maps a file
can be killed by its owner truncating it. So a rank hands its file only to
the processes its peers published, and maps only a file it checked:

Publishing
    A rank binds an abstract Unix socket under a random name (no file, so
    nothing is left behind, even after SIGKILL) and publishes
    ``name pid pid-namespace`` in the group's store.
Who may connect (the listening side)
    The kernel tells the listener who connected (``SO_PEERCRED``). A process
    of another user is dropped at once, before a byte is exchanged; so is a
    process whose pid no peer published. A hello that claims rank ``p`` from
    any process but the one ``p`` published is dropped.
Whom a rank connects to
    The same check the other way: the socket behind the published name must
    belong to this user and to the process the rank published, before it is
    handed this rank's memory.
With a token (``NUMCOLL_AUTH_TOKEN``)
    Both sides prove they know it, challenge–response as the TCPStore does:
    the listener sends a fresh challenge, the connector answers with its own
    nonce and ``HMAC(token, "shm/connector", challenge, nonce, hello)``, the
    listener proves itself with the ``"shm/acceptor"`` HMAC, and only then
    does the memory file travel. The token itself never does.
The memory file
    Created sealed against any change of size before it is passed, and
    mapped only if it carries those seals and has exactly the size the
    settings give (:mod:`transports.shm.region`): no process can truncate it
    under another's mapping (a SIGBUS for its readers).
Never stalled, never failed by a stranger
    One poll loop serves every connection at once, outbound and inbound. An
    inbound connection has :data:`HANDSHAKE_S` to finish its handshake; a
    garbage, silent, impostor or foreign connection is dropped, counted and
    logged (:class:`~transports.refusals.RefusalLog`), and the rank keeps
    accepting until its peers are all in or the set-up deadline passes. Only
    the real peer (right user, pid and token) can fail set-up, by disagreeing
    on the settings: that is a misconfiguration, not an attack.

A process of the *same* user is not kept out by this (it can read the ranks'
memory and environment, token included, through ``/proc`` and ``ptrace``);
the threat model (docs/guide/security.md) says what it can do.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import select
import socket
import struct
import time
import uuid

from .. import tokens
from ..base import Rendezvous, TransportError
from ..endpoint import forget
from ..refusals import RefusalLog
from .region import check_region

__all__ = ["Link", "connect_peers", "HANDSHAKE_S"]

#: Store key of a rank's card: its socket's name, its pid, its pid namespace.
NAME_KEY = "shm/{rank}"
#: Protocol name and version, first in the greeting and the hello.
MAGIC = b"NCSHM\x00\x02\x00"
#: Listener -> connector: magic, flags, challenge.
GREETING = struct.Struct("<8sB32s")
#: Connector -> listener: magic, rank, ring capacity, group size, arena slot
#: bytes, region bytes, nonce, proof (zeros without a token).
HELLO = struct.Struct("<8siqqqq32s32s")
#: Listener -> connector: status, proof.
ANSWER = struct.Struct("<B32s")
#: Connector -> listener, last: this byte carries the memory file (SCM_RIGHTS).
FD_BYTE = b"F"
TOKEN_REQUIRED = 1
OK, SETTINGS, TOKEN = 0, 1, 2
#: An accepted connection must finish its handshake within this (seconds).
HANDSHAKE_S = 3.0
#: Handshakes in progress at once; connections beyond are dropped.
MAX_PENDING = 64
#: A connection the listener's backlog has no room for is tried again after this.
RETRY_S = 0.01
_CRED = struct.Struct("3i")
_NO_PROOF = bytes(tokens.PROOF_NBYTES)


@dataclasses.dataclass
class Link:
    """One connected peer: the socket this rank pokes it through, the socket it
    pokes this rank through (EOF on it: the peer is gone), its memory file,
    mapped, and its pid as the kernel reported it for the socket behind the
    name it published (checked against the pid it published; 0 where its pid
    namespace hides it)."""

    out_sock: socket.socket
    in_sock: socket.socket
    region: mmap.mmap
    pid: int = 0


def connect_peers(rank: int, size: int, store: Rendezvous, fd: int, *,
                  settings: tuple[int, int, int], region_nbytes, token: bytes | None,
                  deadline: float, refusals: RefusalLog) -> dict[int, Link]:
    """Connect this rank to every peer, handing each the memory file ``fd`` and
    mapping theirs (see the module docstring). ``settings`` (ring capacity,
    group size, arena slot bytes) must be the same on every rank;
    ``region_nbytes(peer)`` is the size of ``peer``'s file. Raises
    ``TimeoutError`` at ``deadline`` and :class:`~transports.base.TransportError`
    when a real peer disagrees; strangers are only refused."""
    return _Setup(rank, size, store, fd, settings, region_nbytes, token, deadline,
                  refusals).run()


@dataclasses.dataclass
class _Card:
    name: str
    pid: int
    pidns: int


class _Out:
    """This rank's connection to one peer's listener (it hands over our file)."""

    def __init__(self, peer: int):
        self.peer = peer
        self.sock: socket.socket | None = None
        self.state = "connect"  # then "greeting", "answer", "done"
        self.buf = b""
        self.next_try = 0.0
        self.challenge = self.nonce = self.hello = b""
        self.pid = 0  # the listener's, from SO_PEERCRED, once connected


class _In:
    """A connection accepted by this rank's listener, until its file is mapped."""

    def __init__(self, sock: socket.socket, pid: int, uid: int, challenge: bytes, until: float):
        self.sock, self.pid, self.uid = sock, pid, uid
        self.who = f"pid {pid} uid {uid}"
        self.challenge = challenge
        self.until = until
        self.state = "hello"  # then "fd"
        self.buf = b""
        self.peer = -1
        self.nonce = self.hello = b""


class _Setup:
    def __init__(self, rank, size, store, fd, settings, region_nbytes, token, deadline,
                 refusals):
        self.rank, self.size, self.store, self.fd = rank, size, store, fd
        self.settings, self.region_nbytes, self.token = settings, region_nbytes, token
        self.deadline, self.refusals = deadline, refusals
        self.uid = os.getuid()
        self.pidns = _pid_namespace()
        self.peers = [p for p in range(size) if p != rank]
        self.cards: dict[int, _Card] = {}
        self.outs = {p: _Out(p) for p in self.peers}
        self.ins: dict[int, _In] = {}  # by fd
        self.done_in: dict[int, tuple[socket.socket, mmap.mmap]] = {}
        self.listener: socket.socket | None = None

    # --- the loop ----------------------------------------------------------------------

    def run(self) -> dict[int, Link]:
        try:
            self._publish()
            while not self._finished():
                now = time.monotonic()
                if now >= self.deadline:
                    raise TimeoutError(self._timeout_message())
                for out in self.outs.values():
                    if out.state == "connect" and now >= out.next_try:
                        self._connect(out)
                self._expire(now)
                self._poll()
            links = {p: Link(self.outs[p].sock, *self.done_in[p], pid=self.outs[p].pid)
                     for p in self.peers}
            self.outs.clear()
            self.done_in.clear()
            # Every peer connected, so every peer has read our card: a store
            # shared by many groups need not keep it.
            forget(self.store, NAME_KEY.format(rank=self.rank))
            return links
        finally:
            self._close_all()

    def _finished(self) -> bool:
        return len(self.done_in) == len(self.peers) and \
            all(out.state == "done" for out in self.outs.values())

    def _publish(self) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        name = f"\0numcoll-shm-{uuid.uuid4().hex}-{self.rank}"  # abstract: no file
        self.listener.bind(name)
        self.listener.listen(socket.SOMAXCONN)
        self.listener.setblocking(False)
        self.store.set(NAME_KEY.format(rank=self.rank),
                       f"{name[1:]} {os.getpid()} {self.pidns}".encode())
        for p in self.peers:
            raw = self.store.get(NAME_KEY.format(rank=p))
            try:
                name, pid, pidns = raw.decode().split(" ")
                self.cards[p] = _Card("\0" + name, int(pid), int(pidns))
            except ValueError:
                raise TransportError(f"rank {self.rank}: rank {p} published a malformed shm "
                                     f"card {raw[:80]!r} (another numcoll version?)", p) from None

    def _poll(self) -> None:
        poller = select.poll()
        by_fd = {self.listener.fileno(): None}
        poller.register(self.listener, select.POLLIN)
        for out in self.outs.values():
            if out.state in ("greeting", "answer"):
                poller.register(out.sock, select.POLLIN)
                by_fd[out.sock.fileno()] = out
        for fd, conn in self.ins.items():
            poller.register(fd, select.POLLIN)
            by_fd[fd] = conn
        wake = min([self.deadline] + [c.until for c in self.ins.values()] +
                   [o.next_try for o in self.outs.values() if o.state == "connect"])
        timeout_ms = max(0, min(int((wake - time.monotonic()) * 1000) + 1, 1000))
        for fd, _ in poller.poll(timeout_ms):
            item = by_fd.get(fd)
            if item is None:
                self._accept()
            elif isinstance(item, _Out):
                self._on_out(item)
            elif fd in self.ins:
                self._on_in(item)

    def _expire(self, now: float) -> None:
        for conn in [c for c in self.ins.values() if now >= c.until]:
            self._drop(conn, f"no handshake within {HANDSHAKE_S:g}s")

    # --- outbound: handing our file to a peer -------------------------------------------

    def _connect(self, out: _Out) -> None:
        card = self.cards[out.peer]
        sock = socket.socket(socket.AF_UNIX,
                             socket.SOCK_STREAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        try:
            sock.connect(card.name)
        except (BlockingIOError, InterruptedError):  # its backlog is full: try again soon
            sock.close()
            out.next_try = time.monotonic() + RETRY_S
            return
        except OSError as exc:
            sock.close()
            raise TransportError(f"rank {self.rank}: cannot reach rank {out.peer}'s shm socket "
                                 f"({exc}); did it exit?", out.peer) from None
        pid, uid, _ = _credentials(sock)
        if uid != self.uid or not self._is_process_of(out.peer, pid):
            sock.close()
            self.refusals.refuse("socket not owned by the rank", f"pid {pid} uid {uid}",
                                 f"rank {out.peer} published pid {card.pid}")
            raise TransportError(
                f"rank {self.rank}: the socket rank {out.peer} published belongs to pid {pid} "
                f"(uid {uid}), not to rank {out.peer} (pid {card.pid}, uid {self.uid}): "
                "refusing to hand it this rank's memory", out.peer)
        out.sock, out.state, out.buf, out.pid = sock, "greeting", b"", pid

    def _on_out(self, out: _Out) -> None:
        need = GREETING.size if out.state == "greeting" else ANSWER.size
        data = _recv(out.sock, need - len(out.buf))
        if data is None:
            return
        if not data:  # the listener dropped us (we were too slow for it): connect again
            return self._reconnect(out)
        out.buf += data
        if len(out.buf) < need:
            return
        if out.state == "greeting":
            self._send_hello(out)
        else:
            self._send_file(out)

    def _send_hello(self, out: _Out) -> None:
        p = out.peer
        magic, flags, challenge = GREETING.unpack(out.buf)
        if magic != MAGIC:
            raise TransportError(f"rank {self.rank}: rank {p}'s shm socket does not speak this "
                                 f"protocol (it sent {out.buf[:8]!r}; another numcoll version?)", p)
        if flags & TOKEN_REQUIRED and self.token is None:
            raise TransportError(f"rank {self.rank}: rank {p} requires a token (set "
                                 "NUMCOLL_AUTH_TOKEN alike on every rank)", p)
        if not flags & TOKEN_REQUIRED and self.token is not None:
            raise TransportError(f"rank {self.rank}: rank {p} does not ask for the token: "
                                 "refusing to trust it (set NUMCOLL_AUTH_TOKEN alike on every "
                                 "rank)", p)
        nonce = os.urandom(tokens.NONCE_NBYTES)
        capacity, size, slot = self.settings
        fields = HELLO.pack(MAGIC, self.rank, capacity, size, slot, self.region_nbytes(self.rank),
                            nonce, _NO_PROOF)[:-tokens.PROOF_NBYTES]
        proof = (tokens.proof(self.token, b"shm/connector", challenge, nonce, fields)
                 if self.token else _NO_PROOF)
        out.challenge, out.nonce, out.hello = challenge, nonce, fields
        if not _send(out.sock, fields + proof):
            return self._reconnect(out)
        out.state, out.buf = "answer", b""

    def _reconnect(self, out: _Out) -> None:
        out.sock.close()
        out.sock, out.state, out.next_try = None, "connect", time.monotonic() + RETRY_S

    def _send_file(self, out: _Out) -> None:
        p = out.peer
        status, proof = ANSWER.unpack(out.buf)
        if status == SETTINGS:
            raise TransportError(f"rank {self.rank}: rank {p} refused this rank's shm settings "
                                 f"(ring {self.settings[0]} bytes, group of {self.settings[1]}, "
                                 f"arena slot {self.settings[2]} bytes): do all ranks use the "
                                 "same settings?", p)
        if status == TOKEN:
            raise TransportError(f"rank {self.rank}: rank {p} refused this rank's token: do all "
                                 "ranks share NUMCOLL_AUTH_TOKEN?", p)
        if status != OK:
            raise TransportError(f"rank {self.rank}: rank {p} answered the shm hello with "
                                 f"status {status}", p)
        if self.token and not tokens.matches(self.token, proof, b"shm/acceptor", out.challenge,
                                             out.nonce, out.hello):
            raise TransportError(f"rank {self.rank}: rank {p} could not prove it knows the "
                                 "token: refusing to hand it this rank's memory", p)
        try:
            sent = socket.send_fds(out.sock, [FD_BYTE], [self.fd])
        except OSError:
            sent = 0
        if sent != 1:
            return self._reconnect(out)
        out.state = "done"

    # --- inbound: taking a peer's file ---------------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            sock.setblocking(False)
            pid, uid, _ = _credentials(sock)
            who = f"pid {pid} uid {uid}"
            if uid != self.uid:
                why = "another user"
            elif not any(self._is_process_of(p, pid) for p in self.peers):
                why = "not a process of this group"
            elif len(self.ins) >= MAX_PENDING:
                why = "too many handshakes at once"
            else:
                why = None
            if why is not None:
                sock.close()
                self.refusals.refuse(why, who)
                continue
            challenge = os.urandom(tokens.NONCE_NBYTES)
            flags = TOKEN_REQUIRED if self.token else 0
            conn = _In(sock, pid, uid, challenge, time.monotonic() + HANDSHAKE_S)
            self.ins[sock.fileno()] = conn
            if not _send(sock, GREETING.pack(MAGIC, flags, challenge)):
                self._drop(conn, "hung up before the greeting")

    def _on_in(self, conn: _In) -> None:
        if conn.state == "fd":
            return self._take_file(conn)
        data = _recv(conn.sock, HELLO.size - len(conn.buf))
        if data is None:
            return
        if not data:
            return self._drop(conn, "hung up during the handshake")
        conn.buf += data
        if len(conn.buf) < HELLO.size:
            return
        magic, peer, capacity, size, slot, nbytes, nonce, proof = HELLO.unpack(conn.buf)
        if magic != MAGIC or peer not in self.cards:
            return self._drop(conn, "bad hello", f"{conn.buf[:16]!r}")
        if not self._is_process_of(peer, conn.pid):
            return self._drop(conn, "not the process the rank published",
                              f"claims rank {peer}, which published pid {self.cards[peer].pid}")
        if peer in self.done_in:
            return self._drop(conn, "rank already connected", f"claims rank {peer}")
        fields = conn.buf[:-tokens.PROOF_NBYTES]
        if self.token and not tokens.matches(self.token, proof, b"shm/connector",
                                             conn.challenge, nonce, fields):
            _send(conn.sock, ANSWER.pack(TOKEN, _NO_PROOF))
            return self._drop(conn, "wrong token", f"claims rank {peer}")
        if (capacity, size, slot) != self.settings or nbytes != self.region_nbytes(peer):
            _send(conn.sock, ANSWER.pack(SETTINGS, _NO_PROOF))
            raise TransportError(
                f"rank {self.rank}: bad shm hello from rank {peer} (ring {capacity} bytes, group "
                f"of {size}, arena slot {slot} bytes; expected ring {self.settings[0]}, group of "
                f"{self.settings[1]}, arena slot {self.settings[2]}): do all ranks use the "
                "same settings?", peer)
        proof = (tokens.proof(self.token, b"shm/acceptor", conn.challenge, nonce, fields)
                 if self.token else _NO_PROOF)
        if not _send(conn.sock, ANSWER.pack(OK, proof)):
            return self._drop(conn, "hung up during the handshake")
        conn.peer, conn.state = peer, "fd"

    def _take_file(self, conn: _In) -> None:
        try:
            msg, fds, flags, _ = socket.recv_fds(conn.sock, 1, 1)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            msg, fds, flags = b"", [], 0
        try:
            if not msg:
                return self._drop(conn, "hung up during the handshake")
            if msg != FD_BYTE or len(fds) != 1 or flags & socket.MSG_CTRUNC:
                return self._drop(conn, "bad hello", f"{len(fds)} files with {msg!r}")
            nbytes = self.region_nbytes(conn.peer)
            why = check_region(fds[0], nbytes)
            if why is None:
                try:
                    region = mmap.mmap(fds[0], nbytes)
                except OSError as exc:
                    why = f"cannot be mapped ({exc.strerror})"
            if why is not None:
                return self._drop(conn, "memory file refused", why)
        finally:
            for f in fds:
                os.close(f)
        del self.ins[conn.sock.fileno()]
        self.done_in[conn.peer] = (conn.sock, region)

    def _drop(self, conn: _In, reason: str, detail: str = "") -> None:
        self.ins.pop(conn.sock.fileno(), None)
        conn.sock.close()
        self.refusals.refuse(reason, conn.who, detail)

    # --- helpers -------------------------------------------------------------------------

    def _is_process_of(self, peer: int, pid: int) -> bool:
        """Whether ``pid`` (as the kernel reports it here) is the process ``peer``
        published. Ranks in another pid namespace cannot be told apart by pid:
        there the user (and the token) must do."""
        card = self.cards[peer]
        return card.pidns != self.pidns or card.pid == pid

    def _timeout_message(self) -> str:
        missing = sorted({p for p in self.peers if p not in self.done_in} |
                         {o.peer for o in self.outs.values() if o.state != "done"})
        refused = ", ".join(f"{n} {reason}" for reason, n in self.refusals.counts.items())
        return (f"shm transport: rank {self.rank} timed out connecting to rank(s) "
                f"{', '.join(map(str, missing))}" +
                (f" (refused connections: {refused})" if refused else ""))

    def _close_all(self) -> None:
        for conn in list(self.ins.values()):
            self._drop(conn, "set-up ended before its handshake")
        for out in self.outs.values():
            if out.sock is not None:
                out.sock.close()
        for sock, region in self.done_in.values():
            sock.close()
            region.close()
        if self.listener is not None:
            self.listener.close()


def _credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end, as the kernel reports it."""
    return _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _recv(sock: socket.socket, n: int) -> bytes | None:
    """Up to ``n`` bytes; b"" at EOF (or a broken connection); None if none yet."""
    try:
        return sock.recv(n)
    except (BlockingIOError, InterruptedError):
        return None
    except OSError:
        return b""


def _send(sock: socket.socket, data: bytes) -> bool:
    """Send a handshake message whole (a fresh socket's buffer always has room)."""
    try:
        return sock.send(data) == len(data)
    except OSError:
        return False
