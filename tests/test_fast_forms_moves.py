"""``reduce_scatter_tensor`` and ``all_to_all_single`` on new arrays each call,
run fused through a plan per form (numcoll.fast.forms, the plan a
numcoll.fast.moves.FusedMove pointed at each call's arrays): the ordinary
path's results at 2 and 3 ranks; arrays the form does not fit (overlapping,
strided, another op) taking the ordinary path; a mismatch failing on both
ranks; a plan used by one call at a time and holding no caller's array;
ranks as processes."""

import gc
import weakref
from datetime import timedelta

import numpy as np
import pytest

import numcoll as nc

from test_fast_forms import a_mismatch_fails_on_both_ranks
from test_fast_path import close, fused_runs, reference, value
from test_process_group import groups, on_ranks

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif("not __import__('transports').shm_available()")]


def moved(pg, name, i, n, dtype, op=nc.ReduceOp.SUM, out=None, inp=None):
    """One call of ``name`` (reduce_scatter, alltoall) on new arrays (or
    ``out``, ``inp``), ``n`` elements a rank's share; the output afterwards."""
    size, r = pg.size(), pg.rank()
    out = np.empty(n if name == "reduce_scatter" else n * size, dtype) if out is None else out
    inp = np.empty(n * size, dtype) if inp is None else inp
    inp[...] = value(r, i, n * size, dtype)
    if name == "reduce_scatter":
        nc.reduce_scatter_tensor(out, inp, op=op, group=pg)
    else:
        nc.all_to_all_single(out, inp, group=pg)
    return out.tolist()


def want(name, rank, size, i, n, dtype, op=nc.ReduceOp.SUM) -> list:
    parts = [value(q, i, n * size, dtype) for q in range(size)]
    if name == "reduce_scatter":
        return reference(op, parts)[rank * n:(rank + 1) * n].tolist()
    return np.concatenate([p[rank * n:(rank + 1) * n] for p in parts]).tolist()


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("name, op", [("reduce_scatter", nc.ReduceOp.SUM),
                                      ("reduce_scatter", nc.ReduceOp.MAX),
                                      ("alltoall", None)])
@pytest.mark.parametrize("dtype", [np.float32, np.int64])
def test_fresh_arrays_run_fused_by_their_form_and_agree(size, name, op, dtype):
    pgs = groups(size, transport="shm", timeout=timedelta(seconds=30))
    calls, n = 6, 5
    try:
        def body(pg):
            got = [moved(pg, name, i, n, dtype, op or nc.ReduceOp.SUM) for i in range(calls)]
            return got, fused_runs(pg), pg.sequence_number(), len(pg.repeats._seen)

        for rank, (got, fused, seq, own) in enumerate(on_ranks(pgs, body)):
            assert got == [want(name, rank, size, i, n, dtype, op or nc.ReduceOp.SUM)
                           for i in range(calls)]
            # the first call notes the form, the second plans it, the rest run fused
            assert (fused, seq, own) == (calls - 2, calls, 0)
    finally:
        close(pgs)


def test_arrays_the_form_does_not_fit_take_the_ordinary_path():
    """After the forms of both are planned: a reduce_scatter into its own
    share of the input (torch's in-place form), a strided input, another op,
    an alltoall whose output overlaps its input are not fused and give the
    ordinary results; the planned forms still run."""
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=30))
    n = 4
    try:
        def body(pg):
            r, log = pg.rank(), []

            def call(name, i, fused=False, **kw):
                before = fused_runs(pg)
                got = moved(pg, name, i, n, np.float32, **kw)
                log.append((got == want(name, r, 2, i, n, np.float32, kw.get("op",
                                                                              nc.ReduceOp.SUM)),
                            fused_runs(pg) - before == fused))

            for i in range(3):
                call("reduce_scatter", i, fused=i == 2)
                call("alltoall", i, fused=i == 2)
            whole = np.empty(2 * n, np.float32)
            call("reduce_scatter", 3, out=whole[r * n:(r + 1) * n], inp=whole)
            call("reduce_scatter", 4, inp=np.empty(4 * n, np.float32)[::2])
            call("reduce_scatter", 5, op=nc.ReduceOp.MIN)
            both = np.empty(3 * n, np.float32)  # (the ordinary path reads the input first)
            call("alltoall", 6, out=both[:2 * n], inp=both[n:])
            call("reduce_scatter", 7, fused=True)
            call("alltoall", 7, fused=True)
            return log, pg.sequence_number()

        for log, seq in on_ranks(pgs, body):
            assert log == [(True, True)] * 12, log
            assert seq == 12
    finally:
        close(pgs)


def test_a_mismatch_against_a_form_plan_fails_on_both_ranks():
    a_mismatch_fails_on_both_ranks(lambda pg, i, other: moved(
        pg, "alltoall", i, 4, np.float64 if other else np.float32))


def test_a_plan_in_use_is_not_taken_and_holds_no_array_between_calls():
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=30))
    try:
        def body(pg):
            refs = []
            for i in range(4):  # (the second call made the plan, the rest ran on it)
                out, inp = np.empty(4, np.float32), np.empty(8, np.float32)
                moved(pg, "reduce_scatter", i, 4, np.float32, out=out, inp=inp)
                refs += [weakref.ref(out), weakref.ref(inp)]
            del out, inp
            (planned,) = pg.repeats.forms._planned.values()
            before = fused_runs(pg)
            with planned.lock:
                got = moved(pg, "reduce_scatter", 4, 4, np.float32)
            gc.collect()
            return got, fused_runs(pg) - before, fused_runs(pg), [ref() is None for ref in refs]

        for rank, (got, in_use, fused, released) in enumerate(on_ranks(pgs, body)):
            assert got == want("reduce_scatter", rank, 2, 4, 4, np.float32)
            assert (in_use, fused, released) == (0, 2, [True] * 8)
    finally:
        close(pgs)


def test_arrays_of_one_form_called_in_turn_each_get_a_plan_of_their_own():
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=30))
    try:
        def body(pg):
            pairs = [(np.empty(4, np.float32), np.empty(8, np.float32)) for _ in range(2)]
            got = [moved(pg, "reduce_scatter", i, 4, np.float32, out=out, inp=inp)
                   for i in range(4) for out, inp in pairs]
            return got, len(pg.repeats._seen), len(pg.repeats.forms.plans())

        for rank, (got, own, forms) in enumerate(on_ranks(pgs, body)):
            assert got == [want("reduce_scatter", rank, 2, i, 4, np.float32)
                           for i in range(4) for _ in range(2)]
            assert (own, forms) == (2, 1)
    finally:
        close(pgs)


def fresh_moves(calls, n):
    """``calls`` reduce_scatters and ``calls`` alltoalls on new arrays, each
    checked: whether all were right, and how many ran fused."""
    pg = nc.get_default_group()
    r, size = pg.rank(), pg.size()
    right = [moved(pg, name, i, n, np.float32) == want(name, r, size, i, n, np.float32)
             for name in ("reduce_scatter", "alltoall") for i in range(calls)]
    return all(right), fused_runs(pg)


def test_ranks_as_processes_run_fused_by_form_and_agree():
    assert nc.launch(fresh_moves, 2, (20, 5), transport="shm",
                     timeout=timedelta(seconds=60)) == [(True, 36)] * 2
