"""Matching arriving messages to posted receives: the part every transport shares.

A :class:`Mailbox` belongs to one receiving rank. Receives are posted by
``(peer, tag)`` (``peer`` may be ``ANY_SOURCE``); a message that finds no posted
receive waits in a per-``(src, tag)`` FIFO until one is posted. The in-process
transport delivers into mailboxes from the sending thread; the ZeroMQ
transport from its I/O thread, reading the payload straight into the posted
buffer.

Memory is bounded: a peer whose unexpected messages (those no posted receive
has taken yet) exceed ``max_unexpected_nbytes`` is cut off — its later
messages are refused and its receives fail saying why — instead of growing
this process without bound. Collectives in flight on several threads arrive
out of order and wait here legitimately; the cap is far above what they hold.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections import deque
from typing import Callable

import numpy as np

from .base import (
    ANY_SOURCE,
    CALL_SHIFT,
    MessageSizeError,
    PeerClosed,
    StampMismatch,
    TransportClosed,
    TransportError,
)
from .pending import RECV, PendingRequest, describe

__all__ = ["Mailbox", "DISCARD", "PayloadReader", "NONE_HELD"]

#: ``Mailbox.oldest_call`` while no stamped message is held: above every call.
NONE_HELD = 1 << 64
#: Passed to a payload reader to drop the payload (an empty receive buffer).
DISCARD = memoryview(bytearray())
#: What a held message costs besides its payload (queue entry, stamp, view):
#: so a flood of empty messages counts against the cap too.
HELD_OVERHEAD_NBYTES = 256


#: Reads the payload of the message being delivered: ``read(None)`` returns it
#: as a read-only memoryview; ``read(view)`` receives it into ``view`` (of the
#: right size, or :data:`DISCARD` to drop it).
PayloadReader = Callable[[memoryview | None], memoryview | None]


class Mailbox:
    """Posted receives and unexpected messages of one rank. Thread-safe."""

    def __init__(self, rank: int, size: int, max_unexpected_nbytes: int | None = None,
                 on_overflow: Callable[[int, str], None] | None = None):
        self.rank = rank
        self.size = size
        # Per peer (never this rank): bytes held for receives not posted yet.
        self._max_unexpected = max_unexpected_nbytes
        self._held_nbytes = [0] * size
        self._on_overflow = on_overflow
        self._lock = threading.Lock()
        # (src or ANY_SOURCE, tag) -> posted receives, oldest first
        self._posted: dict[tuple[int, int], deque[PendingRequest]] = {}
        # tag -> src -> (arrival number, payload, stamp), oldest first
        self._unexpected: dict[int, dict[int, deque[tuple[int, memoryview, bytes]]]] = {}
        # (src, call) -> posted whole-call receives / stamps of held messages
        # (see CALL_SHIFT): a message of another call from the same peer fails them.
        self._calls_posted: dict[tuple[int, int], list[PendingRequest]] = {}
        self._calls_held: dict[tuple[int, int], dict[bytes, int]] = {}
        #: Stamped messages held for receives not posted yet: while 0,
        #: :meth:`oldest_held` has nothing to find (a plain attribute, so that a
        #: caller's check costs nothing then).
        self.held_calls = 0
        #: ``held_calls`` again, in a word that compiled code reads (the fused
        #: steps of numcoll.fast, which do not run while it is not 0).
        self.held_word = np.zeros(1, np.int64)
        #: No held message is of a call numbered below this (a lower bound, exact
        #: after :meth:`oldest_held`): a caller compares it with its own call's
        #: number to skip :meth:`oldest_held` when nothing held can be older.
        self.oldest_call = NONE_HELD
        self._held_order: list[int] = []  # their calls (tag >> CALL_SHIFT): a lazy heap
        #: peer -> why it left (read it, never write it: :meth:`peer_gone` does).
        self.gone: dict[int, str] = {}
        self._closed: str | None = None
        # One counter orders posts and arrivals, so ANY_SOURCE takes the oldest.
        self._counter = itertools.count()

    # --- receiving side -----------------------------------------------------

    def post(self, req: PendingRequest) -> None:
        """Match ``req`` with the oldest queued message, or post it."""
        with self._lock:
            found = self._take_unexpected(req.peer, req.tag)
            if found is None:
                exc = self._refusal(req) or self._held_conflict(req)
                if exc is None:
                    req.seq = next(self._counter)
                    self._posted.setdefault((req.peer, req.tag), deque()).append(req)
                    if req.whole_call:
                        self._calls_posted.setdefault(
                            (req.peer, req.tag >> CALL_SHIFT), []).append(req)
                    return
        if found is None:
            req.fail(exc)
            return
        src, payload, stamp = found
        # Outside the lock: the copy into the buffer may be large.
        if not self._accepts(req, src, payload.nbytes, stamp):
            return
        if req.buf is None:
            req.complete(payload, source=src)
        else:
            req.buf[:] = payload
            req.complete(None, source=src)

    def conflicting_stamp(self, peer: int, call: int, stamp: bytes) -> bytes | None:
        """The stamp of a held message from ``peer`` of call ``call`` (tags with
        ``tag >> CALL_SHIFT == call``) that is not ``stamp``, if there is one:
        ``peer`` runs another call at this number."""
        with self._lock:
            for held in self._calls_held.get((peer, call)) or ():
                if held and held != stamp:
                    return held
        return None

    def oldest_held(self) -> tuple[int, int, bytes] | None:
        """``(call, src, stamp)`` of a held stamped message of the lowest call
        (``tag >> CALL_SHIFT``) any is held for, or None: a caller that has
        finished that call knows that no receive will ever take it."""
        with self._lock:
            while self._held_order:
                call = self.oldest_call = self._held_order[0]
                for (src, c), stamps in self._calls_held.items():
                    if c == call and stamps:
                        return call, src, next(iter(stamps))
                heapq.heappop(self._held_order)
            self.oldest_call = NONE_HELD
        return None

    def gone_reason(self, peer: int) -> str | None:
        """Why ``peer`` left, or ``None`` while it is connected."""
        return self.gone.get(peer)

    # --- delivering side ----------------------------------------------------

    def deliver(self, src: int, tag: int, data: memoryview, *, private: bool = False,
                stamp: bytes = b"") -> bool:
        """Deliver the bytes of ``data``; returns False, delivering nothing, if
        this mailbox is closed.

        ``private``: ``data`` is a copy nobody else holds, which may be kept as
        it is. Otherwise it is the sender's buffer (the send completes on
        return, so it may be reused): it is copied before being kept.
        """
        with self._lock:
            if self._closed is not None:
                return False
            req = self._claim(src, tag)
            if req is None:
                victims = self._posted_conflicts(src, tag, stamp)
                if victims:
                    self._fail_conflicts(victims, src, stamp)
                    return True  # the payload belongs to another call: dropped
            held = req is None and private and self._hold(src, tag, data, stamp)
        if req is None and private:
            if not held:
                self._overflowed(src)
            return True
        if req is None:
            data, private = memoryview(bytes(data)), True  # copied without the lock held
            with self._lock:
                if self._closed is not None:
                    return False
                req = self._claim(src, tag)  # a receive may have been posted meanwhile
                if req is None:
                    held = self._hold(src, tag, data, stamp)
            if req is None:
                if not held:
                    self._overflowed(src)
                return True
        if not self._accepts(req, src, data.nbytes, stamp):
            return True
        if req.buf is None:
            req.complete(data if private else memoryview(bytes(data)), source=src)
        else:
            req.buf[:] = data
            req.complete(None, source=src)
        return True

    def arrive(self, src: int, tag: int, nbytes: int, read: PayloadReader,
               stamp: bytes = b"") -> None:
        """Deliver a message whose payload ``read`` fetches (see :data:`PayloadReader`).

        Called by a single I/O thread, in arrival order.
        """
        with self._lock:
            req = self._claim(src, tag)
            if req is None:
                victims = self._posted_conflicts(src, tag, stamp)
                if victims:
                    read(DISCARD)  # the payload belongs to another call
                    self._fail_conflicts(victims, src, stamp)
                    return
                # Read under the lock so a receive posted now cannot miss the message.
                if self._closed is not None:
                    read(DISCARD)
                    return
                if not self._room(src, nbytes):
                    read(DISCARD)
                    held = False
                else:
                    held = self._hold(src, tag, read(None), stamp)
        if req is None:
            if not held:
                self._overflowed(src)
            return
        if not self._accepts(req, src, nbytes, stamp):
            read(DISCARD)
        elif req.buf is None:
            req.complete(read(None), source=src)
        else:
            read(req.buf)
            req.complete(None, source=src)

    def peer_gone(self, peer: int, reason: str) -> None:
        """``peer`` left: fail receives from it that no queued message satisfies
        (and ANY_SOURCE ones once every other rank has left)."""
        with self._lock:
            if peer in self.gone or self._closed is not None:
                return
            self.gone[peer] = reason
            all_gone = len(self.gone) >= self.size - 1
            victims = []
            for key in [k for k in self._posted if k[0] == peer or (all_gone and k[0] == ANY_SOURCE)]:
                victims.extend(self._posted.pop(key))
            for req in victims:
                self._forget_whole_call(req)
        for req in victims:
            req.fail(PeerClosed(f"{req.describe()}: {reason}", peer))

    def close(self, reason: str) -> None:
        """Fail every posted receive with :class:`TransportClosed`; refuse later ones."""
        with self._lock:
            if self._closed is not None:
                return
            self._closed = reason
            victims = [req for queue in self._posted.values() for req in queue]
            self._posted.clear()
            self._unexpected.clear()
            self._held_nbytes = [0] * self.size
            self._calls_posted.clear()
            self._calls_held.clear()
            self.held_calls, self._held_order, self.oldest_call = 0, [], NONE_HELD
            self.held_word[0] = 0
        for req in victims:
            req.fail(TransportClosed(f"{req.describe()}: {reason}", req.peer))

    # --- internals (all but _accepts: callers hold the lock) ----------------------

    def _claim(self, src: int, tag: int) -> PendingRequest | None:
        specific = self._posted.get((src, tag))
        wildcard = self._posted.get((ANY_SOURCE, tag))
        if specific and (not wildcard or specific[0].seq < wildcard[0].seq):
            key, queue = (src, tag), specific
        elif wildcard:
            key, queue = (ANY_SOURCE, tag), wildcard
        else:
            return None
        req = queue.popleft()
        if not queue:
            del self._posted[key]
        if req.whole_call:
            self._forget_whole_call(req)
        return req

    def _room(self, src: int, nbytes: int) -> bool:
        """Whether ``nbytes`` more from ``src`` may be held (and ``src`` is not cut off)."""
        if self._max_unexpected is None or src == self.rank:
            return True
        if src in self.gone:
            return False
        return self._held_nbytes[src] + nbytes + HELD_OVERHEAD_NBYTES <= self._max_unexpected

    def _forget_whole_call(self, req: PendingRequest) -> None:
        key = (req.peer, req.tag >> CALL_SHIFT)
        reqs = self._calls_posted.get(key)
        if reqs is not None:
            reqs.remove(req)
            if not reqs:
                del self._calls_posted[key]

    def _posted_conflicts(self, src: int, tag: int, stamp: bytes) -> list[PendingRequest]:
        """Unpost and return the whole-call receives from ``src`` that a
        message (``tag``, ``stamp``) of the same call contradicts."""
        reqs = self._calls_posted.get((src, tag >> CALL_SHIFT))
        if not reqs or not stamp or all(r.stamp == stamp for r in reqs):
            return []
        victims = list(reqs)
        for req in victims:
            queue = self._posted[(req.peer, req.tag)]
            queue.remove(req)
            if not queue:
                del self._posted[(req.peer, req.tag)]
        del self._calls_posted[(src, tag >> CALL_SHIFT)]
        return victims

    def _fail_conflicts(self, victims, src: int, stamp: bytes) -> None:
        for req in victims:
            req.fail(StampMismatch(
                f"{req.describe()}: rank {src} sent a message of another call "
                "at the same sequence number", src, req.stamp, stamp))

    def _held_conflict(self, req: PendingRequest) -> StampMismatch | None:
        """A held message of ``req``'s call from its peer with another stamp, if any."""
        if not req.whole_call:
            return None
        stamps = self._calls_held.get((req.peer, req.tag >> CALL_SHIFT))
        for stamp in stamps or ():
            if stamp and stamp != req.stamp:
                return StampMismatch(
                    f"{req.describe()}: rank {req.peer} sent a message of another call "
                    "at the same sequence number", req.peer, req.stamp, stamp)
        return None

    def _hold(self, src: int, tag: int, payload: memoryview, stamp: bytes) -> bool:
        """Queue an unexpected message; False (nothing kept) if ``src`` is over its cap."""
        if not self._room(src, payload.nbytes):
            return False
        self._held_nbytes[src] += payload.nbytes + HELD_OVERHEAD_NBYTES
        by_src = self._unexpected.setdefault(tag, {})
        by_src.setdefault(src, deque()).append((next(self._counter), payload, stamp))
        if stamp:
            stamps = self._calls_held.setdefault((src, tag >> CALL_SHIFT), {})
            stamps[stamp] = stamps.get(stamp, 0) + 1
            self.held_calls += 1
            self.held_word[0] = self.held_calls
            heapq.heappush(self._held_order, tag >> CALL_SHIFT)
            self.oldest_call = min(self.oldest_call, tag >> CALL_SHIFT)
        return True

    def _overflowed(self, src: int) -> None:
        """``src`` sent more than the cap (or was cut off already): say so once."""
        if self._max_unexpected is None or src in self.gone:
            return
        reason = (f"rank {src} sent more than {self._max_unexpected} bytes that no receive on "
                  f"rank {self.rank} asked for (NUMCOLL_MAX_UNEXPECTED_NBYTES); cut off")
        if self._on_overflow is not None:
            self._on_overflow(src, reason)
        else:
            self.peer_gone(src, reason)

    def held_nbytes(self, src: int) -> int:
        """Bytes (payloads plus overhead) held for ``src``'s unposted receives."""
        return self._held_nbytes[src]

    def _take_unexpected(self, peer: int, tag: int) -> tuple[int, memoryview, bytes] | None:
        by_src = self._unexpected.get(tag)
        if not by_src:
            return None
        if peer == ANY_SOURCE:
            peer = min(by_src, key=lambda s: by_src[s][0][0])
        queue = by_src.get(peer)
        if not queue:
            return None
        _, payload, stamp = queue.popleft()
        self._held_nbytes[peer] -= payload.nbytes + HELD_OVERHEAD_NBYTES
        if not queue:
            del by_src[peer]
            if not by_src:
                del self._unexpected[tag]
        if stamp:
            key = (peer, tag >> CALL_SHIFT)
            stamps = self._calls_held[key]
            stamps[stamp] -= 1
            if not stamps[stamp]:
                del stamps[stamp]
                if not stamps:
                    del self._calls_held[key]
            self.held_calls -= 1
            self.held_word[0] = self.held_calls
            if not self.held_calls:
                self._held_order.clear()
                self.oldest_call = NONE_HELD
        return peer, payload, stamp

    def _refusal(self, req: PendingRequest) -> TransportError | None:
        if self._closed is not None:
            return TransportClosed(f"{req.describe()}: {self._closed}", req.peer)
        if req.peer == ANY_SOURCE:
            if self.size > 1 and len(self.gone) >= self.size - 1:
                return PeerClosed(f"{req.describe()}: every other rank has left", None)
            return None
        reason = self.gone.get(req.peer)
        if reason is not None:
            return PeerClosed(f"{req.describe()}: {reason}", req.peer)
        return None

    def _accepts(self, req: PendingRequest, src: int, nbytes: int, stamp: bytes) -> bool:
        """Fail ``req`` (and return False) if the message carries another stamp
        than the receive expects, or does not fit its buffer. The caller then
        drops the payload: a receive never sees bytes it cannot vouch for."""
        if req.stamp and stamp != req.stamp:
            req.fail(StampMismatch(
                f"{describe(RECV, self.rank, src, req.tag)}: the message belongs to another "
                "call than the receive", src, req.stamp, stamp))
            return False
        if req.buf is None or req.buf.nbytes == nbytes:
            return True
        req.fail(MessageSizeError(
            f"{describe(RECV, self.rank, src, req.tag)}: the message is {nbytes} bytes "
            f"but the receive buffer is {req.buf.nbytes} bytes", src))
        return False
