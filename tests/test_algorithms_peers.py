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

    @property
    def size(self):             # what the algorithms ask of a peer's view
        return self.count

    def copy_from_peers(self, peers, chunks):
        for other, (start, count) in zip(peers, chunks):
            if other is not None:
                self.log.append(("copy", self.rank, other.rank, start, count))
                self.array[start:start + count] = other.array[start:start + count]

    def copy_peer_ranges(self, peers, moves, wait=True):
        for r, src, dst, count in moves:
            other = peers[r]
            if other is not None and count:
                self.log.append(("copy", self.rank, other.rank, dst, count))
                self.array[dst:dst + count] = other.array[src:src + count]

    def settle(self):
        pass


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


SIZES = [1, 2, 3, 4, 5, 7, 8, 16, 33]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("refuse", [False, True])
def test_reduce_over_peers(size, refuse):
    """The root alone reads the peers (with ``refuse``, the last rank cannot,
    and everyone takes the staged ring)."""
    algorithm = CHOICES["reduce"]["ipc"]
    for root in sorted({0, size // 2, size - 1}):
        for count in (0, 1, 2 * size + 3):
            log = []

            def rank_fn(comm):
                buf = PeerBuffer(data(comm.rank, count), comm.rank, log,
                                 refuse=refuse and comm.rank == size - 1)
                algorithm(comm, buf, root, 3)
                return buf.array

            got = run_ranks(size, rank_fn)
            np.testing.assert_array_equal(got[root], sum(data(r, count) for r in range(size)))
            if refuse and size > 1 and root == size - 1:
                assert log == []
            elif not refuse and count and size > 1:
                assert {(kind, r) for kind, r, *_ in log} == {("reduce", root)}


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("refuse", [False, True])
def test_gather_and_scatter_over_peers(size, refuse):
    for family in ("gather", "scatter"):
        algorithm = CHOICES[family]["ipc"]
        for root in sorted({0, size - 1}):
            log = []

            def rank_fn(comm):
                rank = comm.rank
                mine = refuse and rank == size - 1
                if family == "gather":
                    send = PeerBuffer(data(rank, 5), rank, log, refuse=mine)
                    recv = [np.zeros(5) for _ in range(size)] if rank == root else []
                    algorithm(comm, send, [PeerBuffer(r, rank, log) for r in recv], root, 2)
                    return recv
                sends = [PeerBuffer(data(q, 5), rank, log) for q in range(size)] \
                    if rank == root else []
                recv = np.zeros(5)
                algorithm(comm, sends, PeerBuffer(recv, rank, log, refuse=mine), root, 2)
                return recv

            got = run_ranks(size, rank_fn)
            for q in range(size):
                if family == "gather" and q != root:
                    np.testing.assert_array_equal(got[root][q], data(q, 5))
                if family == "scatter" and q != root:
                    np.testing.assert_array_equal(got[q], data(q, 5))
            if size > 1 and not (refuse and (family == "scatter" or root == size - 1)):
                # every block crossed once, read by its receiver
                assert sorted((e[1], e[2]) for e in log) == sorted(
                    (root, q) if family == "gather" else (q, root)
                    for q in range(size) if q != root), (family, root, log)
            if refuse and size > 1 and (family == "scatter" or root == size - 1):
                assert log == []


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("refuse", [False, True])
def test_alltoall_with_uneven_splits_over_peers(size, refuse):
    """Rank r sends rank q (r + q) % 3 elements (some none); every rank reads
    each of its blocks from its sender, once."""
    algorithm = CHOICES["alltoall"]["ipc"]
    log = []

    def block(src, dst):
        return data(src, 5)[:(src + dst) % 3] + dst / 10

    def rank_fn(comm):
        rank = comm.rank
        send_chunks = _chunks([(rank + q) % 3 for q in range(size)])
        recv_chunks = _chunks([(q + rank) % 3 for q in range(size)])
        send = np.concatenate([block(rank, q) for q in range(size)])
        recv = np.zeros(sum(n for _, n in recv_chunks))
        s, n = send_chunks[rank]
        r, _ = recv_chunks[rank]
        recv[r:r + n] = send[s:s + n]
        algorithm(comm, PeerBuffer(send, rank, log), send_chunks,
                  PeerBuffer(recv, rank, log, refuse=refuse and rank == size - 1),
                  recv_chunks, 2)
        return recv, comm.ran

    for rank, (got, ran) in enumerate(run_ranks(size, rank_fn)):
        np.testing.assert_array_equal(got, np.concatenate([block(q, rank) for q in range(size)]))
        # every rank says what ran instead of ipc (the flight recorder's entry)
        assert ran == ("pairwise (staged: ipc unavailable)" if refuse and size > 1 else None)
    if refuse and size > 1:
        assert log == []
    else:
        assert sorted((e[1], e[2]) for e in log) == sorted(
            (r, q) for r in range(size) for q in range(size) if q != r and (q + r) % 3)


def test_alltoall_blocks_that_disagree_make_every_rank_raise():
    """Rank 1 sends rank 0 two elements where rank 0 expects one: every rank
    raises (none waits for the others until its deadline)."""
    from numcoll.errors import NumcollError

    algorithm = CHOICES["alltoall"]["ipc"]

    def rank_fn(comm):
        rank = comm.rank
        send_chunks = _chunks([2, 2, 2])
        recv_chunks = _chunks([2, 1 if rank == 0 else 2, 2])
        send = PeerBuffer(data(rank, 6), rank, [])
        recv = PeerBuffer(np.zeros(sum(n for _, n in recv_chunks)), rank, [])
        with pytest.raises(NumcollError, match="block sizes do not agree") as info:
            algorithm(comm, send, send_chunks, recv, recv_chunks, 2)
        return str(info.value)

    said = run_ranks(3, rank_fn)
    assert "rank 1 sends rank 0 2 elements, it expects 1" in said[0]
    assert "rank 2" not in said[0]
    assert "another rank's do not" in said[1] and "another rank's do not" in said[2]


def test_gather_block_that_disagrees_makes_every_rank_raise():
    from numcoll.errors import NumcollError

    algorithm = CHOICES["gather"]["ipc"]

    def rank_fn(comm):
        rank = comm.rank
        send = PeerBuffer(data(rank, 3 if rank == 2 else 4), rank, [])
        recv = [PeerBuffer(np.zeros(4), rank, []) for _ in range(3)] if rank == 0 else []
        with pytest.raises(NumcollError, match="sizes do not agree") as info:
            algorithm(comm, send, recv, 0, 2)
        return str(info.value)

    said = run_ranks(3, rank_fn)
    assert "rank 2 has 3 elements, rank 0 expects 4" in said[0]
