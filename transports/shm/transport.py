"""Shared-memory transport ``shm``: ranks that are processes (or threads) of one host.

Rings
    Every rank owns one anonymous shared-memory region
    (:mod:`transports.shm.region`) holding its *inbound* rings, one per
    peer: lock-free single-producer / single-consumer byte rings (layout
    and memory ordering: :mod:`transports.shm.ring`). A message up to ``inline_nbytes`` is
    one record (header, stamp, payload); a larger one is cut into chunks
    that follow each other through the ring, flow-controlled by its read
    index, so memory stays bounded whatever the message size, and two ranks
    sending each other huge messages at once cannot deadlock (whoever waits
    also drains). One record is copied in by the sender and out
    by the receiver, straight into the posted buffer (or into a new one for
    a receive posted without a buffer). A chunked message is assembled in a
    private buffer first (one more copy: the Mailbox can only take a whole
    payload). Collectives that read the peers' bytes in place use the
    shared arena instead (:mod:`transports.shm.arena`, ``self.arena``).
Progress
    The thread that waits on a request moves the bytes itself, spinning,
    then yielding, then blocking; a helper thread, woken by a one-byte poke
    on a Unix socket, carries what no one waits for
    (:mod:`transports.shm.progress`).
Rendezvous and liveness
    Each rank listens on an abstract Unix socket named in the store and
    connects to every peer; once both sides checked who the other is (its
    user and pid, and with ``NUMCOLL_AUTH_TOKEN`` its knowledge of the
    token), the region's fd travels, sealed against any change of size
    (:mod:`transports.shm.rendezvous`). The sockets stay open: a peer's
    process ending, however it ends, closes them, so its death shows up at
    once as EOF in the helper's ``poll``; what the peer wrote before is
    drained first. A closing rank writes ``BYE`` into its rings (after its
    data) before closing its sockets, which tells "closed" from "lost".
"""

from __future__ import annotations

import functools
import os
import socket
import threading
import time

import numpy as np

from . import ring as K
from ..base import Rendezvous, TransportError
from ..endpoint import MailboxTransport
from ..mailbox import Mailbox
from ..refusals import RefusalLog
from .arena import SharedArena
from .progress import RingProgress, Send, ShmRequest
from .region import arena_offset, create_region, region_nbytes
from .rendezvous import connect_peers
from .shared_arrays import SharedMemory
from .single_copy import SingleCopy

__all__ = ["ShmRingTransport", "ring_nbytes_for"]

ring_nbytes_for = K.ring_nbytes_for


