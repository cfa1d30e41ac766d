"""Ranks that disagree on a call never exchange data: every message carries the
call's fingerprint (collective, dtype, element count, op, root), a receiver
checks it before touching the bytes, and the ranks fail with torch's DETAIL
wording, naming both sides, instead of returning wrong data or hanging."""

import time
from datetime import timedelta

import numpy as np
import pytest

import numcoll as nc
from numcoll.call import Call, describe_stamp

from test_process_group import groups

pytestmark = pytest.mark.timeout(60)

TIMEOUT = timedelta(seconds=20)  # far above what detection takes: a timeout here is a failure


def run_pair(calls, world_size=2, transport="inproc"):
    """Run calls[r](pg) on rank r concurrently; return (results, errors) by rank."""
    return run_on(groups(world_size, timeout=TIMEOUT, transport=transport), calls)


def run_on(pgs, calls):
    """Run calls[r](pgs[r]) on rank r concurrently, then shut the groups down;
    return (results, errors, seconds elapsed), by rank."""
    import threading

    results, errors = [None] * len(pgs), [None] * len(pgs)

    def body(r):
        try:
            results[r] = calls[r](pgs[r])
        except BaseException as exc:  # noqa: BLE001
            errors[r] = exc

    threads = [threading.Thread(target=body, args=(r,)) for r in range(len(pgs))]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    elapsed = time.monotonic() - start
    for pg in pgs:
        pg.shutdown()
    return results, errors, elapsed


def f32(n=4, v=1.0):
    return np.full(n, v, np.float32)


# (label, rank 0's call, rank 1's call, what rank 0's message says about rank 1)
CASES = [
    ("dtype", lambda pg: pg.allreduce(f32()).wait(),
     lambda pg: pg.allreduce(np.ones(4, np.float64)).wait(), "allreduce(float64, 4 elements, SUM)"),
    ("count", lambda pg: pg.allreduce(f32(4)).wait(),
     lambda pg: pg.allreduce(f32(5)).wait(), "allreduce(float32, 5 elements, SUM)"),
    ("op", lambda pg: pg.allreduce(f32()).wait(),
     lambda pg: pg.allreduce(f32(), op=nc.ReduceOp.MAX).wait(), "allreduce(float32, 4 elements, MAX)"),
    ("collective", lambda pg: pg.allreduce(f32()).wait(),
     lambda pg: pg.allgather([[f32(), f32()]], [f32()]).wait(), "allgather(float32, 4 elements)"),
    ("barrier vs allreduce", lambda pg: pg.allreduce(f32()).wait(),
     lambda pg: pg.barrier().wait(), "barrier()"),
    ("broadcast vs reduce", lambda pg: pg.broadcast(f32(), root=1).wait(),
     lambda pg: pg.reduce(f32(), nc.ReduceOptions(root_rank=0)).wait(),
     "reduce(float32, 4 elements, SUM, root 0)"),
    ("big dtype", lambda pg: pg.allreduce(f32(1 << 18)).wait(),
     lambda pg: pg.allreduce(np.ones(1 << 18, np.int32)).wait(),
     "allreduce(int32, 262144 elements, SUM)"),
    ("send/recv dtype", lambda pg: pg.recv([f32()], 1).wait(),
     lambda pg: pg.send([np.ones(4, np.int32)], 0).wait(), "p2p(int32, 4 elements)"),
]


@pytest.mark.parametrize("transport", ["inproc", "tcp", "ipc", "shm"])
@pytest.mark.parametrize("label,call0,call1,theirs", CASES, ids=[c[0] for c in CASES])
def test_a_mismatch_fails_at_once_naming_both_sides(label, call0, call1, theirs, transport):
    results, errors, elapsed = run_pair([call0, call1], transport=transport)
    assert elapsed < 10, f"{label}: took {elapsed:.1f}s: a timeout, not a detection"
    mismatches = [e for e in errors if isinstance(e, nc.CollectiveMismatchError)]
    assert mismatches, f"{label}: no rank detected the mismatch: {errors}"
    for e in errors:
        assert not isinstance(e, nc.CollectiveTimeoutError), e
    first = mismatches[0]
    msg = str(first)
    assert msg.startswith("Detected mismatch between collectives on ranks. Rank ")
    if errors[0] is first:
        assert f"but rank 1 is running {theirs}" in msg


def test_no_rank_returns_data_from_a_mismatched_call():
    # rank 1 sends a float64 allreduce; rank 0's float32 result must not be written
    def r0(pg):
        x = np.arange(4, dtype=np.float32)
        try:
            pg.allreduce(x).wait()
        finally:
            r0.after = x.copy()

    results, errors, _ = run_pair([r0, lambda pg: pg.allreduce(np.ones(4, np.float64)).wait()])
    assert all(e is not None for e in errors), errors
    assert np.array_equal(r0.after, np.arange(4, dtype=np.float32))


def test_after_a_mismatch_the_group_is_poisoned_everywhere():
    def body(pg):
        x = f32() if pg.rank() == 0 else np.ones(4, np.float64)
        with pytest.raises(nc.NumcollError):
            pg.allreduce(x).wait()
        with pytest.raises(nc.NumcollError, match="unusable|shut down|aborted"):
            pg.allreduce(f32()).wait()

    results, errors, _ = run_pair([body, body])
    assert errors == [None, None], errors


def test_stamp_round_trip_and_summary():
    call = Call("allreduce", 1.0, np.dtype(np.float32), 4, op="SUM")
    assert call.summary(12) == "allreduce(float32, 4 elements, SUM) #12"
    assert describe_stamp(call.stamp, 12) == call.summary(12)
    bc = Call("broadcast", 1.0, nc.bfloat16, 1, root=3)
    assert describe_stamp(bc.stamp) == "broadcast(bfloat16, 1 element, root 3)"
    assert describe_stamp(b"junk").startswith("an unknown call")
    # a send and a receive of the same array stamp alike
    assert Call("send", 1.0, np.dtype("i8"), 3).stamp == Call("recv_anysource", 2.0,
                                                                 np.dtype("i8"), 3).stamp
