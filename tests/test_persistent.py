"""Persistent collectives (``pg.allreduce_init`` ..., ``nc.all_reduce_init`` ...):
every collective at world sizes 1..4 over inproc and over shm (the arena's
one-step path included), started many times with new contents, interleaved
with ordinary calls; what a request refuses (a second start in flight, an
array that changed), sequence numbers, the flight recorder, mismatches,
shutdown with a start never waited for."""

from datetime import timedelta

import numpy as np
import pytest

import numcoll as nc
from numcoll.diagnostics import flight_recorder

from test_process_group import groups, on_ranks

pytestmark = pytest.mark.timeout(120)

SHM = pytest.mark.skipif("not __import__('transports').shm_available()")
TRANSPORTS = ["inproc", pytest.param("shm", marks=SHM)]
STARTS = 4


def close(pgs):
    for pg in pgs:
        pg.shutdown()


def starts(req, n=1):
    """Start ``req`` and wait for it, ``n`` times."""
    for _ in range(n):
        req.start()
        req.wait()


def value(rank, i, n, dtype=np.float32):
    return (np.arange(n) % 13 + 10 * rank + i).astype(dtype)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [1, 6, 5000])
def test_allreduce_init_many_starts(transport, size, n):
    pgs = groups(size, transport=transport, timeout=timedelta(seconds=30))
    try:
        def body(pg):
            x = np.zeros(n, np.float32)
            req = pg.allreduce_init(x)
            got = []
            for i in range(STARTS):
                x[...] = value(pg.rank(), i, n)
                work = req.start()
                assert isinstance(work, nc.Work)
                assert req.wait() is True and req.is_completed()
                assert work.result()[0] is x
                got.append(x.copy())
            return got, req.work.call.algorithm

        results = on_ranks(pgs, body)
        for i in range(STARTS):
            expected = sum(value(r, i, n) for r in range(size))
            for got, _ in results:
                np.testing.assert_array_equal(got[i], expected)
        if transport == "shm" and size > 1:
            assert {algo for _, algo in results} == {"shared"}
    finally:
        close(pgs)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_every_persistent_collective(transport, size):
    pgs = groups(size, transport=transport, timeout=timedelta(seconds=30))
    n = 7
    try:
        def body(pg):
            r = pg.rank()
            root = size - 1
            b = np.zeros(n)
            rd = np.zeros(n)
            ag_in, ag_out = np.zeros(n), np.zeros(n * size)
            rs_in, rs_out = np.zeros(n * size), np.zeros(n)
            a2a_in, a2a_out = np.zeros(2 * size), np.zeros(2 * size)
            reqs = dict(
                broadcast=pg.broadcast_init(b, root=root),
                reduce=pg.reduce_init(rd, nc.ReduceOptions(reduce_op=nc.ReduceOp.MAX,
                                                           root_rank=root)),
                allgather=pg.allgather_into_tensor_init(ag_out, ag_in),
                reduce_scatter=pg.reduce_scatter_tensor_init(rs_out, rs_in),
                alltoall=pg.alltoall_base_init(a2a_out, a2a_in),
                barrier=pg.barrier_init())
            for i in range(STARTS):
                b[...] = value(r, i, n, np.float64)
                rd[...] = value(r, i, n, np.float64)
                ag_in[...] = value(r, i, n, np.float64)
                rs_in[...] = value(r, i, n * size, np.float64)
                a2a_in[...] = 100 * r + np.arange(2 * size) + i
                for req in reqs.values():
                    req.start()
                for req in reqs.values():
                    req.wait()
                assert np.array_equal(b, value(root, i, n, np.float64))
                if r == root:
                    assert np.array_equal(rd, value(size - 1, i, n, np.float64))
                else:
                    assert np.array_equal(rd, value(r, i, n, np.float64))  # untouched
                assert np.array_equal(ag_out, np.concatenate(
                    [value(q, i, n, np.float64) for q in range(size)]))
                assert np.array_equal(rs_out, sum(value(q, i, n * size, np.float64)
                                                  for q in range(size))[r * n:(r + 1) * n])
                assert np.array_equal(a2a_out, np.concatenate(
                    [100 * q + np.arange(2 * r, 2 * r + 2) + i for q in range(size)]))
            return pg.sequence_number()

        assert set(on_ranks(pgs, body)) == {6 * STARTS}
    finally:
        close(pgs)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_module_functions(transport):
    def body():
        r, size = nc.get_rank(), nc.get_world_size()
        x = np.zeros(3, np.float32)
        reqs = [nc.all_reduce_init(x, op=nc.ReduceOp.MAX),
                nc.broadcast_init(y := np.zeros(2), src=1),
                nc.reduce_init(z := np.zeros(2), dst=0),
                nc.all_gather_into_tensor_init(ag := np.zeros(2 * size), np.full(2, float(r))),
                nc.reduce_scatter_tensor_init(rs := np.zeros(1), np.ones(size)),
                nc.all_to_all_single_init(a2a := np.zeros(size), np.full(size, float(r))),
                nc.barrier_init(timeout=timedelta(seconds=20))]
        x[...], y[...], z[...] = r, r, r + 1
        for req in reqs:
            req.start()
        for req in reqs:
            req.wait()
        return (x.tolist(), y.tolist(), z.tolist(), ag.tolist(), rs.tolist(), a2a.tolist(),
                repr(reqs[0]))

    out = nc.launch(body, 3, mode="thread", transport=transport, timeout=60)
    for r, (x, y, z, ag, rs, a2a, text) in enumerate(out):
        assert x == [2.0] * 3 and y == [1.0] * 2
        assert z == ([6.0] * 2 if r == 0 else [r + 1.0] * 2)
        assert ag == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0] and rs == [3.0] and a2a == [0.0, 1.0, 2.0]
        assert "allreduce" in text


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_interleaved_with_ordinary_and_async_calls(transport):
    """A start takes a sequence number like any call, so ordinary calls (on
    this thread, async, or from another thread) and starts mix freely."""
    pgs = groups(2, transport=transport, threads=2, timeout=timedelta(seconds=30))
    try:
        def body(pg):
            r = pg.rank()
            x = np.zeros(4, np.float32)
            req = pg.allreduce_init(x)
            y = np.zeros(4)
            for i in range(20):
                x[...] = r + i
                y[...] = r
                first = req.start()
                w = pg.allreduce(y)          # queued behind the start
                pg.barrier().wait()          # runs the held start if no one has
                w.wait()
                req.wait()
                assert first.is_completed()
                assert np.all(x == 2 * i + 1) and np.all(y == 1)
            return pg.sequence_number()

        assert on_ranks(pgs, body) == [60, 60]
    finally:
        close(pgs)


