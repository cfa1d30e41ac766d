"""Small calls as one fused arena step (numcoll.fast): a blocking call that
repeats, and persistent requests. Results against a NumPy reference at 1-5
ranks; every change to a repeated call (array, shape, layout, dtype, op,
writability, deadline) falls back to the ordinary path with its checks (or a
plan by form, tests/test_fast_forms.py); a
mismatch, a dead or missing peer, and calls interleaved with a held start are
handled as on the ordinary path; the flight recorder sees every call."""

import time
from datetime import timedelta

import numpy as np
import pytest

import numcoll as nc
from numcoll.diagnostics import flight_recorder
from numcoll.fast import FusedRequest

import benchmark_scripts
from test_process_group import groups, on_ranks

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif("not __import__('transports').shm_available()")]


def close(pgs):
    for pg in pgs:
        pg.shutdown()


def fused_runs(pg) -> int:
    """How many of the group's calls ran fused (their flight-recorder rows)."""
    recorder = flight_recorder.recorder()
    if recorder is None:
        return sum(int(fused.meta[0]) for fused in
                   [seen.fused for seen in pg.repeats._seen.values()] + pg.repeats.forms.plans())
    return sum(int(lane.meta[0]) for lane in recorder._lanes if lane.pg_id == pg._pg_id)


def value(rank, i, n, dtype):
    return ((np.arange(n) % 7) + 3 * rank + i + 1).astype(dtype)


REDUCE = {nc.ReduceOp.SUM: np.add, nc.ReduceOp.PRODUCT: np.multiply,
          nc.ReduceOp.MIN: np.minimum, nc.ReduceOp.MAX: np.maximum}


def logged_all_reduce(pg, log: list):
    """``call(arr, expect, op, fused)``: ``nc.all_reduce(arr, op)`` on ``pg``,
    its result checked against ``expect``; ``log`` gets whether the fused
    count moved by ``fused`` (1 or 0)."""
    def call(arr, expect, op=nc.ReduceOp.SUM, fused=False):
        before = fused_runs(pg)
        nc.all_reduce(arr, op=op, group=pg)
        np.testing.assert_array_equal(arr, expect)
        log.append(fused_runs(pg) - before == int(fused))

    return call


def reference(op, arrays):
    out = arrays[0].copy()
    for a in arrays[1:]:
        out = REDUCE[op](out, a)
    return out


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.uint8])
@pytest.mark.parametrize("op", list(REDUCE))
def test_a_repeated_all_reduce_runs_fused_and_agrees(size, dtype, op):
    pgs = groups(size, transport="shm", timeout=timedelta(seconds=30))
    n, calls = 3, 5
    try:
        def body(pg):
            x = np.zeros(n, dtype)
            got = []
            for i in range(calls):
                x[...] = value(pg.rank(), i, n, dtype)
                assert nc.all_reduce(x, op=op, group=pg) is None
                got.append(x.copy())
            return got, fused_runs(pg), pg.sequence_number()

        results = on_ranks(pgs, body)
        for i in range(calls):
            expected = reference(op, [value(r, i, n, dtype) for r in range(size)])
            for got, _, _ in results:
                np.testing.assert_array_equal(got[i], expected)
        for _, fused, seq in results:
            assert seq == calls
            assert fused == (calls - 2 if size > 1 else 0)  # the second call is learnt
    finally:
        close(pgs)


def test_results_are_bitwise_equal_on_every_rank():
    pgs = groups(4, transport="shm", timeout=timedelta(seconds=30))
    try:
        def body(pg):
            rng = np.random.default_rng(pg.rank())
            x = np.zeros(6, np.float32)
            out = []
            for _ in range(4):
                x[...] = rng.standard_normal(6).astype(np.float32) * 1e3
                nc.all_reduce(x, group=pg)
                out.append(x.tobytes())
            return out, fused_runs(pg)

        results = on_ranks(pgs, body)
        assert len({tuple(out) for out, _ in results}) == 1
        assert {fused for _, fused in results} == {2}
    finally:
        close(pgs)


