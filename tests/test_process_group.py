"""ProcessGroup behaviour beyond the collectives' arithmetic: sequencing,
deadlines, failures, poisoning, shutdown, futures. Ranks are threads unless a
test says otherwise."""

import threading
import time
from datetime import timedelta

import numpy as np
import pytest

import numcoll as nc

pytestmark = pytest.mark.timeout(120)


def groups(world_size, **opts):
    """world_size ProcessGroups over one HashStore, built concurrently (each
    constructor waits for its peers' addresses). ``transport`` may be a name
    or a factory. If a constructor fails, the groups made are shut down and
    its error is raised."""
    store = nc.HashStore(timeout=30)
    out, errors = [None] * world_size, []
    transport = opts.pop("transport", "inproc")

    def make(r):
        try:
            out[r] = nc.ProcessGroup(store, r, world_size,
                                     nc.ProcessGroup.Options(transport=transport, **opts))
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=make, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        for pg in out:
            if pg is not None:
                pg.shutdown()
        raise errors[0]
    return out


def on_ranks(pgs, fn):
    """Run fn(pg) on every group concurrently; return results (re-raise the first error)."""
    results, errors = [None] * len(pgs), []

    def body(i):
        try:
            results[i] = fn(pgs[i])
        except BaseException as exc:  # noqa: BLE001
            errors.append((i, exc))

    threads = [threading.Thread(target=body, args=(i,)) for i in range(len(pgs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0][1]
    return results


def test_futures_value_then_and_callbacks(no_leaked_threads):
    pgs = groups(2)
    try:
        def body(pg):
            x = np.array([pg.rank() + 1.0], np.float32)
            work = pg.allreduce(x)
            fut = work.get_future()
            doubled = fut.then(lambda f: f.value()[0] * 2)
            seen = []
            fut.add_done_callback(lambda f: seen.append(f.done()))
            assert work.wait() is True
            assert work.is_completed() and work.is_success() and work.exception() is None
            assert fut.value()[0] is x and work.result()[0] is x
            assert doubled.wait()[0] == 6.0
            assert seen == [True]
            return True
        assert on_ranks(pgs, body) == [True, True]
    finally:
        for pg in pgs:
            pg.shutdown()


def test_a_future_wakes_every_waiter_whenever_they_came():
    """Waiters that came before completion (the lock they block on is made by
    the first of them), one that timed out first, and one after completion
    all see the value; an error reaches every one of them."""
    from numcoll.futures import Future, FutureTimeoutError
    for error in (None, ValueError("boom")):
        fut = Future()
        with pytest.raises(FutureTimeoutError):
            fut.wait(0.01)
        seen = []

        def waiter():
            try:
                seen.append(fut.wait(30))
            except ValueError as exc:
                seen.append(exc)

        threads = [threading.Thread(target=waiter) for _ in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.05)  # the waiters block
        if error is None:
            fut.set_result(7)
        else:
            fut.set_exception(error)
        for t in threads:
            t.join(30)
        assert seen == [7 if error is None else error] * 4
        waiter()  # after completion: no lock to wait on
        assert seen[-1] == (7 if error is None else error)
    done = Future()
    done.set_result(1)
    assert done.wait(0) == 1 and done._done_lock is None  # nobody waited: none was made


def test_thousand_collectives_in_flight_on_eight_threads_never_mix(no_leaked_threads):
    pgs = groups(3, threads=8)
    try:
        def body(pg):
            xs = [np.array([i + pg.rank()], np.int64) for i in range(1000)]
            works = [pg.allreduce(x) for x in xs]
            nc.futures.wait_all(works)
            return [int(x[0]) for x in xs]
        for result in on_ranks(pgs, body):
            assert result == [3 * i + 3 for i in range(1000)]
    finally:
        for pg in pgs:
            pg.shutdown()


def test_rejected_call_does_not_take_a_sequence_number():
    pgs = groups(2)
    try:
        def body(pg):
            if pg.rank() == 0:
                with pytest.raises(ValueError, match="requires non-empty tensor list"):
                    pg.allreduce([])
            x = np.array([1.0])
            pg.allreduce(x).wait(10)
            return x[0]
        assert on_ranks(pgs, body) == [2.0, 2.0]
    finally:
        for pg in pgs:
            pg.shutdown()


def test_timeout_names_op_rank_and_peer_and_poisons_the_group():
    pgs = groups(2)
    try:
        t0 = time.monotonic()
        work = pgs[0].allreduce(np.zeros(4), nc.AllreduceOptions(timeout=timedelta(milliseconds=200)))
        with pytest.raises(nc.CollectiveTimeoutError) as info:
            work.wait()
        assert time.monotonic() - t0 < 10  # the 200 ms deadline, not the group's 30 min
        msg = str(info.value)
        assert msg.startswith("Timed out waiting 200ms"), msg
        assert "allreduce" in msg and "rank 0" in msg and "rank 1" in msg, msg
        assert isinstance(info.value, TimeoutError)
        with pytest.raises(nc.GroupPoisonedError, match="allreduce .* failed"):
            pgs[0].broadcast(np.zeros(1))
    finally:
        for pg in pgs:
            pg.shutdown()


def test_peer_that_leaves_is_named_quickly():
    pgs = groups(3, timeout=timedelta(seconds=60))
    try:
        pgs[2].shutdown()
        t0 = time.monotonic()
        works = [pg.allreduce(np.ones(10)) for pg in pgs[:2]]
        for w in works:
            with pytest.raises(nc.PeerError, match="rank 2"):
                w.wait()
        assert time.monotonic() - t0 < 20  # far below the 60 s deadline
    finally:
        for pg in pgs:
            pg.shutdown()


def test_barrier_waits_for_earlier_work():
    pgs = groups(2, threads=4)
    try:
        def body(pg):
            xs = [np.full(50_000, float(i)) for i in range(12)]
            for x in xs:
                pg.allreduce(x)
            pg.barrier().wait()
            return all(np.all(x == 2 * i) for i, x in enumerate(xs))
        assert on_ranks(pgs, body) == [True, True]
    finally:
        for pg in pgs:
            pg.shutdown()


def test_shutdown_leaves_no_threads_and_is_idempotent(no_leaked_threads):
    pgs = groups(2)
    on_ranks(pgs, lambda pg: pg.allreduce(np.ones(3)).wait())
    for pg in pgs:
        pg.shutdown()
        pg.shutdown()
    with pytest.raises(nc.NumcollError, match="shut down"):
        pgs[0].allreduce(np.ones(1))


def test_context_manager_and_world_size_one():
    with nc.ProcessGroup(nc.HashStore(), 0, 1) as pg:
        x = np.arange(5.0)
        pg.allreduce(x, op=nc.ReduceOp.AVG).wait()
        assert np.array_equal(x, np.arange(5.0))
        out = [np.empty(5)]
        pg.allgather([out], [x]).wait()
        assert np.array_equal(out[0], x)
        pg.barrier().wait()


def test_argument_errors_name_the_op():
    with nc.ProcessGroup(nc.HashStore(), 0, 1) as pg:
        with pytest.raises(TypeError, match=r"allreduce: invalid tensor type"):
            pg.allreduce([1, 2, 3])
        with pytest.raises(TypeError, match=r"allreduce: invalid tensor type.*not supported"):
            pg.allreduce(np.array(["a"]))
        with pytest.raises(ValueError, match="Cannot use ReduceOp.BAND with non-integral"):
            pg.allreduce(np.ones(2), op=nc.ReduceOp.BAND)
        with pytest.raises(ValueError, match="MAX is not defined for complex"):
            pg.allreduce(np.ones(2, np.complex64), op=nc.ReduceOp.MAX)
        with pytest.raises(ValueError, match="AVG needs a floating point"):
            pg.allreduce(np.ones(2, np.int32), op=nc.ReduceOp.AVG)
        with pytest.raises(ValueError, match="read-only"):
            ro = np.ones(2)
            ro.flags.writeable = False
            pg.allreduce(ro)
        with pytest.raises(ValueError, match="unknown algorithm 'nope'"):
            pg.allreduce(np.ones(2), nc.AllreduceOptions(algorithm="nope"))
        with pytest.raises(ValueError, match="invalid destination rank"):
            pg.send([np.ones(1)], 0)


def test_results_land_in_torch_like_buffers():
    """Anything NumPy views without a copy works: here a memoryview of a bytearray."""
    pgs = groups(2)
    try:
        def body(pg):
            raw = bytearray(np.full(4, pg.rank() + 1, np.int32).tobytes())
            view = memoryview(raw).cast("i")
            pg.allreduce(view).wait()
            return np.frombuffer(raw, np.int32).tolist()
        assert on_ranks(pgs, body) == [[3] * 4, [3] * 4]
    finally:
        for pg in pgs:
            pg.shutdown()


def test_noncontiguous_inputs_and_outputs():
    pgs = groups(2)
    try:
        def body(pg):
            base = np.zeros((6, 4), np.float64)
            col = base[:, 1]  # strided
            col[:] = pg.rank() + 1
            pg.allreduce(col).wait()
            assert np.all(base[:, 1] == 3) and np.all(base[:, 0] == 0)
            outs = [np.zeros((3, 2)).T for _ in range(2)]  # non-contiguous outputs
            pg.allgather([outs], [np.full((2, 3), pg.rank(), np.float64)]).wait()
            return [float(o[0, 0]) for o in outs]
        assert on_ranks(pgs, body) == [[0.0, 1.0], [0.0, 1.0]]
    finally:
        for pg in pgs:
            pg.shutdown()


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_zeromq_transports_in_one_process(transport):
    pgs = groups(3, transport=transport)
    try:
        def body(pg):
            x = np.full(100_000, pg.rank() + 1.0, np.float32)
            pg.allreduce(x).wait()
            return float(x[0]), pg.transport_kind
        assert on_ranks(pgs, body) == [(6.0, transport)] * 3
    finally:
        for pg in pgs:
            pg.shutdown()


def test_set_timeout_does_not_leak_into_shared_options():
    opts = nc.ProcessGroup.Options(transport="inproc", timeout=timedelta(seconds=50))
    with nc.ProcessGroup(nc.HashStore(), 0, 1, opts) as a, \
            nc.ProcessGroup(nc.HashStore(), 0, 1, opts) as b:
        a.set_timeout(timedelta(seconds=23))
        assert a.options.timeout == timedelta(seconds=23)
        assert b.options.timeout == timedelta(seconds=50) == opts.timeout


def test_shutdown_returns_promptly_while_a_peer_stalls(no_leaked_threads):
    pgs = groups(2, timeout=timedelta(minutes=5))
    work = pgs[0].allreduce(np.ones(4))  # rank 1 never joins it
    start = time.monotonic()
    pgs[0].shutdown()
    assert time.monotonic() - start < 20  # the 2 s drain, not the 5 min deadline
    with pytest.raises(nc.NumcollError):
        work.wait()
    pgs[1].shutdown()


def test_abort_fails_the_peers_at_once_naming_this_rank(no_leaked_threads):
    pgs = groups(2, timeout=timedelta(minutes=5))
    try:
        work = pgs[1].allreduce(np.ones(4))  # waits for rank 0
        start = time.monotonic()
        pgs[0].abort("giving up")
        with pytest.raises(nc.PeerError, match="rank 0") as info:
            work.wait()
        assert info.value.peer == 0 and time.monotonic() - start < 20  # not 5 min
        with pytest.raises(nc.GroupPoisonedError, match="giving up"):
            pgs[0].allreduce(np.ones(4))
    finally:
        for pg in pgs:
            pg.shutdown()


def test_alltoall_type_errors_use_torchs_words():
    pgs = groups(2)
    try:
        f32, f64 = np.zeros(2, np.float32), np.zeros(2, np.float64)
        # inputs of one dtype, outputs of another: torch's words for the pair
        with pytest.raises(TypeError, match="alltoall: input and output tensors must have "
                                            "the same type"):
            pgs[0].alltoall([f32, f32.copy()], [f64, f64.copy()])
        # a list that mixes dtypes: the element is named
        with pytest.raises(TypeError, match="alltoall: invalid tensor type: input 1"):
            pgs[0].alltoall([f32, f32.copy()], [f32.copy(), f64])
        with pytest.raises(TypeError, match="alltoall: invalid tensor type: output 1"):
            pgs[0].alltoall([f32, f64], [f32.copy(), f32.copy()])
    finally:
        for pg in pgs:
            pg.shutdown()


def test_transport_choice_tells_network_namespaces_apart():
    from transports import host_key as _host_key

    import os
    import socket

    key = _host_key()
    assert key.startswith(socket.gethostname())
    if os.path.exists("/proc/self/ns/net"):
        assert f"/netns{os.stat('/proc/self/ns/net').st_ino}" in key