def test_start_while_in_flight_and_changed_arrays_are_refused_before_numbering():
    pgs = groups(2, timeout=timedelta(seconds=30))
    try:
        def body(pg):
            x = np.zeros((2, 3), np.float32)
            req = pg.allreduce_init(x)
            with pytest.raises(RuntimeError, match="wait.. before the first start"):
                req.wait()
            req.start()
            with pytest.raises(RuntimeError, match="still in flight"):
                req.start()
            req.wait()
            before = pg.sequence_number()
            x.shape = (3, 2)
            with pytest.raises(ValueError, match=r"allreduce_init: an array of this persistent "
                                                 r"request changed .*shape \(2, 3\)"):
                req.start()
            assert pg.sequence_number() == before  # refused before numbering
            x.shape = (2, 3)
            req.start()
            req.wait()
            return pg.sequence_number()

        assert on_ranks(pgs, body) == [2, 2]
    finally:
        close(pgs)


def test_foreign_arrays_are_checked_by_address():
    torch = pytest.importorskip("torch")
    pgs = groups(2, timeout=timedelta(seconds=30))
    try:
        def body(pg):
            t = torch.ones(4)
            req = pg.allreduce_init(t)
            starts(req)
            assert t.tolist() == [2.0] * 4
            t.set_(torch.zeros(4))  # new memory: the request would still write to the old
            with pytest.raises(ValueError, match="changed since it was made"):
                req.start()
            return True

        assert on_ranks(pgs, body) == [True, True]
    finally:
        close(pgs)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_flight_recorder_and_arguments_checked_at_init(transport):
    pgs = groups(2, transport=transport, timeout=timedelta(seconds=30))
    try:
        with pytest.raises(ValueError, match="invalid root rank"):
            pgs[0].broadcast_init(np.zeros(2), root=5)
        with pytest.raises(ValueError, match="Cannot use ReduceOp.BAND"):
            pgs[0].allreduce_init(np.zeros(2), op=nc.ReduceOp.BAND)

        def body(pg):
            x = np.zeros(2, np.float32)
            starts(pg.allreduce_init(x), 3)
            return [(e["collective_seq_id"], e["state"], e["profiling_name"])
                    for e in flight_recorder.dump(pg.rank())["entries"]
                    if e["pg_id"] == pg._pg_id]

        for entries in on_ranks(pgs, body):
            assert entries == [(i, "completed", "numcoll:all_reduce") for i in (1, 2, 3)]
    finally:
        close(pgs)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_mismatch_with_an_ordinary_call_fails_on_both_ranks(transport):
    pgs = groups(2, transport=transport, timeout=timedelta(seconds=20))
    try:
        def body(pg):
            if pg.rank() == 0:
                starts(pg.allreduce_init(np.zeros(4, np.float32)))
            else:
                pg.allreduce(np.zeros(4, np.float64)).wait()

        with pytest.raises(nc.CollectiveMismatchError, match="Detected mismatch"):
            on_ranks(pgs, body)
    finally:
        close(pgs)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_shutdown_with_a_start_never_waited_for(transport, no_leaked_threads):
    pgs = groups(2, transport=transport, timeout=timedelta(seconds=30))
    reqs = [pg.allreduce_init(np.zeros(3, np.float32)) for pg in pgs]
    works = [reqs[0].start()]  # rank 1 never starts it
    import time

    t0 = time.monotonic()
    close(pgs)
    assert time.monotonic() - t0 < 5
    with pytest.raises(nc.NumcollError, match="shut down"):
        works[0].wait(timeout=10)
    with pytest.raises(nc.NumcollError, match="shut down"):
        reqs[1].start()