def test_any_change_falls_back_to_the_full_checks():
    """Each change below takes the ordinary path (the fused count does not
    move) and gives the ordinary result or error; the unchanged call after it
    is fused again (once a second array of its form came by, through that
    form's plan: numcoll.fast.forms)."""
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=30))
    try:
        def body(pg):
            r = pg.rank()
            x = np.zeros(4, np.float32)
            log = []
            call = logged_all_reduce(pg, log)
            for _ in range(2):
                x[...] = r + 1
                call(x, np.full(4, 3, np.float32))  # seen, learnt, then ...
            x[...] = r + 1
            call(x, np.full(4, 3, np.float32), fused=True)  # ... runs fused
            y = np.full(4, r + 1, np.float32)  # an equal array, another object: the
            call(y, np.full(4, 3, np.float32))  # second of its form, which is planned now
            x[...] = r + 1
            call(x, np.full(4, 2, np.float32), op=nc.ReduceOp.MAX)  # another op
            x.shape = (2, 2)  # the same object, reshaped in place
            x[...] = r + 1
            call(x, np.full((2, 2), 3, np.float32))
            x.shape = (4,)
            for fused in (True, True, True):  # (x's plan is for (2, 2); its form's serves)
                x[...] = r + 1
                call(x, np.full(4, 3, np.float32), fused=fused)
            d = x.view(np.int32)  # another dtype (and object)
            d[...] = r + 1
            call(d, np.full(4, 3, np.int32))
            big = np.full(8, r + 1, np.float32)
            strided = big[::2]  # not contiguous: never fused
            for _ in range(3):
                strided[...] = r + 1
                call(strided, np.full(4, 3, np.float32))
            x[...] = r + 1
            x.flags.writeable = False  # read-only: refused as on the ordinary path
            with pytest.raises(ValueError, match="read-only|writable|writeable"):
                nc.all_reduce(x, group=pg)
            x.flags.writeable = True
            pg.set_timeout(timedelta(seconds=20))  # the stamp's deadline changed
            x[...] = r + 1
            call(x, np.full(4, 3, np.float32))
            return log, pg.sequence_number()

        for log, seq in on_ranks(pgs, body):
            assert all(log), [i for i, ok in enumerate(log) if not ok]
            assert seq == 14
    finally:
        close(pgs)


def test_a_mismatch_on_the_fused_path_fails_on_both_ranks():
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=20))
    try:
        def body(pg):
            x = np.ones(4, np.float32)
            for _ in range(3):
                nc.all_reduce(x, group=pg)
            if pg.rank() == 0:
                nc.all_reduce(x, group=pg)  # fused
            else:
                nc.all_reduce(np.ones(4, np.float64), group=pg)

        with pytest.raises(nc.CollectiveMismatchError, match="Detected mismatch"):
            on_ranks(pgs, body)
    finally:
        close(pgs)


def test_a_fused_persistent_start_against_a_barrier_is_a_mismatch():
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=20))
    try:
        def body(pg):
            req = pg.allreduce_init(np.ones(2, np.float32))
            assert isinstance(req, FusedRequest)
            if pg.rank() == 0:
                req.start()
                req.wait()
            else:
                pg.barrier().wait()

        with pytest.raises(nc.CollectiveMismatchError):
            on_ranks(pgs, body)
    finally:
        close(pgs)


def test_a_missing_peer_times_out_naming_it():
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=2))
    try:
        def body(pg):
            x = np.ones(2, np.float32)
            for _ in range(3):
                nc.all_reduce(x, group=pg)
            if pg.rank() == 0:
                nc.all_reduce(x, group=pg)  # rank 1 never comes

        with pytest.raises(nc.NumcollError, match="rank 1"):
            on_ranks(pgs, body)
        with pytest.raises(nc.NumcollError):  # the group is poisoned, as on the ordinary path
            pgs[0].allreduce(np.ones(2, np.float32)).wait()
    finally:
        close(pgs)


@pytest.mark.parametrize("size", [2, 3, 4])
def test_persistent_requests_fused(size):
    pgs = groups(size, transport="shm", timeout=timedelta(seconds=30))
    try:
        def body(pg):
            r = pg.rank()
            x, b = np.zeros(3, np.float64), np.zeros(5, np.int32)
            reqs = [pg.allreduce_init(x, op=nc.ReduceOp.MAX), pg.broadcast_init(b, root=size - 1),
                    pg.barrier_init()]
            assert all(isinstance(q, FusedRequest) for q in reqs)
            for i in range(6):
                x[...] = value(r, i, 3, np.float64)
                b[...] = value(r, i, 5, np.int32)
                for q in reqs:
                    work = q.start()
                    assert isinstance(work, nc.Work)
                    q.wait()
                    assert work.is_completed() and q.is_completed()
                np.testing.assert_array_equal(x, value(size - 1, i, 3, np.float64))
                np.testing.assert_array_equal(b, value(size - 1, i, 5, np.int32))
            assert reqs[0].result()[0] is x
            return [int(q._fused.meta[0]) for q in reqs], pg.sequence_number()

        for counts, seq in on_ranks(pgs, body):
            assert counts == [6, 6, 6] and seq == 18
    finally:
        close(pgs)


