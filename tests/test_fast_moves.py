"""Small data-moving calls that repeat, run as one fused arena step
(numcoll.fast.moves): all_gather_into_tensor, gather, scatter,
all_to_all_single and reduce_scatter_tensor through the module API.

Results against NumPy at 2-5 ranks, with and without the in-place forms; a
rank on the fused path meets a rank on the ordinary one; the overlap fuzz of
tests/test_overlap.py with every call repeated (so the repeats run fused); a
mismatch on the fused path fails as on the ordinary one; calls the ``shared``
algorithm moves in several rounds are not fused."""

from datetime import timedelta

import numpy as np
import pytest

import numcoll as nc

from test_fast_path import close, fused_runs
from test_overlap import _build, _fuzz
from test_process_group import groups, on_ranks

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.skipif("not __import__('transports').shm_available()")]

CALLS = 4  # the first is seen, the second learnt, the rest run fused


def _every_form(pg, count: int, log: list) -> None:
    """Each fused form CALLS times with new contents, checked against NumPy."""
    r, n = pg.rank(), pg.size()
    root = n - 1
    whole = np.zeros(count * n, np.float32)
    block = np.zeros(count, np.float32)
    other = np.zeros(count * n, np.float32)
    rows, pieces = list(whole.reshape(n, count)), list(other.reshape(n, count))
    own = whole[r * count:(r + 1) * count]
    ramp = np.arange(count, dtype=np.float32)
    for i in range(CALLS):
        block[...] = ramp + 10 * r + i
        nc.all_gather_into_tensor(whole, block, group=pg)
        log.append(np.array_equal(whole, np.concatenate([ramp + 10 * q + i for q in range(n)])))
        own[...] = ramp + 10 * r + i                       # in place
        nc.all_gather_into_tensor(whole, own, group=pg)
        log.append(np.array_equal(whole, np.concatenate([ramp + 10 * q + i for q in range(n)])))
        other[...] = np.repeat(np.arange(n, dtype=np.float32), count) + 100 * r + i
        nc.all_to_all_single(whole, other, group=pg)
        log.append(np.array_equal(whole, np.repeat(np.arange(n, dtype=np.float32) * 100 + r
                                                   + i, count)))
        block[...] = ramp + r + i
        nc.gather(block, rows if r == root else None, dst=root, group=pg)
        if r == root:
            log.append(np.array_equal(whole, np.concatenate([ramp + q + i for q in range(n)])))
        other[...] = np.repeat(np.arange(n, dtype=np.float32), count) + i
        nc.scatter(block, list(pieces) if r == 0 else None, src=0, group=pg)
        # (a new list of the same views each call: still a repeat)
        log.append(np.array_equal(block, np.full(count, r + i, np.float32)))
        other[...] = np.arange(count * n) + r + i
        nc.reduce_scatter_tensor(block, other, op=nc.ReduceOp.MAX, group=pg)
        log.append(np.array_equal(block, np.arange(r * count, (r + 1) * count) + n - 1 + i))
        other[...] = np.arange(count * n) * (r + 1) + i
        nc.reduce_scatter_tensor(own, other, group=pg)
        want = sum(np.arange(r * count, (r + 1) * count) * (q + 1) + i for q in range(n))
        log.append(np.array_equal(own, want.astype(np.float32)))


@pytest.mark.parametrize("size", [2, 3, 5])
@pytest.mark.parametrize("count", [1, 7, 4096])
def test_every_form_repeated_runs_fused_and_agrees(size, count):
    pgs = groups(size, transport="shm", timeout=timedelta(seconds=30))
    try:
        def body(pg):
            log = []
            _every_form(pg, count, log)
            return log, fused_runs(pg)

        for log, fused in on_ranks(pgs, body):
            assert all(log), [i for i, ok in enumerate(log) if not ok]
            # 7 forms (gather's output and scatter's input by the root only):
            # the calls after the second of each ran fused; and the two
            # allgathers' arrays are of one form (numcoll.fast.forms), planned
            # by the first call of the second: each one's second call ran by it.
            assert fused == 7 * (CALLS - 2) + 2
    finally:
        close(pgs)


