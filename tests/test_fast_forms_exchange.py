"""``all_to_all`` (torch's list form) on new arrays each call, run fused
through a plan per form (numcoll.fast.forms: both lists moved through the
plan's own buffers): the ordinary path's results at 2 and 3 ranks, new and
kept lists; lists the form does not fit taking the ordinary path (its errors
included); a rank by form meeting a rank on the ordinary path; a mismatch
failing on both ranks; a plan used by one call at a time and holding no
caller's array; ranks as processes."""

import gc
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


def exchanged(pg, i, n, dtype, outs=None, inps=None):
    """One ``all_to_all`` of ``n``-element arrays, new lists (or ``outs``,
    ``inps``), rank r's input q ``value(r, i + q, n)``; the outputs afterwards."""
    size, r = pg.size(), pg.rank()
    outs = [np.empty(n, dtype) for _ in range(size)] if outs is None else outs
    inps = [np.empty(n, dtype) for _ in range(size)] if inps is None else inps
    for q, a in enumerate(inps):
        a.flat[:n] = value(r, i + q, n, dtype)
    nc.all_to_all(outs, inps, group=pg)
    return [a.tolist() for a in outs]


def want(rank, size, i, n, dtype):
    return [value(q, i + rank, n, dtype).tolist() for q in range(size)]


@pytest.mark.parametrize("size", [2, 3])
def test_fresh_and_kept_lists_run_fused_by_their_form_and_agree(size):
    pgs = groups(size, transport="shm", timeout=timedelta(seconds=30))
    calls, n = 5, 3
    try:
        def body(pg):
            log = []
            for dtype in (np.float32, np.int64):
                for kept in (False, True):
                    pg.repeats.clear()
                    lists = [[np.empty(n, dtype) for _ in range(size)] for _ in range(2)] \
                        if kept else [None, None]
                    before, seq = fused_runs(pg), pg.sequence_number()
                    got = [exchanged(pg, i, n, dtype, *lists) for i in range(calls)]
                    log.append((got, fused_runs(pg) - before, pg.sequence_number() - seq))
            return log

        for rank, log in enumerate(on_ranks(pgs, body)):
            for k, (got, fused, seq) in enumerate(log):
                dtype = (np.float32, np.int64)[k // 2]
                assert got == [want(rank, size, i, n, dtype) for i in range(calls)], k
                # the first call notes the form, the second plans it, the rest run fused
                assert (fused, seq) == (calls - 2, calls), k
    finally:
        close(pgs)


def test_lists_the_form_does_not_fit_take_the_ordinary_path():
    """After the form is planned: an output that is an input, strided inputs
    (copied first) run fused and right; outputs that overlap each other, a
    read-only output, an input of another size, outputs of another shape
    take the ordinary path, with its errors or its results; the planned
    form still runs."""
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=30))
    n = 4
    try:
        def body(pg):
            r, log = pg.rank(), []

            def call(i, **kw):
                before = fused_runs(pg)
                try:
                    got = exchanged(pg, i, n, np.float32, **kw)
                except (ValueError, TypeError) as e:
                    log.append((str(e), fused_runs(pg) - before))
                    return
                log.append((got == want(r, 2, i, n, np.float32), fused_runs(pg) - before))

            for i in range(3):
                call(i)
            both = [np.empty(n, np.float32) for _ in range(2)]
            call(3, outs=[both[1], np.empty(n, np.float32)], inps=both)
            call(4, inps=list(np.empty((2, 2 * n), np.float32)[:, ::2]))
            whole = np.empty(n + 2, np.float32)
            stuck = np.empty(n, np.float32)
            stuck.flags.writeable = False
            for outs in ([whole[:n], whole[2:]], [np.empty(n, np.float32), stuck]):
                call(5, outs=outs)  # (every rank: each raises before it is numbered)
            call(5, inps=[np.empty(n, np.float32), np.empty(n + 1, np.float32)])
            square = [np.empty((2, 2), np.float32) for _ in range(2)]  # (as many elements)
            before = fused_runs(pg)
            exchanged(pg, 6, n, np.float32, outs=square)
            log.append(([a.reshape(-1).tolist() for a in square] == want(r, 2, 6, n, np.float32),
                        fused_runs(pg) - before))
            call(7)
            return log

        for log in on_ranks(pgs, body):
            assert log[:5] == [(True, 0), (True, 0), (True, 1), (True, 1), (True, 1)], log
            (overlap, a), (stuck, b), (longer, c) = log[5:8]
            assert "outputs 0 and 1" in overlap and "index 1 is read-only" in stuck, log
            assert "invalid tensor size" in longer and (a, b, c) == (0, 0, 0), log
            assert log[8:] == [(True, 0), (True, 1)], log
    finally:
        close(pgs)