def test_a_held_start_is_promoted_by_any_other_call():
    """Between a fused start and its wait, another call (blocking, async, a
    barrier, a second request) makes the start an ordinary Work in flight;
    everything completes in order with the right values."""
    pgs = groups(2, transport="shm", threads=2, timeout=timedelta(seconds=30))
    try:
        def body(pg):
            r = pg.rank()
            x, y = np.zeros(2, np.float32), np.zeros(2, np.float32)
            a, b = pg.allreduce_init(x), pg.allreduce_init(y)
            for i in range(8):
                x[...], y[...] = r + i, 10 * r
                first = a.start()
                if i % 4 == 0:
                    w = pg.allreduce(z := np.full(3, r + 1.0))
                    w.wait()
                    assert z.tolist() == [3.0] * 3
                elif i % 4 == 1:
                    pg.barrier().wait()
                    assert first.is_completed()
                elif i % 4 == 2:
                    b.start()
                    b.wait()
                    assert y.tolist() == [10.0] * 2
                else:
                    nc.all_reduce(z := np.ones(1), group=pg)
                a.wait()
                assert first.is_completed() and a.work is not None
                assert x.tolist() == [2 * i + 1.0] * 2
            return pg.sequence_number()

        assert on_ranks(pgs, body) == [16, 16]
    finally:
        close(pgs)


def test_a_start_in_flight_and_a_changed_array_are_refused():
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=30))
    try:
        def body(pg):
            x = np.zeros(4, np.float32)
            req = pg.allreduce_init(x)
            req.start()
            with pytest.raises(RuntimeError, match="still in flight"):
                req.start()
            req.wait()
            x.shape = (2, 2)
            with pytest.raises(ValueError, match="changed since it was made"):
                req.start()
            x.shape = (4,)
            req.start()
            req.wait(timeout=10)
            return pg.sequence_number()

        assert on_ranks(pgs, body) == [2, 2]
    finally:
        close(pgs)


def test_a_start_waits_briefly_for_late_peers_and_wait_finishes_it():
    """A persistent start waits START_SPIN_NS at most: with the peer 0.3 s
    late it returns at once, not completed, and wait() finishes the call; the
    late peer's start, finding the other rank there, completes inside start()."""
    import time
    from numcoll.fast.step import START_SPIN_NS

    assert START_SPIN_NS <= 10_000
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=30))
    try:
        def body(pg):
            x = np.full(2, pg.rank() + 1.0, np.float32)
            req = pg.allreduce_init(x)
            if pg.rank() == 1:
                time.sleep(0.3)
            t0 = time.perf_counter()
            req.start()
            took, done = time.perf_counter() - t0, req.is_completed()
            req.wait()
            return took, done, x.tolist()

        (took0, done0, x0), (took1, done1, x1) = on_ranks(pgs, body)
        assert took0 < 0.1 and not done0  # returned long before its peer came
        assert done1  # its peer was there: done within start()
        assert x0 == x1 == [3.0, 3.0]
    finally:
        close(pgs)


@pytest.fixture
def fresh_recorder():
    flight_recorder._reset_for_tests(100)
    yield
    flight_recorder._reset_for_tests()


def test_the_flight_recorder_sees_every_fused_call(fresh_recorder):
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=30))
    try:
        def body(pg):
            x = np.ones(2, np.float32)
            for _ in range(4):
                nc.all_reduce(x, group=pg)
            req = pg.allreduce_init(x)
            for _ in range(3):
                req.start()
                req.wait()
            for _ in range(2):
                nc.barrier(group=pg)
            return pg._pg_id

        pg_ids = on_ranks(pgs, body)
    finally:
        close(pgs)
    dump = flight_recorder.dump(rank=0)
    mine = [e for e in dump["entries"] if e["pg_id"] == pg_ids[0]]
    assert [e["collective_seq_id"] for e in mine] == list(range(1, 10))
    assert [e["profiling_name"] for e in mine] == ["numcoll:all_reduce"] * 7 + \
        ["numcoll:barrier"] * 2
    for e in mine:
        assert e["state"] == "completed" and e["algorithm"] == "shared"
        assert e["time_created_ns"] <= e["time_started_ns"] <= e["time_completed_ns"]
    ids = [e["record_id"] for e in mine]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert dump["pg_status"][str(pg_ids[0])]["last_completed_collective"] == 9


