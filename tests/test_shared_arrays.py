"""Shared arrays (``nc.empty_shared`` / ``zeros_shared``) end to end: every
collective that reads the other ranks' arrays in place, at world sizes 1..4
over shm (ranks as threads, and as processes), in place and out of place,
with blocks cut small (many pipelined steps); the size threshold; groups
without shared memory; what ranks that disagree get; lifetime, and nothing
left behind. The algorithms alone, at 1..33 ranks, are in
tests/test_algorithms_shared_arrays.py."""

import gc
import os
from datetime import timedelta

import numpy as np
import pytest

import numcoll as nc
from numcoll.memory import shared

from shm_leftovers import numcoll_entries as ours_in_dev_shm
from test_process_group import groups, on_ranks

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif("not __import__('transports').shm_available()")]

N = 5000  # float64: 40,000 bytes, above the threshold set below


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setenv("NUMCOLL_SHARED_ARRAYS_MIN_NBYTES", "4096")
    monkeypatch.setenv("NUMCOLL_SHARED_ARRAYS_BLOCK_NBYTES", "1024")


def shm_groups(size):
    return groups(size, transport="shm", timeout=timedelta(seconds=30))


def close(pgs):
    for pg in pgs:
        pg.shutdown()


def empty(pg, shape, dtype=np.float64):
    return shared.empty(pg.context.shared_memory, pg.rank(), shape, dtype)


def inputs(rank, n, dtype=np.float64):
    return (np.arange(n) % 101 + 1000 * rank + 0.5).astype(dtype)


def algorithms(pg, last):
    from numcoll.diagnostics import flight_recorder

    entries = [e for e in flight_recorder.dump(pg.rank())["entries"] if e["pg_id"] == pg._pg_id]
    return [e["algorithm"] for e in entries[-last:]]


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_every_collective_reads_the_peers_in_place(size):
    pgs = shm_groups(size)
    try:
        def body(pg):
            r, n = pg.rank(), N
            x = empty(pg, (n,))
            assert not x.any()  # the memory starts zeroed
            x[...] = inputs(r, n)
            pg.allreduce(x).wait()
            assert np.array_equal(x, sum(inputs(q, n) for q in range(size)))
            x[...] = inputs(r, n)
            pg.broadcast(x, root=size - 1).wait()
            assert np.array_equal(x, inputs(size - 1, n))
            x[...] = inputs(r, n)
            pg.reduce(x, nc.ReduceOptions(reduce_op=nc.ReduceOp.MAX, root_rank=0)).wait()
            assert np.array_equal(x, inputs(size - 1, n) if r == 0 else inputs(r, n))
            out = np.zeros(n * size)
            x[...] = inputs(r, n)
            pg.allgather_into_tensor(out, x).wait()
            assert np.array_equal(out, np.concatenate([inputs(q, n) for q in range(size)]))
            big = empty(pg, (n * size,))
            big[...] = inputs(r, n * size)
            mine = np.zeros(n)
            pg.reduce_scatter_tensor(mine, big).wait()
            total = sum(inputs(q, n * size) for q in range(size))
            assert np.array_equal(mine, total[r * n:(r + 1) * n])
            recv = np.zeros(n * size)
            big[...] = inputs(r, n * size)
            pg.alltoall_base(recv, big).wait()
            assert np.array_equal(recv, np.concatenate(
                [inputs(q, n * size)[r * n:(r + 1) * n] for q in range(size)]))
            return algorithms(pg, 6)

        expected = ["shared_arrays"] * 6 if size > 1 else None
        for got in on_ranks(pgs, body):
            if expected:
                assert got == expected
    finally:
        close(pgs)


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("dtype, op", [(np.float32, nc.ReduceOp.SUM),
                                       (np.int64, nc.ReduceOp.BXOR),
                                       (np.float64, nc.ReduceOp.AVG),
                                       (np.int32, nc.ReduceOp.MIN)])
def test_allreduce_dtypes_ops_and_bitwise_equal_results(size, dtype, op):
    pgs = shm_groups(size)
    n = 3001  # not divisible by the world size
    try:
        def body(pg):
            x = empty(pg, (n,), dtype)
            rng = np.random.default_rng(pg.rank())
            x[...] = (rng.standard_normal(n) * 1000).astype(dtype)
            ref = x.copy()
            pg.allreduce(x, op=op).wait()
            return ref, x.copy()

        results = on_ranks(pgs, body)
        refs = np.stack([ref for ref, _ in results])
        expected = {"SUM": refs.sum(0), "BXOR": np.bitwise_xor.reduce(refs) if
                    np.issubdtype(dtype, np.integer) else None,
                    "AVG": refs.sum(0) / size, "MIN": refs.min(0)}[op.name]
        for _, got in results:
            if np.issubdtype(dtype, np.integer):
                np.testing.assert_array_equal(got, expected)
            else:  # summed in another order than NumPy's: rounding differs
                np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-3)
            assert got.tobytes() == results[0][1].tobytes()  # bitwise, every rank
    finally:
        close(pgs)


