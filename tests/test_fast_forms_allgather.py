"""``all_gather_into_tensor`` and ``all_gather`` (torch's list form) on new
arrays each call, run fused through a plan per form (numcoll.fast.forms):
the ordinary path's results at 2 and 3 ranks, apart, in place and into kept
outputs; arrays the form does not fit taking the ordinary path (its errors
included); a mismatch failing on both ranks; a plan used by one call at a
time and holding no caller's array; ranks as processes."""

import gc
import weakref
from datetime import timedelta

import numpy as np
import pytest

import numcoll as nc

from test_fast_forms import a_mismatch_fails_on_both_ranks
from test_fast_path import close, fused_runs, value
from test_process_group import groups, on_ranks

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif("not __import__('transports').shm_available()")]


def gathered(pg, i, n, dtype, form="apart", out=None):
    """One ``all_gather_into_tensor`` of this rank's ``value(rank, i, n)``, on a
    new input (``form``: apart, in place -- the output's own chunk --, or
    read-only) into a new output (or ``out``); the output afterwards."""
    size, r = pg.size(), pg.rank()
    out = np.empty(size * n, dtype) if out is None else out
    if form == "in place":
        inp = out.reshape(-1)[r * n:(r + 1) * n]
        inp[...] = value(r, i, n, dtype)
    else:
        inp = value(r, i, n, dtype)
        inp.flags.writeable = form != "read-only"
    nc.all_gather_into_tensor(out, inp, group=pg)
    return out


def want(size, i, n, dtype) -> list:
    return np.concatenate([value(q, i, n, dtype) for q in range(size)]).tolist()


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("form", ["apart", "in place", "read-only", "kept output",
                                  "2-d output"])
@pytest.mark.parametrize("dtype", [np.float32, np.int16])
def test_fresh_allgathers_run_fused_by_their_form_and_agree(size, form, dtype):
    pgs = groups(size, transport="shm", timeout=timedelta(seconds=30))
    calls, n = 6, 5
    try:
        def body(pg):
            kept = np.empty(size * n, dtype)
            got = []
            for i in range(calls):
                out = kept if form == "kept output" else \
                    np.empty((size, n), dtype) if form == "2-d output" else None
                out = gathered(pg, i, n, dtype, "apart" if out is not None else form, out)
                got.append(out.reshape(-1).tolist())
            return got, fused_runs(pg), pg.sequence_number(), len(pg.repeats._seen)

        for got, fused, seq, own in on_ranks(pgs, body):
            assert got == [want(size, i, n, dtype) for i in range(calls)]
            # the first call notes the form, the second plans it, the rest run fused
            assert (fused, seq, own) == (calls - 2, calls, 0)
    finally:
        close(pgs)


def test_arrays_the_form_does_not_fit_take_the_ordinary_path():
    """After the form float32[4] -> float32[8] is planned: a misaligned or a
    strided input, an input overlapping the output other than as its own
    chunk (the ordinary path reads it before it writes), a read-only output
    (its error) are not fused; the planned form still is."""
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=30))
    n = 4
    try:
        def body(pg):
            r, log = pg.rank(), []

            def call(inp, i, fused=False, out=None):
                before = fused_runs(pg)
                out = np.empty(2 * n, np.float32) if out is None else out
                nc.all_gather_into_tensor(out, inp, group=pg)
                log.append((out.tolist() == want(2, i, n, np.float32),
                            fused_runs(pg) - before == fused))

            for i in range(3):
                call(value(r, i, n, np.float32), i, fused=i == 2)
            raw = np.zeros(4 * n + 1, np.uint8)
            odd = np.ndarray((n,), np.float32, buffer=raw, offset=1)  # misaligned
            assert not odd.flags.aligned
            odd[...] = value(r, 3, n, np.float32)
            call(odd, 3)
            call(np.repeat(value(r, 4, n, np.float32), 2)[::2], 4)
            out = np.zeros(2 * n, np.float32)
            out[1:n + 1] = value(r, 5, n, np.float32)
            call(out[1:n + 1], 5, out=out)
            locked = np.empty(2 * n, np.float32)
            locked.flags.writeable = False
            with pytest.raises(ValueError, match="read-only|writable|writeable"):
                nc.all_gather_into_tensor(locked, value(r, 6, n, np.float32), group=pg)
            call(value(r, 7, n, np.float32), 7, fused=True)
            return log, pg.sequence_number()

        for log, seq in on_ranks(pgs, body):
            assert log == [(True, True)] * 7, log
            assert seq == 7  # (the refused call is not numbered)
    finally:
        close(pgs)


