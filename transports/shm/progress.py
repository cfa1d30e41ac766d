"""Moving bytes through the rings of the ``shm`` transport: who does it, and when.

There is no I/O thread on the critical path: the thread that waits on a
request makes progress itself (drains every inbound ring into the
:class:`~transports.mailbox.Mailbox`, pushes queued sends), then polls the
rings without the GIL: a bounded busy spin (``pause``), then ``sched_yield``
polls, then it blocks on the request. A rank whose threads stopped polling
(2 ms after the last poll, or at once when a waiter blocks) marks its rings
ASLEEP; a producer that publishes into a sleeping ring pokes the consumer with
one byte on a Unix socket, which wakes the helper thread (blocked in
``poll``) to drain. The helper also carries progress no one waits for (sends
that did not fit, unexpected messages), so a send completes even if its
receiver is busy, and it sees a peer's socket reach EOF the moment the peer's
process ends, however it ends (what the peer wrote before is drained first).

Ring layout and memory ordering: :mod:`transports.shm.ring`.
"""

from __future__ import annotations

import mmap
import os
import select
import socket
import threading
import time
import warnings
from collections import deque

import numpy as np

from . import ring as K
from ..base import PeerClosed, TransportClosed, TransportError
from ..endpoint import PendingRequest
from ..mailbox import DISCARD, Mailbox
from .rendezvous import Link

__all__ = ["RingProgress", "ShmRequest", "Send"]

#: Chunks of a large message are not cut below this (unless it is the rest).
MIN_CHUNK_NBYTES = 64 << 10
#: While a send waits for room, the waiter returns from its GIL-free poll this often (ns).
SEND_SLICE_NS = 20_000
#: Block-phase waits are cut into slices of this many seconds (a safety net only).
BLOCK_SLICE_S = 0.05
#: The helper's poll timeout when nothing wakes it (a safety net only), ms.
IDLE_POLL_MS = 100
#: A rank whose threads stopped polling stays "awake" (producers do not poke
#: it) this long, since a collective's next wait usually follows within
#: microseconds; a poke costs a syscall and a thread wake-up on both sides.
#: After that the helper marks the rings ASLEEP (and drains what came).
LAZY_SLEEP_NS = 2_000_000
JOIN_TIMEOUT_S = 5.0
_POKE = b"\x01"
_EMPTY = np.empty(0, np.uint8)
#: Payloads up to this size come out of the ring as ``bytes`` (cheaper than an array).
_SMALL_COPY_NBYTES = 4096


class ShmRequest(PendingRequest):
    """A request whose ``wait`` drives the rings (see the module docstring)."""

    __slots__ = ("_engine",)

    def __init__(self, engine: "RingProgress", what: str, rank: int, peer: int, tag: int,
                 buf: memoryview | None = None, stamp: bytes = b"", whole_call: bool = False):
        super().__init__(what, rank, peer, tag, buf, stamp, whole_call)
        self._engine = engine

    def wait(self, deadline: float | None) -> memoryview | None:
        if not self._finished:
            start = time.monotonic()
            if not self._engine.wait_for(self, deadline):
                raise self._timeout(start)
        return super().wait(deadline)


class Send:
    """A send queued for a peer's ring: how far it got."""

    __slots__ = ("req", "tag", "nbytes", "payload", "stamp", "offset", "started")

    def __init__(self, req: PendingRequest, tag: int, data: memoryview, stamp: bytes):
        self.req = req
        self.tag = np.uint64(tag)
        self.payload = np.frombuffer(data, np.uint8) if data.nbytes else _EMPTY
        self.nbytes = self.payload.size
        self.stamp = np.frombuffer(stamp, np.uint8) if stamp else _EMPTY
        self.offset = 0
        self.started = False


