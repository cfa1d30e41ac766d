"""ZeroMQ transport: ``tcp://`` between hosts, ``ipc://`` between processes on one host.

Sockets
    Each rank binds one PULL socket (the OS picks the port; for ipc a Linux
    abstract-namespace name, ``ipc://@numcoll-...``, which no file backs, so a
    killed rank leaves nothing in the temp directory) and publishes its
    endpoint and session nonce in the store as ``addr/{rank}`` (with CURVE, its
    public key as ``curve/{rank}`` first); it connects one PUSH socket to every
    peer's PULL. One I/O thread per transport owns every socket. Sends reach it
    through a queue plus a wakeup fd; receives never wait for it: they are
    matched in a :class:`~transports.mailbox.Mailbox`, which the I/O thread
    fills, reading each payload straight into the posted buffer.
Wire format
    A message starts with a :data:`HEADER` (the sender's session nonce, kind,
    source rank, tag, payload bytes, stamp length) and the stamp's bytes.
    Payloads below ``zero_copy_nbytes`` follow the header in the same frame
    (``INLINE``: one send and one receive per message); larger ones are a
    second frame (``DATA``), sent without a copy. ``BYE`` is a header alone.
Trust
    Anyone who can reach the PULL socket can send it bytes. Every frame is
    checked before it touches the mailbox: length, kind, source rank (a peer,
    never this rank), the source's nonce (a 64-bit random number each rank
    draws per group and publishes only in the store, so a blind forger cannot
    guess it), stamp length, payload size and frame count, slot and credit
    numbers. A frame that fails is dropped and logged (logger
    ``numcoll.transport``, rate-limited); it never completes a receive, never
    drops a peer and never stops the I/O thread. Who may connect at all is
    :mod:`transports.zmq.auth`'s business (same user for ipc, token, CURVE).
Liveness
    A closing rank sends ``BYE`` to every peer after all its data (same pipe, so
    a peer that reads ``BYE`` has everything). A crash shows up as a disconnect
    on the PUSH socket's monitor; after ``peer_grace_s`` of silence (data sent
    before the crash may still be arriving) the peer is declared lost.
"""

from __future__ import annotations

import os
import shutil
import socket
import struct
import sys
import tempfile
import threading
import time
import uuid
import warnings
from collections import deque

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from . import auth
from ..base import (
    SEND,
    PeerClosed,
    Rendezvous,
    TransportClosed,
    TransportError,
    byte_view,
    check_peer,
    check_stamp,
)
from ..mailbox import DISCARD, Mailbox, PendingRequest
from .slabs import SharedSlabs

__all__ = ["ZmqTransport", "SCHEMES"]

SCHEMES = ("tcp", "ipc")

#: sender's nonce, kind, source rank, tag, payload bytes, stamp bytes (the stamp follows).
HEADER = struct.Struct("<QBiQQB")
_KIND_AT = 8  # offset of the kind byte in a header
KIND_INLINE = 0
KIND_DATA = 1
KIND_BYE = 2
#: Payload is in shared-memory slot SLOT (after the header); see transports.zmq.slabs.
KIND_SHM = 3
#: The receiver copied slot ``nbytes`` (the header's last field) out: reuse it.
KIND_CREDIT = 4
SLOT = struct.Struct("<I")

#: How long ZeroMQ may keep flushing queued messages (BYE included) after close.
LINGER_MS = 1000
#: Poll timeout of the I/O thread when nothing is due. Only a safety net:
#: posted sends and close() wake it through the wakeup fd.
IDLE_POLL_MS = 250
#: Inbound messages handled per loop turn before posted sends are served again.
RECV_BATCH = 64
#: Bound on close() waiting for the I/O thread (socket close itself never waits:
#: ZeroMQ lingers in the background).
JOIN_TIMEOUT_S = 5.0
#: TCP keepalive, so a vanished host (no RST) is noticed: idle, interval (s), probes.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 10, 5, 3
#: Bind addresses that peers cannot connect to: publish this host's address instead.
WILDCARD_HOSTS = ("*", "0.0.0.0", "")
#: A peer refusing our handshake: the ranks do not share a token or CURVE setting.
REFUSED_EVENTS = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
MONITOR_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | REFUSED_EVENTS
#: Refusals by libzmq on the listening socket (ZAP refusals are logged by the handler).
HANDSHAKE_EVENTS = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL

