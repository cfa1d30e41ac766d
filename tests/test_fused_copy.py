"""Repeated single-copy allgathers as one compiled start (numcoll.fast.copy):
results right call after call, in place and out of place, with ranks as
processes and as threads; every way a start stops -- a late peer, a copy
that fails -- finished by the group on the ordinary path; a rank that calls
something else gets the mismatch error; what keeps the ordinary path.
(Rank 0 saying the arena, for the allgather too: tests/test_fused_copy_moves.py.)"""

import time
from datetime import timedelta

import numpy as np
import pytest

import numcoll as nc

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif("not __import__('transports').shm_available()")]

#: A pid no process has (above any pid_max): a copy from it fails (ESRCH).
NO_SUCH_PID = 1 << 30
N = 3001  # float64 elements per rank: odd


@pytest.fixture(autouse=True)
def small_threshold(monkeypatch):
    # Slots of 32 KiB: a rank's part (24 KiB) fits one, as a fused start needs.
    monkeypatch.setenv("NUMCOLL_ARENA_SLOT_NBYTES", "32768")


def part(rank, call, n=N):
    return (np.arange(n) % 89 + 1000 * rank + call + 0.5).astype(np.float64)


def fused_copies(pg) -> int:
    from numcoll.fast.copy import FusedCopy

    return sum(isinstance(s.fused, FusedCopy) for s in pg.repeats._seen.values())


def allgathers(calls, in_place, before=None):
    """``calls`` allgathers of the same arrays (new values each call), each
    checked; ``before(i)`` runs before call i. The number of fused plans."""
    pg = nc.get_default_group()
    r, size = pg.rank(), pg.size()
    out = np.zeros(N * size)
    inp = out[r * N:(r + 1) * N] if in_place else np.zeros(N)
    for i in range(calls):
        if before is not None:
            before(i)
        inp[:] = part(r, i)
        nc.all_gather_into_tensor(out, inp)
        want = np.concatenate([part(q, i) for q in range(size)])
        assert np.array_equal(out, want), f"call {i}"
    return fused_copies(pg)


def both_places(calls):
    """:func:`allgathers` out of place, then in place, the group's plans
    forgotten before each (as in a launch of its own; one launch for both
    saves a process start): the fused plans of each."""
    pg = nc.get_default_group()
    plans = []
    for in_place in (False, True):
        pg.repeats.clear()
        plans.append(allgathers(calls, in_place))
    return plans


@pytest.mark.parametrize("size,mode", [(2, "process"), (3, "process"), (2, "thread")])
def test_repeated_allgathers_run_fused_and_right(monkeypatch, size, mode):
    monkeypatch.setenv("NUMCOLL_ALGORITHM", "allgather:cma")
    got = nc.launch(both_places, size, (40,), mode=mode, transport="shm",
                    timeout=timedelta(seconds=60))
    assert got == [[1, 1]] * size


@pytest.mark.parametrize("algorithm", ["cma", "cma_measured"])
@pytest.mark.parametrize("mode", ["process", "thread"])
def test_parts_larger_than_a_slot_copy_without_the_gil(monkeypatch, algorithm, mode):
    """(A claim, then the phases in a compiled call that lets go of the GIL.)"""
    monkeypatch.setenv("NUMCOLL_ALGORITHM", f"allgather:{algorithm}")
    monkeypatch.setenv("NUMCOLL_ARENA_SLOT_NBYTES", "16384")
    got = nc.launch(both_places, 2, (30,), mode=mode, transport="shm",
                    timeout=timedelta(seconds=60))
    assert got == [[1, 1]] * 2


def late_peer(calls):
    pg = nc.get_default_group()

    def before(i):
        if pg.rank() == 1 and i % 3 == 2:
            time.sleep(0.005)  # rank 0's start stops at the where step

    return allgathers(calls, False, before), pg._transport.single_copy.failed


@pytest.mark.slow
def test_a_late_peer_leaves_the_call_to_the_group(monkeypatch):
    monkeypatch.setenv("NUMCOLL_ALGORITHM", "allgather:cma")
    assert nc.launch(late_peer, 2, (30,), transport="shm",
                     timeout=timedelta(seconds=60)) == [(1, None)] * 2


def failing_copies(calls):
    """From call 10 on, rank 1's compiled copies name no such pid: its start
    stops at the copies and the group makes them again (the real pid)."""
    pg = nc.get_default_group()

    def before(i):
        if pg.rank() == 1 and i == 10:
            pg._transport.single_copy.pid_words[:] = NO_SUCH_PID

    return allgathers(calls, True, before), pg._transport.single_copy.failed


@pytest.mark.slow
def test_a_copy_the_start_cannot_make_is_made_by_the_group(monkeypatch):
    monkeypatch.setenv("NUMCOLL_ALGORITHM", "allgather:cma")
    assert nc.launch(failing_copies, 2, (20,), transport="shm",
                     timeout=timedelta(seconds=60)) == [(1, None)] * 2


def mismatched(calls):
    pg = nc.get_default_group()
    r = pg.rank()
    out, inp = np.zeros(2 * N), np.zeros(N)
    for _ in range(calls):
        nc.all_gather_into_tensor(out, inp)
    try:
        if r == 0:
            nc.all_gather_into_tensor(out, inp)
        else:
            nc.all_reduce(np.zeros(N))
    except nc.CollectiveMismatchError as exc:
        return fused_copies(pg), str(exc)
    return fused_copies(pg), None


@pytest.mark.slow
def test_a_rank_that_calls_something_else_gets_the_mismatch_error(monkeypatch):
    monkeypatch.setenv("NUMCOLL_ALGORITHM", "allgather:cma")
    got = nc.launch(mismatched, 2, (5,), transport="shm", timeout=timedelta(seconds=60),
                    group_timeout=timedelta(seconds=10))
    for fused, error in got:
        assert fused == 1
        assert error is not None and "mismatch" in error.lower(), error
