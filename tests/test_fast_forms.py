"""Small calls on a new array each time, run fused through a plan per form
(numcoll.fast.forms): the results of the ordinary path at 2 and 3 ranks,
every array the form does not fit taking the ordinary path, ranks on either
path meeting, a mismatch failing on both ranks, a plan used by one call at
a time and holding no caller's array."""

import gc
import weakref
from datetime import timedelta

import numpy as np
import pytest

import numcoll as nc

from test_fast_path import close, fused_runs, logged_all_reduce, reference, value
from test_process_group import groups, on_ranks

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif("not __import__('transports').shm_available()")]


def fresh(pg, name, i, n, dtype, op=nc.ReduceOp.SUM, root=0):
    """One call of ``name`` on a new array; what it holds afterwards."""
    x = value(pg.rank(), i, n, dtype)
    if name == "allreduce":
        nc.all_reduce(x, op=op, group=pg)
    elif name == "reduce":
        nc.reduce(x, dst=root, op=op, group=pg)
    else:
        nc.broadcast(x, src=root, group=pg)
    return x


def expected(name, rank, size, i, n, dtype, op=nc.ReduceOp.SUM, root=0):
    parts = [value(r, i, n, dtype) for r in range(size)]
    if name == "broadcast":
        return parts[root]
    return reference(op, parts) if name == "allreduce" or rank == root else parts[rank]


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("name, op", [("allreduce", nc.ReduceOp.SUM),
                                      ("allreduce", nc.ReduceOp.MAX),
                                      ("reduce", nc.ReduceOp.SUM), ("broadcast", None)])
@pytest.mark.parametrize("dtype", [np.float32, np.int64])
def test_fresh_arrays_run_fused_by_their_form_and_agree(size, name, op, dtype):
    pgs = groups(size, transport="shm", timeout=timedelta(seconds=30))
    calls, n, root = 6, 5, size - 1
    try:
        def body(pg):
            got = [fresh(pg, name, i, n, dtype, op, root).tolist() for i in range(calls)]
            return got, fused_runs(pg), pg.sequence_number(), len(pg.repeats._seen)

        for rank, (got, fused, seq, planned) in enumerate(on_ranks(pgs, body)):
            for i in range(calls):
                assert got[i] == expected(name, rank, size, i, n, dtype, op, root).tolist()
            # the first array notes the form, the second plans it, the rest run fused
            assert (fused, seq, planned) == (calls - 2, calls, 0)
    finally:
        close(pgs)


def test_arrays_the_form_does_not_fit_take_the_ordinary_path():
    """After the form of float32[4] is planned: a read-only array (the ordinary
    path's error), a misaligned one, a subclass, another op, shape or layout
    are not fused and give the ordinary result; the planned form still is."""
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=30))
    try:
        def body(pg):
            r = pg.rank()
            log = []
            call = logged_all_reduce(pg, log)
            for fused in (False, False, True):
                call(np.full(4, r + 1, np.float32), np.full(4, 3, np.float32), fused=fused)
            locked = np.full(4, r + 1, np.float32)
            locked.flags.writeable = False
            with pytest.raises(ValueError, match="read-only|writable|writeable"):
                nc.all_reduce(locked, group=pg)
            raw = np.zeros(17, np.uint8)
            odd = np.ndarray((4,), np.float32, buffer=raw, offset=1)  # misaligned
            assert not odd.flags.aligned
            odd[...] = r + 1
            call(odd, np.full(4, 3, np.float32))

            class Sub(np.ndarray):
                pass

            call(np.full(4, r + 1, np.float32).view(Sub), np.full(4, 3, np.float32))
            call(np.full(4, r + 1, np.float32), np.full(4, 2, np.float32), op=nc.ReduceOp.MAX)
            call(np.full((2, 2), r + 1, np.float32), np.full((2, 2), 3, np.float32))
            call(np.full(8, r + 1, np.float32)[::2], np.full(4, 3, np.float32))
            call(np.full(4, r + 1, np.float32), np.full(4, 3, np.float32), fused=True)
            return log, pg.sequence_number()

        for log, seq in on_ranks(pgs, body):
            assert all(log), [i for i, ok in enumerate(log) if not ok]
            assert seq == 9  # (the read-only call is refused before it is numbered)
    finally:
        close(pgs)


