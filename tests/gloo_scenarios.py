"""Ports of the pure-collective tests of torch's ProcessGroupGlooTest
(test/distributed/test_c10d_gloo.py), as functions run on every rank.

``tests/test_gloo_ported.py`` runs them all in one launch of 4 rank
processes over ZeroMQ (process start-up is paid once); each scenario gets a
fresh ProcessGroup of its own, so one failure cannot leak into the next.
torch.tensor([x]) becomes a 1-element NumPy array of the same dtype.
"""

from __future__ import annotations

import math
import operator
import re
from datetime import timedelta
from functools import reduce as fold

import numpy as np

import numcoll as nc
from numcoll.api import world as _dist

SCENARIOS = {}


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


class Ctx:
    def __init__(self, name: str):
        self.name = name
        self.rank = nc.get_rank()
        self.ws = nc.get_world_size()
        self._groups = []

    def pg(self, threads: int = 2, timeout_s: float = 50.0) -> nc.ProcessGroup:
        opts = nc.ProcessGroup.Options(timeout=timedelta(seconds=timeout_s), threads=threads,
                                       group_name=f"{self.name}/{len(self._groups)}")
        pg = nc.ProcessGroup(_dist._world().store, self.rank, self.ws, opts)
        pg.barrier().wait()
        self._groups.append(pg)
        return pg

    def close(self):
        for pg in self._groups:
            pg.shutdown()


def raises(exc_types, pattern, fn, *args):
    try:
        fn(*args)
    except exc_types as exc:
        assert re.search(pattern, str(exc)), f"{pattern!r} not in {exc!r}"
        return exc
    raise AssertionError(f"expected {exc_types} matching {pattern!r}")


def t(x, dtype=None):
    """torch.tensor([x])."""
    if dtype is None:
        dtype = np.float32 if isinstance(x, float) else (
            np.complex64 if isinstance(x, complex) else np.int64)
    return np.array([x], dtype=dtype)


def eq(a, b, msg=""):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=msg)


def simple_reduce_tests(rank, ws):
    S = nc.ReduceOp
    tests = [
        (S.SUM, t(rank + 1.0), t(float(ws * (ws + 1) / 2))),
        (S.PRODUCT, t(rank + 1.0), t(float(math.factorial(ws)))),
        (S.MIN, t(rank + 1.0), t(1.0)),
        (S.MAX, t(rank + 1.0), t(float(ws))),
        (S.AVG, t(rank + 1.0), t(float((ws + 1) / 2))),
    ]
    for i in range(4):
        tests.append((S.BAND, t(rank | (1 << i), np.int32), t(1 << i, np.int32)))
    for i in range(1, 5):
        vin = fold(operator.or_, [rank * i + j for j in range(i)])
        tests.append((S.BOR, t(vin, np.int32), t(fold(operator.or_, range(ws * i)), np.int32)))
    for i in range(1, 5):
        vin = fold(operator.xor, [rank * i + j for j in range(i)])
        tests.append((S.BXOR, t(vin, np.int32), t(fold(operator.xor, range(ws * i)), np.int32)))
    half = ws * (ws + 1) / 2
    tests += [
        (S.SUM, t(complex(rank + 1.0, rank + 1.0)), t(complex(half, half))),
        (S.AVG, t(complex(rank + 1.0, rank + 1.0)), t(complex((ws + 1) / 2, (ws + 1) / 2))),
    ]
    return tests


def simple_multi_input_reduce_tests(rank, ws):
    S = nc.ReduceOp
    return [
        (S.SUM, [t(2 * rank + 0.0), t(2 * rank + 1.0)], t(float(ws * (2 * ws - 1)))),
        (S.PRODUCT, [t(2 * rank + 1.0), t(2 * rank + 2.0)], t(float(math.factorial(2 * ws)))),
        (S.MIN, [t(2 * rank + 1.0), t(2 * rank + 2.0)], t(1.0)),
        (S.MAX, [t(2 * rank + 1.0), t(2 * rank + 2.0)], t(2.0 * ws)),
    ]