class RingProgress:
    """The rings of one rank, the sends queued for them, and the threads that
    move bytes through them (see the module docstring).

    Parameters
    ----------
    rank, size : int
    mailbox : Mailbox
        Where arriving messages go.
    region : mmap.mmap
        This rank's memory file (its inbound rings first).
    links : dict
        Per peer, a :class:`~transports.shm.rendezvous.Link`.
    capacity : int
        Bytes of each ring.
    spin_ns, yield_ns : int
        How long a waiter busy-polls, then polls with ``sched_yield``, before it blocks.
    """

    def __init__(self, rank: int, size: int, mailbox: Mailbox, region: mmap.mmap,
                 links: dict[int, Link], capacity: int, spin_ns: int, yield_ns: int):
        self.rank = rank
        self.size = size
        self.spin_ns = spin_ns
        self.yield_ns = yield_ns
        self._mailbox = mailbox
        self._peers = sorted(links)
        self._max_chunk = capacity // 2 - 512
        self._min_chunk = min(MIN_CHUNK_NBYTES, self._max_chunk)
        self._plock = threading.Lock()  # progress: ring reads and writes, the send queues
        self._spin_lock = threading.Lock()
        self._spinners = 0
        self._asleep = True  # the rings' ASLEEP flags are up (see _go_to_sleep)
        self._last_active_ns = 0
        self._epoch = np.zeros(1, np.uint64)  # bumped whenever progress is made
        self._sendq: dict[int, deque[Send]] = {p: deque() for p in self._peers}
        self._blocked: dict[int, bool] = {p: False for p in self._peers}
        self._cursor: dict[int, int] = {p: 0 for p in self._peers}  # read position per ring
        self._tail: dict[int, int] = {p: 0 for p in self._peers}  # TAIL as last written
        self._partial: dict[int, list] = {}  # src -> [tag, stamp, buffer, bytes filled]
        self._gone: dict[int, str] = {}
        self._bye: set[int] = set()
        self._closed = False
        self._stopping = False
        self._maps = [region] + [links[p].region for p in self._peers]
        self._out_sock = {p: links[p].out_sock for p in self._peers}
        self._in_sock = {p: links[p].in_sock for p in self._peers}
        region_u8 = np.frombuffer(region, np.uint8)
        self._region64: np.ndarray | None = region_u8.view(np.uint64)
        self._stride_words = (K.CTRL_NBYTES + capacity) // 8
        self._inbound = {p: K.RingViews(region_u8, K.ring_index(rank, p), capacity)
                         for p in self._peers}
        self._outbound = {p: K.RingViews(np.frombuffer(links[p].region, np.uint8),
                                         K.ring_index(p, rank), capacity) for p in self._peers}
        # Nobody polls yet: producers must poke.
        K.rings_set_flag(self._region64, self._stride_words, size - 1, K.ASLEEP, 1)
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._helper = threading.Thread(target=self._helper_main, daemon=True,
                                        name=f"numcoll-shm-helper-rank{rank}")
        self._helper.start()

    # --- what the transport and the arena call -------------------------------------------

    def post(self, peer: int, send: Send) -> None:
        """Queue ``send`` for ``peer``, and push it at once if no one else is."""
        queue = self._sendq[peer]
        if self._plock.acquire(blocking=False):
            try:
                queue.append(send)
                self._push(peer)
            finally:
                self._plock.release()
        else:  # someone is making progress: queue it, and make sure it is seen
            queue.append(send)
            self._wake_helper()

    def left(self, peer: int) -> TransportError | None:
        """Why ``peer`` can no longer be waited for (this rank closed, or it left), or None."""
        if self._closed:
            return TransportClosed(f"rank {self.rank}'s transport was closed", peer)
        reason = self._gone.get(peer)
        return None if reason is None else PeerClosed(reason, peer)

    def conflicting_call(self, peer: int, call: int, stamp: bytes) -> bytes | None:
        """For slow waits elsewhere (the arena's): drain the rings (unless
        another thread is), then the stamp of a message ``peer`` sent for call
        ``call`` that is not ``stamp``, if any (see :meth:`Mailbox.conflicting_stamp`)."""
        if self._plock.acquire(blocking=False):
            try:
                self._progress()
            finally:
                self._plock.release()
        return self._mailbox.conflicting_stamp(peer, call, stamp)

    def stop(self, reason: str) -> None:
        """Stop moving bytes: fail the queued sends, tell every peer BYE after
        what is already in its ring, stop the helper and release the sockets
        and mappings; the mailbox closes too, failing every receive."""
        self._closed = True
        with self._plock:  # progress never blocks while holding it
            self._stopping = True  # no more progress: ours is over
            for peer, queue in self._sendq.items():
                while queue:
                    req = queue.popleft().req
                    req.fail(TransportClosed(f"{req.describe()}: {reason}", peer))
            # BYE after everything already in the rings, then the sockets
            # close: peers drain our data, read BYE, then see EOF.
            for peer, ring in self._outbound.items():
                if peer not in self._gone and K.ring_bye(ring.ctrl, ring.data64):
                    self._poke(peer)
        self._mailbox.close(reason)
        self._epoch[0] += 1  # spinning waiters look again, and find their requests failed
        self._wake_helper()
        self._helper.join(JOIN_TIMEOUT_S)
        if self._helper.is_alive():
            warnings.warn(f"rank {self.rank}: shm helper thread did not stop within "
                          f"{JOIN_TIMEOUT_S}s", RuntimeWarning, stacklevel=3)
            return  # its fds are still in use: leave them to it
        with self._plock:
            self._release()

    def _release(self) -> None:
        """Close sockets and fds; drop the mappings (unmapped once no view remains)."""
        for sock in (*self._out_sock.values(), *self._in_sock.values()):
            sock.close()
        self._out_sock.clear()
        self._in_sock.clear()
        os.close(self._wake_fd)
        self._wake_fd = -1
        self._inbound = {}
        self._outbound = {}
        self._region64 = None
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a view is still alive (a waiter mid-poll): GC unmaps it
                pass
        self._maps.clear()

    def _progress(self) -> bool:
        if self._stopping:
            return False
        did = False
        for peer in self._peers:
            if peer not in self._gone:
                did = self._drain(peer) or did
        for peer, queue in self._sendq.items():
            if queue:
                did = self._push(peer) or did
        if did:
            self._epoch[0] += 1
        return did

    def _push(self, peer: int) -> bool:
        """Write queued sends to ``peer`` while they fit; True if anything moved."""
        queue = self._sendq[peer]
        ring = self._outbound[peer]
        did = False
        while queue:
            s = queue[0]
            offset, started, poke = K.ring_put(
                ring.ctrl, ring.data, ring.data64, K.KIND_FIRST, s.tag, s.nbytes, s.stamp,
                s.payload, s.offset, s.started, self._max_chunk, self._min_chunk)
            if poke:
                self._poke(peer)
            if started != s.started or offset != s.offset:
                did = True
            s.offset, s.started = offset, started
            if started and offset == s.nbytes:
                queue.popleft()
                s.req.complete(None, source=peer)
                continue
            if self._blocked[peer]:
                break
            # Out of room: ask to be poked when the consumer frees some, then
            # look once more (it may have freed it before seeing the flag).
            self._blocked[peer] = True
            K.ring_set_flag(ring.ctrl, K.BLOCKED, 1)
        if not queue and self._blocked[peer]:
            self._blocked[peer] = False
            K.ring_set_flag(ring.ctrl, K.BLOCKED, 0)
        return did

    def _drain(self, peer: int) -> bool:
        """Hand every record in the ring from ``peer`` to the mailbox."""
        ring = self._inbound[peer]
        data = ring.data
        cursor = self._cursor[peer]
        did = False
        while True:
            pos, word0, tag, nbytes, chunk, cursor = K.ring_next(ring.ctrl, ring.data64, cursor)
            if pos < 0:
                break
            did = True
            end = cursor + (word0 >> 16)
            kind = word0 & 0xFF
            if kind == K.KIND_FIRST:
                stamp_nbytes = (word0 >> 8) & 0xFF
                start = pos + K.HEADER_NBYTES
                stamp = data[start:start + stamp_nbytes].tobytes() if stamp_nbytes else b""
                start += stamp_nbytes
                if chunk == nbytes:
                    self._arrive(peer, tag, nbytes, data, start, stamp, False)
                else:
                    buf = np.empty(nbytes, np.uint8)
                    K.copy_bytes(buf, 0, data, start, chunk)
                    self._partial[peer] = [tag, stamp, buf, chunk]
            elif kind == K.KIND_MORE:
                part = self._partial[peer]
                K.copy_bytes(part[2], part[3], data, pos + K.HEADER_NBYTES, chunk)
                part[3] += chunk
                if part[3] == part[2].size:
                    del self._partial[peer]
                    self._arrive(peer, part[0], part[2].size, part[2], 0, part[1], True)
            elif kind == K.KIND_BYE:  # after everything it sent
                self._cursor[peer] = end
                self._free(peer)
                self._bye.add(peer)
                self._peer_gone(peer, f"rank {peer} closed its transport")
                return True
            else:
                raise TransportError(f"rank {self.rank}: corrupt shm ring from rank {peer} "
                                     f"(record kind {kind})")
            cursor = end
        self._cursor[peer] = cursor
        self._free(peer)
        return did

    def _free(self, peer: int) -> None:
        """Give the producer back every record consumed (up to the read position)."""
        tail = self._cursor[peer]
        if tail != self._tail[peer]:
            self._tail[peer] = tail
            if K.ring_free(self._inbound[peer].ctrl, tail):
                self._poke(peer)

    def _arrive(self, src: int, tag: int, nbytes: int, data: np.ndarray, start: int,
                stamp: bytes, assembled: bool) -> None:
        """Deliver a whole message: bytes ``start:start + nbytes`` of ``data``,
        the ring itself, or (``assembled``) a buffer of our own."""

        def read(into):
            if into is DISCARD or nbytes == 0:
                return None if into is not None else memoryview(b"")
            if into is None:
                if assembled:  # hand over the buffer itself
                    return memoryview(data).toreadonly()
                if nbytes <= _SMALL_COPY_NBYTES:
                    return memoryview(data[start:start + nbytes].tobytes())
                out = np.empty(nbytes, np.uint8)
                K.copy_bytes(out, 0, data, start, nbytes)
                return memoryview(out).toreadonly()
            K.copy_bytes(np.frombuffer(into, np.uint8), 0, data, start, nbytes)
            return None

        self._mailbox.arrive(src, tag, nbytes, read, stamp)

    def _peer_gone(self, peer: int, reason: str) -> None:
        if peer in self._gone:
            return
        self._gone[peer] = reason
        self._partial.pop(peer, None)
        self._mailbox.peer_gone(peer, reason)
        queue = self._sendq[peer]
        while queue:
            req = queue.popleft().req
            req.fail(PeerClosed(f"{req.describe()}: {reason}", peer))

    def _poke(self, peer: int) -> None:
        sock = self._out_sock.get(peer)
        if sock is None:
            return
        try:
            sock.send(_POKE, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
        except OSError:  # full (a poke is pending anyway) or gone (EOF tells the helper)
            pass

    # --- waiting --------------------------------------------------------------------------

    def wait_for(self, req: ShmRequest, deadline: float | None) -> bool:
        """Make progress until ``req`` finishes (True) or ``deadline`` passes (False)."""
        region = self._region64  # a local reference keeps the mapping alive
        if region is None or self._closed:
            return req._wait_lock(deadline)
        deadline_ns = None if deadline is None else int(deadline * 1e9)
        now = time.monotonic_ns()
        spin_until = now + self.spin_ns
        yield_until = spin_until + self.yield_ns
        if deadline_ns is not None:
            yield_until = min(yield_until, deadline_ns)
        self._enter_spin(region)
        blocking = False
        try:
            while not req._finished:
                if self._plock.acquire(blocking=False):
                    try:
                        self._progress()
                    finally:
                        self._plock.release()
                    if req._finished:
                        break
                    seen = int(self._epoch[0])
                    now = time.monotonic_ns()
                    if now >= yield_until:
                        blocking = True
                        break
                    until = yield_until
                    if any(self._sendq.values()):
                        until = min(until, now + SEND_SLICE_NS)
                    K.spin_ready(region, self._stride_words, self.size - 1, self._epoch,
                                 seen, spin_until, until)
                else:  # another thread is making progress: let it have the GIL
                    if req._lock.acquire(timeout=50e-6):
                        req._lock.release()
                    if time.monotonic_ns() >= yield_until:
                        blocking = True
                        break
        finally:
            self._leave_spin(region, blocking or not req._finished)
        # Blocking phase: the helper drains when poked and completes the request.
        while not req._finished:
            now_s = time.monotonic()
            if deadline is not None and now_s >= deadline:
                return False
            slice_s = BLOCK_SLICE_S if deadline is None else min(BLOCK_SLICE_S, deadline - now_s)
            if req._lock.acquire(timeout=slice_s):
                req._lock.release()
                break
        return True

    def _enter_spin(self, region: np.ndarray) -> None:
        with self._spin_lock:
            self._spinners += 1
            if self._asleep:  # someone polls now: producers need not poke
                self._asleep = False
                K.rings_set_flag(region, self._stride_words, self.size - 1, K.ASLEEP, 0)

    def _leave_spin(self, region: np.ndarray, blocking: bool) -> None:
        with self._spin_lock:
            self._spinners -= 1
            self._last_active_ns = time.monotonic_ns()
            if blocking:  # about to block: from now on, arrivals must poke
                self._go_to_sleep(region)

    def _go_to_sleep(self, region: np.ndarray) -> None:
        """Raise the ASLEEP flags unless a thread still polls (caller holds _spin_lock)."""
        if self._spinners or self._asleep:
            return
        self._asleep = True
        if K.rings_set_flag(region, self._stride_words, self.size - 1, K.ASLEEP, 1):
            self._wake_helper()  # arrived before the flags were up: nobody poked

    def _wake_helper(self) -> None:
        if self._wake_fd >= 0:
            try:
                os.eventfd_write(self._wake_fd, 1)
            except OSError:
                pass

    # --- the helper thread ------------------------------------------------------------------

    def _helper_main(self) -> None:
        poller = select.poll()
        by_fd = {}
        for peer, sock in self._in_sock.items():
            poller.register(sock.fileno(), select.POLLIN)
            by_fd[sock.fileno()] = peer
        poller.register(self._wake_fd, select.POLLIN)
        error = None
        try:
            while not self._stopping:
                events = poller.poll(IDLE_POLL_MS if self._asleep else LAZY_SLEEP_NS // 1_000_000)
                if self._stopping:
                    return
                if not self._asleep:
                    with self._spin_lock:
                        if time.monotonic_ns() - self._last_active_ns >= LAZY_SLEEP_NS:
                            region = self._region64
                            if region is not None:
                                self._go_to_sleep(region)
                ended = []
                for fd, _ in events:
                    if fd == self._wake_fd:
                        try:
                            os.eventfd_read(fd)
                        except BlockingIOError:
                            pass
                        continue
                    try:
                        got = os.read(fd, 4096)
                    except BlockingIOError:
                        continue
                    except OSError:
                        got = b""
                    if not got:  # the peer's end closed: it exited or closed its transport
                        poller.unregister(fd)
                        ended.append(by_fd[fd])
                with self._plock:
                    self._progress()  # drains what an ended peer wrote first (BYE included)
                    for peer in ended:
                        self._peer_gone(peer, f"rank {peer} closed its transport" if peer in self._bye
                                        else f"connection to rank {peer} lost (process exited?)")
        except Exception as exc:  # noqa: BLE001 - fail the waiters with the cause
            error = exc
        finally:
            if error is not None:
                self._mailbox.close(f"the shm helper thread of rank {self.rank} failed: {error!r}")