#: Default cap on bytes held per peer for receives not posted yet.
MAX_UNEXPECTED_NBYTES = 512 << 20
#: Linux abstract-namespace ipc endpoints (no file); elsewhere a private temp dir.
ABSTRACT_IPC = sys.platform.startswith("linux")

_WAKE = (1).to_bytes(8, "little")  # an eventfd takes 8-byte counts; a pipe takes anything


class _Wakeup:
    """An fd that worker threads make readable to wake the I/O thread's poll."""

    def __init__(self):
        if hasattr(os, "eventfd"):
            self.fd = self._write_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        else:
            self.fd, self._write_fd = os.pipe()
            os.set_blocking(self.fd, False)
            os.set_blocking(self._write_fd, False)

    def set(self) -> None:
        try:
            os.write(self._write_fd, _WAKE)
        except BlockingIOError:  # full: already readable
            pass

    def clear(self) -> None:
        try:
            os.read(self.fd, 4096)
        except BlockingIOError:
            pass

    def close(self) -> None:
        os.close(self.fd)
        if self._write_fd != self.fd:
            os.close(self._write_fd)


class ZmqTransport:
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
    token : bytes, optional
        Shared secret every connection must prove (ZeroMQ PLAIN, or CURVE keys
        exchanged through the store); see :mod:`transports.zmq.auth`.
    curve : bool
        Encrypt every connection with CURVE.
    max_unexpected_nbytes : int
        Bytes a peer may have waiting for receives not posted yet before it is cut off.
    """

    #: No shared arena between these ranks (see :class:`transports.base.Transport`).
    arena = None

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
        self._grace_s = peer_grace_s
        self._zero_copy_nbytes = zero_copy_nbytes
        self._mailbox = Mailbox(rank, size, max_unexpected_nbytes, self._on_overflow)
        self.mailbox = self._mailbox  # read-only to callers: what arrived, not taken
        self._nonce = int.from_bytes(os.urandom(8), "little")
        self._peer_nonces: dict[int, int] = {}
        self._security = auth.Security(token, curve)
        self._door: auth._Door | None = None
        #: Frames dropped as malformed or forged, and connections refused at
        #: the handshake (logged, rate-limited).
        self.dropped = auth.DropLog(f"numcoll transport rank {rank}: dropped frame")
        self.refused = auth.DropLog(f"numcoll transport rank {rank}: refused connection")
        self._pull_monitor: zmq.Socket | None = None
        self._shm: SharedSlabs | None = None
        # (peer, first frame, second frame | None, zero-copy send | None), or None to stop
        self._ops: deque = deque()
        self._ops_lock = threading.Lock()
        # Held by whichever thread touches a PUSH socket: the I/O thread, or a
        # worker sending a small message itself (see _send_now). ZeroMQ allows a
        # socket to move between threads across a full memory barrier; the lock
        # is that barrier, and it keeps each peer's messages in posting order.
        self._push_lock = threading.Lock()
        self._closing = False  # no more sends are taken
        self._closed_reason = "this transport is closed"
        self._close_called = False
        self._wakeup = _Wakeup()
        self._ipc_dir: str | None = None
        self._pull: zmq.Socket | None = None
        self._push: dict[int, zmq.Socket] = {}
        self._monitors: dict[int, zmq.Socket] = {}
        # State below belongs to the I/O thread.
        self._backlog: dict[int, deque] = {}  # sends ZeroMQ refused (HWM), in order
        self._tracked: dict[int, deque[PendingRequest]] = {p: deque() for p in range(size)}
        self._suspects: dict[int, float] = {}  # disconnected peer -> end of its grace
        self._poller = zmq.Poller()
        ctx = zmq.Context.instance()
        try:
            self._pull = ctx.socket(zmq.PULL)
            self._pull.setsockopt(zmq.RCVHWM, 0)
            self._pull.setsockopt(zmq.LINGER, 0)
            self._door = self._security.serve(self._pull, scheme, self.refused)
            keys = self._exchange_keys(store)
            # Handshakes libzmq itself rejects (a bad greeting, a mechanism other
            # than ours) never reach the ZAP handler: hear of them here.
            self._pull_monitor = self._pull.get_monitor_socket(HANDSHAKE_EVENTS)
            self.endpoint = self._bind(host)
            store.set(f"addr/{rank}", self._card())
            for peer in range(size):
                if peer != rank:
                    endpoint = self._read_card(peer, store.get(f"addr/{peer}"))
                    self._connect(ctx, peer, endpoint, keys.get(peer, b""))
            if scheme == "ipc" and size > 1 and shm_slots > 0 and shm_slot_nbytes >= zero_copy_nbytes:
                self._shm = SharedSlabs(rank, size, store, shm_slot_nbytes, shm_slots)
        except BaseException:
            self._release_sockets()
            self._wakeup.close()
            self._remove_ipc_dir()
            if self._door is not None:
                self._door.close()
            if self._shm is not None:
                self._shm.close()
            raise
        self._thread = threading.Thread(
            target=self._run, name=f"numcoll-{scheme}-io-rank{rank}", daemon=True)
        self._thread.start()  # publishes the sockets made above to the thread that owns them

    # --- setup ----------------------------------------------------------------

    def _exchange_keys(self, store: Rendezvous) -> dict[int, bytes]:
        """With CURVE, every rank's public key, known to the door before anyone
        can connect (a key learnt later would refuse a legitimate peer)."""
        if not self._security.curve:
            return {}
        store.set(f"curve/{self.rank}", self._security.public_key)
        keys = {peer: store.get(f"curve/{peer}") for peer in range(self.size) if peer != self.rank}
        if self._door is not None:
            self._door.allow_keys(keys.values())
        return keys

    def _card(self) -> bytes:
        """What peers need to reach this rank and believe its frames: endpoint, nonce."""
        mode = "curve" if self._security.curve else "-"
        return f"{self.endpoint} {self._nonce:016x} {mode}".encode()

    def _read_card(self, peer: int, card: bytes) -> str:
        try:
            endpoint, nonce, mode = card.decode().split(" ")
            self._peer_nonces[peer] = int(nonce, 16)
        except ValueError:
            raise TransportError(f"rank {self.rank}: rank {peer} published a malformed "
                                 f"address {card[:80]!r} (another numcoll version?)", peer) from None
        if (mode == "curve") != self._security.curve:
            raise TransportError(f"rank {self.rank} and rank {peer} disagree on CURVE "
                                 "(set NUMCOLL_CURVE alike on every rank)", peer)
        return endpoint

    def _bind(self, host: str) -> str:
        if self.scheme == "ipc" and ABSTRACT_IPC:
            # Abstract namespace: no file, so nothing is left behind, even on SIGKILL.
            endpoint = f"ipc://@numcoll-{os.getpid()}-{uuid.uuid4().hex}-{self.rank}"
            self._pull.bind(endpoint)
            return endpoint
        if self.scheme == "ipc":
            self._ipc_dir = tempfile.mkdtemp(prefix="numcoll-ipc-")
            path = os.path.join(self._ipc_dir, f"numcoll-{uuid.uuid4().hex}-{self.rank}.sock")
            self._pull.bind(f"ipc://{path}")
            return f"ipc://{path}"
        self._set_keepalive(self._pull)
        self._pull.bind(f"tcp://{host or '*'}:0")
        endpoint = self._pull.getsockopt_string(zmq.LAST_ENDPOINT)
        if host in WILDCARD_HOSTS:
            port = endpoint.rsplit(":", 1)[1]
            endpoint = f"tcp://{socket.gethostbyname(socket.gethostname())}:{port}"
        return endpoint

    def _connect(self, ctx: zmq.Context, peer: int, endpoint: str, key: bytes) -> None:
        sock = ctx.socket(zmq.PUSH)
        self._push[peer] = sock
        self._security.connect(sock, key)
        # Unbounded queue, and no IMMEDIATE: messages wait for the connection
        # instead of being refused; the algorithms bound what is in flight.
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.LINGER, LINGER_MS)
        if self.scheme == "tcp":
            self._set_keepalive(sock)
        # Monitor before connecting, so the first CONNECTED is not missed.
        self._monitors[peer] = sock.get_monitor_socket(MONITOR_EVENTS)
        sock.connect(endpoint)

    @staticmethod
    def _set_keepalive(sock: zmq.Socket) -> None:
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, KEEPALIVE_IDLE_S)
        sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, KEEPALIVE_INTERVAL_S)
        sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, KEEPALIVE_PROBES)

    # --- the Transport interface (called from any thread) ------------------------

    def isend(self, peer: int, tag: int, buf, stamp: bytes = b"") -> PendingRequest:
        check_peer(SEND, self.rank, self.size, peer, tag)
        data = byte_view(buf)
        stamp = check_stamp(stamp)
        req = PendingRequest(SEND, self.rank, peer, tag)
        if peer == self.rank:
            if self._mailbox.deliver(peer, tag, data, stamp=stamp):
                req.complete(None, source=peer)
            else:
                req.fail(TransportClosed(f"{req.describe()}: {self._closed_reason}", peer))
            return req
        reason = self._mailbox.gone_reason(peer)
        if reason is not None:
            req.fail(PeerClosed(f"{req.describe()}: {reason}", peer))
            return req
        if (self._shm is not None and self._zero_copy_nbytes <= data.nbytes <= self._shm.slot_nbytes
                and self._shm.has_slab(peer)):
            # Through a shared-memory slot: the request completes once the bytes
            # are copied in (here, or by the I/O thread when a slot frees up).
            header = self._header(KIND_SHM, tag, data.nbytes, stamp)
            if self._send_now(peer, header, data):
                req.complete(None, source=peer)
                return req
            posted = self._post((peer, header, data, req))
        elif data.nbytes >= self._zero_copy_nbytes:
            # ZeroMQ reads the caller's buffer; the I/O thread completes the request
            # with ZeroMQ's tracker, which fires when the buffer is released.
            header = self._header(KIND_DATA, tag, data.nbytes, stamp)
            posted = self._post((peer, header, data, req))
        else:
            message = self._header(KIND_INLINE, tag, data.nbytes, stamp) + data
            posted = self._send_now(peer, message) or self._post((peer, message, None, None))
            if posted:  # the copy frees the caller's buffer now
                req.complete(None, source=peer)
        if not posted:
            req.fail(TransportClosed(f"{req.describe()}: {self._closed_reason}", peer))
        return req

    def irecv(self, peer: int, tag: int, buf=None, stamp: bytes = b"",
              whole_call: bool = False) -> PendingRequest:
        return self._mailbox.receive(peer, tag, buf, stamp, whole_call)

    def _header(self, kind: int, tag: int, nbytes: int, stamp: bytes = b"") -> bytes:
        return HEADER.pack(self._nonce, kind, self.rank, tag, nbytes, len(stamp)) + stamp

    def close(self) -> None:
        with self._ops_lock:
            if self._close_called:
                return
            self._close_called = True
            if not self._closing:
                self._closing = True
                self._closed_reason = f"rank {self.rank}'s transport was closed"
                self._ops.append(None)  # after every send posted so far: BYE follows the data
        self._mailbox.close(f"rank {self.rank}'s transport was closed")
        self._wakeup.set()
        self._thread.join(JOIN_TIMEOUT_S)
        if self._thread.is_alive():
            warnings.warn(f"rank {self.rank}: transport I/O thread did not stop within "
                          f"{JOIN_TIMEOUT_S}s", RuntimeWarning, stacklevel=2)
            return  # its sockets and fd are still in use: leave them to it
        self._wakeup.close()
        self._remove_ipc_dir()
        if self._shm is not None:
            self._shm.close()
        if self._door is not None:
            self._door.close()

    def __repr__(self) -> str:
        return f"<ZmqTransport {self.endpoint} rank {self.rank}/{self.size}>"

    def _send_now(self, peer: int, message: bytes, payload=None) -> bool:
        """Send on the calling thread, sparing the hand-off to the I/O thread
        (a large part of a small message's latency): a small ``message``, or
        (with ``payload``) ``message`` as the header of ``payload`` sent through
        a free shared-memory slot. Only
        when nothing is queued ahead of it, so per-peer order holds; False
        means "queue it instead", never an error."""
        if not self._push_lock.acquire(blocking=False):
            return False
        try:
            with self._ops_lock:
                if self._ops or self._closing:
                    return False
            sock = self._push.get(peer)
            if sock is None or peer in self._backlog:
                return False
            if payload is not None:
                slot = self._shm.acquire(peer)
                if slot is None:
                    return False
            else:
                try:
                    sock.send(message, zmq.NOBLOCK)
                except zmq.ZMQError:
                    return False
                return True
        finally:
            self._push_lock.release()
        # The copy into the slot runs without the lock, so the I/O thread can
        # keep sending credits meanwhile. Order still holds: this thread posts
        # nothing else until it returns, and other threads' messages have no
        # order relative to ours.
        self._shm.write(peer, slot, payload)
        header = message + SLOT.pack(slot)
        with self._push_lock:
            sock = self._push.get(peer)
            if sock is None:  # the peer left meanwhile: let the queued path fail the request
                self._shm.release(peer, slot)
                return False
            sock.send(header, zmq.NOBLOCK)
        return True

    def _send_shm(self, peer: int, header: bytes, payload) -> bool:
        """Copy ``payload`` into a free slot towards ``peer`` and send its header;
        False (nothing sent) if every slot is in flight. Holds the push lock."""
        slot = self._shm.acquire(peer)
        if slot is None:
            return False
        self._shm.write(peer, slot, payload)
        self._push[peer].send(header + SLOT.pack(slot), zmq.NOBLOCK)
        return True

    def _post(self, op) -> bool:
        with self._ops_lock:
            if self._closing:
                return False
            # A non-empty queue means a wakeup is already pending (the I/O thread
            # clears the fd before it takes the queue), so skip the syscall.
            wake = not self._ops
            self._ops.append(op)
        if wake:
            self._wakeup.set()
        return True

    # --- the I/O thread ---------------------------------------------------------------

    def _run(self) -> None:
        poller = self._poller
        poller.register(self._pull, zmq.POLLIN)
        poller.register(self._wakeup.fd, zmq.POLLIN)
        for mon in self._monitors.values():
            poller.register(mon, zmq.POLLIN)
        poller.register(self._pull_monitor, zmq.POLLIN)
        error = None
        try:
            running = True
            while running:
                ready = poller.poll(self._poll_timeout_ms())
                for sock, _ in ready:
                    if sock is self._pull:
                        self._read_inbound()
                    elif sock is self._pull_monitor:
                        self._read_refusals()
                    elif sock == self._wakeup.fd:
                        self._wakeup.clear()
                    else:
                        with self._push_lock:
                            self._on_peer_socket(sock)
                with self._push_lock:
                    running = self._run_ops()
                    if self._suspects:
                        self._expire_suspects()
        except Exception as exc:  # fail every waiter with the cause instead of leaving them hanging
            error = exc
        finally:
            with self._push_lock:
                self._shutdown(error)

    def _poll_timeout_ms(self) -> int:
        if not self._suspects:
            return IDLE_POLL_MS
        due_s = min(self._suspects.values()) - time.monotonic()
        return max(0, min(IDLE_POLL_MS, int(due_s * 1000) + 1))

    def _on_peer_socket(self, sock: zmq.Socket) -> None:
        for peer, mon in self._monitors.items():
            if sock is mon:
                return self._read_monitor(peer)
        for peer, push in self._push.items():
            if sock is push:
                return self._flush_backlog(peer)

    def _run_ops(self) -> bool:
        """Send what the workers posted; False once told to stop."""
        while True:
            with self._ops_lock:
                if not self._ops:
                    return True
                ops, self._ops = self._ops, deque()
            for op in ops:
                if op is None:
                    return False
                self._send(*op)

    def _send(self, peer: int, first: bytes, payload, req: PendingRequest | None) -> None:
        if peer not in self._push:  # gone; eager sends to it are silently lost, as on any crash
            if req is not None:
                reason = self._mailbox.gone_reason(peer) or f"rank {peer} has left"
                req.fail(PeerClosed(f"{req.describe()}: {reason}", peer))
            return
        backlog = self._backlog.get(peer)
        if backlog is not None:
            backlog.append((first, payload, req))
        elif not self._try_send(peer, first, payload, req):
            self._backlog[peer] = deque([(first, payload, req)])
            if first[_KIND_AT] != KIND_SHM:  # a full socket; a slot shortage ends with a credit
                self._poller.register(self._push[peer], zmq.POLLOUT)

    def _try_send(self, peer: int, first: bytes, payload, req: PendingRequest | None) -> bool:
        sock = self._push[peer]
        if first[_KIND_AT] == KIND_SHM:
            if not self._send_shm(peer, first, payload):
                return False  # waits in the backlog for a credit, not for POLLOUT
            req.complete(None, source=peer)
            return True
        try:
            sock.send(first, zmq.NOBLOCK if payload is None else zmq.SNDMORE | zmq.NOBLOCK)
        except zmq.Again:
            return False
        if payload is None:
            return True
        # Once the first frame is taken, ZeroMQ takes the rest of the message.
        frame = zmq.Frame(payload, track=True, copy=False)
        sock.send(frame, zmq.NOBLOCK, copy=False)
        req.complete(None, source=peer, after=frame.tracker_event)
        # Drop our reference: ZeroMQ releases the buffer only once every copy of the frame is gone.
        del frame
        tracked = self._tracked[peer]
        while tracked and tracked[0].done():
            tracked.popleft()
        tracked.append(req)
        return True

    def _flush_backlog(self, peer: int) -> None:
        backlog = self._backlog.get(peer)
        if backlog is None:
            return
        while backlog:
            if not self._try_send(peer, *backlog[0]):
                if backlog[0][0][_KIND_AT] == KIND_SHM and self._is_polled(peer):
                    self._poller.unregister(self._push[peer])  # now waiting for a credit
                return
            backlog.popleft()
        del self._backlog[peer]
        if self._is_polled(peer):
            self._poller.unregister(self._push[peer])

    def _is_polled(self, peer: int) -> bool:
        sock = self._push[peer]
        return any(s is sock for s, _ in self._poller.sockets)

    def _read_inbound(self) -> None:
        pull = self._pull
        for _ in range(RECV_BATCH):
            try:
                first = pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._take(first)
            except _BadFrame as bad:
                self.dropped.drop(str(bad))
            # Whatever a bad message carried beyond what was read: a multipart
            # message arrives whole, so this never blocks.
            while pull.getsockopt(zmq.RCVMORE):
                pull.recv(zmq.NOBLOCK, copy=False)

    def _take(self, first: bytes) -> None:
        """Check one inbound message (its first frame read) and act on it;
        :class:`_BadFrame` before anything is delivered if it is not one a peer sends."""
        if len(first) < HEADER.size:
            raise _BadFrame(f"{len(first)}-byte frame, shorter than a header")
        nonce, kind, src, tag, nbytes, stamp_nbytes = HEADER.unpack_from(first)
        if not 0 <= src < self.size or src == self.rank:
            raise _BadFrame(f"kind {kind} claiming to be from rank {src} (group of {self.size}, "
                            f"this is rank {self.rank})")
        if nonce != self._peer_nonces.get(src):
            raise _BadFrame(f"kind {kind} claiming to be from rank {src} without its session nonce")
        body = HEADER.size + stamp_nbytes
        if body > len(first):
            raise _BadFrame(f"from rank {src}: stamp of {stamp_nbytes} bytes runs past the frame")
        more = self._pull.getsockopt(zmq.RCVMORE)
        if kind != KIND_DATA and more:
            raise _BadFrame(f"kind {kind} from rank {src} with extra frames")
        if self._mailbox.gone_reason(src) is not None:
            raise _BadFrame(f"kind {kind} from rank {src}, which has left or was cut off")
        if src in self._suspects:  # still draining what it sent: extend its grace
            self._suspects[src] = time.monotonic() + self._grace_s
        stamp = first[HEADER.size:body]
        if kind == KIND_INLINE:  # the frame is our own copy: the mailbox may keep it
            if len(first) - body != nbytes:
                raise _BadFrame(f"inline message from rank {src} claims {nbytes} bytes "
                                f"but carries {len(first) - body}")
            self._mailbox.deliver(src, tag, memoryview(first)[body:], private=True, stamp=stamp)
        elif kind == KIND_DATA:
            if not more or len(first) != body:
                raise _BadFrame(f"data header from rank {src} without exactly one payload frame")
            payload = self._pull.recv(zmq.NOBLOCK, copy=False)
            if self._pull.getsockopt(zmq.RCVMORE) or len(payload) != nbytes:
                raise _BadFrame(f"data message from rank {src} claims {nbytes} bytes but "
                                f"its payload frame has {len(payload)}")
            self._mailbox.arrive(src, tag, nbytes, lambda into: _read_frame(payload, into), stamp)
        elif kind == KIND_SHM:
            if len(first) != body + SLOT.size:
                raise _BadFrame(f"slot header from rank {src} of {len(first)} bytes")
            slot = SLOT.unpack_from(first, body)[0]
            if self._shm is None or not self._shm.readable(src, slot, nbytes):
                raise _BadFrame(f"rank {src} names slot {slot} for {nbytes} bytes, which "
                                "its slab does not have")
            self._mailbox.arrive(src, tag, nbytes, lambda into, s=slot, n=nbytes, p=src:
                                 self._read_slot(p, s, n, into), stamp)
            self._credit(src, slot)
        elif kind == KIND_CREDIT:
            if len(first) != HEADER.size or self._shm is None or not self._shm.release(src, nbytes):
                raise _BadFrame(f"credit from rank {src} for slot {nbytes}, not in flight to it")
            with self._push_lock:
                if src in self._push:
                    self._flush_backlog(src)
        elif kind == KIND_BYE:  # comes after everything src sent us
            if len(first) != HEADER.size or nbytes or tag:
                raise _BadFrame(f"malformed goodbye from rank {src}")
            with self._push_lock:
                self._peer_gone(src, f"rank {src} closed its transport")
        else:
            raise _BadFrame(f"unknown kind {kind} claiming to be from rank {src}")

    def _on_overflow(self, peer: int, reason: str) -> None:
        """The mailbox holds too much from ``peer`` (called on the I/O thread)."""
        auth.log.error("numcoll transport rank %d: %s", self.rank, reason)
        with self._push_lock:
            self._peer_gone(peer, reason)

    def _read_slot(self, peer: int, slot: int, nbytes: int, into):
        if into is DISCARD:
            return None
        view = self._shm.read(peer, slot, nbytes, into)
        return view if into is None else None

    def _credit(self, peer: int, slot: int) -> None:
        # Straight onto the socket, never behind the backlog: two ranks each
        # waiting for slots must still be able to hand each other credits.
        with self._push_lock:
            sock = self._push.get(peer)
            if sock is not None:
                try:
                    sock.send(self._header(KIND_CREDIT, 0, slot), zmq.NOBLOCK)
                except zmq.ZMQError:  # gone: it will not need the slot again
                    pass

    def _read_refusals(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self._pull_monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            name = zmq.Event(event["event"]).name.lower()
            self.refused.drop(f"{name} (error {event['value']}) on {self.endpoint}")

    def _read_monitor(self, peer: int) -> None:
        mon = self._monitors[peer]
        while True:
            try:
                event = recv_monitor_message(mon, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            if event & REFUSED_EVENTS:
                self._peer_gone(peer, f"rank {peer} refused this rank's connection at the "
                                f"handshake ({zmq.Event(event).name.lower()}): do all ranks "
                                "share NUMCOLL_AUTH_TOKEN and NUMCOLL_CURVE?")
                return
            if event == zmq.EVENT_DISCONNECTED:
                self._suspects.setdefault(peer, time.monotonic() + self._grace_s)
            elif event == zmq.EVENT_CONNECTED:
                self._suspects.pop(peer, None)

    def _expire_suspects(self) -> None:
        now = time.monotonic()
        for peer, end in list(self._suspects.items()):
            if end <= now:
                self._peer_gone(peer, f"connection to rank {peer} lost (process exited?)")

    def _peer_gone(self, peer: int, reason: str) -> None:
        self._suspects.pop(peer, None)
        if peer not in self._push:
            return
        self._mailbox.peer_gone(peer, reason)
        unsent = [req for _, _, req in self._backlog.pop(peer, ()) if req is not None]
        for req in unsent + list(self._tracked[peer]):
            req.fail(PeerClosed(f"{req.describe()}: {reason}", peer))
        self._tracked[peer].clear()
        # Nothing queued for it can be delivered: drop it now, which releases the
        # zero-copy buffers and so lets the failed sends' waiters return.
        self._close_peer(peer, linger_ms=0)

    def _close_peer(self, peer: int, linger_ms: int) -> None:
        sock = self._push.pop(peer)
        mon = self._monitors.pop(peer)
        registered = {s for s, _ in self._poller.sockets}
        for s in (sock, mon):
            if s in registered:
                self._poller.unregister(s)
        sock.disable_monitor()
        mon.close(linger=0)
        sock.close(linger=linger_ms)

    def _shutdown(self, error: Exception | None) -> None:
        reason = (f"rank {self.rank}'s transport was closed" if error is None
                  else f"the I/O thread of rank {self.rank} failed: {error!r}")
        with self._ops_lock:
            self._closing = True
            self._closed_reason = reason
            leftover = [op for op in self._ops if op is not None]
            self._ops.clear()
        self._mailbox.close(reason)
        failed = [req for _, _, _, req in leftover if req is not None]
        for peer in self._push:
            backlog = self._backlog.pop(peer, None)
            if backlog is not None:
                failed.extend(req for _, _, req in backlog if req is not None)
            elif error is None:
                self._say_bye(peer)
            failed.extend(self._tracked[peer])
        # Fail the waiters before touching sockets, which may be what broke. Zero-copy
        # sends already handed over still wait until the closing sockets release their buffers.
        for req in failed:
            req.fail(TransportClosed(f"{req.describe()}: {reason}", req.peer))
        try:
            for peer in list(self._push):
                self._close_peer(peer, linger_ms=LINGER_MS)  # lingers in the background
        finally:
            self._close_pull()

    def _close_pull(self) -> None:
        if self._pull_monitor is not None:
            self._pull.disable_monitor()
            self._pull_monitor.close(linger=0)
        self._pull.close(linger=0)

    def _say_bye(self, peer: int) -> None:
        try:
            self._push[peer].send(self._header(KIND_BYE, 0, 0), zmq.NOBLOCK)
        except zmq.ZMQError:  # it will see the disconnect instead
            pass

    def _release_sockets(self) -> None:
        """Close sockets from the constructing thread (the I/O thread never started)."""
        for peer in list(self._push):
            if peer in self._monitors:
                self._close_peer(peer, linger_ms=0)
            else:
                self._push.pop(peer).close(linger=0)
        if self._pull is not None:
            self._close_pull()

    def _remove_ipc_dir(self) -> None:
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)


class _BadFrame(Exception):
    """An inbound message no numcoll peer of this group would send."""


def _read_frame(frame: zmq.Frame, into: memoryview | None) -> memoryview | None:
    """A :data:`~transports.mailbox.PayloadReader` over a received payload frame."""
    if into is None:
        return memoryview(frame.buffer).toreadonly()
    if into.nbytes:
        # NumPy releases the GIL for a large copy; a memoryview assignment would not.
        np.frombuffer(into, np.uint8)[...] = np.frombuffer(frame.buffer, np.uint8)
    return None