@pytest.mark.parametrize("forms", [False, True])
def test_a_fused_rank_meets_an_ordinary_one(forms):
    """Rank 0 repeats its arrays (fused), rank 1 passes fresh ones: the
    ordinary path (its forms forgotten before each call), or its forms'
    plans (numcoll.fast.forms). The same steps, the same results."""
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=30))
    try:
        def body(pg):
            r, count, log = pg.rank(), 5, []
            keep_out, keep_in = np.zeros(2 * count), np.zeros(2 * count)
            for i in range(CALLS):
                if r == 1 and not forms:
                    pg.repeats.forms.clear()
                out, inp = (keep_out, keep_in) if r == 0 else (np.zeros(10), np.zeros(10))
                inp[...] = np.arange(10) + 100 * r + i
                nc.all_to_all_single(out, inp, group=pg)
                log.append(np.array_equal(out, np.concatenate(
                    [np.arange(r * 5, r * 5 + 5) + 100 * q + i for q in range(2)])))
                nc.reduce_scatter_tensor(out[:count], inp, group=pg)
                log.append(np.array_equal(out[:count], np.arange(r * 5, r * 5 + 5) * 2 + 100
                                          + 2 * i))
            return log, fused_runs(pg)

        (log0, fused0), (log1, fused1) = on_ranks(pgs, body)
        assert all(log0) and all(log1)
        # (rank 0's reduce_scatter, a new view each call, by its form from the
        # third call; rank 1's calls, both by form, or none fused)
        assert (fused0, fused1) == (2 * (CALLS - 2), 2 * (CALLS - 2) * forms)
    finally:
        close(pgs)


def test_a_changed_array_takes_the_ordinary_path():
    """After a fused repeat, each change below -- an array reshaped or retyped
    in place (the same object), a list element swapped for an equal array,
    an output made read-only -- takes the ordinary path (the fused count does
    not move) with the ordinary result or error; the unchanged call after it
    is fused again."""
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=30))
    try:
        def body(pg):
            r, log = pg.rank(), []
            out, inp = np.zeros(8, np.float32), np.zeros(8, np.float32)
            block = np.zeros(4, np.float32)
            whole = np.zeros(8, np.float32)
            rows = list(whole.reshape(2, 4))

            def exchange(fused, dtype=np.float32):
                """One all_to_all_single, checked; ``fused``: whether it must
                have run fused (None: either)."""
                before = fused_runs(pg)
                inp.reshape(-1)[...] = np.arange(8) + 10 * r
                nc.all_to_all_single(out, inp, group=pg)
                want = np.concatenate([np.arange(4 * r, 4 * r + 4) + 10 * q for q in range(2)])
                log.append(("alltoall result", out.dtype == dtype and
                            np.array_equal(out.reshape(-1), want)))
                ran = fused_runs(pg) - before == 1
                log.append((f"fused is {ran}", fused is None or ran == fused))
                return ran

            def gather(fused):
                """One gather into ``rows`` on rank 0, checked (as ``exchange``)."""
                before = fused_runs(pg)
                block[...] = r + 1
                nc.gather(block, rows if r == 0 else None, dst=0, group=pg)
                if r == 0:
                    log.append(("gather result",
                                np.array_equal(np.concatenate(rows), np.repeat([1., 2.], 4))))
                ran = fused_runs(pg) - before == 1
                log.append((f"fused is {ran}", fused is None or ran == fused))
                return ran

            def fused_again(call):
                """The unchanged call runs fused again within three calls."""
                log.append(("fused again", any([call(None) for _ in range(3)])))  # (every rank makes all three)

            for fused in (False, False, True):  # seen, learnt, fused
                exchange(fused)
                gather(fused)
            out.shape = inp.shape = (2, 4)  # the same objects, reshaped in place
            exchange(False)
            out.shape = inp.shape = (8,)
            fused_again(exchange)
            out.dtype = inp.dtype = np.int32  # retyped in place
            exchange(False, np.int32)
            out.dtype = inp.dtype = np.float32
            fused_again(exchange)
            if r == 0:
                rows[1] = rows[1].copy()  # an equal array, another object
            gather(False if r == 0 else None)  # (rank 1 changed nothing)
            if r == 0:
                rows[1] = whole.reshape(2, 4)[1]  # a new view: another object
            fused_again(gather)
            out.flags.writeable = False  # read-only: the ordinary path's error
            with pytest.raises(ValueError, match="read-only|writable|writeable"):
                nc.all_to_all_single(out, inp, group=pg)
            out.flags.writeable = True
            fused_again(exchange)
            return log

        for log in on_ranks(pgs, body):
            assert all(ok for _, ok in log), [(i, what) for i, (what, ok) in enumerate(log) if not ok]
    finally:
        close(pgs)


