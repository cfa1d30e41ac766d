"""Arrays that share memory (numcoll.memory.overlap): every collective that reads
some arrays and writes others either gives what it would give had the inputs
been separate copies, or refuses at the call -- on every transport.

The fuzz below draws random views of one buffer per rank (shifted, strided,
reversed, 2-D; torch's own-chunk in-place forms; the same view twice) for every
collective, runs them over threads, shm and tcp, and compares each rank's whole
buffer with a reference computed from copies of the inputs taken before the
call. ``NUMCOLL_TEST_OVERLAP_TRIALS`` sets the trials per group (a soak: 2000).
"""

import os
import threading
from collections import Counter

import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

import numcoll as nc
from numcoll.collectives import exchange, movement, reductions
from numcoll.memory.overlap import (INTERNAL_OVERLAP, check_overlap, has_internal_overlap,
                                    same_view, shares_memory)

from test_process_group import groups, on_ranks

pytestmark = pytest.mark.timeout(300)

TRIALS = int(os.environ.get("NUMCOLL_TEST_OVERLAP_TRIALS", "400"))


# -- the rule, on its own --------------------------------------------------------------------
def test_internal_overlap_is_found_exactly():
    x = np.zeros(100)
    assert has_internal_overlap(as_strided(np.zeros(1), shape=(2 ** 40,), strides=(0,)))
    assert has_internal_overlap(as_strided(x, shape=(3, 3), strides=(16, 8)))   # rows overlap
    assert has_internal_overlap(as_strided(x, shape=(4,), strides=(4,)))        # half items
    assert not has_internal_overlap(x[::3])
    assert not has_internal_overlap(x.reshape(10, 10).T[::2])
    assert not has_internal_overlap(x[::-2])
    # interleaved strides that never meet: 0, 16, 24, 32, 40, 48, 56, 64, 80
    assert not has_internal_overlap(as_strided(x, shape=(3, 3), strides=(24, 16)))
    assert not has_internal_overlap(as_strided(np.zeros(1), shape=(1, 5), strides=(0, 0))[:, :1])


def test_overlap_between_arrays_is_exact():
    x = np.zeros(64)
    assert not shares_memory(x[::2], x[1::2])   # their byte ranges meet, their bytes do not
    assert shares_memory(x[:10], x[9:])
    assert same_view(x[4:8], x[4:8]) and same_view(x[4:8].reshape(2, 2), x[4:8])
    assert not same_view(x[4:8], x[4:9]) and not same_view(x[4:8], x[4:12:2])
    with pytest.raises(ValueError, match="outputs 0 and 1 refer to the same memory"):
        check_overlap("op", [x[:4], x[2:6]])
    assert check_overlap("op", [x[:4], x[:4]], same_result=True) is False
    with pytest.raises(ValueError, match="outputs 0 and 1"):
        check_overlap("op", [x[:4], x[:4]])          # two places, two results
    many = [x[i * 4:(i + 1) * 4] for i in range(16)]  # sorted sweep, no pair
    assert check_overlap("op", many) is False
    many[9] = x[38:42]
    with pytest.raises(ValueError, match="outputs 9 and 10"):
        check_overlap("op", many)
    assert check_overlap("op", [x[:4]], [x[2:6]]) is True   # read from a copy
    assert check_overlap("op", [x[:4]], [x[4:8]]) is False
    out = x[:4]                                   # the in-place form the caller vouches for
    assert check_overlap("op", [out], [x], in_place=[(x, out)]) is False
    with pytest.raises(ValueError, match="cannot read its input from a copy"):
        check_overlap("op", [x[:4]], [x[2:6]], copy=False)


