"""Moving bytes for the ZeroMQ transport: the I/O thread, and the shortcut around it.

One I/O thread per transport owns every socket. Sends reach it through a
queue plus a wakeup fd; small ones skip it when nothing is queued ahead of
them (:meth:`IOThread.send_now`: a large part of a small message's latency is
the hand-off). Receives never wait for it: they are matched in the
:class:`~transports.mailbox.Mailbox`, which the I/O thread fills after
:class:`~transports.zmq.wire.Inbound` checked each message, reading each
payload straight into the posted buffer.

Liveness
    A closing rank sends ``BYE`` to every peer after all its data (same pipe,
    so a peer that reads ``BYE`` has everything). A crash shows up as a
    disconnect on the PUSH socket's monitor; after ``peer_grace_s`` of silence
    (data sent before the crash may still be arriving) the peer is declared lost.
Refusals
    Frames that fail their checks, and connections that libzmq hangs up on
    before their handshake ends (a bad greeting, a frame over the size
    limit, a handshake that never finishes), are counted and logged through
    the transport's :class:`~transports.refusals.RefusalLog`; ZAP refusals are
    counted by :mod:`transports.zmq.auth`.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque

import zmq
from zmq.utils.monitor import recv_monitor_message

from ..base import PeerClosed, TransportClosed
from ..endpoint import AllEvents, PendingRequest
from ..mailbox import Mailbox
from ..refusals import RefusalLog
from . import rendezvous as rv
from . import zerocopy
from .slabs import SharedSlabs
from .wire import KIND_AT, KIND_BYE, KIND_CREDIT, KIND_SHM, SLOT, BadFrame, Inbound

__all__ = ["IOThread"]

#: Poll timeout of the I/O thread when nothing is due. Only a safety net:
#: posted sends and close() wake it through the wakeup fd.
IDLE_POLL_MS = 250
#: Inbound messages handled per loop turn before posted sends are served again.
RECV_BATCH = 64
#: Bound on close() waiting for the I/O thread (socket close itself never waits:
#: ZeroMQ lingers in the background).
JOIN_TIMEOUT_S = 5.0
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


class IOThread:
    """The sockets of one rank and the thread that owns them.

    An *op* is ``(peer, first frame, payload | None, request | None, chunks |
    None)``: ``request`` completes once the message is handed over (after
    ZeroMQ released a zero-copy ``payload``); ``chunks``, shared by the ops of
    one message cut into several, collects their frames' release events.
    """

    def __init__(self, rank: int, size: int, sockets: rv.Sockets, mailbox: Mailbox,
                 slabs: SharedSlabs | None, refusals: RefusalLog, *, grace_s: float,
                 header, name: str):
        self.rank = rank
        self._s = sockets
        self._mailbox = mailbox
        self._inbound = Inbound(rank, size, mailbox, sockets.peer_nonces, slabs,
                                on_slot_read=self._credit, on_credit=self._credited,
                                on_bye=self._bye, on_alive=self._alive)
        self._slabs = slabs
        self._refusals = refusals
        self._grace_s = grace_s
        self._header = header  # header(kind, tag, nbytes, stamp=b"") -> bytes
        self._ops: deque = deque()  # ops, or None to stop
        self._ops_lock = threading.Lock()
        # Held by whichever thread touches a PUSH socket: the I/O thread, or a
        # worker sending a small message itself (see send_now). ZeroMQ allows a
        # socket to move between threads across a full memory barrier; the lock
        # is that barrier, and it keeps each peer's messages in posting order.
        self.push_lock = threading.Lock()
        self.closing = False  # no more sends are taken
        self.closed_reason = "this transport is closed"
        self._wakeup = _Wakeup()
        # State below belongs to the I/O thread.
        self._backlog: dict[int, deque] = {}  # sends ZeroMQ refused (HWM), in order
        self._tracked: dict[int, deque[PendingRequest]] = {p: deque() for p in sockets.push}
        #: Peers that left without a goodbye (crashed, vanished, refused us).
        self.lost: set[int] = set()
        self._suspects: dict[int, float] = {}  # disconnected peer -> end of its grace
        self._handshaking: deque[int] = deque()  # accepted fds, handshake not ended yet
        self._poller = zmq.Poller()
        self._pull_monitor = sockets.pull_monitor
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        zerocopy.ready()  # pyzmq's, made before any I/O thread of this process makes frames
        self._thread.start()  # publishes the sockets made before to the thread that owns them

    # --- worker threads --------------------------------------------------------------------

    def post(self, *ops) -> bool:
        """Queue ``ops`` for the I/O thread, together (no other op comes between
        them); False if the transport is closing."""
        with self._ops_lock:
            if self.closing:
                return False
            # A non-empty queue means a wakeup is already pending (the I/O thread
            # clears the fd before it takes the queue), so skip the syscall.
            wake = not self._ops
            self._ops.extend(ops)
        if wake:
            self._wakeup.set()
        return True

    def send_now(self, peer: int, message: bytes, payload=None) -> bool:
        """Send on the calling thread, sparing the hand-off to the I/O thread:
        a small ``message``, or (with ``payload``) ``message`` as the header of
        ``payload`` sent through a free shared-memory slot. Only when nothing
        is queued ahead of it, so per-peer order holds; False means "queue it
        instead", never an error."""
        if not self.push_lock.acquire(blocking=False):
            return False
        try:
            with self._ops_lock:
                if self._ops or self.closing:
                    return False
            sock = self._s.push.get(peer)
            if sock is None or peer in self._backlog:
                return False
            if payload is not None:
                slot = self._slabs.acquire(peer)
                if slot is None:
                    return False
            else:
                try:
                    sock.send(message, zmq.NOBLOCK)
                except zmq.ZMQError:
                    return False
                return True
        finally:
            self.push_lock.release()
        # The copy into the slot runs without the lock, so the I/O thread can
        # keep sending credits meanwhile. Order still holds: this thread posts
        # nothing else until it returns, and other threads' messages have no
        # order relative to ours.
        self._slabs.write(peer, slot, payload)
        with self.push_lock:
            sock = self._s.push.get(peer)
            if sock is None:  # the peer left meanwhile: let the queued path fail the request
                self._slabs.release(peer, slot)
                return False
            sock.send(message + SLOT.pack(slot), zmq.NOBLOCK)
        return True

    def close(self) -> bool:
        """Stop after every op posted so far (BYE follows the data); False if
        the thread did not stop in time (its sockets are left to it)."""
        with self._ops_lock:
            if not self.closing:
                self.closing = True
                self.closed_reason = f"rank {self.rank}'s transport was closed"
                self._ops.append(None)
        self._wakeup.set()
        self._thread.join(JOIN_TIMEOUT_S)
        if self._thread.is_alive():
            return False
        self._wakeup.close()
        return True

    def peer_left(self, peer: int, reason: str, graceful: bool = False) -> None:
        """Called on the I/O thread (the mailbox's overflow, a BYE): ``peer`` is gone."""
        with self.push_lock:
            self._peer_gone(peer, reason, graceful)

    # --- the loop ------------------------------------------------------------------------------

    def _run(self) -> None:
        poller = self._poller
        poller.register(self._s.pull, zmq.POLLIN)
        poller.register(self._wakeup.fd, zmq.POLLIN)
        for mon in self._s.monitors.values():
            poller.register(mon, zmq.POLLIN)
        poller.register(self._pull_monitor, zmq.POLLIN)
        error = None
        try:
            running = True
            while running:
                ready = poller.poll(self._poll_timeout_ms())
                for sock, _ in ready:
                    if sock is self._s.pull:
                        self._read_inbound()
                    elif sock is self._pull_monitor:
                        self._read_pull_monitor()
                    elif sock == self._wakeup.fd:
                        self._wakeup.clear()
                    else:
                        with self.push_lock:
                            self._on_peer_socket(sock)
                with self.push_lock:
                    running = self._run_ops()
                    if self._suspects:
                        self._expire_suspects()
        except Exception as exc:  # fail every waiter with the cause instead of leaving them hanging
            error = exc
        finally:
            with self.push_lock:
                self._shutdown(error)

    def _poll_timeout_ms(self) -> int:
        if not self._suspects:
            return IDLE_POLL_MS
        due_s = min(self._suspects.values()) - time.monotonic()
        return max(0, min(IDLE_POLL_MS, int(due_s * 1000) + 1))

    def _on_peer_socket(self, sock: zmq.Socket) -> None:
        for peer, mon in self._s.monitors.items():
            if sock is mon:
                return self._read_monitor(peer)
        for peer, push in self._s.push.items():
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

    # --- sending ---------------------------------------------------------------------------------

    def _send(self, peer: int, first: bytes, payload, req, chunks) -> None:
        if peer not in self._s.push:  # gone; eager sends to it are silently lost, as on any crash
            if req is not None:
                reason = self._mailbox.gone_reason(peer) or f"rank {peer} has left"
                req.fail(PeerClosed(f"{req.describe()}: {reason}", peer))
            return
        backlog = self._backlog.get(peer)
        if backlog is not None:
            backlog.append((first, payload, req, chunks))
        elif not self._try_send(peer, first, payload, req, chunks):
            self._backlog[peer] = deque([(first, payload, req, chunks)])
            if first[KIND_AT] != KIND_SHM:  # a full socket; a slot shortage ends with a credit
                self._poller.register(self._s.push[peer], zmq.POLLOUT)

    def _try_send(self, peer: int, first: bytes, payload, req, chunks) -> bool:
        sock = self._s.push[peer]
        if first[KIND_AT] == KIND_SHM:
            slot = self._slabs.acquire(peer)
            if slot is None:
                return False  # waits in the backlog for a credit, not for POLLOUT
            self._slabs.write(peer, slot, payload)
            sock.send(first + SLOT.pack(slot), zmq.NOBLOCK)
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
        if chunks is not None:
            chunks.append(frame.tracker_event)
        # Drop our reference: ZeroMQ releases the buffer only once every copy of the frame is gone.
        after = frame.tracker_event if chunks is None else AllEvents(chunks)
        del frame
        if req is not None:  # a message's last (or only) frame
            req.complete(None, source=peer, after=after)
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
                if backlog[0][0][KIND_AT] == KIND_SHM and self._is_polled(peer):
                    self._poller.unregister(self._s.push[peer])  # now waiting for a credit
                return
            backlog.popleft()
        del self._backlog[peer]
        if self._is_polled(peer):
            self._poller.unregister(self._s.push[peer])

    def _is_polled(self, peer: int) -> bool:
        sock = self._s.push[peer]
        return any(s is sock for s, _ in self._poller.sockets)

    def _credit(self, peer: int, slot: int) -> None:
        """Give ``peer`` its slot back (on the I/O thread, after reading it)."""
        # Straight onto the socket, never behind the backlog: two ranks each
        # waiting for slots must still be able to hand each other credits.
        with self.push_lock:
            sock = self._s.push.get(peer)
            if sock is not None:
                try:
                    sock.send(self._header(KIND_CREDIT, 0, slot), zmq.NOBLOCK)
                except zmq.ZMQError:  # gone: it will not need the slot again
                    pass

    def _credited(self, peer: int) -> None:
        """``peer`` gave a slot back: what waited for one may go."""
        with self.push_lock:
            if peer in self._s.push:
                self._flush_backlog(peer)

    def _bye(self, peer: int) -> None:
        """``peer`` said goodbye, after everything it sent."""
        self.peer_left(peer, f"rank {peer} closed its transport", graceful=True)

    def _alive(self, peer: int) -> None:
        """A good message from ``peer``: if it is suspected, it is still draining
        what it sent, so extend its grace."""
        if peer in self._suspects:
            self._suspects[peer] = time.monotonic() + self._grace_s

    # --- receiving and watching ----------------------------------------------------------------

    def _read_inbound(self) -> None:
        pull = self._s.pull
        for _ in range(RECV_BATCH):
            try:
                first = pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._inbound.take(first, pull)
            except BadFrame as bad:
                self._refusals.refuse("bad frame", detail=str(bad))
            # Whatever a bad message carried beyond what was read: a multipart
            # message arrives whole, so this never blocks.
            while pull.getsockopt(zmq.RCVMORE):
                pull.recv(zmq.NOBLOCK, copy=False)

    def _read_pull_monitor(self) -> None:
        """Count connections libzmq hung up on before their handshake ended.

        A monitor event names the connection's fd only when it is accepted and
        when it ends; a handshake's success or failure names none, so each is
        taken to end the oldest handshake still open (they are short and run on
        one ZeroMQ I/O thread). A connection that ends with its handshake open
        was dropped by libzmq (over the frame size limit, or no greeting)."""
        while True:
            try:
                msg = recv_monitor_message(self._pull_monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            event, value = msg["event"], msg["value"]
            if event == zmq.EVENT_ACCEPTED:
                self._handshaking.append(value)
            elif event == zmq.EVENT_DISCONNECTED:
                if value in self._handshaking:
                    self._handshaking.remove(value)
                    self._refusals.refuse("dropped before its handshake ended",
                                          detail=f"on {self._s.endpoint}")
            elif self._handshaking:
                self._handshaking.popleft()
                if event & rv.HANDSHAKE_EVENTS:  # ZAP refusals are counted by the door
                    name = zmq.Event(event).name.lower()
                    self._refusals.refuse("handshake failed",
                                          detail=f"{name} (error {value}) on {self._s.endpoint}")

    def _read_monitor(self, peer: int) -> None:
        mon = self._s.monitors[peer]
        while True:
            try:
                event = recv_monitor_message(mon, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            if event & rv.REFUSED_EVENTS:
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

    # --- endings (the I/O thread, holding the push lock) ----------------------------------------

    def _peer_gone(self, peer: int, reason: str, graceful: bool = False) -> None:
        self._suspects.pop(peer, None)
        if peer not in self._s.push:
            return
        self._mailbox.peer_gone(peer, reason)
        self._inbound.forget(peer)
        unsent = [op[2] for op in self._backlog.pop(peer, ()) if op[2] is not None]
        # A send ZeroMQ has taken completes when its buffer is free, as it would have.
        # After a goodbye it may well have been read (the peer answered it, then closed:
        # failing it would be a false alarm); the peer's own waits report whatever it
        # missed. After a crash nothing says it arrived, so it fails.
        failed = unsent if graceful else unsent + list(self._tracked[peer])
        if not graceful:
            self.lost.add(peer)
        for req in failed:
            req.fail(PeerClosed(f"{req.describe()}: {reason}", peer))
        self._tracked[peer].clear()
        # Nothing queued for it can be delivered: drop it now, which releases the
        # zero-copy buffers and so lets the sends' waiters return.
        self._close_peer(peer, linger_ms=0)

    def _close_peer(self, peer: int, linger_ms: int) -> None:
        registered = {s for s, _ in self._poller.sockets}
        for s in (self._s.push[peer], self._s.monitors[peer]):
            if s in registered:
                self._poller.unregister(s)
        rv.close_peer(self._s, peer, linger_ms)

    def _shutdown(self, error: Exception | None) -> None:
        reason = (f"rank {self.rank}'s transport was closed" if error is None
                  else f"the I/O thread of rank {self.rank} failed: {error!r}")
        with self._ops_lock:
            self.closing = True
            self.closed_reason = reason
            leftover = [op for op in self._ops if op is not None]
            self._ops.clear()
        self._mailbox.close(reason)
        failed = [op[3] for op in leftover if op[3] is not None]
        for peer in self._s.push:
            backlog = self._backlog.pop(peer, None)
            if backlog is not None:
                failed.extend(op[2] for op in backlog if op[2] is not None)
            elif error is None:
                self._say_bye(peer)
            failed.extend(self._tracked[peer])
        # Fail the waiters before touching sockets, which may be what broke. Zero-copy
        # sends already handed over still wait until the closing sockets release their buffers.
        for req in failed:
            req.fail(TransportClosed(f"{req.describe()}: {reason}", req.peer))
        try:
            for peer in list(self._s.push):
                self._close_peer(peer, linger_ms=rv.LINGER_MS)  # lingers in the background
        finally:
            rv.close_pull(self._s)

    def _say_bye(self, peer: int) -> None:
        try:
            self._s.push[peer].send(self._header(KIND_BYE, 0, 0), zmq.NOBLOCK)
        except zmq.ZMQError:  # it will see the disconnect instead
            pass