def test_a_mismatch_against_a_form_plan_fails_on_both_ranks():
    a_mismatch_fails_on_both_ranks(lambda pg, i, other: gathered(
        pg, i, 4, np.float64 if other else np.float32))


def test_a_plan_in_use_is_not_taken_and_holds_no_array_between_calls():
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=30))
    try:
        def body(pg):
            r = pg.rank()
            refs = []
            for i in range(3):  # (the second call made the plan, the third ran on it)
                out, inp = np.empty(8, np.float32), value(r, i, 4, np.float32)
                nc.all_gather_into_tensor(out, inp, group=pg)
                refs += [weakref.ref(out), weakref.ref(inp)]
            del out, inp
            (planned,) = pg.repeats.forms._planned.values()
            before = fused_runs(pg)
            with planned.lock:
                x = gathered(pg, 3, 4, np.float32)
            in_use = fused_runs(pg) - before
            y, inp = np.empty(8, np.float32), value(r, 4, 4, np.float32)
            nc.all_gather_into_tensor(y, inp, group=pg)  # (by the plan again)
            refs.append(weakref.ref(inp))
            del inp
            gc.collect()
            return [x.tolist(), y.tolist()], in_use, fused_runs(pg) - before, \
                [ref() is None for ref in refs]

        for got, in_use, fused, released in on_ranks(pgs, body):
            assert got == [want(2, 3, 4, np.float32), want(2, 4, 4, np.float32)]
            assert (in_use, fused, released) == (0, 1, [True] * 7)
    finally:
        close(pgs)


def test_a_form_whose_input_may_be_shared_is_never_fused(monkeypatch):
    """Shared arrays from 4 KiB: no allgather of a 4 KiB input runs by form,
    and a shared input of that form gets the ordinary path's result."""
    monkeypatch.setenv("NUMCOLL_SHARED_ARRAYS_MIN_NBYTES", "4096")
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=30))
    try:
        def body(pg):
            for i in range(4):
                gathered(pg, i, 1024, np.float32)
            out = nc.empty_shared((2048,), np.float32, group=pg)
            inp = nc.empty_shared((1024,), np.float32, group=pg)
            inp[...] = value(pg.rank(), 9, 1024, np.float32)
            nc.all_gather_into_tensor(out, inp, group=pg)
            return len(pg.repeats.forms.plans()), fused_runs(pg), out.tolist()

        for planned, fused, out in on_ranks(pgs, body):
            assert (planned, fused) == (1, 0)
            assert out == want(2, 9, 1024, np.float32)
    finally:
        close(pgs)


def listed(pg, i, n, dtype, form="new", outs=None, inp=None):
    """One ``all_gather(outs, inp)`` of this rank's ``value(rank, i, n)`` into
    a new list of new arrays (or ``outs``; ``form``: "own row", the input is
    this rank's array of the list); the list afterwards, flat."""
    size, r = pg.size(), pg.rank()
    outs = [np.empty(n, dtype) for _ in range(size)] if outs is None else outs
    inp = outs[r] if form == "own row" else np.empty(n, dtype) if inp is None else inp
    inp[...] = value(r, i, n, dtype)
    nc.all_gather(outs, inp, group=pg)
    return np.concatenate([o.reshape(-1) for o in outs]).tolist()


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("form", ["new", "own row", "kept", "2-d"])
def test_fresh_all_gather_lists_run_fused_by_their_form_and_agree(size, form):
    pgs = groups(size, transport="shm", timeout=timedelta(seconds=30))
    calls, n, dtype = 6, 5, np.int32
    try:
        def body(pg):
            kept = [np.empty(n, dtype) for _ in range(size)], np.empty(n, dtype)
            got = []
            for i in range(calls):
                if form == "kept":
                    got.append(listed(pg, i, n, dtype, "new", *kept))
                elif form == "2-d":
                    outs = [np.empty((1, n), dtype) for _ in range(size)]
                    got.append(listed(pg, i, n, dtype, "new", outs, np.empty((1, n), dtype)))
                else:
                    got.append(listed(pg, i, n, dtype, form))
            return got, fused_runs(pg), pg.sequence_number()

        for got, fused, seq in on_ranks(pgs, body):
            assert got == [want(size, i, n, dtype) for i in range(calls)]
            assert (fused, seq) == (calls - 2, calls)
    finally:
        close(pgs)


