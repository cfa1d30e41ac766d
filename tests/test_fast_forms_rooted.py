"""``gather`` and ``scatter`` on new arrays each call, run fused through a plan
per form (numcoll.fast.forms: the root's list moved through the plan's own
buffer): the ordinary path's results at 2 and 3 ranks, every root, in place
and into kept lists; arrays the form does not fit taking the ordinary path
(its errors included); a mismatch failing on both ranks; a plan used by one
call at a time and holding no caller's array; ranks as processes."""

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


def rooted(pg, name, i, n, dtype, root=0, tensor=None, blocks=None):
    """One ``name`` (gather, scatter) from or to group rank ``root`` of
    ``n``-element arrays, new ones (or ``tensor``, and the root's ``blocks``)
    filled from ``value``; what the rank holds afterwards (the root's list
    for a gather, ``tensor`` for a scatter)."""
    size, r = pg.size(), pg.rank()
    tensor = np.empty(n, dtype) if tensor is None else tensor
    if r == root and blocks is None:
        blocks = [np.empty(n, dtype) for _ in range(size)]
    if name == "gather":
        tensor[...] = value(r, i, n, dtype)
        nc.gather(tensor, blocks if r == root else None, dst=root, group=pg)
        return [b.tolist() for b in blocks] if r == root else None
    if r == root:
        for q, b in enumerate(blocks):
            if b is not tensor:
                b[...] = value(q, i, n, dtype)
        if tensor is blocks[r]:
            tensor[...] = value(r, i, n, dtype)
    nc.scatter(tensor, blocks if r == root else None, src=root, group=pg)
    return tensor.tolist()


def want(name, rank, size, i, n, dtype, root=0):
    if name == "gather":
        return [value(q, i, n, dtype).tolist() for q in range(size)] if rank == root else None
    return value(rank, i, n, dtype).tolist()


@pytest.mark.parametrize("size", [2, 3])
def test_fresh_arrays_run_fused_by_their_form_and_agree(size):
    """Each of gather and scatter, from rank 0 and the last rank, float32 and
    int64, on new arrays each call: the first call notes the form, the
    second plans it, the rest run fused, and every result is NumPy's."""
    pgs = groups(size, transport="shm", timeout=timedelta(seconds=30))
    calls, n = 5, 3
    cases = [(name, root, dtype) for name in ("gather", "scatter") for root in (0, size - 1)
             for dtype in (np.float32, np.int64)]
    try:
        def body(pg):
            log = []
            for name, root, dtype in cases:
                pg.repeats.clear()
                before, seq = fused_runs(pg), pg.sequence_number()
                got = [rooted(pg, name, i, n, dtype, root) for i in range(calls)]
                log.append((got, fused_runs(pg) - before, pg.sequence_number() - seq,
                            len(pg.repeats._seen)))
            return log

        for rank, log in enumerate(on_ranks(pgs, body)):
            for (name, root, dtype), (got, fused, seq, own) in zip(cases, log):
                assert got == [want(name, rank, size, i, n, dtype, root)
                               for i in range(calls)], (name, root, dtype)
                assert (fused, seq, own) == (calls - 2, calls, 0), (name, root, dtype)
    finally:
        close(pgs)


def test_in_place_kept_and_spanned_lists_run_fused_and_agree():
    """Once the forms are planned: the root's ``tensor`` as its own entry of
    the list (torch's in-place form), a list kept across calls, a list of
    views of one array, a scatter's read-only and strided inputs -- each
    fused, each right."""
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=30))
    n = 4
    try:
        def body(pg):
            r, log = pg.rank(), []

            def call(name, i, **kw):
                before = fused_runs(pg)
                got = rooted(pg, name, i, n, np.float32, **kw)
                log.append((got == want(name, r, 2, i, n, np.float32), fused_runs(pg) - before))

            for i in range(2):
                call("gather", i)
                call("scatter", i)
            own = [np.empty(n, np.float32) for _ in range(2)]
            call("gather", 2, tensor=own[0] if r == 0 else None, blocks=own)
            call("scatter", 3, tensor=own[0] if r == 0 else None, blocks=own)
            kept = [np.empty(n, np.float32) for _ in range(2)]
            call("gather", 4, blocks=kept)
            call("gather", 5, blocks=kept)  # (new tensors: still by form)
            call("gather", 6, blocks=list(np.empty((2, n), np.float32)))
            strided = np.empty((2, 2 * n), np.float32)
            call("scatter", 7, blocks=[strided[0, ::2], strided[1, ::2]])
            if r == 0:  # (a read-only list: filled first, then scattered)
                blocks = [value(q, 8, n, np.float32) for q in range(2)]
                for b in blocks:
                    b.flags.writeable = False
                before = fused_runs(pg)
                x = np.empty(n, np.float32)
                nc.scatter(x, blocks, src=0, group=pg)
                log.append((x.tolist() == want("scatter", r, 2, 8, n, np.float32),
                            fused_runs(pg) - before))
            else:
                call("scatter", 8)
            return log

        for log in on_ranks(pgs, body):
            assert log == [(True, 0)] * 4 + [(True, 1)] * 7, log
    finally:
        close(pgs)