class ShmRingTransport(MailboxTransport):
    """Point-to-point messaging through shared-memory rings (one host).

    Parameters
    ----------
    rank, size : int
        This rank and the group size.
    store : Rendezvous
        Already prefixed for the group; carries ``shm/{rank}``.
    timeout_s : float
        Kept as ``self.timeout_s``; also bounds the connection set-up.
    inline_nbytes : int
        Messages up to this size are one ring record (one copy in, one out);
        larger ones are chunked. Rings are sized to hold two such records.
    spin_us, yield_us : float
        A waiter busy-polls for ``spin_us``, then polls with ``sched_yield``
        for ``yield_us`` more, then blocks. With more ranks than this process
        may use CPUs, it does not busy-poll at all: the rank it waits for may
        need this very core, and ``sched_yield`` hands it over.
    arena_slot_nbytes : int
        Payload bytes per rank and step of the shared arena
        (:mod:`transports.shm.arena`, ``self.arena``); 0: no arena.
    token : bytes, optional
        A shared secret every peer must prove it knows before memory is
        exchanged (:mod:`transports.shm.rendezvous`).

    ``refusals`` counts (and logs) every connection refused at set-up.
    """

    def __init__(self, rank: int, size: int, store: Rendezvous, *, timeout_s: float = 300.0,
                 inline_nbytes: int = 1 << 20, spin_us: float = 5.0, yield_us: float = 2000.0,
                 arena_slot_nbytes: int = 0, token: bytes | None = None):
        if not 0 <= rank < size:
            raise ValueError(f"invalid rank {rank} for group size {size}")
        if size > 1 and not (hasattr(os, "memfd_create") and hasattr(socket, "send_fds")):
            raise TransportError("the shm transport needs Linux (memfd_create, SCM_RIGHTS)")
        if arena_slot_nbytes < 0 or arena_slot_nbytes % 64:
            raise ValueError(f"arena_slot_nbytes must be a non-negative multiple of 64, "
                             f"got {arena_slot_nbytes}")
        self.rank = rank
        self.size = size
        self.timeout_s = timeout_s
        self._mailbox = Mailbox(rank, size)
        self.refusals = RefusalLog(f"numcoll shm transport rank {rank}")
        self._capacity = K.ring_nbytes_for(inline_nbytes)
        self._spin_ns = int(spin_us * 1000) if size <= _usable_cpus() else 0
        self._yield_ns = int(yield_us * 1000)
        self._arena_slot_nbytes = arena_slot_nbytes if size > 1 else 0
        self._closed = False
        self._close_lock = threading.Lock()
        self._rings: RingProgress | None = None
        #: The shared arena (:mod:`transports.shm.arena`), or None.
        self.arena: SharedArena | None = None
        #: Single-copy reads from the peers (:mod:`transports.shm.single_copy`):
        #: where there is an arena to agree on it; ``single_copy.refused`` says
        #: why not, where the kernel refuses.
        self.single_copy: SingleCopy | None = None
        #: Memory the ranks map together (:mod:`transports.shm.shared_arrays`).
        self.shared_memory = SharedMemory(rank, size, store, token=token,
                                          refusals=self.refusals, timeout_s=timeout_s)
        if size == 1:
            return
        try:
            self._connect(store, token)
        except BaseException:
            self.refusals.close()
            raise
        if self.arena is not None:
            single_copy = SingleCopy(rank, size, self._peer_pids)
            try:
                single_copy.agree(self.arena, time.monotonic() + timeout_s)
            except BaseException:
                self.close()
                raise
            self.single_copy = single_copy

    # --- set-up -------------------------------------------------------------------------

    def _region_nbytes(self, owner: int) -> int:
        return region_nbytes(owner, self.size, self._capacity, self._arena_slot_nbytes)

    def _connect(self, store: Rendezvous, token: bytes | None) -> None:
        fd, region = create_region(self.rank, self._region_nbytes(self.rank))
        try:
            links = connect_peers(
                self.rank, self.size, store, fd,
                settings=(self._capacity, self.size, self._arena_slot_nbytes),
                region_nbytes=self._region_nbytes, token=token,
                deadline=time.monotonic() + self.timeout_s, refusals=self.refusals)
        except BaseException:
            region.close()
            raise
        finally:
            os.close(fd)  # every peer that needs it holds its own
        self._peer_pids = {p: link.pid for p, link in links.items()}
        try:
            self._rings = RingProgress(self.rank, self.size, self._mailbox, region, links,
                                       self._capacity, self._spin_ns, self._yield_ns)
        except BaseException:
            for link in links.values():
                link.out_sock.close()
                link.in_sock.close()
                link.region.close()
            region.close()
            raise
        # Requests that drive the rings while they wait (a group of one has none to drive).
        self._new_request = functools.partial(ShmRequest, self._rings)
        if self._arena_slot_nbytes:
            home = np.frombuffer(region if self.rank == 0 else links[0].region, np.uint8)
            self.arena = SharedArena(
                home, arena_offset(self.size, self._capacity), self.rank, self.size,
                self._arena_slot_nbytes, spin_ns=self._spin_ns, yield_ns=self._yield_ns,
                peer_left=self._rings.left, conflicting_call=self._rings.conflicting_call)

    @property
    def peers_in_this_process(self) -> bool:
        """Whether a peer is a thread of this process (``nc.launch``'s thread
        mode, tests): then a wait that holds the GIL keeps that peer from
        arriving."""
        return os.getpid() in self._peer_pids.values()

    # --- MailboxTransport ---------------------------------------------------------------

    def _send(self, req: ShmRequest, peer: int, tag: int, data: memoryview,
              stamp: bytes) -> bool:
        self._rings.post(peer, Send(req, tag, data, stamp))
        return False  # completed once its last byte is in the ring

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            self._closed_why = reason = f"rank {self.rank}'s transport was closed"
        if self._rings is not None:
            self._rings.stop(reason)  # closes the mailbox once the peers are told
        else:
            self._mailbox.close(reason)
        if self.arena is not None:
            self.arena.release()
        self.shared_memory.close()
        self.refusals.close()

    def __repr__(self) -> str:
        return f"<ShmRingTransport rank {self.rank}/{self.size}{' closed' if self._closed else ''}>"


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
