"""The transport interface: post a send or a receive by (peer, tag), then wait
with a deadline.

A transport connects the ``size`` ranks of one group. It knows nothing of
arrays, dtypes or collectives: it moves bytes. Every message carries the
sender's rank and a 64-bit tag; a receive matches the oldest unmatched message
with the same (peer, tag) — or from any peer, for ``ANY_SOURCE``. Messages with
the same (sender, receiver, tag) arrive in the order they were sent.

Implementations: :mod:`transports.inproc` (ranks are threads of one process)
and :mod:`transports.zmq.transport` (``tcp://`` and ``ipc://``).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = [
    "ANY_SOURCE",
    "MAX_TAG",
    "Request",
    "Transport",
    "TransportError",
    "TransportTimeout",
    "PeerClosed",
    "TransportClosed",
    "MessageSizeError",
    "StampMismatch",
    "MAX_STAMP_NBYTES",
    "CALL_SHIFT",
]

#: Pass as ``peer`` to :meth:`Transport.irecv` to match a message from any rank.
ANY_SOURCE = -1
#: Tags are unsigned 64-bit integers.
MAX_TAG = (1 << 64) - 1
#: A message's stamp (see :meth:`Transport.isend`) is at most this many bytes.
MAX_STAMP_NBYTES = 255
#: Tags whose high bits (``tag >> CALL_SHIFT``) agree belong to one call: a
#: receive posted with ``whole_call=True`` checks the stamps of all of them.
CALL_SHIFT = 32


class TransportError(Exception):
    """Base of transport failures. ``peer`` is the rank involved, when known."""

    def __init__(self, message: str, peer: int | None = None):
        super().__init__(message)
        self.peer = peer


class TransportTimeout(TransportError, TimeoutError):
    """A wait passed its deadline. ``waited_s`` is how long the caller waited,
    ``what`` is "send" or "recv", ``tag`` the message tag."""

    def __init__(self, message: str, peer: int | None, tag: int, what: str, waited_s: float):
        super().__init__(message, peer)
        self.tag = tag
        self.what = what
        self.waited_s = waited_s


class PeerClosed(TransportError):
    """The peer shut down or its connection broke before the message could move."""


class TransportClosed(TransportError):
    """This rank's own transport was closed while the request was pending."""


class MessageSizeError(TransportError):
    """An incoming message does not fit the buffer posted to receive it."""


class StampMismatch(TransportError):
    """A message matched a receive by (peer, tag) but carried another stamp:
    the two ranks are not running the same call. ``local_stamp`` is the
    receive's, ``remote_stamp`` the message's; the payload was dropped.
    ``remote_seq``: the peer's sequence number, where it is known to differ."""

    def __init__(self, message: str, peer: int | None, local_stamp: bytes,
                 remote_stamp: bytes, remote_seq: int | None = None):
        super().__init__(message, peer)
        self.local_stamp = local_stamp
        self.remote_stamp = remote_stamp
        self.remote_seq = remote_seq


class Request(Protocol):
    """A posted send or receive."""

    #: For a receive: the rank the matched message came from (useful with
    #: ANY_SOURCE); for a send: the destination. ``None`` until known.
    source: int | None

    def wait(self, deadline: float | None) -> memoryview | None:
        """Block until the request completes or ``deadline`` passes.

        ``deadline`` is an absolute ``time.monotonic()`` value (``None`` waits
        forever; numcoll itself always passes one). A send returns ``None`` once
        its buffer may be reused. A receive posted with a buffer returns
        ``None`` once the bytes are in it; one posted without a buffer returns a
        read-only ``memoryview`` of the message (valid until dropped). Raises
        :class:`TransportTimeout` (the request stays posted and may be waited
        on again), :class:`PeerClosed`, :class:`TransportClosed` or
        :class:`MessageSizeError`.
        """
        ...

    def done(self) -> bool:
        """True once ``wait`` would return (or raise) without blocking."""
        ...