def test_arrays_the_form_does_not_fit_take_the_ordinary_path():
    """After the forms are planned: a root's tensor that is another rank's entry
    of its gather list, entries of another shape, a strided tensor, a list
    whose entries overlap take the ordinary path, with its results or its
    errors; the planned forms still run."""
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=30))
    n = 4
    try:
        def body(pg):
            r, log = pg.rank(), []

            def call(name, i, **kw):
                before = fused_runs(pg)
                got = rooted(pg, name, i, n, np.float32, **kw)
                log.append((got, fused_runs(pg) - before))

            for i in range(3):
                call("gather", i)
            lst = [np.empty(n, np.float32) for _ in range(2)]
            call("gather", 3, tensor=lst[1] if r == 0 else None, blocks=lst)
            call("gather", 4, tensor=np.empty(2 * n, np.float32)[::2])
            if r == 0:  # (the ordinary errors, raised before the call is numbered)
                whole, stuck = np.empty(n + 2, np.float32), np.empty(n, np.float32)
                stuck.flags.writeable = False
                for blocks in ([np.empty((2, 2), np.float32) for _ in range(2)],
                               [whole[:n], whole[2:]], [np.empty(n, np.float32), stuck]):
                    try:
                        call("gather", 5, blocks=blocks)
                    except ValueError as e:
                        log.append(str(e))
            call("gather", 6)
            for i in range(3):
                call("scatter", i)
            stuck = np.empty(n, np.float32)  # (a read-only output, on every rank: its error)
            stuck.flags.writeable = False
            try:
                nc.scatter(stuck, [np.empty(n, np.float32)] * 2 if r == 0 else None, group=pg)
            except ValueError as e:
                log.append(str(e))
            call("scatter", 3)
            return log

        for rank, log in enumerate(on_ranks(pgs, body)):
            fresh = [(want("gather", rank, 2, i, n, np.float32), int(i == 2)) for i in range(3)]
            assert log[:3] == fresh
            # rank 0's tensor, lst[1], is read before the list is written (rank 1's
            # call fits its form: a fused rank meeting an ordinary one)
            assert log[3] == (want("gather", rank, 2, 3, n, np.float32), rank)
            assert log[4] == (want("gather", rank, 2, 4, n, np.float32), 0)
            if rank == 0:
                assert "invalid tensor size" in log[5], log[5]
                assert "overlap" in log[6], log[6]
                assert "read-only" in log[7], log[7]
            assert log[-6] == (want("gather", rank, 2, 6, n, np.float32), 1)
            assert "read-only" in log[-2], log[-2]
            assert log[-1] == (want("scatter", rank, 2, 3, n, np.float32), 1)
    finally:
        close(pgs)


def test_zero_dimensional_arrays_run_by_form_and_agree():
    """0-d arrays through the plans whose lists move through a buffer of
    their own (gather, scatter, both list forms): each row one element."""
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=30))
    try:
        def body(pg):
            r, got = pg.rank(), []

            def scalars(*values):
                return [np.array(float(v), np.float32) for v in values]

            for i in range(4):
                lst = scalars(-1, -1) if r == 0 else None
                nc.gather(scalars(r + i)[0], lst, dst=0, group=pg)
                y = scalars(-1)[0]
                nc.scatter(y, scalars(i, 10 + i) if r == 0 else None, src=0, group=pg)
                outs = scalars(-1, -1)
                nc.all_to_all(outs, scalars(10 * r + i, 10 * r + 1 + i), group=pg)
                rows = scalars(-1, -1)
                nc.all_gather(rows, scalars(r + i)[0], group=pg)
                got.append([None if lst is None else [float(a) for a in lst], float(y),
                            [float(a) for a in outs], [float(a) for a in rows]])
            return got, fused_runs(pg)

        for rank, (got, fused) in enumerate(on_ranks(pgs, body)):
            assert got == [[[float(i), 1.0 + i] if rank == 0 else None, 10.0 * rank + i,
                            [float(rank + i), 10.0 + rank + i], [float(i), 1.0 + i]]
                           for i in range(4)]
            assert fused == 8
    finally:
        close(pgs)


