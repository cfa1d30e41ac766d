"""The ZeroMQ transport's messages, and the checks every arriving one passes.

Wire format
    A message starts with a :data:`HEADER` (the sender's session nonce, kind,
    source rank, tag, payload bytes, stamp length) and the stamp's bytes.
    Payloads below ``zero_copy_nbytes`` follow the header in the same frame
    (``INLINE``: one send and one receive per message); larger ones are a
    second frame (``DATA``), sent without a copy. ``BYE`` is a header alone;
    ``SHM`` names a shared-memory slot (:mod:`transports.zmq.slabs`) that
    holds the payload, ``CREDIT`` gives a slot back.
No frame over :data:`MAX_FRAME_NBYTES`
    A payload larger than that travels as a ``DATA`` message carrying its
    first :data:`MAX_FRAME_NBYTES` and ``MORE`` messages carrying the rest, in
    order, each with its own header (one peer's messages never interleave
    with its own chunks: they leave one socket in order). The receiver
    assembles them in a private buffer (one more copy, only for messages that
    large: the collectives cut theirs into 4 MiB segments). So every socket
    can refuse, before any authentication, any frame longer than
    :data:`MAX_WIRE_FRAME_NBYTES` (``ZMQ_MAXMSGSIZE``): a stranger declaring
    an 8 GB frame is hung up on at its first bytes instead of being buffered.
Trust
    Anyone who can reach the PULL socket can send it bytes. Every frame is
    checked before it touches the mailbox: length, kind, source rank (a peer,
    never this rank), the source's nonce (a 64-bit random number each rank
    draws per group and publishes only in the store, so a blind forger cannot
    guess it), stamp length, payload size and frame count, slot and credit
    numbers, chunk order. A message that fails raises :class:`BadFrame`: it is
    dropped and counted (never delivered, never fatal).
"""

from __future__ import annotations

import struct
from typing import Callable

import numpy as np
import zmq

from ..mailbox import DISCARD, Mailbox
from .slabs import SharedSlabs

__all__ = ["HEADER", "MAX_FRAME_NBYTES", "MAX_WIRE_FRAME_NBYTES", "BadFrame", "Inbound",
           "header", "chunks"]

#: sender's nonce, kind, source rank, tag, payload bytes, stamp bytes (the stamp follows).
HEADER = struct.Struct("<QBiQQB")
KIND_AT = 8  # offset of the kind byte in a header
KIND_INLINE = 0
KIND_DATA = 1
KIND_BYE = 2
#: Payload is in shared-memory slot SLOT (after the header); see transports.zmq.slabs.
KIND_SHM = 3
#: The receiver copied slot ``nbytes`` (the header's last field) out: reuse it.
KIND_CREDIT = 4
#: The next chunk of the data message (tag, total bytes) being assembled.
KIND_MORE = 5
SLOT = struct.Struct("<I")
#: Payload bytes in one frame at most (larger payloads are cut into chunks).
MAX_FRAME_NBYTES = 4 << 20
#: The largest frame a peer sends: a payload chunk, or a header with its stamp.
MAX_WIRE_FRAME_NBYTES = MAX_FRAME_NBYTES + 4096


def header(nonce: int, kind: int, rank: int, tag: int, nbytes: int, stamp: bytes = b"") -> bytes:
    return HEADER.pack(nonce, kind, rank, tag, nbytes, len(stamp)) + stamp


def chunks(nbytes: int) -> list[tuple[int, int]]:
    """(start, stop) of each frame of a ``nbytes`` payload."""
    return [(s, min(s + MAX_FRAME_NBYTES, nbytes)) for s in range(0, nbytes, MAX_FRAME_NBYTES)]


class BadFrame(Exception):
    """An inbound message no numcoll peer of this group would send."""


