"""The algorithms over the peers' memory (numcoll.algorithms.peers) against NumPy,
at 1..33 ranks, with a host twin of the device buffer's peer verbs: ranks are
threads (numcoll.testing's in-memory comm), a peer's buffer is its NumPy array.
The device buffer itself is tested in tests/test_cuda_ipc.py."""

import threading

import numpy as np
import pytest

from numcoll.algorithms import CHOICES, DEVICE_PEERS
from numcoll.memory.host import HostBuffer
from numcoll.testing import run_ranks

pytestmark = pytest.mark.timeout(120)


def add(acc, x):
    np.add(acc, x, out=acc)


class PeerBuffer(HostBuffer):
    """A NumPy buffer with the peer verbs of numcoll.cuda.buffer.DeviceBuffer,
    which records who read and wrote what, to check the schedule's claims;
    ``refuse``: this rank cannot reach its peers (the staged fallback)."""

    __slots__ = ("rank", "log", "refuse")
    registry: dict = {}
    lock = threading.Lock()

    def __init__(self, array, rank, log, refuse=False):
        super().__init__(array, add)
        self.rank, self.log, self.refuse = rank, log, refuse

    def peer_export(self) -> bytes:
        key = f"{id(self)}".encode()
        with self.lock:
            self.registry[key] = self
        return key

    def peer_views(self, described, op):
        if self.refuse:
            return [], "cannot reach them"
        return [None if d is None else self.registry[d] for d in described], None

    def reduce_peers(self, peers, start, count):
        self.log.append(("reduce", self.rank, start, count))
        for other in peers:
            if other is not None:
                self.array[start:start + count] += other.array[start:start + count]

    def copy_from_peers(self, peers, chunks):
        for other, (start, count) in zip(peers, chunks):
            if other is not None:
                self.log.append(("copy", self.rank, other.rank, start, count))
                self.array[start:start + count] = other.array[start:start + count]


def data(rank, count):
    return (np.arange(count, dtype=np.int64) * 7 + rank * 1000 + 1).astype(np.float64)


@pytest.mark.parametrize("name", sorted(DEVICE_PEERS & set(CHOICES["allreduce"])))
@pytest.mark.parametrize("size", list(range(1, 34)))
def test_allreduce_over_peers(name, size):
    algorithm = CHOICES["allreduce"][name]
    for count in sorted({0, 1, max(size - 1, 2), 2 * size + 3}):
        log = []

        def rank_fn(comm):
            buf = PeerBuffer(data(comm.rank, count), comm.rank, log)
            algorithm(comm, buf, 3)
            return buf.array

        expected = sum(data(r, count) for r in range(size))
        for got in run_ranks(size, rank_fn):
            np.testing.assert_array_equal(got, expected)
        # each rank reduces only its own chunk, and copies each other chunk from its owner
        if size > 1 and count:
            reduced = sorted(e[1:] for e in log if e[0] == "reduce")
            assert [r for r, _, _ in reduced] == list(range(size))
            assert all(src != dst for kind, dst, src, *_ in log if kind == "copy")


@pytest.mark.parametrize("size", [2, 3, 5, 8])
def test_one_rank_that_cannot_reach_its_peers_sends_everyone_to_the_staged_ring(size):
    algorithm = CHOICES["allreduce"]["ipc"]
    count = 2 * size + 3
    log = []

    def rank_fn(comm):
        buf = PeerBuffer(data(comm.rank, count), comm.rank, log, refuse=comm.rank == size - 1)
        algorithm(comm, buf, 3)
        return buf.array

    expected = sum(data(r, count) for r in range(size))
    for got in run_ranks(size, rank_fn):
        np.testing.assert_array_equal(got, expected)
    assert log == []            # nobody read a peer's memory


@pytest.mark.parametrize("size", list(range(1, 34)))
def test_broadcast_over_peers(size):
    algorithm = CHOICES["broadcast"]["ipc"]
    for root in sorted({0, size // 2, size - 1}):
        for count in (0, 1, 2 * size + 3):
            log = []

            def rank_fn(comm):
                buf = PeerBuffer(data(comm.rank, count), comm.rank, log)
                algorithm(comm, buf, root, 3)
                return buf.array

            for got in run_ranks(size, rank_fn):
                np.testing.assert_array_equal(got, data(root, count))
            if count and size > 1:      # every other rank copied from the root, once
                assert sorted(e[1] for e in log) == [r for r in range(size) if r != root]
                assert {e[2] for e in log} == {root}


@pytest.mark.parametrize("size", [2, 5])
def test_broadcast_falls_back_together(size):
    algorithm = CHOICES["broadcast"]["ipc"]
    log = []

    def rank_fn(comm):
        buf = PeerBuffer(data(comm.rank, 9), comm.rank, log, refuse=comm.rank == 1)
        algorithm(comm, buf, 0, 3)
        return buf.array

    for got in run_ranks(size, rank_fn):
        np.testing.assert_array_equal(got, data(0, 9))
    assert log == []


def _chunks(sizes):
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int)
    return [(int(s), int(n)) for s, n in zip(starts, sizes)]


@pytest.mark.parametrize("family", ["allgather", "reduce_scatter"])
@pytest.mark.parametrize("size", list(range(1, 34)))
@pytest.mark.parametrize("refuse", [False, True])
def test_uneven_chunks_over_peers(family, size, refuse):
    """Rank r owns r % 3 * 2 elements (some none); with ``refuse`` the last rank
    cannot reach its peers and everyone takes the ring instead."""
    algorithm = CHOICES[family]["ipc"]
    sizes = [r % 3 * 2 for r in range(size)]
    chunks, total = _chunks(sizes), sum(sizes)
    log = []

    def rank_fn(comm):
        mine = refuse and comm.rank == size - 1
        s, n = chunks[comm.rank]
        if family == "allgather":
            buf = np.zeros(total)
            buf[s:s + n] = data(comm.rank, n)
            algorithm(comm, PeerBuffer(buf, comm.rank, log, refuse=mine), chunks, 3)
            return buf
        buf = data(comm.rank, total)
        algorithm(comm, PeerBuffer(buf, comm.rank, log, refuse=mine), chunks, 3)
        return buf[s:s + n]

    results = run_ranks(size, rank_fn)
    if family == "allgather":
        expected = np.concatenate([data(r, n) for r, n in enumerate(sizes)])
        for got in results:
            np.testing.assert_array_equal(got, expected)
    else:
        whole = sum(data(r, total) for r in range(size))
        for r, got in enumerate(results):
            s, n = chunks[r]
            np.testing.assert_array_equal(got, whole[s:s + n])
    if refuse and size > 1:
        assert log == []