def test_a_failed_publish_is_the_works_error():
    """A held start whose first half fails hands that error to its Work's run
    (it once raised NameError there: the except clause's name was gone)."""
    from numcoll.collectives.persistent import first_half

    def publish(comm):
        raise OSError("the arena went away")

    run = first_half(publish, None, lambda comm, work: "ran")
    with pytest.raises(OSError, match="the arena went away"):
        run(None, None)
    assert first_half(lambda comm: None, None, lambda comm, work: "ran")(None, None) == "ran"


def test_a_rank_outside_the_group_gets_none():
    def body():
        sub = nc.new_group([0])
        if nc.get_rank() == 0:
            return nc.all_reduce_init(np.ones(1), group=sub) is not None
        with pytest.warns(UserWarning, match="does not belong"):
            return nc.all_reduce_init(np.ones(1), group=sub)

    assert nc.launch(body, 2, mode="thread", timeout=60) == [True, None]


@pytest.mark.slow
@SHM
def test_processes_over_shm_with_avg_and_four_ranks():
    def body():
        r = nc.get_rank()
        x = np.zeros(10, np.float64)
        req = nc.all_reduce_init(x, op=nc.ReduceOp.AVG)
        out = []
        for i in range(50):
            x[...] = r * 0.1 + i
            req.start()
            req.wait()
            out.append(x.tobytes())
        return out, req.work.call.algorithm

    results = nc.launch(body, 4, mode="process", timeout=120)
    assert len({tuple(out) for out, _ in results}) == 1  # bitwise equal on every rank
    assert {algo for _, algo in results} == {"shared"}
    got = np.frombuffer(results[0][0][7], np.float64)
    np.testing.assert_allclose(got, sum(r * 0.1 + 7 for r in range(4)) / 4)
