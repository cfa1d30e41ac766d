"""Repeated single-copy allreduces (SUM) as one compiled call
(numcoll.fast.sum.FusedAllreduce: the reduce-scatter's reads and sums and
the allgather's reads, both phases without the GIL): results right call
after call, and bit for bit those of the ordinary path, with ranks as
processes and as threads; a rank on the compiled call and a rank on the
ordinary path meet; every way a call stops -- a read that fails, a late
peer, rank 0 saying the arena, a refusal -- finished from where it stopped,
a sum never added twice."""

import errno
import time

import numpy as np
import pytest

import numcoll as nc

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif("not __import__('transports').shm_available()")]

#: A pid no process has (above any pid_max): a copy from it fails (ESRCH).
NO_SUCH_PID = 1 << 30
N = 3001  # elements: odd, chunks of unequal length


@pytest.fixture(autouse=True)
def small_threshold(monkeypatch):
    # Single copy from 1 KiB, slots of 4 KiB, pieces of 2 KiB (several a chunk).
    monkeypatch.setenv("NUMCOLL_ARENA_SLOT_NBYTES", "4096")
    monkeypatch.setenv("NUMCOLL_SINGLE_COPY_MIN_NBYTES", "1024")
    monkeypatch.setenv("NUMCOLL_SINGLE_COPY_ALLREDUCE_MIN_NBYTES", "1024")
    monkeypatch.setenv("NUMCOLL_SINGLE_COPY_CROWDED_MIN_NBYTES", "1024")


def values(rank, call, dtype):
    # (not exact in every order: the test sees the order of the additions)
    return (np.arange(N) % 89 * 0.1 + 1000.3 * rank + call / 7).astype(dtype)


def want(size, call, dtype):
    """What the ordinary path gives: each chunk summed by its owner, its own
    part first, then the peers' in rank order."""
    from numcoll.algorithms.partition import chunk_bounds

    got = np.empty(N, dtype)
    for owner, (first, n) in enumerate(chunk_bounds(N, size)):
        acc = values(owner, call, dtype)[first:first + n].copy()
        for q in range(size):
            if q != owner:
                acc += values(q, call, dtype)[first:first + n]
        got[first:first + n] = acc
    return got


def allreduces(calls, dtype=np.float32, before=None, fresh=False):
    """``calls`` all_reduce calls of the same array (new values each call;
    ``fresh``: a new array each call), each checked bit for bit; ``before(i)``
    runs before call i. The fused calls planned, and what each call ran."""
    from numcoll.diagnostics import flight_recorder
    from numcoll.fast.sum import FusedAllreduce

    pg = nc.get_default_group()
    r, size = pg.rank(), pg.size()
    x = np.zeros(N, dtype)
    for i in range(calls):
        if before is not None:
            before(i)
        if fresh:
            x = np.zeros(N, dtype)
        x[:] = values(r, i, dtype)
        nc.all_reduce(x)
        assert np.array_equal(x, want(size, i, dtype)), f"call {i}"
    fused = sum(isinstance(s.fused, FusedAllreduce) for s in pg.repeats._seen.values())
    ran = [e["algorithm"] for e in flight_recorder.dump(r)["entries"]
           if e["profiling_name"].endswith("all_reduce")]
    return fused, ran[-calls:]


@pytest.mark.parametrize("size,mode,dtype", [(2, "process", np.float32),
                                             (3, "process", np.float64),
                                             (2, "thread", np.int64),
                                             (2, "process", np.complex64)])
def test_repeated_allreduces_run_fused_and_right(monkeypatch, size, mode, dtype):
    monkeypatch.setenv("NUMCOLL_ALGORITHM", "allreduce:cma")
    for fused, ran in nc.launch(allreduces, size, (12, dtype), mode=mode, transport="shm",
                                timeout=60):
        assert fused == 1
        assert ran == ["cma"] * 12


@pytest.mark.slow
def test_a_rank_on_the_ordinary_path_meets_a_fused_one(monkeypatch):
    monkeypatch.setenv("NUMCOLL_ALGORITHM", "allreduce:cma")

    def body():
        return allreduces(10, fresh=nc.get_rank() == 1)

    (fused0, ran0), (fused1, ran1) = nc.launch(body, 2, transport="shm", timeout=60)
    assert (fused0, fused1) == (1, 0)
    assert ran0 == ran1 == ["cma"] * 10


