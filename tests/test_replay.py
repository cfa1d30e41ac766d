"""Large blocking calls that repeat run again without their checks
(numcoll.fast.replay): all_gather_into_tensor, all_to_all_single, gather,
scatter, broadcast, all_reduce, reduce and reduce_scatter_tensor through the
module API, on calls no fused step takes
(the arena's slot made 4 KiB, so every call here takes several rounds).

A replay must give the ordinary path's results, take the full checks again
for any change to the arrays it was made for, keep no array alive, and
still meet a rank that runs another call with the mismatch error."""

import collections
import gc
import weakref
from datetime import timedelta

import numpy as np
import pytest

import numcoll as nc
from numcoll.collectives import exchange, movement, reductions
from numcoll.fast.repeat import REPLAYS_KEPT

from test_fast_path import close
from test_process_group import groups, on_ranks

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.skipif("not __import__('transports').shm_available()")]

COUNT = 3000  # float64 elements: 24 KB a block, several rounds of a 4 KiB slot
BUILDERS = {"all_gather_into_tensor": (movement, "allgather_into_tensor_coalesced"),
            "all_to_all_single": (exchange, "alltoall_base"),
            "gather": (movement, "gather"), "scatter": (movement, "scatter"),
            "broadcast": (movement, "broadcast"), "all_reduce": (reductions, "allreduce"),
            "reduce": (reductions, "reduce"),
            "reduce_scatter_tensor": (reductions, "reduce_scatter_tensor_coalesced")}


@pytest.fixture
def built(monkeypatch):
    """Small slots (nothing here is fused), and a count of the builders' calls
    by module function and rank (a replay calls none)."""
    monkeypatch.setenv("NUMCOLL_ARENA_SLOT_NBYTES", "4096")
    counts = collections.Counter()
    for name, (module, attr) in BUILDERS.items():
        real = getattr(module, attr)

        def counted(ctx, *args, _real=real, _name=name, **kwargs):
            counts[_name, ctx.rank] += 1
            return _real(ctx, *args, **kwargs)

        monkeypatch.setattr(module, attr, counted)
    return counts


def _every_form(pg, log: list) -> None:
    """Each form four times with new contents, checked against NumPy."""
    r, n = pg.rank(), pg.size()
    whole = np.zeros(COUNT * n)
    block = np.zeros(COUNT)
    other = np.zeros(COUNT * n)
    rows = list(whole.reshape(n, COUNT))
    apart = [np.zeros(COUNT) for _ in range(n)]  # the root's list, not one array
    own = whole[r * COUNT:(r + 1) * COUNT]
    ramp = np.arange(COUNT, dtype=np.float64)
    for i in range(4):
        block[...] = ramp + 10 * r + i
        nc.all_gather_into_tensor(whole, block, group=pg)
        log.append(np.array_equal(whole, np.concatenate([ramp + 10 * q + i for q in range(n)])))
        own[...] = ramp + 10 * r + i  # in place
        nc.all_gather_into_tensor(whole, own, group=pg)
        log.append(np.array_equal(whole, np.concatenate([ramp + 10 * q + i for q in range(n)])))
        other[...] = np.repeat(np.arange(n, dtype=np.float64), COUNT) + 100 * r + i
        nc.all_to_all_single(whole, other, group=pg)
        log.append(np.array_equal(whole, np.repeat(np.arange(n) * 100.0 + r + i, COUNT)))
        for target in (rows, apart):
            block[...] = ramp + r + i
            nc.gather(block, target if r == 0 else None, dst=0, group=pg)
            if r == 0:
                log.append(all(np.array_equal(t, ramp + q + i) for q, t in enumerate(target)))
        if r == n - 1:
            whole[...] = np.repeat(np.arange(n, dtype=np.float64), COUNT) + i  # (rows)
        nc.scatter(block, rows if r == n - 1 else None, src=n - 1, group=pg)
        log.append(np.array_equal(block, np.full(COUNT, r + i, np.float64)))
        if r == 0:
            other[...] = ramp.repeat(n) + i
        nc.broadcast(other, src=0, group=pg)
        log.append(np.array_equal(other, ramp.repeat(n) + i))
        total = sum(np.arange(COUNT * n) * (q + 1) + i for q in range(n))
        other[...] = np.arange(COUNT * n) * (r + 1) + i
        nc.all_reduce(other, group=pg)
        log.append(np.array_equal(other, total))
        other[...] = np.arange(COUNT * n) * (r + 1) + i
        nc.reduce(other, dst=n - 1, group=pg)
        log.append(np.array_equal(other, total if r == n - 1
                                  else np.arange(COUNT * n) * (r + 1) + i))
        other[...] = np.arange(COUNT * n) * (r + 1) + i
        nc.reduce_scatter_tensor(block, other, op=nc.ReduceOp.SUM, group=pg)
        log.append(np.array_equal(block, total[r * COUNT:(r + 1) * COUNT]))


@pytest.mark.parametrize("size", [2, 3])
def test_every_form_repeated_replays_and_agrees(built, size):
    pgs = groups(size, transport="shm", timeout=timedelta(seconds=30))
    try:
        def body(pg):
            log = []
            _every_form(pg, log)
            return log, dict(pg.repeats._replays)

        for log, replays in on_ranks(pgs, body):
            assert all(log), [i for i, ok in enumerate(log) if not ok]
            assert len(replays) in (9, 10)  # (a gather's root has two forms more)
    finally:
        close(pgs)
    # Each form was built twice (seen, learnt) on each rank, then replayed:
    # all_gather_into_tensor has two forms, gather's root two lists (the
    # other ranks make the same call with either).
    for r in range(size):
        assert {name: built[name, r] for name in BUILDERS} == {
            "all_gather_into_tensor": 4, "all_to_all_single": 2, "gather": 4 if r == 0 else 2,
            "scatter": 2, "broadcast": 2, "all_reduce": 2, "reduce": 2,
            "reduce_scatter_tensor": 2}