def test_a_rank_on_a_form_plan_meets_ranks_on_the_ordinary_and_repeat_paths():
    pgs = groups(3, transport="shm", timeout=timedelta(seconds=30))
    try:
        def body(pg):
            r, kept, got = pg.rank(), np.zeros(3, np.int64), []
            for i in range(8):
                if r == 0:  # a new array each call: its form's plan from the third
                    x = value(r, i, 3, np.int64)
                elif r == 1:  # the same array: its own plan from the third
                    kept[...] = value(r, i, 3, np.int64)
                    x = kept
                else:  # a new array of a new shape each call: never planned
                    x = value(r, i, 3, np.int64).reshape(1, 3) if i % 2 else \
                        value(r, i, 3, np.int64)
                nc.all_reduce(x, group=pg)
                got.append(x.reshape(-1).tolist())
            return got, fused_runs(pg) > 0

        results = on_ranks(pgs, body)
        for got, _ in results:
            assert got == [sum(value(q, i, 3, np.int64) for q in range(3)).tolist()
                           for i in range(8)]
        assert [f for _, f in results] == [True, True, True]
    finally:
        close(pgs)


def a_mismatch_fails_on_both_ranks(call):
    """Calls ``call(pg, i, False)`` 0-2 plan a form; call 3 -- rank 0's by the
    form's plan, rank 1's ``call(pg, 3, True)`` of another form on the
    ordinary path -- fails with the mismatch error on both ranks."""
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=20))
    try:
        def body(pg):
            for i in range(3):
                call(pg, i, False)
            call(pg, 3, pg.rank() == 1)

        with pytest.raises(nc.CollectiveMismatchError, match="Detected mismatch"):
            on_ranks(pgs, body)
    finally:
        close(pgs)


def by_form_beside_the_ordinary_path(call, calls: int) -> list:
    """``call(pg, i)`` (whether its result is right) for ``i`` in
    ``range(calls)`` on 2 ranks, rank 1 forgetting its forms before each
    call (the ordinary path, every time), rank 0 running by form: each
    rank's results and fused runs."""
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=30))
    try:
        def body(pg):
            got = []
            for i in range(calls):
                if pg.rank() == 1:
                    pg.repeats.clear()
                got.append(call(pg, i))
            return got, fused_runs(pg)

        return on_ranks(pgs, body)
    finally:
        close(pgs)


def test_a_mismatch_against_a_form_plan_fails_on_both_ranks():
    a_mismatch_fails_on_both_ranks(lambda pg, i, other: fresh(
        pg, "allreduce", i, 4, np.float64 if other else np.float32))


def test_a_plan_in_use_is_not_taken_and_holds_no_array_between_calls():
    """A call that finds its form's plan in use (another thread's call of
    the same form) takes the ordinary path; once a call returns, the plan
    keeps no reference to its array."""
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=30))
    try:
        def body(pg):
            # (the second array made the plan)
            refs = [weakref.ref(fresh(pg, "allreduce", i, 4, np.float32)) for i in range(3)]
            (planned,) = pg.repeats.forms._planned.values()
            before = fused_runs(pg)
            with planned.lock:
                x = fresh(pg, "allreduce", 3, 4, np.float32)
            in_use = fused_runs(pg) - before
            y = fresh(pg, "allreduce", 4, 4, np.float32)
            refs.append(weakref.ref(y))
            del y
            gc.collect()
            return x.tolist(), in_use, fused_runs(pg) - before, [r() is None for r in refs]

        for x, in_use, fused, released in on_ranks(pgs, body):
            assert x == [float(v) for v in value(0, 3, 4, np.float32) + value(1, 3, 4, np.float32)]
            assert (in_use, fused, released) == (0, 1, [True] * 4)
    finally:
        close(pgs)


def test_a_new_default_timeout_forgets_the_forms():
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=30))
    try:
        def body(pg):
            for i in range(3):
                fresh(pg, "broadcast", i, 4, np.float32)
            planned = len(pg.repeats.forms.plans())
            pg.set_timeout(timedelta(seconds=20))  # every plan holds its deadline
            before = fused_runs(pg)
            x = fresh(pg, "broadcast", 3, 4, np.float32)
            return planned, len(pg.repeats.forms.plans()), fused_runs(pg) - before, x.tolist()

        for planned, after, fused, x in on_ranks(pgs, body):
            assert (planned, after, fused) == (1, 0, 0)
            assert x == value(0, 3, 4, np.float32).tolist()
    finally:
        close(pgs)