def test_alltoall_counts_that_disagree_fail_on_the_fused_path():
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=20))
    try:
        def body(pg):
            out, inp = np.zeros(8), np.zeros(8)
            for _ in range(3):
                nc.all_to_all_single(out, inp, group=pg)
            if pg.rank() == 0:
                nc.all_to_all_single(out, inp, group=pg)    # fused: 4 elements each way
            else:
                nc.all_to_all_single(out, inp, [6, 2], [6, 2], group=pg)

        with pytest.raises(nc.NumcollError, match="sends this rank 6 elements, this rank "
                                                  "expects 4|expects 6"):
            on_ranks(pgs, body)
    finally:
        close(pgs)


def test_a_call_of_several_rounds_is_not_fused(monkeypatch):
    monkeypatch.setenv("NUMCOLL_ARENA_SLOT_NBYTES", "4096")
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=30))
    try:
        def body(pg):
            r, log = pg.rank(), []
            for count in (512, 513):  # 4096 bytes: one round; 4104: two
                whole, block = np.zeros(2 * count), np.zeros(count)
                for i in range(CALLS):
                    block[...] = r + i
                    nc.all_gather_into_tensor(whole, block, group=pg)
                    log.append(np.array_equal(whole, np.repeat([i, 1.0 + i], count)))
            return log, fused_runs(pg)

        for log, fused in on_ranks(pgs, body):
            assert all(log) and fused == CALLS - 2
    finally:
        close(pgs)


# -- the overlap fuzz, every call repeated --------------------------------------------------
FUSED = ("reduce_scatter_tensor", "allgather_into_tensor", "gather", "scatter",
         "alltoall_base")


class _Repeated:
    """A fuzz call made through the module API, started again and again (a
    persistent request's shape, for ``_fuzz(make=..., starts=...)``)."""

    def __init__(self, pg, t, ins, outs):
        self.work = type("W", (), {"call": _build(pg.context, t, ins, outs)[0]})
        name, root = t["name"], t["root"]
        if name == "reduce_scatter_tensor":
            self.start = lambda: nc.reduce_scatter_tensor(outs[0], ins[0], group=pg)
        elif name == "allgather_into_tensor":
            self.start = lambda: nc.all_gather_into_tensor(outs[0], ins[0], group=pg)
        elif name == "gather":
            self.start = lambda: nc.gather(ins[0], outs or None, dst=root, group=pg)
        elif name == "scatter":
            self.start = lambda: nc.scatter(outs[0], ins or None, src=root, group=pg)
        else:
            self.start = lambda: nc.all_to_all_single(outs[0], ins[0], group=pg)

    def wait(self):
        return True


@pytest.mark.parametrize("size", [2, 3])
def test_fuzz_overlapping_views_repeated(size):
    pgs = groups(size, transport="shm", timeout=timedelta(seconds=60))
    try:
        stats = _fuzz(pgs, 150, seed=3300 + size, names=FUSED, make=_Repeated, starts=CALLS)
        assert stats["wrong"] == 0, stats
        assert stats["right"] > 100, stats
        assert sum(fused_runs(pg) for pg in pgs) > 0
    finally:
        close(pgs)

