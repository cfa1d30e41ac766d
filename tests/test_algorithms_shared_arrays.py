"""The shared-array algorithms (numcoll.algorithms.shared_arrays) against NumPy,
alone, at 1..33 ranks: the in-memory fake comm (numcoll.testing) stands for
the arena, and every rank's array is a part of one fake shared allocation.
Tiny blocks force many pipelined steps; counts that do not divide by the
world size, and empty shares, are included."""

import numpy as np
import pytest

from numcoll.algorithms.shared_arrays import (allgather_shared_arrays, allreduce_shared_arrays,
                                              alltoall_shared_arrays, broadcast_shared_arrays,
                                              reduce_scatter_shared_arrays, reduce_shared_arrays)
from numcoll.memory.host import HostBuffer
from numcoll.testing import run_ranks

from test_algorithms import WORLD_SIZES, add, counts, data

pytestmark = pytest.mark.timeout(180)

BLOCK = 3  # elements: every share of more than 3 elements takes several steps
KEY = 7


def shared(arrays):
    """A fake shared allocation holding ``arrays`` (one per rank), with an
    unrelated word before each, so offsets are exercised."""
    parts, views = [], []
    for a in arrays:
        part = np.zeros(8 + a.nbytes, np.uint8)
        view = part[8:].view(a.dtype)
        view[...] = a
        parts.append(part)
        views.append(view)
    return {KEY: parts}, views


@pytest.mark.parametrize("size", WORLD_SIZES)
def test_allreduce(size):
    for count in counts(size):
        fabric, views = shared([data(r, count) for r in range(size)])

        def rank_fn(comm):
            allreduce_shared_arrays(comm, HostBuffer(views[comm.rank], add), (KEY, 8), BLOCK)

        run_ranks(size, rank_fn, shared=fabric)
        expected = sum(data(r, count) for r in range(size))
        for got in views:
            np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("size", WORLD_SIZES)
def test_broadcast_and_reduce(size):
    count = size + 5
    for root in {0, size // 2, size - 1}:
        fabric, views = shared([data(r, count) for r in range(size)])
        run_ranks(size, lambda comm: broadcast_shared_arrays(
            comm, HostBuffer(views[comm.rank]), (KEY, 8), root), shared=fabric)
        for got in views:
            np.testing.assert_array_equal(got, data(root, count))

        fabric, views = shared([data(r, count) for r in range(size)])
        run_ranks(size, lambda comm: reduce_shared_arrays(
            comm, HostBuffer(views[comm.rank], add), (KEY, 8), root, BLOCK), shared=fabric)
        np.testing.assert_array_equal(views[root], sum(data(r, count) for r in range(size)))
        for r in range(size):  # the other ranks' arrays are only read
            if r != root:
                np.testing.assert_array_equal(views[r], data(r, count))


@pytest.mark.parametrize("size", WORLD_SIZES)
def test_allgather_and_reduce_scatter(size):
    for per in (0, 1, 5):
        fabric, views = shared([data(r, per) for r in range(size)])

        def gather(comm):
            out = np.full(per * size, -1.0)
            out[comm.rank * per:(comm.rank + 1) * per] = views[comm.rank]
            allgather_shared_arrays(comm, HostBuffer(out), (KEY, 8), per)
            return out

        for got in run_ranks(size, gather, shared=fabric):
            np.testing.assert_array_equal(got, np.concatenate([data(r, per)
                                                               for r in range(size)]))

        fabric, views = shared([data(r, per * size) for r in range(size)])

        def scatter(comm):
            r = comm.rank
            out = views[r][r * per:(r + 1) * per].copy()
            reduce_scatter_shared_arrays(comm, HostBuffer(out, add), (KEY, 8), per, BLOCK)
            return out

        total = sum(data(r, per * size) for r in range(size))
        for r, got in enumerate(run_ranks(size, scatter, shared=fabric)):
            np.testing.assert_array_equal(got, total[r * per:(r + 1) * per])


@pytest.mark.parametrize("size", WORLD_SIZES)
def test_alltoall_uneven(size):
    # rank r sends (r + q) % 3 elements to rank q
    def n(src, dst):
        return (src + dst) % 3

    sends = []
    for r in range(size):
        sends.append(np.concatenate([np.full(n(r, q), 100.0 * r + q) for q in range(size)]
                                    or [np.zeros(0)]))
    fabric, views = shared(sends)

    def rank_fn(comm):
        r = comm.rank
        send_counts = [n(r, q) for q in range(size)]
        recv_counts = [n(q, r) for q in range(size)]
        send_chunks = list(zip(np.cumsum([0] + send_counts[:-1]).tolist(), send_counts))
        recv_chunks = list(zip(np.cumsum([0] + recv_counts[:-1]).tolist(), recv_counts))
        out = np.full(sum(recv_counts), -1.0)
        s, k = send_chunks[r]
        out[recv_chunks[r][0]:recv_chunks[r][0] + k] = views[r][s:s + k]
        alltoall_shared_arrays(comm, (KEY, 8), views[r].nbytes, send_chunks, HostBuffer(out),
                               recv_chunks)
        return out

    for r, got in enumerate(run_ranks(size, rank_fn, shared=fabric)):
        expected = np.concatenate([np.full(n(q, r), 100.0 * q + r) for q in range(size)]
                                  or [np.zeros(0)])
        np.testing.assert_array_equal(got, expected)


def test_a_rank_without_a_shared_array_is_caught():
    fabric, views = shared([data(r, 10) for r in range(2)])

    def rank_fn(comm):
        if comm.rank == 0:
            allreduce_shared_arrays(comm, HostBuffer(views[0], add), (KEY, 8), BLOCK)
        else:  # publishes plain data where rank 0 expects a *where*
            comm.shared_step(np.zeros(32, np.uint8))

    with pytest.raises(AssertionError, match="not a shared array"):
        run_ranks(2, rank_fn, shared=fabric)