def test_without_a_flight_recorder_the_fused_path_still_runs():
    flight_recorder._reset_for_tests(0)
    try:
        pgs = groups(2, transport="shm", timeout=timedelta(seconds=30))
        try:
            def body(pg):
                x = np.ones(2, np.float32)
                for _ in range(3):
                    nc.all_reduce(x, group=pg)
                return x.tolist(), fused_runs(pg)

            assert on_ranks(pgs, body) == [([8.0, 8.0], 1)] * 2
        finally:
            close(pgs)
    finally:
        flight_recorder._reset_for_tests()


@pytest.mark.parametrize("size", [2, 3, 4])
def test_repeated_broadcast_and_reduce_run_fused(size):
    pgs = groups(size, transport="shm", timeout=timedelta(seconds=30))
    try:
        def body(pg):
            r, root = pg.rank(), size - 1
            b, d = np.zeros(3, np.int32), np.zeros(4, np.float64)
            for i in range(4):
                b[...] = value(r, i, 3, np.int32)
                nc.broadcast(b, src=root, group=pg)
                np.testing.assert_array_equal(b, value(root, i, 3, np.int32))
                d[...] = value(r, i, 4, np.float64)
                nc.reduce(d, dst=1, op=nc.ReduceOp.SUM, group=pg)
                want = sum(value(q, i, 4, np.float64) for q in range(size)) if r == 1 \
                    else value(r, i, 4, np.float64)  # non-roots' arrays are left alone
                np.testing.assert_array_equal(d, want)
            req = pg.reduce_init(d, nc.ReduceOptions(reduce_op=nc.ReduceOp.MIN, root_rank=0))
            assert isinstance(req, FusedRequest)
            for i in range(3):
                d[...] = value(r, i, 4, np.float64)
                req.start()
                req.wait()
                np.testing.assert_array_equal(d, value(0, i, 4, np.float64) if r == 0
                                              else value(r, i, 4, np.float64))
            return fused_runs(pg), pg.sequence_number()

        assert on_ranks(pgs, body) == [(4 + 3, 11)] * size
    finally:
        close(pgs)


def test_eight_ranks():
    pgs = groups(8, transport="shm", timeout=timedelta(seconds=60))
    try:
        def body(pg):
            x = np.zeros(2, np.int64)
            out = []
            for i in range(3):
                x[...] = pg.rank() + i
                nc.all_reduce(x, group=pg)
                out.append(x.tolist())
                nc.barrier(group=pg)
            return out, fused_runs(pg)

        for out, fused in on_ranks(pgs, body):
            assert out == [[28 + 8 * i] * 2 for i in range(3)] and fused == 1 + 2
    finally:
        close(pgs)


def test_a_fresh_array_per_call_is_planned_once_by_its_form():
    """Code that allocates its array per call makes no plan per array (nor
    fills the flight recorder with lanes): the second array of a form plans
    that form, once, and later arrays of it run fused (numcoll.fast.forms)."""
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=30))
    try:
        def body(pg):
            for i in range(6):
                x = np.full(2, float(i), np.float32)
                nc.all_reduce(x, group=pg)
                assert x.tolist() == [2.0 * i] * 2
                del x
            return len(pg.repeats._seen), len(pg.repeats.forms.plans()), fused_runs(pg)

        assert on_ranks(pgs, body) == [(0, 1, 4)] * 2
    finally:
        close(pgs)


def test_a_fresh_input_beside_a_kept_output_makes_no_plan():
    """A new input each call (a fresh view, whose object may take the freed
    one's address and so its key) beside the same output: no plan is made
    for them, as none could serve a later call -- only arrays seen twice
    alive, every one of them, are planned. (Both run by their form's plan
    from the third call: numcoll.fast.forms.)"""
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=30))
    try:
        def body(pg):
            r = pg.rank()
            base = np.arange(4, dtype=np.float32) + 10 * r
            out = np.zeros(4, np.float32)
            for i in range(6):
                inp = base[:2]
                nc.all_gather_into_tensor(out, inp, group=pg)
                assert out.tolist() == [0, 1, 10, 11]
                del inp
                sent = base + i
                nc.all_to_all_single(out, sent, group=pg)
                assert out.tolist() == [2 * r + i, 2 * r + 1 + i, 10 + 2 * r + i, 11 + 2 * r + i]
                del sent
            repeats = pg.repeats
            return len(repeats._seen), len(repeats._replays), fused_runs(pg)

        assert on_ranks(pgs, body) == [(0, 0, 8)] * 2
    finally:
        close(pgs)


