"""The transport interface: post a send or a receive by (peer, tag), then wait
with a deadline.

A transport connects the ``size`` ranks of one group. It knows nothing of
arrays, dtypes or collectives: it moves bytes. Every message carries the
sender's rank and a 64-bit tag; a receive matches the oldest unmatched message
with the same (peer, tag) — or from any peer, for ``ANY_SOURCE``. Messages with
the same (sender, receiver, tag) arrive in the order they were sent.

Implementations: :mod:`transports.inproc` (ranks are threads of one process),
:mod:`transports.zmq.transport` (``tcp://`` and ``ipc://``) and
:mod:`transports.shm.transport` (shared-memory rings between the processes of
one host). What they share -- the argument checks, requests, loopback, failing
requests to a closed transport or a departed peer, matching in a mailbox -- is
:mod:`transports.endpoint`.

Optional capabilities are declared, never discovered: a transport that has a
shared arena (:class:`Arena`) exposes it as ``transport.arena``, one whose
ranks can map memory together (:class:`SharedMemory`) as
``transport.shared_memory``, one whose ranks can read each other's memory
where it lies (:class:`SingleCopy`) as ``transport.single_copy``; every other
transport sets them to None.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = [
    "ANY_SOURCE",
    "MAX_TAG",
    "Request",
    "Transport",
    "Arena",
    "SharedMemory",
    "SingleCopy",
    "TransportError",
    "TransportTimeout",
    "PeerClosed",
    "TransportClosed",
    "MessageSizeError",
    "StampMismatch",
    "SingleCopyRefused",
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
    ``what`` is "send" or "recv", ``tag`` the message tag; ``unreleased`` is
    True for a zero-copy send that ZeroMQ took but never reported done with
    (its buffer not released)."""

    def __init__(self, message: str, peer: int | None, tag: int, what: str, waited_s: float,
                 unreleased: bool = False):
        super().__init__(message, peer)
        self.tag = tag
        self.what = what
        self.waited_s = waited_s
        self.unreleased = unreleased


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


class Arena(Protocol):
    """Memory every rank of the group maps, written in *steps*: the optional
    capability of transports whose ranks share memory (``transport.arena``;
    None elsewhere). Implementation and memory-ordering argument:
    :mod:`transports.shm.arena`.

    A step is: each rank fills its slot (:meth:`mine`, or a payload given to
    :meth:`put`), publishes it under the call's sequence number and stamp
    (:meth:`put`), waits until every rank published the same step with the
    same call (:meth:`wait`), then reads any rank's slot in place
    (:meth:`view`, :meth:`nbytes`). Every rank runs the same steps in the same
    order; a slot may be read until the step after next begins. Arrays are
    NumPy ``uint8`` arrays.
    """

    #: Payload bytes a rank can contribute per step.
    slot_nbytes: int

    @property
    def next_step(self) -> int:
        """The step this rank publishes next."""
        ...

    def mine(self, step: int):
        """This rank's (writable) slot for ``step``, to fill before ``put(None, ...)``."""
        ...

    def put(self, payload, seq: int, stamp: bytes, nbytes: int | None = None) -> int:
        """Publish this rank's part of the next step: ``payload`` (copied in) or,
        with None, the first ``nbytes`` already written into :meth:`mine`.
        Returns the step."""
        ...

    def wait(self, step: int, seq: int, stamp: bytes, deadline: float | None,
             call: int | None = None) -> None:
        """Return once every rank published ``step`` under ``seq`` and ``stamp``;
        raise :class:`StampMismatch`, :class:`PeerClosed`,
        :class:`TransportClosed` or :class:`TransportTimeout`. ``call``: the
        call's key in tags (``tag >> CALL_SHIFT``), to also catch a peer
        running another call through point-to-point messages."""
        ...

    def step(self, payload, seq: int, stamp: bytes, deadline: float | None,
             call: int | None = None, nbytes: int | None = None) -> int:
        """:meth:`put` then :meth:`wait` (one compiled call where it can).
        Returns the step."""
        ...

    def nbytes(self, step: int, rank: int) -> int:
        """The payload size ``rank`` published for ``step``."""
        ...

    def view(self, step: int, rank: int, start: int = 0, nbytes: int | None = None):
        """``rank``'s payload of ``step`` (read-only by convention), bytes
        ``start:start + nbytes``."""
        ...


class SharedMemory(Protocol):
    """Memory every rank of the group maps, allocated together: the optional
    capability of transports whose ranks share a host (``transport.shared_memory``;
    None elsewhere). Implementation: :mod:`transports.shm.shared_arrays`.

    An allocation gives every rank a part of ``nbytes`` and maps every rank's
    part into every rank; it is collective (every rank allocates the same
    size, in the same order: the n-th allocation is key ``n`` everywhere).
    Parts are NumPy ``uint8`` arrays, 64-byte aligned.
    """

    def allocate(self, nbytes: int):
        """A new allocation: ``.key``, ``.nbytes``, ``.take()`` (this rank's own
        part, once: the allocation holds it only weakly), ``.parts[peer]``,
        ``.address`` (where this rank's part starts)."""
        ...

    def find(self, address: int, nbytes: int) -> tuple[int, int] | None:
        """``(key, offset)`` of this rank's part holding bytes ``address`` to
        ``address + nbytes``, or None."""
        ...

    def part(self, key: int, rank: int):
        """Peer ``rank``'s part of allocation ``key``; None once released."""
        ...

    def release(self, key: int) -> None:
        """This rank is done with allocation ``key``: drop its mappings of the
        peers' parts (its own part stays mapped while anything views it)."""
        ...


class SingleCopyRefused(TransportError):
    """The kernel refused a single-copy read from ``peer`` (:class:`SingleCopy`):
    the caller finishes another way."""


class SingleCopy(Protocol):
    """Reading a peer's memory where it lies, in one copy (cross-memory
    attach): the optional capability of transports whose ranks are processes
    of one host (``transport.single_copy``; :mod:`transports.shm.single_copy`).
    ``refused`` says why the group cannot (the same on every rank, fixed at
    set-up), None where it can; ``failed``, why reads failed in a call since."""

    refused: str | None
    failed: str | None

    def read(self, peer: int, address: int, out) -> None:
        """Copy ``out.nbytes`` bytes from ``address`` in ``peer``'s memory into
        ``out`` (a C-contiguous writable array)."""
        ...

    def refuse(self, reason: str) -> bool:
        """Reads failed in a call, for ``reason`` (every rank, in the same call):
        later reads fail at once. True the first time."""
        ...


@runtime_checkable
class Transport(Protocol):
    """Point-to-point messaging among the ``size`` ranks of one group."""

    rank: int
    size: int
    #: The shared arena (:class:`Arena`), or None where the ranks share no memory.
    arena: Arena | None
    #: Memory the ranks map together (:class:`SharedMemory`), or None.
    shared_memory: SharedMemory | None
    #: Whether every rank is a thread of this one process (they can then use
    #: each other's memory, device memory included, by address).
    in_process: bool
    #: Single-copy reads from the peers (:class:`SingleCopy`), or None.
    single_copy: SingleCopy | None

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
    own deadline).

    A store may also have ``delete_key(key)`` (numcoll's do): a transport
    then deletes a key it published once every peer has read it (see
    :func:`transports.endpoint.forget`), so a store shared by many groups
    does not grow with them. A store with only ``set`` and ``get`` keeps them."""

    def set(self, key: str, value: bytes) -> None: ...

    def get(self, key: str) -> bytes: ...
