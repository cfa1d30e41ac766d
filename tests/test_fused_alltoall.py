"""Repeated all_to_all_single calls whose blocks are read whole, as one
compiled start (numcoll.fast.copy.fused_copy_alltoall: the arena alltoall's
round 0, reads and *done* step as a single-copy call's phases): results
right call after call, with ranks as processes and as threads; a rank on
the compiled start and a rank on the ordinary path meet; every way a start
stops -- a read that fails, a late peer, a refusal published by a peer --
finished by the algorithm from where it stopped."""

import errno
import time

import numpy as np
import pytest

import numcoll as nc

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif("not __import__('transports').shm_available()")]

#: A pid no process has (above any pid_max): a copy from it fails (ESRCH).
NO_SUCH_PID = 1 << 30
N = 1500  # float64 elements a block: 12000 bytes, read whole from 4 KiB


@pytest.fixture(autouse=True)
def small_threshold(monkeypatch):
    # Slots of 32 KiB (a block takes one round) and blocks read whole from 4 KiB.
    monkeypatch.setenv("NUMCOLL_ARENA_SLOT_NBYTES", "32768")
    monkeypatch.setenv("NUMCOLL_SINGLE_COPY_ALLTOALL_REST_MIN_NBYTES", "4096")


def block(src, dst, call):
    return (np.arange(N) % 89 + 1000 * src + 10 * dst + call + 0.5).astype(np.float64)


def alltoalls(calls, before=None, fresh=False):
    """``calls`` all_to_all_single calls of the same arrays (new values each
    call; ``fresh``: new arrays each call), each checked; ``before(i)`` runs
    before call i. The fused starts planned, and what each call ran."""
    from numcoll.diagnostics import flight_recorder
    from numcoll.fast.copy import FusedCopy

    pg = nc.get_default_group()
    r, size = pg.rank(), pg.size()
    inp, out = np.zeros(N * size), np.zeros(N * size)
    for i in range(calls):
        if before is not None:
            before(i)
        if fresh:
            inp, out = np.zeros(N * size), np.zeros(N * size)
        inp[:] = np.concatenate([block(r, q, i) for q in range(size)])
        nc.all_to_all_single(out, inp)
        want = np.concatenate([block(q, r, i) for q in range(size)])
        assert np.array_equal(out, want), f"call {i}"
    fused = sum(isinstance(s.fused, FusedCopy) for s in pg.repeats._seen.values())
    ran = [e["algorithm"] for e in flight_recorder.dump(r)["entries"]
           if "all_to_all" in e["profiling_name"]]
    return fused, ran[-calls:]


@pytest.mark.parametrize("size,mode", [(2, "process"), (3, "process"), (2, "thread")])
def test_repeated_calls_run_fused_and_right(size, mode):
    for fused, ran in nc.launch(alltoalls, size, (12,), mode=mode, transport="shm", timeout=60):
        assert fused == 1
        assert ran == ["shared+cma"] * 12


@pytest.mark.slow
def test_a_rank_on_the_ordinary_path_meets_a_fused_one():
    """Rank 1 passes new arrays every call (the ordinary path, which publishes
    the same header); rank 0 the same ones (a fused start)."""
    def body():
        return alltoalls(10, fresh=nc.get_rank() == 1)

    (fused0, ran0), (fused1, ran1) = nc.launch(body, 2, transport="shm", timeout=60)
    assert (fused0, fused1) == (1, 0)
    assert ran0 == ran1 == ["shared+cma"] * 10


@pytest.mark.slow
@pytest.mark.parametrize("where", ["copies", "steps"])
def test_a_start_that_stops_is_finished_from_where_it_stopped(where):
    """Its compiled reads fail (no such pid: the step-by-step reads do not),
    or every wait gives up at once and a peer is late: the algorithm goes on
    from round 0's headers or from its *done* step. Results right, every
    call read single-copy, nothing refused."""
    def body():
        pg = nc.get_default_group()

        def before(i):
            if i == 0 and where == "copies":
                pg._transport.single_copy._pid_words[:] = NO_SUCH_PID
            if i == 0 and where == "steps":
                pg._transport.arena._spin_ns = pg._transport.arena._yield_ns = 0
            if where == "steps" and pg.rank() == i % 2:
                time.sleep(0.002)

        fused, ran = alltoalls(10, before)
        return fused, ran, pg._transport.single_copy.failed

    for fused, ran, failed in nc.launch(body, 2, transport="shm", timeout=60):
        assert fused == 1 and failed is None
        assert ran == ["shared+cma"] * 10


@pytest.mark.slow
def test_a_refusal_published_by_a_peer_sends_every_rank_through_the_rounds():
    """From call 4 rank 1's reads are refused (EPERM; its compiled ones fail:
    no such pid): its *done* step says so, rank 0's start -- its reads made
    -- finds the refusal there, and both run the whole call again through
    the arena's rounds. Results right on every call, both ranks learn the
    same reason, and later calls keep the arena."""
    def body():
        from transports.shm import single_copy

        pg = nc.get_default_group()

        def before(i):
            if i == 4 and pg.rank() == 1:
                pg._transport.single_copy._pid_words[:] = NO_SUCH_PID
                single_copy._process_vm_readv = lambda *args: -errno.EPERM

        _, ran = alltoalls(10, before)
        return ran, pg._transport.single_copy.failed

    got = nc.launch(body, 2, transport="shm", timeout=60)
    for ran, failed in got:
        assert ran[:4] == ["shared+cma"] * 4
        assert ran[4:] == ["shared"] * 6
        assert "EPERM" in failed
    assert got[0][1] == got[1][1]
