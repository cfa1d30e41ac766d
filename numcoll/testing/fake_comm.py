"""An in-memory stand-in for :class:`numcoll.comm.Comm`, to test algorithms alone.

Ranks are threads; a send copies its bytes into the receiver's inbox at once
(FIFO per (source, step)), a receive waits on the receiver's own condition
with a deadline. No transport, no ProcessGroup, no dtype: what an algorithm
sees of the world is exactly this interface, so an algorithm of your own can
be checked at 1..33 ranks in milliseconds::

    from numcoll.testing import run_ranks
    results = run_ranks(5, lambda comm: my_allreduce(comm, HostBuffer(x, add), 1024))

Every wait has a deadline (:data:`WAIT_S`); ``run_ranks`` re-raises the first
rank's error, and checks that no message was left unreceived and that every
rank ran the same shared-arena steps.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections import defaultdict, deque

import numpy as np

from ..algorithms.levels import Topology

WAIT_S = 20.0


class _Inbox:
    def __init__(self):
        self.cond = threading.Condition()
        self.messages: dict[tuple[int, int], deque[bytes]] = defaultdict(deque)


class _Pending:
    __slots__ = ("peer", "step", "buf", "done")

    def __init__(self, peer, step, buf=None, done=False):
        self.peer, self.step, self.buf, self.done = peer, step, buf, done


class _Arena:
    """The shared arena of transports.shm.arena, in memory, for the group
    ranks ``ranks`` (one host's): two sets of slots and a step count per
    rank; a step waits (with a deadline) until every rank has published it.
    Addressed by group rank, as the hier transport's. A rank's view of it is
    :class:`_ArenaView`."""

    def __init__(self, ranks, slot_nbytes: int):
        self.index = {r: i for i, r in enumerate(ranks)}
        self.slot_nbytes = slot_nbytes
        self.slots = np.zeros((2, len(ranks), slot_nbytes), np.uint8)
        self.nbytes = np.zeros((2, len(ranks)), np.int64)
        self.published = [0] * len(ranks)
        self.cond = threading.Condition()


class _ArenaView:
    def __init__(self, arena: _Arena, rank: int):
        self._arena, self._rank = arena, arena.index[rank]
        self.slot_nbytes = arena.slot_nbytes
        self.next_step = 0

    def mine(self, step: int) -> np.ndarray:
        return self._arena.slots[step & 1, self._rank]


class FakeComm:
    """One rank's comm: the send/recv and shared-arena verbs of
    :class:`numcoll.comm.Comm`, and with ``topology`` the group's hosts (the
    arena is then this rank's host's)."""

    def __init__(self, fabric: list[_Inbox], rank: int, log: list | None = None,
                 arena: _Arena | None = None, topology: Topology | None = None,
                 shared: dict | None = None):
        self.rank, self.size = rank, len(fabric)
        self.op_name = "fake"  # (Comm's: the collective's name)
        self._fabric = fabric
        self._log = log
        self.arena = None if arena is None else _ArenaView(arena, rank)
        self.topology = topology
        self._shared = shared or {}
        #: Why single-copy reads are refused (None: they succeed): set it to
        #: test an algorithm's fallback; :meth:`refuse_single_copy` sets it too.
        self.single_copy_refused: str | None = None
        self._reads_left: int | None = None  # (refuse_reads_after)
        self._refusal = ""
        self.tuning: dict = {}
        #: What the algorithm said ran instead of itself (:meth:`ran_instead`), if anything.
        self.ran: str | None = None

    @property
    def arena_slot_nbytes(self) -> int:
        return self.arena.slot_nbytes

    def next_slot(self) -> np.ndarray:
        return self.arena.mine(self.arena.next_step)

    def shared_step(self, payload=None, nbytes: int | None = None) -> int:
        """Comm.shared_step: publish, then wait for every rank's part of the step."""
        step = self.shared_publish(payload, nbytes)
        self.shared_wait(step)
        return step

    def shared_publish(self, payload=None, nbytes: int | None = None) -> int:
        """Comm.shared_publish: this rank's part of the next step, no waiting."""
        view, arena = self.arena, self.arena._arena
        step, me = view.next_step, view._rank
        if payload is not None:
            nbytes = payload.size
            arena.slots[step & 1, me, :nbytes] = payload
        nbytes = nbytes or 0
        assert nbytes <= arena.slot_nbytes, f"rank {self.rank}: {nbytes} bytes overflow the slot"
        if self._log is not None:
            self._log.append(nbytes)
        with arena.cond:
            # The two-set rule of transports.shm.arena: overwriting set step % 2
            # is safe only once every rank has published step - 1.
            assert min(arena.published) >= step, f"rank {self.rank} overwrote a set in use"
            arena.nbytes[step & 1, me] = nbytes
            arena.published[me] = step + 1
            arena.cond.notify_all()
        view.next_step = step + 1
        return step

    def shared_wait(self, step: int) -> None:
        """Comm.shared_wait: until every rank has published ``step`` (a deadline)."""
        arena = self.arena._arena
        deadline = time.monotonic() + WAIT_S
        with arena.cond:
            while min(arena.published) < step + 1:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"rank {self.rank}: step {step} never completed")
                arena.cond.wait(left)

    def shared_slots(self) -> list:
        """Comm.shared_slots: ``[set][rank]`` whole payload slots."""
        return [[self.arena._arena.slots[s, r] for r in range(self.size)] for s in (0, 1)]

    def shared_view(self, step: int, peer: int, start: int, nbytes: int) -> np.ndarray:
        arena = self._arena_checked(step)
        at = arena.index[peer]
        assert start + nbytes <= arena.nbytes[step & 1, at], (
            f"rank {self.rank} reads bytes {start}..{start + nbytes} of rank {peer}'s "
            f"{arena.nbytes[step & 1, at]}")
        return arena.slots[step & 1, at, start:start + nbytes]

    def shared_array(self, peer: int, key: int, start: int, nbytes: int) -> np.ndarray:
        """Comm.shared_array: bytes of ``peer``'s part of shared allocation ``key``
        (``run_ranks(..., shared={key: [every rank's uint8 part]})``)."""
        part = self._shared[key][peer]
        assert 0 <= start and start + nbytes <= part.size, (
            f"rank {self.rank} reads bytes {start}..{start + nbytes} of rank {peer}'s "
            f"shared part #{key} of {part.size}")
        return part[start:start + nbytes]

    def published_nbytes(self, step: int, peer: int) -> int:
        """Comm.published_nbytes: what ``peer`` published at ``step``."""
        arena = self._arena_checked(step)
        return int(arena.nbytes[step & 1, arena.index[peer]])

    def read_peer(self, peer: int, address: int, out: np.ndarray) -> str | None:
        """Comm.read_peer: the ranks are threads of this process, so a peer's
        address is this process's; a refusal's text if :attr:`single_copy_refused`."""
        assert 0 <= peer < self.size and peer != self.rank, f"rank {self.rank} reads {peer}"
        if self._reads_left is not None:
            if self._reads_left == 0:
                self.single_copy_refused = self._refusal
            self._reads_left -= 1
        if self.single_copy_refused is not None:
            return self.single_copy_refused
        ctypes.memmove(out.ctypes.data, address, out.nbytes)
        return None

    def refuse_reads_after(self, n: int, reason: str = "EPERM (simulated)") -> None:
        """Let this rank's next ``n`` reads succeed and refuse every later one
        (setting :attr:`single_copy_refused` then): a refusal in the middle
        of a call."""
        self._reads_left, self._refusal = n, reason

    def write_peer(self, peer: int, address: int, data: np.ndarray) -> str | None:
        """Comm.write_peer: as :meth:`read_peer`, the other way."""
        assert 0 <= peer < self.size and peer != self.rank, f"rank {self.rank} writes {peer}"
        if self.single_copy_refused is not None:
            return self.single_copy_refused
        ctypes.memmove(address, data.ctypes.data, data.nbytes)
        return None

    def single_copy_exchange(self, where, copies) -> None:
        """Comm.single_copy_exchange: never compiled here (None: the algorithm
        takes every phase step by step, through the methods above)."""
        return None

    def single_copy_tuning(self) -> dict:
        """Comm.single_copy_tuning: this rank's own dict (only rank 0 uses it)."""
        return self.tuning

    def single_copy_usable(self) -> bool:
        """Comm.single_copy_usable: until :attr:`single_copy_refused` is set."""
        return self.single_copy_refused is None

    def refuse_single_copy(self, reason: str) -> None:
        """Comm.refuse_single_copy: later reads are refused."""
        self.single_copy_refused = reason

    def ran_instead(self, algorithm: str) -> None:
        """Comm.ran_instead: kept in :attr:`ran`, for the test to read."""
        self.ran = algorithm

    def size_mismatch(self, peer: int, detail: str):
        raise AssertionError(f"rank {self.rank}: wrong size from rank {peer}: {detail}")

    def _arena_checked(self, step: int) -> _Arena:
        arena = self.arena._arena
        assert step >= self.arena.next_step - 2, "read of a step whose set was reused"
        return arena

    def isend(self, peer: int, step: int, buf) -> _Pending:
        assert 0 <= peer < self.size, f"rank {self.rank} sends to rank {peer}"
        data = bytes(memoryview(np.ascontiguousarray(buf)).cast("B")) if not isinstance(
            buf, bytes) else buf
        if self._log is not None:
            self._log.append(len(data))
        inbox = self._fabric[peer]
        with inbox.cond:
            inbox.messages[(self.rank, step)].append(data)
            inbox.cond.notify_all()
        return _Pending(peer, step, done=True)

    def irecv(self, peer: int, step: int, buf=None) -> _Pending:
        assert 0 <= peer < self.size, f"rank {self.rank} receives from rank {peer}"
        return _Pending(peer, step, buf)

    def wait(self, pending: _Pending):
        if pending.done:
            return None
        inbox = self._fabric[self.rank]
        deadline = time.monotonic() + WAIT_S
        with inbox.cond:
            queue = inbox.messages[(pending.peer, pending.step)]
            while not queue:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"rank {self.rank}: no message from rank "
                                       f"{pending.peer} at step {pending.step}")
                inbox.cond.wait(left)
            data = queue.popleft()
        pending.done = True
        if pending.buf is None:
            return memoryview(data)
        target = memoryview(np.asarray(pending.buf)).cast("B")
        assert target.nbytes == len(data), (
            f"rank {self.rank}: message of {len(data)} bytes for a {target.nbytes}-byte buffer")
        target[:] = data
        return None

    def wait_all(self, pendings) -> None:
        for p in pendings:
            self.wait(p)

    def sendrecv(self, send_peer, recv_peer, step, send_buf, recv_buf=None):
        r = self.irecv(recv_peer, step, recv_buf)
        self.wait(self.isend(send_peer, step, send_buf))
        return self.wait(r)