# -- issue 21's cases, and torch's in-place forms ------------------------------------------
@pytest.mark.parametrize("transport", ["inproc", "shm", "tcp"])
def test_reduce_scatter_into_a_view_of_its_input(transport):
    """Rank 0's output was a view of its input other than its own share: on shm
    its write changed what rank 1 read (rank 1 got [14, 16, 18, 20])."""
    pgs = groups(2, transport=transport)
    try:
        def body(pg):
            r, got = pg.rank(), {}
            for lo in (0, 2, 4):
                y = np.arange(8, dtype=np.float32) + 10 * r
                pg.reduce_scatter_tensor(y[lo:lo + 4], y).wait()
                got[lo] = y[lo:lo + 4].tolist()
            big = np.arange(1 << 20, dtype=np.float32) % 1000 + r
            pg.reduce_scatter_tensor(big[:1 << 19], big).wait()
            got["big"] = bool(np.array_equal(
                big[:1 << 19], 2 * (np.arange(r << 19, (r + 1) << 19) % 1000) + 1))
            return got
        results = on_ranks(pgs, body)
    finally:
        for pg in pgs:
            pg.shutdown()
    for lo in (0, 2, 4):
        assert results[0][lo] == [10.0, 12.0, 14.0, 16.0], (lo, results)
        assert results[1][lo] == [18.0, 20.0, 22.0, 24.0], (lo, results)
    assert results[0]["big"] and results[1]["big"]


@pytest.mark.parametrize("transport", ["inproc", "shm", "tcp"])
def test_torch_in_place_forms(transport):
    pgs = groups(3, transport=transport)
    try:
        def body(pg):
            r, n = pg.rank(), 5
            inp = np.arange(3 * n, dtype=np.float64) + 100 * r
            pg.reduce_scatter_tensor(inp[r * n:(r + 1) * n], inp).wait()
            out = np.zeros(3 * n)
            out[r * n:(r + 1) * n] = r + 1
            pg.allgather_into_tensor(out, out[r * n:(r + 1) * n]).wait()
            return inp[r * n:(r + 1) * n], out
        results = on_ranks(pgs, body)
    finally:
        for pg in pgs:
            pg.shutdown()
    for r, (share, gathered) in enumerate(results):
        full = sum(np.arange(15, dtype=np.float64) + 100 * q for q in range(3))
        assert np.array_equal(share, full[r * 5:(r + 1) * 5])
        assert np.array_equal(gathered, np.repeat([1.0, 2.0, 3.0], 5))


# -- issue 23 item 5: an output overlapping itself is refused before numbering ---------------
ZERO_STRIDE = "more than one element of the written-to tensor refers to a single memory"


def _self_overlapping():
    return as_strided(np.zeros(1), shape=(2 ** 40,), strides=(0,))


def test_an_output_that_overlaps_itself_is_refused_at_the_call():
    pgs = groups(2)
    try:
        def body(pg):
            z = _self_overlapping()
            fine = np.ones(4)
            calls = [
                lambda: pg.allreduce(z), lambda: pg.broadcast(z, root=0),
                lambda: pg.reduce(z, nc.ReduceOptions(root_rank=pg.rank())),
                lambda: pg.allreduce_coalesced([fine, z]),
                lambda: pg.allgather([[z, z]], [z]),
                lambda: pg.recv(z, 1 - pg.rank()),
                lambda: pg.scatter([z], [[z, z]] if pg.rank() == 0 else []),
                lambda: pg.reduce_scatter_tensor(as_strided(fine, (2,), (0,)), fine[:4]),
                lambda: pg.allgather_into_tensor(as_strided(fine, (4,), (0,)), fine[:2]),
            ]
            before = pg.sequence_number()
            for call in calls:
                with pytest.raises(ValueError, match=ZERO_STRIDE):
                    call()
            assert pg.sequence_number() == before  # nothing was numbered
            x = np.full(4, pg.rank() + 1.0)
            pg.allreduce(x).wait()                  # and the group is fine
            return x
        results = on_ranks(pgs, body)
    finally:
        for pg in pgs:
            pg.shutdown()
    assert all(np.array_equal(x, np.full(4, 3.0)) for x in results)