def test_a_changed_array_is_checked_again(built):
    """After a replay, each change -- an array reshaped or retyped in place (the
    same object), a list element swapped for an equal array, an output made
    read-only -- takes the builder again, with the ordinary result or error;
    the unchanged call is replayed again after it."""
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=30))
    try:
        def body(pg):
            r, log = pg.rank(), []
            out, inp = np.zeros(2 * COUNT), np.zeros(2 * COUNT)
            block = np.zeros(COUNT)
            rows = list(np.zeros((2, COUNT)))

            def exchange_(dtype=np.float64):
                inp.reshape(-1)[...] = np.arange(2 * COUNT) + 10 * r
                nc.all_to_all_single(out, inp, group=pg)
                want = np.concatenate([np.arange(r * COUNT, (r + 1) * COUNT) + 10 * q
                                       for q in range(2)])
                log.append(out.dtype == dtype and np.array_equal(out.reshape(-1), want))

            def gather():
                block[...] = r + 1
                nc.gather(block, rows if r == 0 else None, dst=0, group=pg)
                if r == 0:
                    log.append(np.array_equal(np.concatenate(rows), np.repeat([1., 2.], COUNT)))

            def builds(name, call, want: int):
                """``call``'s number of builder calls (on this rank) is ``want``."""
                before = built[name, r]
                call()
                log.append(built[name, r] - before == want)

            for _ in range(3):  # seen, learnt, replayed
                exchange_()
                gather()
            builds("all_to_all_single", exchange_, 0)
            out.shape = inp.shape = (2, COUNT)  # the same objects, reshaped in place
            builds("all_to_all_single", exchange_, 1)
            out.shape = inp.shape = (2 * COUNT,)
            builds("all_to_all_single", exchange_, 0)  # the replay was made for this
            out.dtype = inp.dtype = np.int64  # retyped in place
            builds("all_to_all_single", lambda: exchange_(np.int64), 1)
            out.dtype = inp.dtype = np.float64
            for _ in range(2):
                exchange_()
            builds("all_to_all_single", exchange_, 0)
            builds("gather", gather, 0)
            if r == 0:
                rows[1] = rows[1].copy()  # an equal array, another object
            builds("gather", gather, 1 if r == 0 else 0)  # (rank 1 changed nothing)
            out.flags.writeable = False  # read-only: the ordinary path's error
            with pytest.raises(ValueError, match="read-only|writable|writeable"):
                nc.all_to_all_single(out, inp, group=pg)
            out.flags.writeable = True
            builds("all_to_all_single", exchange_, 0)
            pg.set_timeout(timedelta(seconds=20))  # the stamp's deadline changed
            builds("all_to_all_single", exchange_, 1)
            return log

        for log in on_ranks(pgs, body):
            assert all(log), [i for i, ok in enumerate(log) if not ok]
    finally:
        close(pgs)


def test_a_replay_keeps_no_array_alive(built):
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=30))
    try:
        def body(pg):
            out, inp = np.zeros(2 * COUNT), np.ones(2 * COUNT)
            for _ in range(4):
                nc.all_to_all_single(out, inp, group=pg)
            assert len(pg.repeats._replays) == 1
            gone = weakref.ref(out), weakref.ref(inp)
            del out, inp
            gc.collect()
            # A new array at the dropped one's address meets no replay.
            again_out, again_in = np.zeros(2 * COUNT), np.full(2 * COUNT, 2.0)
            nc.all_to_all_single(again_out, again_in, group=pg)
            return [ref() is None for ref in gone], bool(np.all(again_out == 2.0))

        for freed, right in on_ranks(pgs, body):
            assert freed == [True, True] and right
    finally:
        close(pgs)


def test_a_replay_meets_another_call_with_the_mismatch_error(built):
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=20))
    try:
        def body(pg):
            whole, block = np.zeros(2 * COUNT), np.zeros(COUNT)
            for _ in range(3):
                nc.all_gather_into_tensor(whole, block, group=pg)
            if pg.rank() == 0:
                nc.all_gather_into_tensor(whole, block, group=pg)  # replayed
            else:
                nc.broadcast(whole, src=0, group=pg)

        with pytest.raises(nc.CollectiveMismatchError):
            on_ranks(pgs, body)
    finally:
        close(pgs)


def test_a_group_keeps_its_last_replays(built):
    pgs = groups(2, transport="shm", timeout=timedelta(seconds=30))
    many = REPLAYS_KEPT + 2
    try:
        def body(pg):
            r, right = pg.rank(), []
            pairs = [(np.zeros(2 * COUNT), np.zeros(2 * COUNT)) for _ in range(many)]
            for k, (out, inp) in enumerate(pairs * 3):  # each pair three times, in turn
                inp[...] = np.arange(2 * COUNT) + 10 * r + k
                nc.all_to_all_single(out, inp, group=pg)
                right.append(np.array_equal(out, np.concatenate(
                    [np.arange(r * COUNT, (r + 1) * COUNT) + 10 * q + k for q in range(2)])))
            return all(right), len(pg.repeats._replays)

        for right, kept in on_ranks(pgs, body):
            assert right and kept == REPLAYS_KEPT
    finally:
        close(pgs)
