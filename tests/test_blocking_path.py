"""Blocking module-level calls (``async_op=False``) run on the calling thread
when their group has nothing in flight, and behave as queued work does
otherwise: the same sequence numbers, results, errors, poisoning and
flight-recorder records."""

import threading
import time

import numpy as np
import pytest

import numcoll as nc
from numcoll.comm import Comm
from numcoll.memory.host import HostSteps
from numcoll.diagnostics import flight_recorder as fr
from numcoll.process_group import ProcessGroup
from numcoll.work import Work

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def fresh_recorder():
    fr._reset_for_tests(100)
    yield
    fr._reset_for_tests()


@pytest.fixture
def where_work_runs(monkeypatch):
    """Spy on every group: ``ran`` lists (op, seq, thread id) of each work run,
    ``queued`` (op, seq) of each work put on a queue."""
    log = {"ran": [], "queued": []}
    execute, queued = ProcessGroup._execute, Work._queued

    def spy_execute(pg, work, run):
        log["ran"].append((work.op_name, work.seq, threading.get_ident()))
        return execute(pg, work, run)

    def spy_queued(work, run_it, run):
        log["queued"].append((work.op_name, work.seq))
        return queued(work, run_it, run)

    monkeypatch.setattr(ProcessGroup, "_execute", spy_execute)
    monkeypatch.setattr(Work, "_queued", spy_queued)
    return log


def _world_of_one():
    nc.init_process_group("gloo", store=nc.HashStore(), rank=0, world_size=1)
    return nc.get_default_group()


def test_blocking_calls_run_on_the_caller_without_a_queue(where_work_runs):
    def body():
        rank, size = nc.get_rank(), nc.get_world_size()
        me = threading.get_ident()
        x, y, z = np.full(3, rank + 1.0), np.full(2, float(rank)), np.ones(2)
        parts, flat, share = [np.empty(1) for _ in range(size)], np.empty(size), np.empty(1)
        nc.all_reduce(x)
        nc.broadcast(y, src=1)
        nc.reduce(z, dst=0)
        nc.all_gather(parts, np.array([rank * 1.0]))
        nc.all_gather_into_tensor(flat, np.array([rank * 1.0]))
        nc.reduce_scatter_tensor(share, np.ones(size))
        nc.barrier()
        nc.monitored_barrier()
        mine = [(op, seq) for op, seq, tid in where_work_runs["ran"] if tid == me]
        return (x.tolist(), y.tolist(), z.tolist() if rank == 0 else None,
                [p[0] for p in parts], flat.tolist(), share.tolist(), mine)

    results = nc.launch(body, 2, mode="thread", timeout=60)
    ops = ["allreduce", "broadcast", "reduce", "allgather", "allgather_into_tensor",
           "reduce_scatter_tensor", "barrier", "monitored_barrier"]
    for rank, (x, y, z, parts, flat, share, mine) in enumerate(results):
        assert x == [3.0] * 3 and y == [1.0, 1.0] and parts == [0.0, 1.0]
        assert flat == [0.0, 1.0] and share == [2.0]
        assert z == ([2.0, 2.0] if rank == 0 else None)
        # Every collective ran on the rank's own thread, numbered in call order.
        assert mine == [(op, seq) for seq, op in enumerate(ops, 1)]
    assert where_work_runs["queued"] == []


def test_async_op_still_queues(where_work_runs):
    pg = _world_of_one()
    try:
        x = np.ones(4)
        work = nc.all_reduce(x, async_op=True)
        assert isinstance(work, nc.Work)
        work.wait()
        assert where_work_runs["queued"] == [("allreduce", 1)]
        assert nc.all_reduce(x) is None
        assert where_work_runs["queued"] == [("allreduce", 1)]
        assert pg.sequence_number() == 2
    finally:
        nc.destroy_process_group()


def test_blocking_call_queues_behind_work_in_flight(where_work_runs, fresh_recorder):
    pgs = {}

    def body():
        rank = nc.get_rank()
        pg = pgs.setdefault(rank, nc.get_default_group())
        a, b = np.full(4, rank + 1.0), np.full(4, 10.0 * (rank + 1))
        if rank == 0:
            first = nc.all_reduce(a, async_op=True)  # in flight until rank 1 joins
            nc.all_reduce(b)                          # so this one is queued behind it
            first.wait()
        else:
            # Join only once rank 0 has numbered both calls: its first is then
            # certainly in flight when its second is made.
            deadline = time.monotonic() + 30
            while (0 not in pgs or pgs[0].sequence_number() < 2) and \
                    time.monotonic() < deadline:
                time.sleep(0.001)
            nc.all_reduce(a)
            nc.all_reduce(b)
        return a.tolist(), b.tolist(), pg.sequence_number()

    results = nc.launch(body, 2, mode="thread", timeout=60)
    assert results == [([3.0] * 4, [30.0] * 4, 2)] * 2
    # Rank 0's blocking call was queued: its first call was still in flight.
    assert ("allreduce", 2) in where_work_runs["queued"]
    entries = [e for e in nc.flight_recorder.dump()["entries"] if e["rank"] == 0]
    assert [(e["collective_seq_id"], e["state"]) for e in entries] == [(1, "completed"),
                                                                      (2, "completed")]