@runtime_checkable
class Transport(Protocol):
    """Point-to-point messaging among the ``size`` ranks of one group."""

    rank: int
    size: int

    def isend(self, peer: int, tag: int, buf, stamp: bytes = b"") -> Request:
        """Post a send of the bytes of ``buf`` (any C-contiguous buffer) to ``peer``.

        The caller must not modify ``buf`` until the request's ``wait`` returns.
        Large buffers are sent without copying. ``peer`` may be this rank.
        ``stamp`` (at most :data:`MAX_STAMP_NBYTES` bytes) travels with the
        message for the receiver to check (see :meth:`irecv`).
        """
        ...

    def irecv(self, peer: int, tag: int, buf=None, stamp: bytes = b"",
              whole_call: bool = False) -> Request:
        """Post a receive of the message ``(peer, tag)``.

        ``buf``: a writable C-contiguous buffer whose size must equal the
        message's (``MessageSizeError`` otherwise); the bytes land directly in
        it. ``None``: the message is returned by ``wait``. ``peer`` may be
        :data:`ANY_SOURCE`. A non-empty ``stamp`` must equal the matched
        message's stamp, else the receive fails with :class:`StampMismatch`
        and the payload is dropped, never written into ``buf``. With
        ``whole_call``, any stamped message from ``peer`` whose tag belongs to
        the same call (see :data:`CALL_SHIFT`) but carries another stamp fails
        the receive too: a peer running another call may use other tags
        altogether, and must still be caught rather than waited for.
        """
        ...

    def close(self) -> None:
        """Tell the peers this rank is leaving, fail pending requests with
        :class:`TransportClosed`, and release every thread, socket and file.
        Idempotent."""
        ...


class Rendezvous(Protocol):
    """What a transport needs from a store to exchange addresses: numcoll's
    stores satisfy it. ``get`` blocks until the key exists (with the store's
    own deadline)."""

    def set(self, key: str, value: bytes) -> None: ...

    def get(self, key: str) -> bytes: ...


# --- Helpers shared by the implementations (not part of the interface) -------

#: ``what`` of a request: the words error messages use.
SEND = "send"
RECV = "recv"


def describe(what: str, rank: int, peer: int, tag: int) -> str:
    """Name a request in error messages: ``"recv from rank 1 (tag 7) on rank 0"``."""
    who = "any rank" if peer == ANY_SOURCE else f"rank {peer}"
    direction = "to" if what == SEND else "from"
    return f"{what} {direction} {who} (tag {tag}) on rank {rank}"


def check_peer(what: str, rank: int, size: int, peer, tag) -> None:
    """Raise ``ValueError`` unless ``peer`` is a rank of the group (or, for a
    receive, :data:`ANY_SOURCE`) and ``tag`` fits in 64 unsigned bits."""
    if not isinstance(peer, int) or not (0 <= peer < size or (what == RECV and peer == ANY_SOURCE)):
        raise ValueError(f"{what} on rank {rank}: invalid peer rank {peer!r} (group size {size})")
    if not isinstance(tag, int) or not 0 <= tag <= MAX_TAG:
        raise ValueError(f"{what} on rank {rank}: invalid tag {tag!r} (must be in [0, 2**64))")


def check_stamp(stamp) -> bytes:
    """``stamp`` as bytes; ``ValueError`` if it is not bytes or is too long."""
    if not isinstance(stamp, (bytes, bytearray)) or len(stamp) > MAX_STAMP_NBYTES:
        raise ValueError(f"stamp must be at most {MAX_STAMP_NBYTES} bytes, got {stamp!r:.80}")
    return bytes(stamp)


def byte_view(buf, *, writable: bool = False) -> memoryview:
    """A flat unsigned-byte view of ``buf`` without copying.

    Accepts anything exporting the buffer protocol, and NumPy arrays whose
    dtype the buffer protocol cannot describe (``ml_dtypes.bfloat16``).
    Raises ``ValueError`` for non-contiguous or (when ``writable``) read-only
    buffers, since the bytes must move in place.
    """
    try:
        view = memoryview(buf)
    except (TypeError, ValueError):
        if not hasattr(buf, "__array_interface__"):
            raise
        import numpy  # only for dtypes the buffer protocol cannot describe

        array = numpy.asarray(buf)
        if not array.flags.c_contiguous:
            raise ValueError("buffer must be C-contiguous") from None
        view = memoryview(array.reshape(-1).view(numpy.uint8))
    if not view.c_contiguous:
        raise ValueError("buffer must be C-contiguous")
    if writable and view.readonly:
        raise ValueError("receive buffer must be writable")
    if view.format == "B" and view.ndim == 1:
        return view
    if view.nbytes == 0:  # memoryview cannot cast a shape containing 0
        return memoryview(bytearray() if writable else b"")
    return view.cast("B")