def test_a_mismatch_against_a_form_plan_fails_on_both_ranks():
    a_mismatch_fails_on_both_ranks(lambda pg, i, other: rooted(
        pg, "gather", i, 4, np.float64 if other else np.float32))


def test_a_plan_in_use_is_not_taken_and_holds_no_array_between_calls():
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=30))
    try:
        def body(pg):
            refs = []
            for i in range(4):  # (the second call made the plans, the rest ran on them)
                for name in ("gather", "scatter"):
                    tensor = np.empty(4, np.float32)
                    blocks = [np.empty(4, np.float32) for _ in range(2)] if pg.rank() == 0 \
                        else None
                    rooted(pg, name, i, 4, np.float32, tensor=tensor, blocks=blocks)
                    refs += [weakref.ref(a) for a in [tensor, *(blocks or ())]]
            del tensor, blocks
            gathering = pg.repeats.forms._planned[("gather", 0, (4,), np.dtype(np.float32).num)]
            before = fused_runs(pg)
            with gathering.lock:
                got = rooted(pg, "gather", 4, 4, np.float32)
            gc.collect()
            return got, fused_runs(pg) - before, fused_runs(pg), [ref() is None for ref in refs]

        for rank, (got, in_use, fused, released) in enumerate(on_ranks(pgs, body)):
            assert got == want("gather", rank, 2, 4, 4, np.float32)
            assert (in_use, fused) == (0, 4)
            assert released == [True] * (len(released)) and len(released) == (24 if rank == 0
                                                                                else 8)
    finally:
        close(pgs)


@pytest.mark.slow
def test_runs_promoted_by_a_late_peer_agree_and_hold_no_array():
    """A gather whose non-root comes after the root's spin and yield phases,
    and a scatter whose root does: the waiting rank's run is finished by the
    group (promoted), the root's list still copied out of, or into, the
    plan's own buffer; no array kept."""
    import time

    pgs = groups(2, transport="shm", timeout=timedelta(seconds=30))
    try:
        def body(pg):
            r, got, refs = pg.rank(), [], []
            for name, late in (("gather", 1), ("scatter", 0)):
                for i in range(3):  # (the second call made the plan)
                    rooted(pg, name, i, 4, np.float32)
                if r == late:
                    time.sleep(0.1)  # (the yield phase is 2 ms)
                tensor = np.empty(4, np.float32)
                blocks = [np.empty(4, np.float32) for _ in range(2)] if r == 0 else None
                got.append(rooted(pg, name, 3, 4, np.float32, tensor=tensor, blocks=blocks))
                refs += [weakref.ref(a) for a in [tensor, *(blocks or ())]]
            del tensor, blocks
            gc.collect()
            return got, [ref() is None for ref in refs], fused_runs(pg)

        for rank, (got, released, fused) in enumerate(on_ranks(pgs, body)):
            assert got == [want(name, rank, 2, 3, 4, np.float32) for name in ("gather", "scatter")]
            assert all(released) and fused == 4
    finally:
        close(pgs)


def fresh_rooted(calls, n):
    """``calls`` gathers and ``calls`` scatters from rank 1 on new arrays, each
    checked: whether all were right, and how many ran fused."""
    pg = nc.get_default_group()
    r, size = pg.rank(), pg.size()
    right = [rooted(pg, name, i, n, np.float32, root=1) == want(name, r, size, i, n, np.float32,
                                                                root=1)
             for name in ("gather", "scatter") for i in range(calls)]
    return all(right), fused_runs(pg)


def test_ranks_as_processes_run_fused_by_form_and_agree():
    assert nc.launch(fresh_rooted, 2, (20, 5), transport="shm",
                     timeout=timedelta(seconds=60)) == [(True, 36)] * 2
