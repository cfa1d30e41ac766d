"""``gather`` and ``scatter`` of new arrays each call where they read
single-copy, run as one compiled start through a plan per form
(numcoll.fast.copy.fused_copy_rooted: on the root the list moves through the
plan's own buffer, elsewhere the start is pointed at each call's tensor):
the ordinary path's results at 2 and 3 ranks, every root, apart and in
place; rank 0 saying the arena (the root's list then scattered or gathered
through it); a rank by form meeting a rank on the ordinary path; a start the
group finishes (a late peer); a mismatch failing on both ranks; no caller's
array kept; ranks as processes."""

import gc
import time
import weakref
from datetime import timedelta

import numpy as np
import pytest

import numcoll as nc

from test_fast_forms import a_mismatch_fails_on_both_ranks, by_form_beside_the_ordinary_path
from test_fast_forms_copy import copies_by_form
from test_fast_forms_rooted import rooted, want
from test_fast_path import close, fused_runs
from test_process_group import groups, on_ranks

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif("not __import__('transports').shm_available()")]

N = 20001  # float64 elements: 160 KiB, odd (the root's share and the rest differ)
NAMES = ("gather", "scatter")


@pytest.fixture(autouse=True)
def single_copy(monkeypatch):
    monkeypatch.setenv("NUMCOLL_ALGORITHM", "gather:cma,scatter:cma")


def kept_rooted(pg, name, i, root, kept, dtype=np.float64, in_place=False):
    """One ``rooted`` call of new arrays, kept alive in ``kept`` (so the next
    call's lie elsewhere: a freed array's memory is most often the next
    one's); ``in_place``: the root's own entry of the list is its tensor.
    Whether the rank holds what it should afterwards."""
    size, r = pg.size(), pg.rank()
    tensor, blocks = np.empty(N, dtype), None
    if r == root:
        blocks = [tensor if in_place and q == r else np.empty(N, dtype) for q in range(size)]
    kept += [tensor, *(blocks or ())]
    return rooted(pg, name, i, N, dtype, root, tensor=tensor, blocks=blocks) \
        == want(name, r, size, i, N, dtype, root)


@pytest.mark.parametrize("size", [2, 3])
def test_new_arrays_run_single_copy_by_form_and_agree(size):
    """Gather and scatter from rank 0 and the last rank, float64 and int32,
    and in place: the first call notes the form, the second plans it (a
    single-copy start), the rest run by it, every result NumPy's."""
    pgs = groups(size, transport="shm", timeout=timedelta(seconds=30))
    calls = 5
    cases = [(name, root, dtype, False) for name in NAMES for root in (0, size - 1)
             for dtype in (np.float64, np.int32)] + [(name, 1, np.float64, True)
                                                     for name in NAMES]
    try:
        def body(pg):
            log, kept = [], []
            for name, root, dtype, in_place in cases:
                pg.repeats.clear()
                before = fused_runs(pg)
                got = [kept_rooted(pg, name, i, root, kept, dtype, in_place)
                       for i in range(calls)]
                log.append((got, fused_runs(pg) - before, copies_by_form(pg)))
            return log

        for log in on_ranks(pgs, body):
            assert log == [([True] * calls, calls - 2, 1)] * len(cases), log
    finally:
        close(pgs)


def test_rank_0_saying_the_arena_sends_the_root_s_list_through_it(monkeypatch):
    """``cma_measured``: where rank 0 says the arena, a root by form (rank 1)
    finishes through the arena's algorithm over its own buffer, every row of
    it the call's, its own block too; rank 0 as the root takes the ordinary
    path. Rank 0 says the arena every other call here."""
    from numcoll.algorithms import single_copy, single_copy_say

    def every_other(tuning, key):  # (fused_say gives a said arena's count back)
        times = single_copy_say._times(tuning, key)
        times.calls += 1
        return times.calls % 2 == 0

    monkeypatch.setenv("NUMCOLL_ALGORITHM", "gather:cma_measured,scatter:cma_measured")
    monkeypatch.setattr(single_copy_say, "_say", every_other)
    monkeypatch.setattr(single_copy, "_say", every_other)
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=30))
    try:
        def body(pg):
            log, kept = [], []
            for name in NAMES:
                for root in (1, 0):
                    pg.repeats.clear()
                    log.append([kept_rooted(pg, name, i, root, kept) for i in range(8)])
            return log, copies_by_form(pg)

        assert on_ranks(pgs, body) == [([[True] * 8] * 4, 1)] * 2
    finally:
        close(pgs)


def test_a_rank_by_form_meets_a_rank_on_the_ordinary_path():
    """Rank 1 forgets its forms before each call; rank 0 runs by form: the
    same *where*, the same copies, the same results, either rank the root
    (gather, then scatter, eight calls each)."""
    kept = []
    assert by_form_beside_the_ordinary_path(lambda pg, i: kept_rooted(
        pg, NAMES[i // 8], i % 8, i % 8 // 4, kept), 16) == [([True] * 16, 8), ([True] * 16, 0)]


@pytest.mark.slow
def test_a_start_the_group_finishes_uses_this_calls_arrays():
    """A late peer, then a late root: the waiting rank's start is finished by
    the group (promoted), from parts made for this call's tensor and the
    plan's own buffer; nothing of the call's arrays is kept."""
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=30))
    try:
        def body(pg):
            got, refs, kept = [], [], []
            for name in NAMES:
                for late in (1, 0):
                    pg.repeats.clear()
                    for i in range(3):  # (the second call made the plan)
                        kept_rooted(pg, name, i, 0, kept)
                    if pg.rank() == late:
                        time.sleep(0.1)  # (beyond the start's spin and yield phases)
                    now = []
                    got.append(kept_rooted(pg, name, 3, 0, now))
                    refs += [weakref.ref(a) for a in now]
                    del now
            gc.collect()
            (planned,) = pg.repeats.forms._planned.values()
            fused = planned.fused
            return got, all(r() is None for r in refs), fused.parts, fused.own, fused.outs

        assert on_ranks(pgs, body) == [([True] * 4, True, None, None, [])] * 2
    finally:
        close(pgs)


def test_a_mismatch_against_a_form_plan_fails_on_both_ranks():
    a_mismatch_fails_on_both_ranks(lambda pg, i, other: kept_rooted(
        pg, "scatter", i, 0, [], np.float32 if other else np.float64))


def fresh_single_copy(calls):
    """``calls`` gathers and ``calls`` scatters from rank 1 on new arrays,
    each checked: whether all were right, how many ran by a single-copy
    form's plan."""
    pg, kept = nc.get_default_group(), []
    right = [kept_rooted(pg, name, i, 1, kept) for name in NAMES for i in range(calls)]
    return all(right), fused_runs(pg)


def test_ranks_as_processes_read_each_other_by_form():
    assert nc.launch(fresh_single_copy, 2, (6,), transport="shm",
                     timeout=timedelta(seconds=60)) == [(True, 8)] * 2