def test_in_place_forms_and_aliased_outputs():
    size, n = 3, 3000
    pgs = shm_groups(size)
    try:
        def body(pg):
            r = pg.rank()
            # torch's in-place allgather: the input is this rank's block of the output
            out = empty(pg, (n * size,))
            out[r * n:(r + 1) * n] = inputs(r, n)
            pg.allgather_into_tensor(out, out[r * n:(r + 1) * n]).wait()
            assert np.array_equal(out, np.concatenate([inputs(q, n) for q in range(size)]))
            # in-place reduce_scatter: the output is this rank's share of the input
            big = empty(pg, (n * size,))
            big[...] = inputs(r, n * size)
            pg.reduce_scatter_tensor(big[r * n:(r + 1) * n], big).wait()
            total = sum(inputs(q, n * size) for q in range(size))
            assert np.array_equal(big[r * n:(r + 1) * n], total[r * n:(r + 1) * n])
            # alltoall whose output is its input: written only once no one reads it
            big[...] = inputs(r, n * size)
            pg.alltoall_base(big, big).wait()
            assert np.array_equal(big, np.concatenate(
                [inputs(q, n * size)[r * n:(r + 1) * n] for q in range(size)]))
            return algorithms(pg, 3)

        assert on_ranks(pgs, body) == [["shared_arrays"] * 3] * size
    finally:
        close(pgs)


def test_small_arrays_and_forced_algorithms_take_the_arena():
    pgs = shm_groups(2)
    try:
        def body(pg):
            small = empty(pg, (10,))
            small[...] = 1
            pg.allreduce(small).wait()
            x = empty(pg, (N,))
            x[...] = 1
            pg.allreduce(x, nc.AllreduceOptions(algorithm="shared_split")).wait()
            assert np.all(small == 2) and np.all(x == 2)
            return algorithms(pg, 2)

        assert on_ranks(pgs, body) == [["shared", "shared_split"]] * 2
    finally:
        close(pgs)


def test_persistent_requests_on_shared_arrays():
    pgs = shm_groups(2)
    try:
        def body(pg):
            x = empty(pg, (N,))
            req = pg.allreduce_init(x)
            for i in range(5):
                x[...] = pg.rank() + i
                req.start()
                req.wait()
                assert np.all(x == 2 * i + 1)
            return req.work.call.algorithm

        assert on_ranks(pgs, body) == ["shared_arrays"] * 2
    finally:
        close(pgs)


def test_groups_without_shared_memory_get_plain_arrays():
    def body():
        x = nc.empty_shared((4, 2), np.float32)
        z = nc.zeros_shared(3, "int64")
        x[...] = 1
        nc.all_reduce(x)
        return type(x).__name__, x.shape, float(x[0, 0]), z.tolist()

    assert nc.launch(body, 2, mode="thread", timeout=60) == [
        ("ndarray", (4, 2), 2.0, [0, 0, 0])] * 2


def test_bad_arguments_and_ranks_that_disagree():
    pgs = shm_groups(2)
    try:
        with pytest.raises(TypeError, match="empty_shared: invalid tensor type"):
            empty(pgs[0], 3, object)
        with pytest.raises(ValueError, match="negative dimensions"):
            empty(pgs[0], (-1,))

        def body(pg):
            return empty(pg, (10 + pg.rank(),))

        with pytest.raises(nc.NumcollError, match="allocates .* bytes, rank . .* same shape"):
            on_ranks(pgs, body)
    finally:
        close(pgs)


def test_a_shared_array_on_one_rank_and_a_plain_one_on_the_other_fails_on_both():
    pgs = shm_groups(2)
    try:
        arrays = on_ranks(pgs, lambda pg: empty(pg, (N,)))
        errors = []

        def body(pg):
            x = arrays[0] if pg.rank() == 0 else np.zeros(N)
            try:
                pg.allreduce(x).wait()
            except nc.NumcollError as exc:
                errors.append(str(exc))

        on_ranks(pgs, body)
        assert len(errors) == 2, errors
        assert all("Detected mismatch" in e and "shared arrays)" in e for e in errors), errors
    finally:
        close(pgs)


def test_lifetime_release_and_nothing_left_behind():
    fds_before = len(os.listdir("/proc/self/fd"))
    shm_before = ours_in_dev_shm()
    pgs = shm_groups(2)
    try:
        arrays = on_ranks(pgs, lambda pg: empty(pg, (N,)))
        memory = [pg.context.shared_memory for pg in pgs]
        assert [len(m) for m in memory] == [1, 1]
        views = [a[10:20] for a in arrays]
        del arrays
        gc.collect()
        assert [len(m) for m in memory] == [1, 1]  # a view keeps the array alive
        del views
        gc.collect()
        assert [len(m) for m in memory] == [0, 0]
        kept = on_ranks(pgs, lambda pg: empty(pg, (N,)))
    finally:
        close(pgs)
    kept[0][...] = 3  # after the group: ordinary memory, still this rank's own
    assert kept[0].sum() == 3 * N
    del kept
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) <= fds_before
    assert ours_in_dev_shm() <= shm_before


def _killed_with_shared_arrays():
    x = nc.empty_shared((1 << 18,), np.float32)
    x[...] = 1
    nc.all_reduce(x)
    if nc.get_rank() == 1:
        os.kill(os.getpid(), 9)
    nc.all_reduce(x)


@pytest.mark.slow
def test_processes_and_a_killed_rank_leave_nothing_behind():
    shm_before = ours_in_dev_shm()

    def body():
        x = nc.empty_shared((1 << 20,), np.float32)
        x[...] = nc.get_rank() + 1
        req = nc.all_reduce_init(x)
        for _ in range(3):
            req.start()
            req.wait()
        nc.broadcast(x, src=1)
        return float(x[0]), req.work.call.algorithm

    assert nc.launch(body, 4, mode="process", timeout=120) == [(10.0 * 16, "shared_arrays")] * 4
    with pytest.raises(nc.RankFailedError, match="rank 1"):
        nc.launch(_killed_with_shared_arrays, 2, mode="process", timeout=60,
                  group_timeout=timedelta(seconds=20))
    assert ours_in_dev_shm() <= shm_before
