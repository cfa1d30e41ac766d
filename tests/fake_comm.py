"""An in-memory stand-in for numcoll.comm.Comm, to test algorithms alone.

Ranks are threads; a send copies its bytes into the receiver's inbox at once
(FIFO per (source, step)), a receive waits on the receiver's own condition
with a deadline. No transport, no ProcessGroup, no dtype: what an algorithm
sees of the world is exactly this interface.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque

import numpy as np

WAIT_S = 20.0


class _Inbox:
    def __init__(self):
        self.cond = threading.Condition()
        self.messages: dict[tuple[int, int], deque[bytes]] = defaultdict(deque)


class _Pending:
    __slots__ = ("peer", "step", "buf", "done")

    def __init__(self, peer, step, buf=None, done=False):
        self.peer, self.step, self.buf, self.done = peer, step, buf, done


class FakeComm:
    def __init__(self, fabric: list[_Inbox], rank: int, log: list | None = None):
        self.rank, self.size = rank, len(fabric)
        self._fabric = fabric
        self._log = log

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


def run_ranks(world_size: int, fn, log: list | None = None) -> list:
    """fn(comm) on ``world_size`` thread ranks; their results; the first error re-raised."""
    fabric = [_Inbox() for _ in range(world_size)]
    results, errors = [None] * world_size, []

    def body(rank):
        try:
            results[rank] = fn(FakeComm(fabric, rank, log))
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
    return results