def _failing_run(monkeypatch):
    """Make every host collective fail while it runs (after its call was accepted)."""
    def boom(steps, arrays):
        raise RuntimeError("boom while running")

    monkeypatch.setattr(HostSteps, "work_buffer", boom)
    # As a failure after messages left the rank: in a world of one nothing
    # leaves, and a failure before anything left the rank does not poison the
    # group (ranks that all fail alike are still in step: test_mismatch_hidden).
    monkeypatch.setattr(Comm, "alone", lambda self, exc: False)


def _fail_once(call):
    """Run ``call`` on a fresh group of one; what it raised, what the group says
    next, and the flight recorder's entry."""
    fr._reset_for_tests(100)
    pg = _world_of_one()
    try:
        with pytest.raises(RuntimeError) as failed:
            call(pg)
        with pytest.raises(nc.GroupPoisonedError) as poisoned:
            nc.all_reduce(np.ones(1))
        (entry,) = [e for e in nc.flight_recorder.dump()["entries"]
                    if e["profiling_name"] == "numcoll:all_reduce"]
        return failed.value, str(poisoned.value), entry
    finally:
        nc.destroy_process_group()
        fr._reset_for_tests()


def test_a_failure_on_the_caller_is_the_queued_failure(monkeypatch, where_work_runs):
    _failing_run(monkeypatch)
    x = np.ones(3)
    queued = _fail_once(lambda pg: pg.allreduce(x).wait())
    assert where_work_runs["queued"] == [("allreduce", 1)]
    where_work_runs["ran"].clear()
    here = _fail_once(lambda pg: nc.all_reduce(x))
    assert where_work_runs["queued"] == [("allreduce", 1)]  # nothing more was queued
    assert [tid for op, _, tid in where_work_runs["ran"]][0] == threading.get_ident()

    for (error, poisoned, entry) in (queued, here):
        assert type(error) is RuntimeError and str(error) == "boom while running"
        assert "allreduce (collective #1) failed on rank 0: boom while running" in poisoned
        assert entry["state"] == "failed" and entry["error"] == "boom while running"
        assert entry["collective_seq_id"] == 1
        assert entry["time_created_ns"] <= entry["time_started_ns"] <= \
            entry["time_completed_ns"]
    assert queued[1] == here[1]
    same = ("profiling_name", "input_sizes", "input_dtypes", "output_sizes", "output_dtypes",
            "algorithm", "nbytes", "op", "root", "timeout_ms")
    assert {k: queued[2][k] for k in same} == {k: here[2][k] for k in same}


def test_argument_errors_take_no_number_and_leave_the_flag_clear():
    pg = _world_of_one()
    try:
        with pytest.raises(ValueError, match="unknown algorithm"):
            pg.allreduce(np.ones(2), nc.AllreduceOptions(algorithm="nope"))
        with pytest.raises(TypeError, match="invalid tensor type"):
            nc.all_reduce("not an array")
        assert pg.sequence_number() == 0
        # The refused blocking call left nothing behind: the next async call is async.
        work = pg.allreduce(np.ones(2))
        assert isinstance(work, nc.Work) and work.wait()
        assert pg.sequence_number() == 1
    finally:
        nc.destroy_process_group()


def test_repeated_calls_reuse_their_plan_but_not_stale_settings():
    from datetime import timedelta

    pg = _world_of_one()
    try:
        x = np.ones(4, np.float32)
        nc.all_reduce(x)
        nc.all_reduce(x, op=nc.ReduceOp.MAX)
        pg.set_timeout(timedelta(seconds=7))
        nc.all_reduce(x)
        nc.all_reduce(x.reshape(2, 2))
        entries = nc.flight_recorder.dump(0)["entries"][-4:]
        assert [e["op"] for e in entries] == ["SUM", "MAX", "SUM", "SUM"]
        assert [e["timeout_ms"] for e in entries][2:] == [7000, 7000]
        assert entries[3]["input_sizes"] == [[2, 2]]
    finally:
        nc.destroy_process_group()