class Inbound:
    """What arrives on one rank's PULL socket: checked, then delivered.

    Runs on the transport's I/O thread only. ``on_slot_read(src, slot)``,
    ``on_credit(src)`` and ``on_bye(src)`` hand what is not a payload back to
    the I/O loop; ``on_alive(src)`` is told of every good message.
    """

    def __init__(self, rank: int, size: int, mailbox: Mailbox, peer_nonces: dict[int, int],
                 slabs: SharedSlabs | None, *, on_slot_read: Callable[[int, int], None],
                 on_credit: Callable[[int], None], on_bye: Callable[[int], None],
                 on_alive: Callable[[int], None]):
        self.rank, self.size = rank, size
        self._mailbox = mailbox
        self._nonces = peer_nonces
        self._slabs = slabs
        self._on_slot_read, self._on_credit = on_slot_read, on_credit
        self._on_bye, self._on_alive = on_bye, on_alive
        self._partial: dict[int, list] = {}  # src -> [tag, stamp, buffer, bytes filled]

    def forget(self, src: int) -> None:
        """``src`` left: drop what of its message was assembled."""
        self._partial.pop(src, None)

    def take(self, first: bytes, pull: zmq.Socket) -> None:
        """Check one inbound message (its first frame read from ``pull``) and act
        on it; :class:`BadFrame` before anything is delivered if it is not one a
        peer sends. The caller discards any frames of it left unread."""
        if len(first) < HEADER.size:
            raise BadFrame(f"{len(first)}-byte frame, shorter than a header")
        nonce, kind, src, tag, nbytes, stamp_nbytes = HEADER.unpack_from(first)
        if not 0 <= src < self.size or src == self.rank:
            raise BadFrame(f"kind {kind} claiming to be from rank {src} (group of {self.size}, "
                           f"this is rank {self.rank})")
        if nonce != self._nonces.get(src):
            raise BadFrame(f"kind {kind} claiming to be from rank {src} without its session nonce")
        body = HEADER.size + stamp_nbytes
        if body > len(first):
            raise BadFrame(f"from rank {src}: stamp of {stamp_nbytes} bytes runs past the frame")
        more = pull.getsockopt(zmq.RCVMORE)
        if kind not in (KIND_DATA, KIND_MORE) and more:
            raise BadFrame(f"kind {kind} from rank {src} with extra frames")
        if self._mailbox.gone_reason(src) is not None:
            raise BadFrame(f"kind {kind} from rank {src}, which has left or was cut off")
        self._on_alive(src)
        stamp = first[HEADER.size:body]
        if kind == KIND_INLINE:  # the frame is our own copy: the mailbox may keep it
            if len(first) - body != nbytes:
                raise BadFrame(f"inline message from rank {src} claims {nbytes} bytes "
                               f"but carries {len(first) - body}")
            self._mailbox.deliver(src, tag, memoryview(first)[body:], private=True, stamp=stamp)
        elif kind in (KIND_DATA, KIND_MORE):
            if not more or len(first) != body:
                raise BadFrame(f"data header from rank {src} without exactly one payload frame")
            payload = pull.recv(zmq.NOBLOCK, copy=False)
            if pull.getsockopt(zmq.RCVMORE):
                raise BadFrame(f"data message from rank {src} with more than one payload frame")
            if kind == KIND_DATA:
                self._data(src, tag, nbytes, stamp, payload)
            else:
                self._more(src, tag, nbytes, payload)
        elif kind == KIND_SHM:
            if len(first) != body + SLOT.size:
                raise BadFrame(f"slot header from rank {src} of {len(first)} bytes")
            slot = SLOT.unpack_from(first, body)[0]
            slabs = self._slabs
            if slabs is None or not slabs.readable(src, slot, nbytes):
                raise BadFrame(f"rank {src} names slot {slot} for {nbytes} bytes, which "
                               "its slab does not have")
            self._mailbox.arrive(src, tag, nbytes, lambda into: _read_slot(slabs, src, slot,
                                                                           nbytes, into), stamp)
            self._on_slot_read(src, slot)
        elif kind == KIND_CREDIT:
            if len(first) != HEADER.size or self._slabs is None or \
                    not self._slabs.release(src, nbytes):
                raise BadFrame(f"credit from rank {src} for slot {nbytes}, not in flight to it")
            self._on_credit(src)
        elif kind == KIND_BYE:  # comes after everything src sent us
            if len(first) != HEADER.size or nbytes or tag:
                raise BadFrame(f"malformed goodbye from rank {src}")
            self._on_bye(src)
        else:
            raise BadFrame(f"unknown kind {kind} claiming to be from rank {src}")

    def _data(self, src: int, tag: int, nbytes: int, stamp: bytes, payload: zmq.Frame) -> None:
        if src in self._partial:
            del self._partial[src]
            raise BadFrame(f"data message from rank {src} while its previous one is unfinished")
        got = len(payload)
        if got == nbytes:
            self._mailbox.arrive(src, tag, nbytes, lambda into: _read_frame(payload, into), stamp)
            return
        if got != MAX_FRAME_NBYTES or nbytes < got:
            raise BadFrame(f"data message from rank {src} claims {nbytes} bytes but "
                           f"its payload frame has {got}")
        try:
            buf = np.empty(nbytes, np.uint8)
        except (MemoryError, ValueError):
            raise BadFrame(f"data message from rank {src} claims {nbytes} bytes, more than "
                           "this rank can hold") from None
        buf[:got] = np.frombuffer(payload.buffer, np.uint8)
        self._partial[src] = [tag, stamp, buf, got]

    def _more(self, src: int, tag: int, nbytes: int, payload: zmq.Frame) -> None:
        part = self._partial.get(src)
        got = len(payload)
        if part is None or part[0] != tag or part[2].size != nbytes:
            raise BadFrame(f"chunk from rank {src} (tag {tag}, {nbytes} bytes) of no message "
                           "being assembled")
        tag, stamp, buf, filled = part
        end = filled + got
        if end > nbytes or (end < nbytes and got != MAX_FRAME_NBYTES):
            del self._partial[src]
            raise BadFrame(f"chunk of {got} bytes from rank {src} at byte {filled} of a "
                           f"{nbytes}-byte message")
        buf[filled:end] = np.frombuffer(payload.buffer, np.uint8)
        if end < nbytes:
            part[3] = end
            return
        del self._partial[src]
        self._mailbox.arrive(src, tag, nbytes, lambda into: _read_array(buf, into), stamp)


def _read_frame(frame: zmq.Frame, into: memoryview | None) -> memoryview | None:
    """A :data:`~transports.mailbox.PayloadReader` over a received payload frame."""
    if into is None:
        return memoryview(frame.buffer).toreadonly()
    if into.nbytes:
        # NumPy releases the GIL for a large copy; a memoryview assignment would not.
        np.frombuffer(into, np.uint8)[...] = np.frombuffer(frame.buffer, np.uint8)
    return None


def _read_array(buf: np.ndarray, into: memoryview | None) -> memoryview | None:
    """A payload reader over an assembled message (handed over as it is)."""
    if into is None:
        return memoryview(buf).toreadonly()
    if into.nbytes:
        np.frombuffer(into, np.uint8)[...] = buf
    return None


def _read_slot(slabs: SharedSlabs, peer: int, slot: int, nbytes: int, into):
    if into is DISCARD:
        return None
    view = slabs.read(peer, slot, nbytes, into)
    return view if into is None else None