def test_lists_the_form_does_not_fit_take_the_ordinary_path():
    """After the form int32[4] is planned: a tuple, a strided input are not
    fused and give the ordinary result (a strided array of the list is
    fused); a list whose arrays overlap, a read-only array, another dtype,
    shape or length get the ordinary path's errors; the planned form still
    runs."""
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=30))
    n = 4
    try:
        def body(pg):
            r, log = pg.rank(), []

            def call(i, outs=None, inp=None, fused=False):
                before = fused_runs(pg)
                got = listed(pg, i, n, np.int32, "new", outs, inp)
                log.append((got == want(2, i, n, np.int32), fused_runs(pg) - before == fused))

            for i in range(3):
                call(i, fused=i == 2)
            call(3, [np.empty(2 * n, np.int32)[::2], np.empty(n, np.int32)], fused=True)
            call(4, (np.empty(n, np.int32), np.empty(n, np.int32)))
            call(5, inp=np.empty(2 * n, np.int32)[::2])
            one = np.empty(n, np.int32)
            locked = np.empty(n, np.int32)
            locked.flags.writeable = False
            for outs, error in (([one, one], "overlap"), ([one, locked], "read-only|writ"),
                                ([one, np.empty(n, np.int64)], "dtype"),
                                ([one, np.empty((2, 2), np.int32)], "size"),
                                ([one], "expected length 2")):
                with pytest.raises(ValueError, match=error):
                    nc.all_gather(outs, value(r, 6, n, np.int32), group=pg)
            call(7, fused=True)
            return log, pg.sequence_number()

        for log, seq in on_ranks(pgs, body):
            assert log == [(True, True)] * 7, log
            assert seq == 7  # (the refused calls are not numbered)
    finally:
        close(pgs)


def test_a_list_mismatch_against_a_form_plan_fails_on_both_ranks():
    a_mismatch_fails_on_both_ranks(lambda pg, i, other: listed(
        pg, i, 5 if other else 4, np.float32))


def test_a_list_plan_holds_no_array_between_calls():
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=30))
    try:
        def body(pg):
            refs = []
            for i in range(4):  # (the second call made the plan, the rest ran on it)
                outs, inp = [np.empty(4, np.float32) for _ in range(2)], np.empty(4, np.float32)
                listed(pg, i, 4, np.float32, "new", outs, inp)
                refs += [weakref.ref(a) for a in (*outs, inp)]
            del outs, inp
            gc.collect()
            return fused_runs(pg), [ref() is None for ref in refs]

        assert on_ranks(pgs, body) == [(2, [True] * 12)] * 2
    finally:
        close(pgs)


def fresh_allgathers(calls, n):
    """``calls`` allgathers into one tensor and ``calls`` into a list, on new
    arrays, each checked: whether all were right, and how many ran fused."""
    pg = nc.get_default_group()
    right = [gathered(pg, i, n, np.float32).tolist() == want(pg.size(), i, n, np.float32)
             for i in range(calls)]
    right += [listed(pg, i, n, np.float32) == want(pg.size(), i, n, np.float32)
              for i in range(calls)]
    return all(right), fused_runs(pg)


def test_ranks_as_processes_run_fused_by_form_and_agree():
    assert nc.launch(fresh_allgathers, 2, (20, 5), transport="shm",
                     timeout=timedelta(seconds=60)) == [(True, 36)] * 2