def test_a_form_an_array_of_which_may_be_shared_is_never_fused(monkeypatch):
    """Shared arrays from 4 KiB: a plain array of that size planned by form
    could stand for a shared one, which the ordinary path reads in place, so
    no array of such a form runs fused, and a shared array of it gets the
    ordinary path's result."""
    monkeypatch.setenv("NUMCOLL_SHARED_ARRAYS_MIN_NBYTES", "4096")
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=30))
    try:
        def body(pg):
            for i in range(4):
                fresh(pg, "allreduce", i, 1024, np.float32)
            x = nc.empty_shared((1024,), np.float32, group=pg)
            x[...] = value(pg.rank(), 9, 1024, np.float32)
            nc.all_reduce(x, group=pg)
            return len(pg.repeats.forms.plans()), fused_runs(pg), x.tolist()

        for planned, fused, x in on_ranks(pgs, body):
            assert (planned, fused) == (1, 0)
            assert x == (value(0, 9, 1024, np.float32) + value(1, 9, 1024, np.float32)).tolist()
    finally:
        close(pgs)


def test_arrays_of_one_form_called_in_turn_each_get_a_plan_of_their_own():
    """Two kept arrays of one form, called in turn: the second plans the form,
    and each array that comes back through it gets its own plan (the faster
    path), as it would without forms."""
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=30))
    try:
        def body(pg):
            r = pg.rank()
            a, b = np.zeros(3, np.float64), np.zeros(3, np.float64)
            got = []
            for i in range(6):
                for x in (a, b):
                    x[...] = value(r, i, 3, np.float64)
                    nc.all_reduce(x, group=pg)
                    got.append(x.tolist())
            own = sorted(seen.x is a or seen.x is b for seen in pg.repeats._seen.values())
            return got, own, len(pg.repeats.forms.plans()), fused_runs(pg)

        for got, own, forms, fused in on_ranks(pgs, body):
            assert got == [(value(0, i, 3, np.float64) + value(1, i, 3, np.float64)).tolist()
                           for i in range(6) for _ in range(2)]
            # a's first call is ordinary; b's too, and plans the form; each one's
            # second runs by form and, the array seen twice, plans its own
            assert (own, forms, fused) == ([True, True], 1, 10)
    finally:
        close(pgs)


def test_two_dtypes_of_one_shape_called_in_turn_each_keep_their_plan():
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=30))
    try:
        def body(pg):
            got = []
            for i in range(5):
                for dtype in (np.float32, np.float64):
                    got.append(fresh(pg, "allreduce", i, 4, dtype).tolist())
            return got, len(pg.repeats.forms.plans()), fused_runs(pg)

        for got, forms, fused in on_ranks(pgs, body):
            assert got == [(value(0, i, 4, d) + value(1, i, 4, d)).tolist()
                           for i in range(5) for d in (np.float32, np.float64)]
            assert (forms, fused) == (2, 6)
    finally:
        close(pgs)


def test_a_run_promoted_by_a_late_peer_holds_no_array_afterwards():
    """A form's run whose peer comes after the wait's spin and yield phases
    is finished by the group (promoted, as any fused call): its Work's
    future held the array until the plan's next promoted run."""
    import time

    pgs = groups(2, transport="shm", timeout=timedelta(seconds=30))
    try:
        def body(pg):
            for i in range(3):  # (the second array made the plan)
                fresh(pg, "allreduce", i, 4, np.float32)
            if pg.rank() == 1:
                time.sleep(0.1)  # (the yield phase is 2 ms)
            x = fresh(pg, "allreduce", 3, 4, np.float32)
            ref = weakref.ref(x)
            got = x.tolist()
            del x
            gc.collect()
            return got, ref() is None, fused_runs(pg)

        for got, released, fused in on_ranks(pgs, body):
            assert got == (value(0, 3, 4, np.float32) + value(1, 3, 4, np.float32)).tolist()
            assert (released, fused) == (True, 2)
    finally:
        close(pgs)