@pytest.mark.slow
@pytest.mark.parametrize("where", ["copies", "steps"])
def test_a_call_that_stops_is_finished_from_where_it_stopped(monkeypatch, where):
    """Its compiled reads fail (no such pid; the step-by-step reads do not),
    or every wait gives up at once and a peer is late (in either phase):
    the ordinary path goes on from that phase. Results right, nothing
    added twice, every call single copy, nothing refused."""
    monkeypatch.setenv("NUMCOLL_ALGORITHM", "allreduce:cma")

    def body():
        pg = nc.get_default_group()

        def before(i):
            if i == 0 and where == "copies":
                pg._transport.single_copy._pid_words[:] = NO_SUCH_PID
            if i == 0 and where == "steps":
                pg._transport.arena._spin_ns = pg._transport.arena._yield_ns = 0
            if where == "steps" and pg.rank() == i % 2:
                time.sleep(0.002)

        fused, ran = allreduces(10, before=before)
        return fused, ran, pg._transport.single_copy.failed

    for fused, ran, failed in nc.launch(body, 2, transport="shm", timeout=60):
        assert fused == 1 and failed is None
        assert ran == ["cma"] * 10


@pytest.mark.slow
def test_a_call_that_stops_between_the_phases_is_finished_from_the_allgather(monkeypatch):
    """Rank 1, on the ordinary path, publishes its allgather's *where* 20 ms
    after its reduce-scatter; rank 0's compiled call waits 2 ms at most, so
    it stops in its second phase, and the ordinary path finishes the
    allgather (the sums kept)."""
    monkeypatch.setenv("NUMCOLL_ALGORITHM", "allreduce:cma")

    def body():
        from numcoll.algorithms import single_copy_reduce

        pg = nc.get_default_group()
        if pg.rank() == 0:
            pg._transport.arena._yield_ns = 2_000_000
        else:
            exchange = single_copy_reduce.exchange

            def late_allgather(comm, parts, measured=False, then=None, copier=None):
                if then is None and copier is None:  # (the allgather's)
                    time.sleep(0.02)
                return exchange(comm, parts, measured, then, copier)

            single_copy_reduce.exchange = late_allgather
        return allreduces(6, fresh=pg.rank() == 1)

    (fused0, ran0), (fused1, ran1) = nc.launch(body, 2, transport="shm", timeout=60)
    assert (fused0, fused1) == (1, 0)
    assert ran0 == ran1 == ["cma"] * 6


@pytest.mark.slow
def test_rank_0_says_the_arena_and_every_rank_follows():
    """The automatic choice (``cma_measured``): rank 0 says, call by call,
    single copy or the arena; a fused call it sends to the arena takes the
    ordinary path, which says so in its *where*, and the peer's compiled
    call stops there and goes through the arena. Results right either way."""
    def body():
        from numcoll.algorithms import single_copy
        from numcoll.fast import sum as fast_sum

        said = []

        def fused_say(tuning, key):  # copy, arena, copy, ...
            said.append(key)
            return len(said) % 2 == 0

        fast_sum.fused_say = fused_say
        single_copy._say = lambda tuning, key: True  # (the ordinary path's say: the arena)
        return allreduces(12), len(said)

    got = nc.launch(body, 2, transport="shm", timeout=60)
    # (calls 0 and 1 on the ordinary path; from call 2 rank 0 alone asks)
    assert got[0] == ((1, ["shared_split"] * 2 + ["cma", "shared_split"] * 5), 10)
    assert got[1][0] == got[0][0]


@pytest.mark.slow
def test_a_refusal_sends_every_rank_through_the_arena(monkeypatch):
    """From call 4 rank 1's reads are refused (EPERM; its compiled ones fail:
    no such pid): its *done* step says so, rank 0's compiled call finds the
    refusal there, and both finish through the arena from what they summed.
    Results right on every call, both ranks learn the same reason, later
    calls keep the arena."""
    monkeypatch.setenv("NUMCOLL_ALGORITHM", "allreduce:cma")

    def body():
        from transports.shm import single_copy

        pg = nc.get_default_group()

        def before(i):
            if i == 4 and pg.rank() == 1:
                pg._transport.single_copy._pid_words[:] = NO_SUCH_PID
                single_copy._process_vm_readv = lambda *args: -errno.EPERM

        _, ran = allreduces(10, before=before)
        return ran, pg._transport.single_copy.failed

    got = nc.launch(body, 2, transport="shm", timeout=60)
    for ran, failed in got:
        assert ran[:4] == ["cma"] * 4
        assert "EPERM" in failed
    assert got[0][1] == got[1][1]
