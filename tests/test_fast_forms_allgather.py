"""``all_gather_into_tensor`` on new arrays each call, run fused through a plan
per form (numcoll.fast.forms): the ordinary path's results at 2 and 3 ranks,
apart, in place and into a kept output; arrays the form does not fit taking
the ordinary path (its errors included); a mismatch failing on both ranks; a
plan used by one call at a time and holding no caller's array."""

import gc
import weakref
from datetime import timedelta

import numpy as np
import pytest

import numcoll as nc

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
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=20))
    try:
        def body(pg):
            for i in range(3):
                gathered(pg, i, 4, np.float32)
            # rank 0 by the form's plan, rank 1 on the ordinary path
            gathered(pg, 3, 4, np.float32 if pg.rank() == 0 else np.float64)

        with pytest.raises(nc.CollectiveMismatchError, match="Detected mismatch"):
            on_ranks(pgs, body)
    finally:
        close(pgs)


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


def fresh_allgathers(calls, n):
    """``calls`` allgathers on new arrays, each checked: whether all were
    right, and how many ran fused."""
    pg = nc.get_default_group()
    right = [gathered(pg, i, n, np.float32).tolist() == want(pg.size(), i, n, np.float32)
             for i in range(calls)]
    return all(right), fused_runs(pg)


def test_ranks_as_processes_run_fused_by_form_and_agree():
    assert nc.launch(fresh_allgathers, 2, (20, 5), transport="shm",
                     timeout=timedelta(seconds=60)) == [(True, 18)] * 2
