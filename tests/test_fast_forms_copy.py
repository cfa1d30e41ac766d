"""``broadcast`` and ``all_gather_into_tensor`` of new arrays each call where
they read single-copy, run as one compiled start through a plan per form
(numcoll.fast.forms: a FusedCopy whose addresses are pointed at each call's
arrays, numcoll.collectives.fused_copy.point): the ordinary path's results
at 2 and 3 ranks, every root, apart and in place, forced and measured; a
rank by form meeting a rank on the ordinary path; a start the group finishes
(a late peer) made with this call's arrays; a mismatch failing on both
ranks; no caller's array kept."""

import gc
import time
import weakref
from datetime import timedelta

import numpy as np
import pytest

import numcoll as nc

from test_fast_forms import a_mismatch_fails_on_both_ranks, by_form_beside_the_ordinary_path
from test_fast_path import close, fused_runs, value
from test_process_group import groups, on_ranks

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif("not __import__('transports').shm_available()")]

N = 20001  # float64 elements: 160 KiB, odd (the root's share and the rest differ)


@pytest.fixture(autouse=True)
def single_copy(monkeypatch):
    monkeypatch.setenv("NUMCOLL_ALGORITHM", "broadcast:cma,allgather:cma")


def broadcasted(pg, i, root, n=N, dtype=np.float64, x=None, kept=None):
    """One broadcast from group rank ``root`` of a new array (or ``x``): the
    root's ``value(root, i, n)``; the array afterwards, as a list. ``kept``:
    a list the array is added to (kept alive, the next new array lies
    elsewhere: a freed one's memory is most often the next one's)."""
    x = np.empty(n, dtype) if x is None else x
    if kept is not None:
        kept.append(x)
    if pg.rank() == root:
        x[...] = value(root, i, n, dtype)
    nc.broadcast(x, src=root, group=pg)
    return x.tolist()


def gathered(pg, i, in_place, kept, n=N):
    """One ``all_gather_into_tensor`` of new arrays (kept alive in ``kept``),
    this rank's ``value(rank, i, n)``: whether the output is right."""
    size, r = pg.size(), pg.rank()
    out = np.empty(n * size)
    inp = out[r * n:(r + 1) * n] if in_place else np.empty(n)
    kept += [out, inp]
    inp[...] = value(r, i, n, np.float64)
    nc.all_gather_into_tensor(out, inp, group=pg)
    return out.tolist() == np.concatenate([value(q, i, n, np.float64)
                                           for q in range(size)]).tolist()


def copies_by_form(pg) -> int:
    from numcoll.fast.copy import FusedCopy

    return sum(type(p) is FusedCopy for p in pg.repeats.forms.plans())


@pytest.mark.parametrize("size", [2, 3])
def test_new_arrays_run_single_copy_by_form_and_agree(size):
    pgs = groups(size, transport="shm", timeout=timedelta(seconds=30))
    calls = 5
    try:
        def body(pg):
            log, kept = [], []
            for root in (0, size - 1):
                for dtype in (np.float64, np.int32):
                    pg.repeats.clear()
                    before = fused_runs(pg)
                    got = [broadcasted(pg, i, root, dtype=dtype, kept=kept)
                           == value(root, i, N, dtype).tolist() for i in range(calls)]
                    log.append((got, fused_runs(pg) - before, copies_by_form(pg)))
            return log

        for log in on_ranks(pgs, body):
            # the first call notes the form, the second plans it, the rest run fused
            assert log == [([True] * calls, calls - 2, 1)] * 4, log
    finally:
        close(pgs)


@pytest.mark.parametrize("size", [2, 3])
def test_new_allgather_arrays_run_single_copy_by_form_and_agree(size):
    pgs = groups(size, transport="shm", timeout=timedelta(seconds=30))
    calls = 5
    try:
        def body(pg):
            log, kept = [], []
            for in_place in (False, True):
                pg.repeats.clear()
                before = fused_runs(pg)
                got = [gathered(pg, i, in_place, kept) for i in range(calls)]
                log.append((got, fused_runs(pg) - before, copies_by_form(pg)))
            return log

        assert on_ranks(pgs, body) == [[([True] * calls, calls - 2, 1)] * 2] * size
    finally:
        close(pgs)