@pytest.mark.parametrize("n", [3, 32768])
def test_a_rank_by_form_meets_a_rank_on_the_ordinary_path(n):
    """Rank 1 forgets its forms before each call (the ordinary path, every
    time); rank 0 runs by form: the same header, the same results. Blocks
    of 128 KiB, which the ordinary path offers to be read whole in a round
    of their own, are not planned by form."""
    for rank, (got, fused) in enumerate(by_form_beside_the_ordinary_path(lambda pg, i: exchanged(
            pg, i, n, np.float32) == want(pg.rank(), 2, i, n, np.float32), 6)):
        assert got == [True] * 6
        assert fused == (4 if rank == 0 and n == 3 else 0)


def test_a_mismatch_against_a_form_plan_fails_on_both_ranks():
    a_mismatch_fails_on_both_ranks(lambda pg, i, other: exchanged(
        pg, i, 4, np.float64 if other else np.float32))


def test_a_plan_in_use_is_not_taken_and_holds_no_array_between_calls():
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=30))
    try:
        def body(pg):
            refs = []
            for i in range(4):  # (the second call made the plan, the rest ran on it)
                outs, inps = ([np.empty(4, np.float32) for _ in range(2)] for _ in range(2))
                exchanged(pg, i, 4, np.float32, outs, inps)
                refs += [weakref.ref(a) for a in outs + inps]
            del outs, inps
            (planned,) = pg.repeats.forms._planned.values()
            before = fused_runs(pg)
            with planned.lock:
                got = exchanged(pg, 4, 4, np.float32)
            gc.collect()
            return got, fused_runs(pg) - before, fused_runs(pg), [ref() is None for ref in refs]

        for rank, (got, in_use, fused, released) in enumerate(on_ranks(pgs, body)):
            assert got == want(rank, 2, 4, 4, np.float32)
            assert (in_use, fused, released) == (0, 2, [True] * 16)
    finally:
        close(pgs)


@pytest.mark.slow
def test_a_run_promoted_by_a_late_peer_agrees_and_holds_no_array():
    """A run whose peer comes after the spin and yield phases is finished by
    the group (promoted), into the plan's own output buffer, then copied out."""
    import time

    pgs = groups(2, transport="shm", timeout=timedelta(seconds=30))
    try:
        def body(pg):
            for i in range(3):  # (the second call made the plan)
                exchanged(pg, i, 4, np.float32)
            if pg.rank() == 1:
                time.sleep(0.1)  # (the yield phase is 2 ms)
            outs = [np.empty(4, np.float32) for _ in range(2)]
            got = exchanged(pg, 3, 4, np.float32, outs=outs)
            refs = [weakref.ref(a) for a in outs]
            del outs
            gc.collect()
            return got, [ref() is None for ref in refs], fused_runs(pg)

        for rank, (got, released, fused) in enumerate(on_ranks(pgs, body)):
            assert got == want(rank, 2, 3, 4, np.float32)
            assert (released, fused) == ([True] * 2, 2)
    finally:
        close(pgs)


def fresh_exchanges(calls, n):
    """``calls`` all_to_alls on new lists, each checked: whether all were
    right, and how many ran fused."""
    pg = nc.get_default_group()
    r, size = pg.rank(), pg.size()
    right = [exchanged(pg, i, n, np.float32) == want(r, size, i, n, np.float32)
             for i in range(calls)]
    return all(right), fused_runs(pg)


def test_ranks_as_processes_run_fused_by_form_and_agree():
    assert nc.launch(fresh_exchanges, 2, (20, 5), transport="shm",
                     timeout=timedelta(seconds=60)) == [(True, 18)] * 2