def simple_coalesced_reduce_tests(rank, ws):
    S = nc.ReduceOp
    return [
        (S.SUM, [t(rank + 1.0), t((rank + 1.0) ** 2)],
         [t(float(ws * (ws + 1) / 2)), t(float(ws * (ws + 1) * (2 * ws + 1) / 6))]),
        (S.PRODUCT, [t(rank + 1.0), t(rank + 2.0)],
         [t(float(math.factorial(ws))), t(float(math.factorial(ws + 1)))]),
        (S.MIN, [t(rank + x) for x in (0.0, 1.0)], [t(0.0), t(1.0)]),
        (S.MAX, [t(rank + x) for x in (1.0, 2.0)], [t(float(ws)), t(ws + 1.0)]),
    ]


ARG = (ValueError, TypeError)


# -- construction / empty ------------------------------------------------------------
@scenario
def test_empty_tensors(c):
    pg = c.pg()
    xs = [np.array([], np.float32)]
    fut = pg.broadcast(xs).get_future()
    fut.wait()
    assert fut.value()[0].size == 0


@scenario
def test_set_gloo_pg_timeout(c):
    pg = c.pg()
    pg.allreduce(np.random.rand(10)).wait()
    assert pg.options.timeout == timedelta(seconds=50)
    pg._set_default_timeout(timedelta(seconds=23))
    assert pg.options.timeout == timedelta(seconds=23)


# -- broadcast ------------------------------------------------------------------------
@scenario
def test_broadcast_checks(c):
    pg = c.pg()
    t1, t2, t3 = np.zeros(1, np.float32), np.zeros(1, np.float64), np.zeros(2, np.float32)
    B = nc.BroadcastOptions
    raises(ARG, "invalid root rank", pg.broadcast, [t1], B(root_rank=-1, root_tensor=0))
    raises(ARG, "invalid root rank", pg.broadcast, [t1], B(root_rank=c.ws, root_tensor=0))
    raises(ARG, "invalid root tensor", pg.broadcast, [t1], B(root_rank=c.rank, root_tensor=-1))
    raises(ARG, "invalid root tensor", pg.broadcast, [t1], B(root_rank=c.rank, root_tensor=1))
    raises(ARG, "invalid root tensor", pg.broadcast, [], B(root_rank=c.rank, root_tensor=0))
    raises(ARG, "invalid tensor type", pg.broadcast, [t1, t2], B(root_rank=c.rank))
    raises(ARG, "invalid tensor size", pg.broadcast, [t1, t3], B(root_rank=c.rank))


@scenario
def test_broadcast_basics(c):
    pg = c.pg()

    def broadcast(xs, root_rank, root_tensor):
        fut = pg.broadcast(xs, nc.BroadcastOptions(root_rank=root_rank,
                                                    root_tensor=root_tensor)).get_future()
        fut.wait()
        return fut.value()

    for i in range(c.ws):
        eq(broadcast([t(c.rank)], i, 0)[0], t(i))
        num = 2
        for j in range(num):
            xs = [t(c.rank * num + 0.0), t(c.rank * num + 1.0)]
            out = broadcast(xs, i, j)
            eq(out[0], t(float(i * num + j)))
            eq(out[1], t(float(i * num + j)))
        eq(broadcast([t(complex(c.rank, c.rank))], i, 0)[0], t(complex(i, i)))
    x = t(c.rank + 1.0)
    fut = pg.broadcast(x, root=0).get_future()
    fut.wait()
    eq(fut.value()[0], t(1.0))


@scenario
def test_broadcast_stress(c):
    pg = c.pg(threads=8)
    inputs = [t(i * c.ws + c.rank) for i in range(1000)]
    works = [pg.broadcast(inputs[i], root=i % c.ws) for i in range(len(inputs))]
    for i, w in enumerate(works):
        w.wait()
        eq(inputs[i], t(i * c.ws + i % c.ws), f"Mismatch in iteration {i}")