@pytest.mark.slow
def test_a_late_peer_allgather_by_form_agrees_and_keeps_no_array():
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=30))
    try:
        def body(pg):
            kept = []
            got = [gathered(pg, i, False, kept) for i in range(3)]
            if pg.rank() == 1:
                time.sleep(0.1)  # (beyond the start's spin and yield phases)
            got.append(gathered(pg, 3, False, kept))
            refs = [weakref.ref(a) for a in kept]
            del kept
            gc.collect()
            (planned,) = pg.repeats.forms._planned.values()
            return got, all(r() is None for r in refs), planned.fused.parts

        assert on_ranks(pgs, body) == [([True] * 4, True, None)] * 2
    finally:
        close(pgs)


def test_measured_calls_agree(monkeypatch):
    """``cma_measured``, the automatic choice: rank 0 says, call by call,
    whether the call copies or goes through the arena (the ordinary path)."""
    monkeypatch.setenv("NUMCOLL_ALGORITHM", "broadcast:cma_measured")
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=30))
    try:
        def body(pg):
            kept = []
            got = [broadcasted(pg, i, i % 2, kept=kept) == value(i % 2, i, N, np.float64)
                   .tolist() for i in range(12)]
            return got, copies_by_form(pg)

        assert on_ranks(pgs, body) == [([True] * 12, 2)] * 2
    finally:
        close(pgs)


def test_a_rank_by_form_meets_a_rank_on_the_ordinary_path():
    """Rank 1 forgets its forms before each call; rank 0 runs by form: the
    same *where*, the same copies, the same results, either rank the root."""
    kept = []
    assert by_form_beside_the_ordinary_path(lambda pg, i: broadcasted(
        pg, i, i // 4, kept=kept) == value(i // 4, i, N, np.float64).tolist(), 8) \
        == [([True] * 8, 4), ([True] * 8, 0)]


@pytest.mark.slow
def test_a_start_the_group_finishes_uses_this_calls_array():
    """A late peer: the waiting rank's start is finished by the group
    (promoted), from parts made for this call's array (the plan keeps none);
    nothing of either array is kept."""
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=30))
    try:
        def body(pg):
            got, refs, kept = [], [], []
            for late in (1, 0):
                for i in range(3):  # (the second call made the plan)
                    broadcasted(pg, i, 0, kept=kept)
                if pg.rank() == late:
                    time.sleep(0.1)  # (beyond the start's spin and yield phases)
                x = np.empty(N)
                got.append(broadcasted(pg, 3, 0, x=x) == value(0, 3, N, np.float64).tolist())
                refs.append(weakref.ref(x))
                del x
            gc.collect()
            planned = next(iter(pg.repeats.forms._planned.values()))
            return got, [r() is None for r in refs], planned.fused.parts

        assert on_ranks(pgs, body) == [([True] * 2, [True] * 2, None)] * 2
    finally:
        close(pgs)


def test_a_mismatch_against_a_form_plan_fails_on_both_ranks():
    a_mismatch_fails_on_both_ranks(lambda pg, i, other: broadcasted(
        pg, i, 0, dtype=np.float32 if other else np.float64))


def test_the_plan_holds_no_array_between_calls():
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=30))
    try:
        def body(pg):
            refs = []
            for i in range(5):
                x = np.empty(N)
                broadcasted(pg, i, 1, x=x)
                refs.append(weakref.ref(x))
            del x
            gc.collect()
            (planned,) = pg.repeats.forms._planned.values()
            fused = planned.fused
            return [r() is None for r in refs], fused.parts, fused.outs, fused.x.size

        assert on_ranks(pgs, body) == [([True] * 5, None, [], 0)] * 2
    finally:
        close(pgs)