def test_a_started_handle_is_reused_only_when_nobody_holds_it():
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=30))
    try:
        def body(pg):
            x = np.ones(2, np.float32)
            req = pg.allreduce_init(x)
            first = req.start()
            req.wait()
            second = req.start()  # ``first`` is held: a new handle
            # (``second`` may have completed inside start() already: no claim on it)
            assert second is not first and first.is_completed() and first.seq == 1 \
                and second.seq == 2
            req.wait()
            assert second.is_completed() and second.result()[0] is x
            ident = id(second)
            del first, second
            req.start()
            req.wait()
            req.start()
            third = req.work
            req.wait()
            return third.is_completed(), third.seq, id(third) == ident

        assert on_ranks(pgs, body) == [(True, 4, True)] * 2
    finally:
        close(pgs)


def test_a_request_made_after_shutdown_fails_at_its_start():
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=30))
    close(pgs)
    req = pgs[0].allreduce_init(np.ones(2, np.float32))
    with pytest.raises(nc.NumcollError, match="shut down"):
        req.start()


@pytest.mark.slow
def test_the_arena_sync_benchmark_runs_both_barriers_to_the_end(capsys):
    """benchmarks/arena_sync.py (flat step against dissemination): every rank
    gets through every barrier of both kinds, at 2 and 3 ranks."""
    bench = benchmark_scripts.load("arena_sync")
    bench.main(["-n", "2", "-n", "3", "--steps", "200", "--runs", "1"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()
            if line.strip()[:1].isdigit()]
    assert [(r[0], r[1]) for r in rows] == [("2", "flat"), ("2", "dissemination"),
                                            ("3", "flat"), ("3", "dissemination")], rows


@pytest.mark.slow
def test_the_handoff_benchmark_hands_over_whole_buffers_both_ways(capsys):
    """benchmarks/handoff.py (plain against non-temporal stores): every handoff
    arrives whole (it raises otherwise) and each size gets both figures."""
    bench = benchmark_scripts.load("handoff")
    if bench.first_two_cpus() is None:
        pytest.skip("needs two CPUs")
    assert bench.main(["--sizes", "4K,64K", "--runs", "1"]) == 0
    (row,) = [line for line in capsys.readouterr().out.splitlines()
              if line.startswith("round trip")]
    cells = row.split("|")[1:]
    assert [c.split()[:2] for c in cells] == [["4", "KiB"], ["64", "KiB"]]
    for cell in cells:
        plain, nontemporal = (float(v) for v in cell.split()[2::2])
        assert plain > 0 and nontemporal > 0


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_small_calls_beside_mpi_benchmark_times_all_four_calls():
    """benchmarks/small_calls_mpi.py under mpirun: a row per call, each rank's
    median and the slower rank's, and no store file left behind."""
    import pathlib
    import re
    import subprocess
    import sys
    import tempfile

    from numcoll.bench import mpi

    if not mpi.mpi_available():
        pytest.skip("mpi4py with mpirun is not installed")
    path = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "small_calls_mpi.py"
    stores = set(pathlib.Path(tempfile.gettempdir()).glob("numcoll-store-*"))
    out = subprocess.run(["mpirun", "--allow-run-as-root", "-n", "2", "--bind-to", "none",
                          sys.executable, str(path), "--calls", "200", "--rounds", "2"],
                         capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stderr[-2000:]
    text = re.sub(r"\x1b\[[0-9;]*m", "", out.stdout)  # (mpirun colours some lines' starts)
    rows = {line[:26].strip(): line[26:].split() for line in text.splitlines()
            if line.startswith(("Open MPI", "numcoll"))}
    assert sorted(rows) == ["Open MPI allreduce 8 B", "Open MPI barrier",
                            "numcoll allreduce 8 B", "numcoll barrier"], out.stdout
    for cells in rows.values():
        slower, *ranks = (float(c) for c in cells)
        assert len(ranks) == 2 and 0 < min(ranks) and max(ranks) <= slower * 1.5
    assert set(pathlib.Path(tempfile.gettempdir()).glob("numcoll-store-*")) == stores


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_new_arrays_benchmark_times_every_collective_three_ways():
    """benchmarks/new_arrays.py under mpirun: a row per collective and size,
    the ordinary path, by form and Open MPI, each a positive time, and
    their ratio; no store file left. (How fast is the benchmark's to say,
    not a test's: under a parallel test run its ranks share the CPUs.)"""
    import pathlib
    import subprocess
    import sys
    import tempfile

    from numcoll.bench import mpi

    if not mpi.mpi_available():
        pytest.skip("mpi4py with mpirun is not installed")
    bench = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "new_arrays.py"
    stores = set(pathlib.Path(tempfile.gettempdir()).glob("numcoll-store-*"))
    out = subprocess.run(["mpirun", "--allow-run-as-root", "-n", "2", "--bind-to", "none",
                          sys.executable, str(bench), "--calls", "100", "--rounds", "2",
                          "--sizes", "8,4K"], capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split() for line in out.stdout.splitlines()
            if line.split() and line.split()[0] in bench_calls()]
    assert [(r[0], int(r[1])) for r in rows] == [(name, size) for size in (8, 4096)
                                                 for name in bench_calls()], out.stdout
    for name, _, ordinary, by_form, by_mpi, ratio in rows:
        assert min(float(ordinary), float(by_form), float(by_mpi)) > 0, name
        want = float(by_form) / float(by_mpi)  # (of the printed, rounded times)
        assert abs(float(ratio) - want) <= 0.01 + 0.01 * want, name
    assert set(pathlib.Path(tempfile.gettempdir()).glob("numcoll-store-*")) == stores


def bench_calls() -> tuple:
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "new_arrays.py"
    spec = importlib.util.spec_from_file_location("new_arrays", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CALLS


def test_the_module_functions_take_their_parameters_in_every_form_on_the_default_group():
    """The default group's busiest case (a call that waits, no group named) runs
    fused however its arguments are passed -- positional, by keyword, or the
    defaults spelled out -- while ``async_op=True`` and a named group take
    their own paths, and wrong arguments are refused with the collective's name."""
    def body():
        pg = nc.get_default_group()
        r = pg.rank()
        x = np.zeros(2, np.float32)
        forms = [lambda: nc.all_reduce(x), lambda: nc.all_reduce(x, nc.ReduceOp.SUM),
                 lambda: nc.all_reduce(tensor=x), lambda: nc.all_reduce(x, op=nc.ReduceOp.SUM),
                 lambda: nc.all_reduce(x, nc.ReduceOp.SUM, None, False),
                 lambda: nc.all_reduce(x, group=pg)]
        for i, form in enumerate(forms * 2):
            x[...] = r + i
            assert form() is None
            assert x.tolist() == [2.0 * i + 1] * 2
        fused = fused_runs(pg)
        x[...] = 1
        work = nc.all_reduce(x, async_op=True)
        assert isinstance(work, nc.Work) and work.wait() and x.tolist() == [2.0, 2.0]
        for _ in range(3):
            nc.barrier()
        nc.barrier(None, False, None, None)
        nc.barrier(timeout=timedelta(seconds=20))
        errors = []
        for bad in (lambda: nc.all_reduce(), lambda: nc.all_reduce(x, bogus=1),
                    lambda: nc.barrier(1, 2, 3, 4, 5)):
            with pytest.raises(TypeError) as info:
                bad()
            errors.append(str(info.value))
        return fused, fused_runs(pg) - fused, errors

    results = nc.launch(body, 2, mode="thread", transport="shm", timeout=60)
    for fused, after, errors in results:
        # every form of the call on one array, the first two learnt
        assert fused == 2 * 6 - 2
        assert after >= 2  # the barriers repeated (the async call is not fused)
        assert all(e.startswith(("all_reduce()", "barrier()")) for e in errors), errors


def test_a_repeated_rooted_call_translates_its_global_root_on_every_call():
    """The repeat path keeps what it translated of a global ``src``/``dst``
    (the group's ranks are fixed): on a sub-group the root is still the
    group rank of that global rank on every repeat, a root outside the group
    is refused every time, and ``group_src`` names a group rank as before."""
    def body():
        r = nc.get_rank()
        g = nc.new_group([1, 3])
        if r not in (1, 3):
            return None
        x = np.zeros(3, np.int32)
        whole = np.zeros((2, 3), np.int32)
        blocks = list(whole) if r == 3 else None
        for i in range(4):
            x[...] = 10 * r + i
            nc.broadcast(x, src=3, group=g)
            assert x.tolist() == [30 + i] * 3
            x[...] = 10 * r + i
            nc.broadcast(x, group=g, group_src=0)  # group rank 0: global rank 1
            assert x.tolist() == [10 + i] * 3
            x[...] = 10 * r + i
            nc.gather(x, blocks, dst=3, group=g)
            if r == 3:
                assert whole.tolist() == [[10 + i] * 3, [30 + i] * 3]
        refused = []
        for _ in range(2):
            with pytest.raises(ValueError) as info:
                nc.broadcast(x, src=2, group=g)
            refused.append(str(info.value))
        return fused_runs(g), refused

    results = nc.launch(body, 4, mode="thread", transport="shm", timeout=60)
    assert results[0] is None and results[2] is None
    for fused, refused in (results[1], results[3]):
        assert fused == 3 * (4 - 2)  # every call from its third on
        assert refused == ["src rank 2 is not part of the group [1, 3]"] * 2


def test_the_groups_words_say_when_a_fused_call_may_run():
    """The word the compiled step checks (``GROUP_BLOCKED``) is set while a
    call is in flight or held and once the group is poisoned or closed, and
    clear otherwise; the number it claims from is the group's
    (``sequence_number``), fused and ordinary calls alike."""
    from numcoll.collectives.fused_step import GROUP_BLOCKED

    pgs = groups(2, transport="shm", threads=2, timeout=timedelta(seconds=30))
    try:
        def body(pg):
            blocked = []
            x = np.zeros(2, np.float32)
            for _ in range(4):
                nc.all_reduce(x, group=pg)  # fused from the third on
            blocked.append(pg._word[GROUP_BLOCKED])
            if pg.rank() == 1:
                time.sleep(0.2)  # rank 0's call stays in flight meanwhile
            work = pg.allreduce(np.ones(3))
            if pg.rank() == 0:
                blocked.append(pg._word[GROUP_BLOCKED])
            work.wait()
            nc.all_reduce(x, group=pg)
            blocked.append(pg._word[GROUP_BLOCKED])
            req = pg.allreduce_init(x)
            req.start()  # fused; held if the peer is not there within 3 us
            held = pg._fast_held is not None
            blocked.append(pg._word[GROUP_BLOCKED] == held)
            req.wait()
            blocked.append(pg._word[GROUP_BLOCKED])
            return blocked, pg.sequence_number(), fused_runs(pg)

        zero, one = on_ranks(pgs, body)
        assert zero[0] == [0, 1, 0, True, 0] and one[0] == [0, 0, True, 0]
        for blocked, seq, fused in (zero, one):
            assert seq == 4 + 1 + 1 + 1 and fused >= 3
        pgs[0].abort("test")
        pgs[1].shutdown()
        assert pgs[0]._word[GROUP_BLOCKED] == 1 and pgs[1]._word[GROUP_BLOCKED] == 1
    finally:
        close(pgs)


def test_a_fused_call_claimed_on_another_thread_goes_first():
    """A fused call runs without the group's lock: between its compiled claim
    and the group holding it (``GROUP_CLAIMED``), no other fused call is taken
    and a call of another thread waits (``settle``) instead of overtaking
    it; once the claiming thread holds it, everything completes in order."""
    import threading

    from numcoll.collectives.fused_step import GROUP_CLAIMED, NOT_TAKEN

    pgs = groups(2, transport="shm", threads=2, timeout=timedelta(seconds=30))
    try:
        def body(pg):
            for _ in range(4):
                nc.barrier(group=pg)
            fused = pg.repeats.default_barrier
            got = fused._start(fused.address, fused.x, 0)  # the claim; no wait
            claimed = got != -1
            seen = {"claimed": pg._word[GROUP_CLAIMED] == claimed}
            if claimed:  # (else this rank found its peer there: done, let go)
                seen["no second claim"] = fused._start(fused.address, fused.x, 0) == NOT_TAKEN
            done = []
            z = np.full(3, pg.rank() + 1.0)
            other = threading.Thread(target=lambda: done.append(pg.allreduce(z).wait()))
            other.start()
            time.sleep(0.2)
            seen["waited"] = not done if claimed else True
            if claimed:
                fused.hold(got)
            other.join(10)
            seen["after"] = not other.is_alive() and z.tolist() == [3.0] * 3
            return seen, pg.sequence_number()

        for seen, seq in on_ranks(pgs, body):
            assert all(seen.values()), seen
            assert seq == 4 + 1 + 1
    finally:
        close(pgs)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_small_calls_benchmark_times_every_layer(capsys):
    """benchmarks/small_calls.py: a time for every layer of the small call,
    the compiled step's included (which runs the fused start by hand and must
    let go of its claim, or every later call of the group waits)."""
    bench = benchmark_scripts.load("small_calls")
    bench.main(["--calls", "400", "--runs", "1"])
    out = capsys.readouterr().out
    rows = {name: out.split(name, 1)[1].split()[:2] for name in bench.ROWS if name in out}
    assert sorted(rows) == sorted(bench.ROWS), out
    assert all(float(median) > 0 for median, _ in rows.values()), out


def _crowded_body(size):
    from numcoll.api.world import get_default_group

    pg = get_default_group()
    x = np.zeros(2, np.float32)
    for _ in range(4):
        nc.barrier()
    right = True
    for i in range(6):
        x[...] = pg.rank() + i
        nc.all_reduce(x)
        right = right and x.tolist() == [sum(range(size)) + size * i] * 2
    return pg.repeats.default_barrier.spin_ns, fused_runs(pg), right


def test_a_crowded_groups_fused_start_polls_with_yields_instead_of_returning_at_once():
    """Where a group has more ranks than CPUs its arena does not spin, and a
    fused call's start polls with ``sched_yield`` for CROWDED_WAIT_NS instead
    of returning at once (which sent every call down the held path); an
    uncrowded group's start busy-polls its spin phase, and one whose peers are
    threads of this process looks once (holding the GIL, it would keep them
    from arriving)."""
    from numcoll.collectives.fused_step import ROWS, SPIN, _start_phases
    from numcoll.fast.step import CROWDED_WAIT_NS
    from transports.shm.transport import _usable_cpus

    plan = np.zeros(ROWS, np.int64)
    plan[SPIN] = 5000
    assert _start_phases(plan, 100, 5000) == (5100, 5100)  # busy-polls, then returns
    plan[SPIN] = 0
    assert _start_phases(plan, 100, CROWDED_WAIT_NS) == (100, 100 + CROWDED_WAIT_NS)
    pgs = groups(2, transport="shm", threads=2, timeout=timedelta(seconds=30))
    try:
        def threads(pg):
            for _ in range(4):
                nc.barrier(group=pg)
            return pg.repeats.default_barrier.spin_ns

        assert on_ranks(pgs, threads) == [0, 0]
    finally:
        close(pgs)
    size = _usable_cpus() + 1
    if size > 5:
        pytest.skip("a crowded group of processes here would take more than 5 ranks")
    for spin, fused, right in nc.launch(_crowded_body, size, args=(size,), mode="process",
                                        timeout=90):
        assert spin == CROWDED_WAIT_NS and fused >= 4 and right


def test_a_claim_never_handed_over_fails_the_next_call_at_the_deadline_naming_it():
    """A fused claim whose thread never hands it to the group (killed between
    the two) leaves every later call waiting on it: that wait ends at the
    group's deadline with an error naming the call, the rank and the number;
    shutdown() gives up on it and closes."""
    from numcoll.collectives.fused_step import GROUP_CLAIMED, GROUP_SEQ

    (pg,) = groups(1, timeout=timedelta(seconds=0.5))
    try:
        # (what a claim of collective #1 leaves until hold(): the number taken)
        pg._word[GROUP_SEQ], pg._word[GROUP_CLAIMED] = 2, 1
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"allreduce on rank 0 waited 0.5 s for "
                                               r"collective #1, which a fused call"):
            pg.allreduce(np.ones(2)).wait()
        assert 0.4 < time.monotonic() - started < 10
        pg._word[GROUP_CLAIMED] = 0  # (as hold() does)
        assert pg.allreduce(np.ones(2)).wait()  # the group is usable again
        pg._word[GROUP_CLAIMED] = 1
        pg.shutdown()  # gives up on it within the deadline and closes all the same
        assert pg._closed
    finally:
        pg.shutdown()