def test_the_refusal_has_torchs_words():
    pgs = groups(1)
    try:
        with pytest.raises(ValueError) as info:
            pgs[0].allreduce(_self_overlapping())
        assert str(info.value) == f"allreduce: output array at index 0: {INTERNAL_OVERLAP}"
    finally:
        pgs[0].shutdown()


def test_reducer_and_broadcast_coalesced_refuse_gradients_that_share_memory():
    def body():
        flat = np.zeros(10, np.float32)
        with pytest.raises(ValueError, match="gradients 0 and 1 refer to the same memory"):
            nc.Reducer([flat[:6], flat[4:]])
        nc.Reducer([flat[:5], flat[5:]])             # views of one buffer, disjoint: fine
        with pytest.raises(ValueError, match="refer to the same memory"):
            nc.broadcast_coalesced([flat[:6], flat[4:]], src=0)
        x = np.arange(4, dtype=np.float32) * (nc.get_rank() + 1)
        nc.broadcast_coalesced([x, x], src=0)        # one array twice: one result
        return x
    for x in nc.launch(body, 2, mode="thread", timeout=60):
        assert np.array_equal(x, np.arange(4, dtype=np.float32))


# -- the fuzz -----------------------------------------------------------------------------
# A view is (offset, count, step, rows) into a rank's buffer; rows > 1 makes it 2-D.
def _view(base, spec):
    offset, count, step, rows = spec
    v = base[offset:offset + (count - 1) * abs(step) + 1:abs(step)]
    if step < 0:
        v = v[::-1]
    return v.reshape(rows, count // rows) if rows > 1 else v


def _spec(rng, length, count, contiguous=False, flat=False):
    step = 1 if contiguous else int(rng.choice([1, 1, 1, 2, 3, -1, -2]))
    rows = 1 if contiguous or flat or count % 2 or rng.random() < 0.6 else 2
    return _placed(rng, length, (0, count, step, rows))


def _placed(rng, length, spec):
    """``spec`` at a random offset."""
    _, count, step, rows = spec
    if (count - 1) * abs(step) + 1 > length:
        step = 1 if step > 0 else -1             # every count fits the buffer at step 1
    extent = (count - 1) * abs(step) + 1
    return int(rng.integers(0, length - extent + 1)), count, step, rows


def _draw(rng, name, size):
    """One trial: the collective's views, the same on every rank but for the
    own-chunk forms (functions of the rank), and the buffer length."""
    n = int(rng.choice([1, 2, 3, 7, 16, 61, 300, 1001, 5000]))
    root = int(rng.integers(0, size))
    m = int(rng.integers(1, 4))
    length = int(n * size * rng.uniform(1.2, 3.0)) + 4
    # Shapes must agree where the collective compares them: flat views there.
    flat = name in ("allgather", "gather", "scatter")
    spec = lambda count, contiguous=False: _spec(rng, length, count, contiguous, flat)  # noqa
    counts = [int(rng.integers(1, n + 1)) for _ in range(m)]
    t = {"name": name, "n": n, "root": root, "length": length, "m": m}
    if name in ("allreduce", "broadcast"):     # in place, one shape for all
        first = spec(n)
        t["ins"] = t["outs"] = [first if rng.random() < 0.3 else _placed(rng, length, first)
                                for _ in range(m)]
    elif name == "allreduce_coalesced":
        views = [spec(c) for c in counts]
        t["ins"] = t["outs"] = views + views[:1] if rng.random() < 0.2 else views
    elif name == "reduce":
        t["ins"] = t["outs"] = [spec(n)]
    elif name == "reduce_scatter_tensor":
        own = rng.random() < 0.3                 # torch's in-place form
        inp = spec(n * size, contiguous=own)
        t["ins"], t["outs"] = [inp], [("own", inp) if own else spec(n)]
    elif name == "allgather_into_tensor":
        own = rng.random() < 0.3
        out = spec(n * size, contiguous=own)
        t["ins"], t["outs"] = [("own", out) if own else spec(n)], [out]
    elif name == "reduce_scatter_tensor_coalesced":
        t["ins"], t["outs"] = [spec(c * size) for c in counts], [spec(c) for c in counts]
    elif name == "allgather_into_tensor_coalesced":
        t["ins"], t["outs"] = [spec(c) for c in counts], [spec(c * size) for c in counts]
    elif name in ("allgather", "gather"):
        t["outs"] = [spec(n) for _ in range(size)]
        own = name == "gather" and rng.random() < 0.3
        t["ins"] = [("slot", t["outs"][root])] if own else [spec(n)]
    elif name == "allgather_coalesced":
        t["ins"] = [spec(c) for c in counts]
        t["outs"] = [spec(c) for _ in range(size) for c in counts]
    elif name == "scatter":
        t["ins"] = [spec(n) for _ in range(size)]
        t["outs"] = [("slot", t["ins"][root]) if rng.random() < 0.3 else spec(n)]
    elif name == "alltoall":
        t["ins"], t["outs"] = [spec(n) for _ in range(size)], [spec(n) for _ in range(size)]
    elif name == "reduce_scatter":
        t["ins"], t["outs"] = [spec(n) for _ in range(size)], [spec(n)]
    elif name == "alltoall_base":
        inp = spec(n * size, contiguous=True)
        t["ins"] = [inp]
        t["outs"] = [inp if rng.random() < 0.3 else spec(n * size, contiguous=True)]
    return t


def _resolve(t, spec, rank):
    """A spec, with the forms that depend on the rank worked out."""
    if spec[0] == "own":
        offset, _, _, _ = spec[1]
        return offset + rank * t["n"], t["n"], 1, 1
    if spec[0] == "slot":
        return spec[1]
    return spec


def _roles(t, rank):
    """(input specs, output specs) this rank passes (root-only lists are empty elsewhere)."""
    name, is_root = t["name"], rank == t["root"]
    ins = [_resolve(t, s, rank) for s in t["ins"]]
    outs = [_resolve(t, s, rank) for s in t["outs"]]
    if (name in ("gather", "reduce") and not is_root):
        outs = []
    if name == "scatter" and not is_root:
        ins = []
    return ins, outs


def _build(ctx, t, ins, outs):
    name, root = t["name"], t["root"]
    if name == "allreduce":
        return reductions.allreduce(ctx, ins)
    if name == "broadcast":
        return movement.broadcast(ctx, ins, nc.BroadcastOptions(root_rank=root))
    if name == "reduce":
        return reductions.reduce(ctx, ins, nc.ReduceOptions(root_rank=root))
    if name == "allreduce_coalesced":
        return reductions.allreduce_coalesced(ctx, ins)
    if name == "reduce_scatter_tensor":
        return reductions.reduce_scatter_tensor_coalesced(ctx, outs[0], ins[0], name=name)
    if name == "allgather_into_tensor":
        return movement.allgather_into_tensor_coalesced(ctx, outs[0], ins[0], name=name)
    if name == "reduce_scatter_tensor_coalesced":
        return reductions.reduce_scatter_tensor_coalesced(ctx, outs, ins)
    if name == "allgather_into_tensor_coalesced":
        return movement.allgather_into_tensor_coalesced(ctx, outs, ins)
    if name == "allgather":
        return movement.allgather(ctx, [outs], ins)
    if name == "allgather_coalesced":
        m = len(ins)
        return movement.allgather_coalesced(ctx, [outs[q * m:(q + 1) * m]
                                                  for q in range(ctx.size)], ins)
    if name == "gather":
        return movement.gather(ctx, [outs] if outs else [], ins,
                               nc.GatherOptions(root_rank=root))
    if name == "scatter":
        return movement.scatter(ctx, outs, [ins] if ins else [],
                                nc.ScatterOptions(root_rank=root))
    if name == "alltoall":
        return exchange.alltoall(ctx, outs, ins)
    if name == "alltoall_base":
        return exchange.alltoall_base(ctx, outs[0], ins[0])
    if name == "reduce_scatter":
        return reductions.reduce_scatter(ctx, outs, [ins])
    raise AssertionError(name)


def _expected(t, rank, size, before):
    """What each of ``rank``'s outputs must hold, from copies of every rank's
    inputs taken before the call (``before[q]``: rank q's input copies)."""
    name, root, n = t["name"], t["root"], t["n"]
    flat = lambda q, i: before[q][i].reshape(-1)  # noqa: E731
    if name == "allreduce":
        total = sum(sum(before[q]) for q in range(size))
        return [total] * len(before[rank])
    if name == "broadcast":
        return [before[root][0]] * len(before[rank])
    if name == "reduce":
        return [sum(before[q][0] for q in range(size))] if rank == root else []
    if name == "allreduce_coalesced":
        return [sum(before[q][i] for q in range(size)) for i in range(len(before[rank]))]
    if name == "reduce_scatter_tensor":
        return [sum(flat(q, 0)[rank * n:(rank + 1) * n] for q in range(size))]
    if name == "allgather_into_tensor":
        return [np.concatenate([flat(q, 0) for q in range(size)])]
    if name == "reduce_scatter_tensor_coalesced":
        return [sum(flat(q, i)[rank * (a.size // size):(rank + 1) * (a.size // size)]
                    for q in range(size)) for i, a in enumerate(before[rank])]
    if name == "allgather_into_tensor_coalesced":
        return [np.concatenate([flat(q, i) for q in range(size)])
                for i in range(len(before[rank]))]
    if name in ("allgather", "gather"):
        return [before[q][0] for q in range(size)] if name == "allgather" or rank == root \
            else []
    if name == "allgather_coalesced":
        return [a for q in range(size) for a in before[q]]
    if name == "scatter":
        return [before[root][rank]]
    if name == "alltoall":
        return [before[q][rank] for q in range(size)]
    if name == "alltoall_base":
        return [np.concatenate([flat(q, 0)[rank * n:(rank + 1) * n] for q in range(size)])]
    if name == "reduce_scatter":
        return [sum(before[q][rank] for q in range(size))]
    raise AssertionError(name)


_SAME_RESULT = ("allreduce", "broadcast", "allreduce_coalesced")
COLLECTIVES = ("allreduce", "broadcast", "reduce", "allreduce_coalesced",
               "reduce_scatter_tensor", "allgather_into_tensor",
               "reduce_scatter_tensor_coalesced", "allgather_into_tensor_coalesced",
               "allgather", "allgather_coalesced", "gather", "scatter", "alltoall",
               "alltoall_base", "reduce_scatter")


def _must_refuse(t, out_specs):
    """The rule, worked out independently from the element positions: outputs
    that share an element, unless they are the same elements in the same order
    in a call that writes one result into all of them."""
    where = [_view(np.arange(t["length"]), s).reshape(-1) for s in out_specs]
    for i in range(len(where)):
        for j in range(i + 1, len(where)):
            if np.intersect1d(where[i], where[j]).size:
                if not (t["name"] in _SAME_RESULT and np.array_equal(where[i], where[j])):
                    return True
    return False


def _fuzz(pgs, trials, seed, strict=True, *, names=COLLECTIVES, make=None, region=None,
          starts=1):
    """Run ``trials`` random calls on the groups ``pgs``; count right, wrong and
    refused ones. ``strict=False`` (to measure a library without the rule)
    skips, instead of failing, the calls the rule refuses.

    The calls are of ``names``, made by ``make(pg, t, ins, outs)`` (default: the
    builder's ``(call, run)``; or a persistent request, started ``starts`` times
    with new contents); each rank's buffer is a slice of ``region(pg, length)``
    (default: a new array per trial)."""
    size = len(pgs)
    rng = np.random.default_rng(seed)
    plan = [_draw(rng, names[int(rng.integers(len(names)))], size) for _ in range(trials)]
    longest = max(t["length"] for t in plan)
    sync = threading.Barrier(size, timeout=60)
    shared = [None] * size
    refused = [False] * size
    stats = Counter()

    def body(pg):
        rank = pg.rank()
        area = region(pg, longest) if region else None
        for k, t in enumerate(plan):
            base = area[:t["length"]] if region else np.empty(t["length"])
            in_specs, out_specs = _roles(t, rank)
            ins = [_view(base, s) for s in in_specs]
            outs = [_view(base, s) for s in out_specs]
            if t["ins"] is t["outs"]:               # in place: the same objects
                outs = ins if out_specs else []
            numbered = pg.sequence_number()
            try:
                made = make(pg, t, ins, outs) if make else _build(pg.context, t, ins, outs)
                refused[rank] = None
            except ValueError as exc:
                assert "refer to" in str(exc) and "memory location" in str(exc), exc
                assert pg.sequence_number() == numbered  # refused before numbering
                refused[rank] = str(exc)
            what = f"trial {k} (seed {seed}) on rank {rank}: {t}"
            if strict:
                assert bool(refused[rank]) == _must_refuse(t, out_specs), \
                    f"{what}: refused={refused[rank]!r}"
            elif _must_refuse(t, out_specs):
                refused[rank] = "not refused, but no result is right"
            sync.wait()
            if any(refused):                        # every rank skips it alike
                if rank == 0:
                    stats["refused"] += 1
                sync.wait()
                continue
            for start in range(starts):
                base[...] = np.arange(t["length"]) * (rank + 1) + 7 * rank + 100 * start
                shared[rank] = [a.copy() for a in ins]
                expected_base = base.copy()
                if isinstance(made, tuple):
                    call = made[0]
                    pg.submit(*made).wait()
                else:                               # a persistent request
                    made.start()
                    made.wait()
                    call = made.work.call
                sync.wait()                         # every rank's copies are in place
                for s, value in zip(out_specs, _expected(t, rank, size, shared)):
                    _view(expected_base, s)[...] = np.asarray(value).reshape(
                        _view(base, s).shape)
                if not np.array_equal(base, expected_base):
                    bad = np.flatnonzero(base != expected_base)
                    stats["wrong"] += 1
                    stats[f"wrong {t['name']}"] += 1
                    print(f"WRONG {what}, start {start}: elements {bad[:10]}: got "
                          f"{base[bad[:10]]}, expected {expected_base[bad[:10]]}")
                elif rank == 0:
                    stats["right"] += 1
                    aliased = any(np.shares_memory(a, b) for a in ins for b in outs
                                  if a is not b)
                    stats["right, inputs overlapping outputs"] += aliased
                    stats[f"right, overlapping, {call.algorithm}"] += aliased
                sync.wait()                         # before the copies are replaced

    on_ranks(pgs, body)
    return stats


FUZZ_GROUPS = [("inproc", 3, {}),
               ("shm", 2, {"NUMCOLL_ARENA_SLOT_NBYTES": "4096", "NUMCOLL_SEGMENT_NBYTES": "256"}),
               ("shm", 3, {}),
               ("tcp", 2, {"NUMCOLL_SEGMENT_NBYTES": "256"})]


@pytest.mark.parametrize("transport,world_size,env", FUZZ_GROUPS,
                         ids=[f"{t}-{n}{'-small' if e else ''}" for t, n, e in FUZZ_GROUPS])
def test_fuzz_overlapping_views_against_copies(transport, world_size, env, monkeypatch):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    pgs = groups(world_size, transport=transport)
    try:
        stats = _fuzz(pgs, TRIALS, seed=2100 + 10 * world_size + len(transport))
    finally:
        for pg in pgs:
            pg.shutdown()
    print(f"{transport} x{world_size}: {dict(stats)}")
    assert stats["wrong"] == 0, dict(stats)
    assert stats["right"] + stats["refused"] == TRIALS
    assert stats["right, inputs overlapping outputs"] > TRIALS // 10, dict(stats)