# -- allreduce ---------------------------------------------------------------------------
@scenario
def test_allreduce_checks(c):
    pg = c.pg()
    t1, t2, t3 = np.zeros(1, np.float32), np.zeros(1, np.float64), np.zeros(2, np.float32)
    raises(ARG, "requires non-empty tensor list", pg.allreduce, [], nc.AllreduceOptions())
    raises(ARG, "invalid tensor type", pg.allreduce, [t1, t2], nc.AllreduceOptions())
    raises(ARG, "invalid tensor size", pg.allreduce, [t1, t3], nc.AllreduceOptions())


@scenario
def test_allreduce_op_timeout(c):
    pg = c.pg()
    if c.rank == 0:
        opts = nc.AllreduceOptions(timeout=timedelta(milliseconds=1))
        exc = raises(TimeoutError, "Timed out waiting 1ms",
                     lambda: pg.allreduce([np.zeros(1, np.float32)], opts).wait())
        # numcoll names the op, this rank and the peer it waited for
        assert "allreduce" in str(exc) and "rank 0" in str(exc), str(exc)
        assert re.search(r"rank [123]\b", str(exc).split("rank 0", 1)[1]), str(exc)
    nc.barrier()  # the other ranks keep their group alive meanwhile, as in torch's test


@scenario
def test_allreduce_overall_timeout(c):
    pg = c.pg()
    pg.set_timeout(timedelta(milliseconds=1))
    if c.rank == 0:
        raises(TimeoutError, "Timed out waiting 1ms",
               lambda: pg.allreduce([np.zeros(1, np.float32)]).wait())
    nc.barrier()


@scenario
def test_allreduce_basics(c):
    pg = c.pg()
    for op, inp, expected in simple_reduce_tests(c.rank, c.ws):
        fut = pg.allreduce([inp.copy()], nc.AllreduceOptions(reduce_op=op)).get_future()
        fut.wait()
        eq(fut.value()[0], expected, f"{op}")
    for op, inputs, output in simple_multi_input_reduce_tests(c.rank, c.ws):
        tensors = [x.copy() for x in inputs]
        fut = pg.allreduce(tensors, nc.AllreduceOptions(reduce_op=op)).get_future()
        fut.wait()
        for tensor in fut.value():
            eq(tensor, output, f"{op}")
    x = t(c.rank + 1.0)
    fut = pg.allreduce(x).get_future()
    fut.wait()
    eq(fut.value()[0], t(float(c.ws * (c.ws + 1) / 2)))
    # fp16 numerical correctness: allgather, sum in float32, compare
    rng = np.random.default_rng(c.rank)
    tensor = ((rng.random((200, 1), dtype=np.float32) * 2 - 1) * 65504 / c.ws).astype(np.float16)
    output = [[np.zeros_like(tensor) for _ in range(c.ws)]]
    fut = pg.allgather(output, [tensor]).get_future()
    fut.wait()
    total = np.stack(fut.value()).astype(np.float32).sum(axis=0)
    fut = pg.allreduce([tensor]).get_future()
    fut.wait()
    np.testing.assert_allclose(fut.value()[0].astype(np.float32), total.astype(np.float16)
                               .astype(np.float32), rtol=1e-2, atol=1e-3)