def run_ranks(world_size: int, fn, log: list | None = None,
              arena_slot_nbytes: int = 4096, hosts=None, shared: dict | None = None) -> list:
    """fn(comm) on ``world_size`` thread ranks; their results; the first error re-raised.
    The comms share an in-memory arena of ``arena_slot_nbytes`` per slot, and
    the shared memory ``shared`` ({key: [every rank's part, uint8]}) for the
    shared-array algorithms.

    ``hosts`` (lists of ranks covering every rank once, e.g. ``[[0, 1, 2],
    [3]]``) gives the comms a :class:`~numcoll.algorithms.levels.Topology`, as on a group
    over several hosts: each host has an arena of its own, as the two-level
    algorithms need."""
    fabric = [_Inbox() for _ in range(world_size)]
    layout = [list(range(world_size))] if hosts is None else [list(h) for h in hosts]
    assert sorted(r for h in layout for r in h) == list(range(world_size)), (
        f"hosts {hosts} must hold every rank of {world_size} once")
    arenas = [_Arena(h, arena_slot_nbytes) for h in layout]
    arena_of = {r: a for h, a in zip(layout, arenas) for r in h}
    results, errors = [None] * world_size, []

    def body(rank):
        topology = None if hosts is None else Topology(layout, rank, arena_slot_nbytes)
        try:
            results[rank] = fn(FakeComm(fabric, rank, log, arena_of[rank], topology, shared))
        except BaseException as exc:  # noqa: BLE001 - re-raised on the test thread
            errors.append((rank, exc))

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S * 2)
    if errors:
        rank, exc = errors[0]
        raise AssertionError(f"rank {rank} failed: {exc!r}") from exc
    assert not any(t.is_alive() for t in threads), "a rank hung"
    # Every message sent was received: nothing left over.
    leftovers = sum(len(q) for inbox in fabric for q in inbox.messages.values())
    assert leftovers == 0, f"{leftovers} messages were sent but never received"
    for h, arena in zip(layout, arenas):
        assert len(set(arena.published)) == 1, (
            f"ranks {h} ran different arena steps: {arena.published}")
    return results