@scenario
def test_allreduce_stress(c):
    pg = c.pg(threads=8)
    futs = [pg.allreduce(t(i + c.rank)).get_future() for i in range(1000)]
    for i, f in enumerate(futs):
        f.wait()
        eq(f.value()[0], t(i * c.ws + c.ws * (c.ws - 1) // 2), f"Mismatch in iteration {i}")


@scenario
def test_allreduce_coalesced_checks(c):
    pg = c.pg()
    t1, t2 = np.zeros(1, np.float32), np.zeros(1, np.float64)
    raises(ARG, "requires non-empty tensor list", pg.allreduce_coalesced, [])
    raises(ARG, "tensors must all have the same type", pg.allreduce_coalesced, [t1, t2])


@scenario
def test_allreduce_coalesced_basics(c):
    pg = c.pg()
    for op, inputs, outputs in simple_coalesced_reduce_tests(c.rank, c.ws):
        tensors = [x.copy() for x in inputs]
        fut = pg.allreduce_coalesced(tensors, nc.AllreduceCoalescedOptions(reduce_op=op)
                                     ).get_future()
        fut.wait()
        for r, e in zip(fut.value(), outputs):
            eq(r, e, f"{op}")


def _expected_coalesced(i, ws):
    return 2 * [t(i * ws + ws * (ws - 1) // 2)]


@scenario
def test_allreduce_coalesced_stress(c):
    pg = c.pg(threads=8)
    futs = [pg.allreduce_coalesced(2 * [t(i + c.rank)]).get_future() for i in range(1000)]
    for i, f in enumerate(futs):
        f.wait()
        for r, e in zip(f.value(), _expected_coalesced(i, c.ws)):
            eq(r, e, f"Mismatch in iteration {i}")


@scenario
def test_allreduce_coalesced_async(c):
    xs = [2 * [t(i + c.rank)] for i in range(2)]
    futs = [nc.all_reduce_coalesced(x, async_op=True) for x in xs]
    nc.futures.wait_all(futs)
    for i, f in enumerate(futs):
        for r, e in zip(f.get_future().wait(), _expected_coalesced(i, c.ws)):
            eq(r, e)


# -- the *_tensor_coalesced family, reduce_scatter ------------------------------------------
@scenario
def test_allgather_into_tensor_coalesced(c):
    rng = np.random.default_rng(42)
    in_shapes = [(5, 5), (10, 10), (15, 15)]
    outputs = [np.empty((s[0] * c.ws,) + s[1:], np.float32) for s in in_shapes]
    inputs = [rng.random(s, dtype=np.float32) for s in in_shapes]
    nc.group.WORLD.allgather_into_tensor_coalesced(outputs, inputs).wait()
    for o, i in zip(outputs, inputs):
        np.testing.assert_allclose(o, np.concatenate([i] * c.ws))


@scenario
def test_reduce_scatter(c):
    rng = np.random.default_rng(42)
    inputs = [rng.random(i, dtype=np.float32) for i in range(c.ws)]
    output = np.empty(c.rank, np.float32)
    nc.reduce_scatter(output, inputs, async_op=True).wait()
    np.testing.assert_allclose(output, inputs[c.rank] * c.ws, rtol=1e-6)


@scenario
def test_reduce_scatter_tensor(c):
    rng = np.random.default_rng(42)
    out_shape = (20, 20)
    output = np.empty(out_shape, np.float32)
    inp = rng.random((out_shape[0] * c.ws,) + out_shape[1:], dtype=np.float32)
    nc.reduce_scatter_tensor(output, inp, async_op=True).wait()
    expect = inp.reshape(c.ws, *out_shape)[c.rank] * c.ws
    np.testing.assert_allclose(output, expect, rtol=1e-6)


@scenario
def test_reduce_scatter_tensor_coalesced(c):
    rng = np.random.default_rng(42)
    out_shapes = [(5, 5), (10, 10), (15, 15)]
    outputs = [np.empty(s, np.float32) for s in out_shapes]
    inputs = [rng.random((s[0] * c.ws,) + s[1:], dtype=np.float32) for s in out_shapes]
    nc.group.WORLD.reduce_scatter_tensor_coalesced(outputs, inputs).wait()
    for o, i in zip(outputs, inputs):
        np.testing.assert_allclose(o, i.reshape(c.ws, *o.shape)[c.rank] * c.ws, rtol=1e-6)


# -- scatter ----------------------------------------------------------------------------
@scenario
def test_scatter_checks(c):
    pg = c.pg()
    t1, t2, t3 = np.zeros(1, np.float32), np.zeros(1, np.float64), np.zeros(2, np.float32)
    S = nc.ScatterOptions
    raises(ARG, "invalid root rank", pg.scatter, [t1], [], S(root_rank=-1))
    raises(ARG, "invalid root rank", pg.scatter, [t1], [], S(root_rank=c.ws))
    raises(ARG, "requires a single-element output tensor list", pg.scatter, [], [], S())
    raises(ARG, "requires a single-element output tensor list", pg.scatter, [t1, t1], [], S())
    me = S(root_rank=c.rank)
    raises(ARG, "requires a single-element input list", pg.scatter, [t1], [], me)
    raises(ARG, "requires a single-element input list", pg.scatter, [t1],
           [[t1] * c.ws, [t1] * c.ws], me)
    err = "Incorrect input list size {}. Input list size should be {}"
    raises(ARG, err.format(c.ws - 1, c.ws), pg.scatter, [t1], [[t1] * (c.ws - 1)], me)
    raises(ARG, err.format(c.ws + 1, c.ws), pg.scatter, [t1], [[t1] * (c.ws + 1)], me)
    raises(ARG, "invalid tensor type", pg.scatter, [t1], [[t2] * c.ws], me)
    raises(ARG, "invalid tensor size", pg.scatter, [t1], [[t3] * c.ws], me)
    raises(ARG, "requires empty input on non-root", pg.scatter, [t1], [[t1] * c.ws],
           S(root_rank=(c.rank + 1) % c.ws))


@scenario
def test_scatter_basics(c):
    pg = c.pg()
    inp = [t(c.rank) for _ in range(c.ws)]
    outputs = [t(-1) for _ in range(c.ws)]
    futs = []
    for i in range(c.ws):
        opts = nc.ScatterOptions(root_rank=i)
        futs.append(pg.scatter([outputs[i]], [inp] if i == c.rank else [], opts).get_future())
    for i in range(c.ws):
        futs[i].wait()
        eq(futs[i].value()[0], t(i))


@scenario
def test_scatter_stress(c):
    pg = c.pg(threads=8)
    inputs = [[t(i + c.rank) for _ in range(c.ws)] for i in range(1000)]
    outputs = [[t(-1) for _ in range(c.ws)] for _ in range(len(inputs))]
    futs = []
    for i in range(len(inputs)):
        for root in range(c.ws):
            opts = nc.ScatterOptions(root_rank=root)
            ins = [[e.copy() for e in inputs[i]]] if root == c.rank else []
            futs.append(pg.scatter([outputs[i][root]], ins, opts).get_future())
    for i, f in enumerate(futs):
        f.wait()
        it, root = divmod(i, c.ws)
        eq(f.value()[0], t(it + root), f"Mismatch in iteration {it} for rank {root}")


# -- gather -----------------------------------------------------------------------------
@scenario
def test_gather_checks(c):
    pg = c.pg()
    t1, t2, t3 = np.zeros(1, np.float32), np.zeros(1, np.float64), np.zeros(2, np.float32)
    G = nc.GatherOptions
    raises(ARG, "invalid root rank", pg.gather, [], [t1], G(root_rank=-1))
    raises(ARG, "invalid root rank", pg.gather, [], [t1], G(root_rank=c.ws))
    raises(ARG, "requires a single-element input tensor list", pg.gather, [], [], G())
    raises(ARG, "requires a single-element input tensor list", pg.gather, [], [t1, t1], G())
    me = G(root_rank=c.rank)
    raises(ARG, "requires a single-element output list", pg.gather, [], [t1], me)
    raises(ARG, "requires a single-element output list", pg.gather,
           [[t1] * c.ws, [t1] * c.ws], [t1], me)
    err = "Incorrect output list size {}. Output list size should be {}"
    raises(ARG, err.format(c.ws - 1, c.ws), pg.gather, [[t1] * (c.ws - 1)], [t1], me)
    raises(ARG, err.format(c.ws + 1, c.ws), pg.gather, [[t1] * (c.ws + 1)], [t1], me)
    raises(ARG, "invalid tensor type", pg.gather, [[t2] * c.ws], [t1], me)
    raises(ARG, "invalid tensor size", pg.gather, [[t3] * c.ws], [t1], me)
    raises(ARG, "requires empty output on non-root", pg.gather, [[t1] * c.ws], [t1],
           G(root_rank=(c.rank + 1) % c.ws))


def _gather_basics(c, fn):
    pg = c.pg()
    inp = [fn(t(c.rank))]
    outputs = [fn(t(-1)) for _ in range(c.ws)]
    futs = []
    for i in range(c.ws):
        opts = nc.GatherOptions(root_rank=i)
        futs.append(pg.gather([outputs] if i == c.rank else [], inp, opts).get_future())
    expected = [fn(t(r)) for r in range(c.ws)]
    for i in range(c.ws):
        futs[i].wait()
        if i == c.rank:
            for r, e in zip(futs[i].value(), expected):
                eq(r, e)


def _noncontiguous(x):
    # torch: t.expand(2, 2).tril().contiguous()[:, 0] -- a column, not dense
    return np.tril(np.broadcast_to(x, (2, 2))).copy()[:, 0]


@scenario
def test_gather_basics(c):
    _gather_basics(c, np.copy)


@scenario
def test_gather_noncontiguous_input(c):
    assert not _noncontiguous(t(1)).flags.c_contiguous
    _gather_basics(c, _noncontiguous)


@scenario
def test_gather_stress(c):
    pg = c.pg(threads=8)
    inputs = [t(i + c.rank) for i in range(1000)]
    outputs = [[[t(-1) for _ in range(c.ws)]] for _ in range(len(inputs))]
    futs = []
    for i in range(len(inputs)):
        for root in range(c.ws):
            opts = nc.GatherOptions(root_rank=root)
            outs = outputs[i] if root == c.rank else []
            futs.append(pg.gather(outs, [inputs[i].copy()], opts).get_future())
    for i, f in enumerate(futs):
        f.wait()
        it, root = divmod(i, c.ws)
        if root == c.rank:
            for r, e in zip(f.value(), [t(it + j) for j in range(c.ws)]):
                eq(r, e, f"Mismatch in iteration {it} for root {root}")


# -- allgather -------------------------------------------------------------------------
@scenario
def test_allgather_checks(c):
    pg = c.pg()
    t1, t2, t3 = np.zeros(1, np.float32), np.zeros(1, np.float64), np.zeros(2, np.float32)
    ws = c.ws
    raises(ARG, "requires non-empty input tensor list", pg.allgather, [], [])
    raises(ARG, "requires input/output tensor lists to have the same length",
           pg.allgather, [], [t1])
    raises(ARG, "requires input/output tensor lists to have the same length",
           pg.allgather, [[t1] * ws, [t1] * ws], [t1])
    raises(ARG, "invalid output tensor list", pg.allgather, [[t1] * (ws - 1)], [t1])
    raises(ARG, "invalid output tensor list", pg.allgather, [[t1] * (ws + 1)], [t1])
    raises(ARG, "invalid tensor type", pg.allgather, [[t1, t1] * ws, [t1, t1] * ws], [t1, t2])
    raises(ARG, "invalid tensor size", pg.allgather, [[t1, t1] * ws, [t1, t1] * ws], [t1, t3])
    raises(ARG, "invalid tensor type", pg.allgather, [([t1, t2] * ws)[:ws]], [t1])
    raises(ARG, "invalid tensor size", pg.allgather, [([t1, t3] * ws)[:ws]], [t1])


def _allgather_basics(c, fn):
    pg = c.pg()
    for n in (1, 2, 3):
        inp = [fn(t(n * c.rank + i)) for i in range(n)]
        output = [[fn(t(-1)) for _ in range(n * c.ws)] for _ in range(n)]
        expected = [[fn(t(i)) for i in range(n * c.ws)] for _ in range(n)]
        fut = pg.allgather(output, inp).get_future()
        fut.wait()
        result = fut.value()
        if n == 1:
            result = [result]
        for rl, el in zip(result, expected):
            assert len(rl) == len(el)
            for r, e in zip(rl, el):
                eq(r, e)


@scenario
def test_allgather_basics(c):
    _allgather_basics(c, np.copy)


@scenario
def test_allgather_noncontiguous_input(c):
    _allgather_basics(c, _noncontiguous)


@scenario
def test_allgather_stress(c):
    pg = c.pg(threads=8)
    outputs = [[[t(-1) for _ in range(c.ws)]] for _ in range(1000)]
    futs = [pg.allgather(outputs[i], [t(i + c.rank)]).get_future() for i in range(1000)]
    for i, f in enumerate(futs):
        f.wait()
        for r, e in zip(f.value(), [t(i + j) for j in range(c.ws)]):
            eq(r, e, f"Mismatch in iteration {i}")


@scenario
def test_allgather_coalesced_checks(c):
    pg = c.pg()
    dummy_input = [np.zeros(1, np.float32)]
    outs = [[np.zeros(1, np.float32)] for _ in range(c.ws)]
    outs[0] = [np.zeros(0, np.float32)]
    raises(ARG, "invalid size of output tensor at index 0", nc.all_gather_coalesced, outs,
           dummy_input, pg)
    outs[0] = [np.zeros(1, np.float64)]
    raises(ARG, "invalid tensor type at index 0", nc.all_gather_coalesced, outs, dummy_input, pg)
    outs = [[np.zeros(1, np.float32)] for _ in range(c.ws + 1)]
    raises(ARG, "output lists should be equal to world size", nc.all_gather_coalesced, outs,
           dummy_input, pg)


@scenario
def test_allgather_coalesced_async(c):
    xxs = [2 * [t(i + c.rank)] for i in range(2)]
    yys = [[[np.zeros_like(x) for x in xx] for _ in range(c.ws)] for xx in xxs]
    futs = [nc.all_gather_coalesced(yy, xx, async_op=True) for xx, yy in zip(xxs, yys)]
    zzs = [[2 * [t(i + r)] for r in range(c.ws)] for i in range(2)]
    nc.futures.wait_all(futs)
    for yy, zz in zip(yys, zzs):
        for y_out, z_out in zip(yy, zz):
            for y, z in zip(y_out, z_out):
                eq(y, z)


# -- reduce ----------------------------------------------------------------------------
@scenario
def test_reduce_checks(c):
    pg = c.pg()
    t1 = np.zeros(1, np.float32)
    R = nc.ReduceOptions
    raises(ARG, "invalid root rank", pg.reduce, [t1], R(root_rank=-1))
    raises(ARG, "invalid root rank", pg.reduce, [t1], R(root_rank=c.ws))
    raises(ARG, "invalid root tensor", pg.reduce, [t1], R(root_rank=c.rank, root_tensor=1))
    raises(ARG, "requires a single-element tensor list", pg.reduce, [t1, t1],
           R(root_rank=c.rank))


@scenario
def test_reduce_basics(c):
    pg = c.pg()
    for op, inp, output in simple_reduce_tests(c.rank, c.ws):
        for root in range(c.ws):
            fut = pg.reduce([inp.copy()], nc.ReduceOptions(reduce_op=op, root_rank=root)
                            ).get_future()
            fut.wait()
            if root == c.rank:
                eq(fut.value()[0], output, f"{op} root {root}")


@scenario
def test_reduce_stress(c):
    pg = c.pg(threads=8)
    futs = []
    for i in range(1000):
        for root in range(c.ws):
            futs.append(pg.reduce([t(i + c.rank)], nc.ReduceOptions(root_rank=root)).get_future())
    for i, f in enumerate(futs):
        f.wait()
        it, root = divmod(i, c.ws)
        if root == c.rank:
            eq(f.value()[0], t(it * c.ws + c.ws * (c.ws - 1) // 2),
               f"Mismatch in iteration {it} with root rank {root}")


# -- send/recv, alltoall, barrier ---------------------------------------------------------
@scenario
def test_send_recv_all_to_all(c):
    pg = c.pg()
    inputs = [t(c.rank) for _ in range(c.ws)]
    outputs = [t(-1) for _ in range(c.ws)]
    sends = [pg.send([inputs[i]], i, 0) for i in range(c.ws) if i != c.rank]
    recvs = [pg.recv([outputs[i]], i, 0) for i in range(c.ws) if i != c.rank]
    for w in sends + recvs:
        w.wait()
        assert w.is_completed()
    for i in range(c.ws):
        if i != c.rank:
            eq(outputs[i], t(i))


@scenario
def test_recv_anysource(c):
    pg = c.pg()
    if c.rank == 0:
        got = set()
        for _ in range(c.ws - 1):
            buf = t(-1)
            w = pg.recv_anysource([buf], tag=7)
            w.wait()
            assert buf[0] == w.source_rank() * 10
            got.add(w.source_rank())
        assert got == set(range(1, c.ws))
    else:
        pg.send([t(c.rank * 10)], 0, tag=7).wait()


@scenario
def test_alltoall_basics(c):
    pg = c.pg()
    inputs = [t(c.rank * 100 + q) for q in range(c.ws)]
    outputs = [t(-1) for _ in range(c.ws)]
    fut = pg.alltoall(outputs, inputs).get_future()
    fut.wait()
    for r, o in enumerate(fut.value()):
        eq(o, t(r * 100 + c.rank))
    raises(ARG, "input tensor list size", pg.alltoall, outputs, inputs[:-1])
    raises(ARG, "output tensor list size", pg.alltoall, outputs[:-1], inputs)


@scenario
def test_alltoall_base_splits(c):
    pg = c.pg()
    # equal splits
    inp = np.arange(c.ws * 2, dtype=np.float32) + 100 * c.rank
    out = np.empty_like(inp)
    pg.alltoall_base(out, inp).wait()
    expect = np.concatenate([np.arange(2 * c.rank, 2 * c.rank + 2) + 100 * r
                             for r in range(c.ws)]).astype(np.float32)
    eq(out, expect)
    # explicit splits: rank r sends q + 1 rows of 3 to rank q
    in_splits = [q + 1 for q in range(c.ws)]
    out_splits = [c.rank + 1] * c.ws
    inp = np.concatenate([np.full((q + 1, 3), c.rank * 10 + q, np.int32) for q in range(c.ws)])
    out = np.empty((sum(out_splits), 3), np.int32)
    pg.alltoall_base(out, inp, out_splits, in_splits).wait()
    expect = np.concatenate([np.full((c.rank + 1, 3), r * 10 + c.rank, np.int32)
                             for r in range(c.ws)])
    eq(out, expect)
    raises(ARG, "Tensors must be contiguous", pg.alltoall_base, out, inp.T)
    raises(ARG, "same type", pg.alltoall_base, out.astype(np.float32), inp, out_splits, in_splits)


@scenario
def test_barrier_implies_wait(c):
    pg = c.pg()
    tensors = [np.full((100, 100), float(i), np.float32) for i in range(16)]
    for x in tensors:
        pg.allreduce(x)  # work handle leaked on purpose
    pg.barrier().get_future().wait()
    for i, x in enumerate(tensors):
        eq(x, np.full((100, 100), float(i * c.ws), np.float32))


@scenario
def test_monitored_barrier(c):
    pg = c.pg(timeout_s=5)
    pg.monitored_barrier(timedelta(seconds=5)).wait()
    pg2 = c.pg(timeout_s=5)
    if c.rank == c.ws - 1:
        return  # this rank never arrives
    work = pg2.monitored_barrier(timedelta(milliseconds=500), wait_all_ranks=True)
    if c.rank == 0:
        raises(TimeoutError, rf"Rank {c.ws - 1} failed to pass monitoredBarrier", work.wait)
    else:
        raises(Exception, "", work.wait)  # never released by rank 0


def run_all(names):
    """Run the named scenarios on this rank; {name: None | error text}."""
    outcomes = {}
    for name in names:
        c = Ctx(name)
        try:
            SCENARIOS[name](c)
            outcomes[name] = None
        except BaseException as exc:  # noqa: BLE001 - reported per scenario
            import traceback

            outcomes[name] = f"rank {c.rank}: {type(exc).__name__}: {exc}\n" + \
                traceback.format_exc()[-2000:]
        finally:
            c.close()
    return outcomes
