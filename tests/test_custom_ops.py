"""User-defined reductions (ReduceOp.custom) and the scaled sum (ReduceOp.premul_sum)
in every reducing collective, on host arrays, against NumPy; world sizes 1-4."""

import pickle

import numba
import numpy as np
import pytest

import numcoll as nc
from reference import make_input

pytestmark = pytest.mark.timeout(120)

WORLD_SIZES = [1, 2, 3, 4]

max_abs = nc.ReduceOp.custom(lambda a, b: a if abs(a) >= abs(b) else b, name="max_abs")
bits_and = nc.ReduceOp.custom(lambda a, b: a & b, name="bits_and")


@numba.njit
def _gcd(a, b):
    while b:
        a, b = b, a % b
    return abs(a)


gcd = nc.ReduceOp.custom(_gcd)


def _run(fn, world_size):
    return nc.launch(fn, world_size, mode="thread", timeout=100)


def _signed_distinct(dtype, count, rank, salt=0):
    """Values whose magnitudes differ across ranks, element by element, so that
    max_abs has no ties and the result does not depend on the order of combination."""
    i = np.arange(count) + salt
    return (((i % 5) + 1) * (rank + 1) * np.where((i + rank) % 2, -1, 1)).astype(dtype)


def _max_abs_reference(dtype, arrays):
    stack = np.stack([a.astype(np.float64) for a in arrays])
    return stack[np.abs(stack).argmax(axis=0), np.arange(stack.shape[1])].astype(dtype)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_custom_op_in_every_reducing_collective(world_size, tiny_segments):
    dtypes = [np.float32, np.float64, np.float16, nc.bfloat16, np.int32, np.int8]

    def body():
        pg, rank = nc.get_default_group(), nc.get_rank()
        for dtype in dtypes:
            everyone = [_signed_distinct(dtype, 23, r) for r in range(world_size)]
            expect = _max_abs_reference(dtype, everyone)
            for algorithm in ("ring", "recursive_doubling"):
                x = everyone[rank].copy()
                pg.allreduce(x, nc.AllreduceOptions(reduce_op=max_abs,
                                                    algorithm=algorithm)).wait()
                np.testing.assert_array_equal(x, expect, f"allreduce {algorithm} {dtype}")
            for root in range(world_size):
                x = everyone[rank].copy()
                pg.reduce([x], nc.ReduceOptions(reduce_op=max_abs, root_rank=root)).wait()
                if rank == root:
                    np.testing.assert_array_equal(x, expect, f"reduce root {root}")
                else:
                    np.testing.assert_array_equal(x, everyone[rank])
            opts = nc.ReduceScatterOptions(reduce_op=max_abs)
            # reduce_scatter: rank r's share has r + 2 elements
            shares = [_signed_distinct(dtype, r + 2, rank, salt=r) for r in range(world_size)]
            out = np.empty(rank + 2, dtype)
            pg.reduce_scatter([out], [shares], opts).wait()
            np.testing.assert_array_equal(out, _max_abs_reference(
                dtype, [_signed_distinct(dtype, rank + 2, r, salt=rank)
                        for r in range(world_size)]))
            # reduce_scatter_tensor: 3 elements each
            big = [_signed_distinct(dtype, 3 * world_size, r) for r in range(world_size)]
            out = np.empty(3, dtype)
            pg.reduce_scatter_tensor(out, big[rank], opts).wait()
            np.testing.assert_array_equal(
                out, _max_abs_reference(dtype, big)[rank * 3:rank * 3 + 3])
        # an @njit function, and allreduce_coalesced
        ints = [np.array([12, 18, 35, 7]) * (r + 1) for r in range(world_size)]
        xs = [ints[rank].astype(np.int64), ints[rank][:2].astype(np.int64) * 5]
        pg.allreduce_coalesced(xs, nc.AllreduceCoalescedOptions(reduce_op=gcd)).wait()
        np.testing.assert_array_equal(xs[0], np.gcd.reduce(np.stack(ints), axis=0))
        np.testing.assert_array_equal(xs[1], np.gcd.reduce(np.stack(ints)[:, :2] * 5, axis=0))
        return True

    assert all(_run(body, world_size))


@pytest.mark.parametrize("world_size", [2, 3])
def test_custom_op_that_does_not_compile_fails_at_the_call_on_every_rank(world_size):
    def body():
        pg, rank = nc.get_default_group(), nc.get_rank()
        caught = []
        calls = [
            lambda: pg.allreduce(np.ones(4, np.float32), op=bits_and),
            lambda: pg.allreduce_coalesced([np.ones(4, np.float32)],
                                           nc.AllreduceCoalescedOptions(reduce_op=bits_and)),
            lambda: pg.reduce([np.ones(4, np.float32)], op=bits_and, root=0),
            lambda: pg.reduce_scatter([np.ones(1, np.float32)],
                                      [[np.ones(1, np.float32)] * world_size],
                                      nc.ReduceScatterOptions(reduce_op=bits_and)),
            lambda: pg.reduce_scatter_tensor(np.ones(1, np.float32),
                                             np.ones(world_size, np.float32),
                                             nc.ReduceScatterOptions(reduce_op=bits_and)),
        ]
        for call in calls:
            with pytest.raises(TypeError, match=r"custom\(bits_and\) cannot reduce dtype "
                                                r"float32.*does not compile") as info:
                call()
            caught.append(info.value)
        # Nothing was queued, so the ranks are still in step; the op compiles for ints.
        x = np.full(3, 0b110 | (1 << rank), np.int32)
        pg.allreduce(x, op=bits_and).wait()
        y = np.full(2, rank + 1.0)
        pg.allreduce(y).wait()
        return len(caught), x, y

    results = _run(body, world_size)
    expect = np.bitwise_and.reduce([0b110 | (1 << r) for r in range(world_size)])
    for caught, x, y in results:             # every rank got every TypeError
        assert caught == 5
        np.testing.assert_array_equal(x, np.full(3, expect, np.int32))
        np.testing.assert_array_equal(y, np.full(2, world_size * (world_size + 1) / 2))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_premul_sum(world_size, tiny_segments):
    dtypes = [np.float32, np.float64, np.float16, nc.bfloat16, np.complex64]

    def reference(dtype, factor, arrays):
        wide = np.complex128 if np.dtype(dtype).kind == "c" else np.float64
        total = sum(factor * a.astype(wide) for a in arrays)
        return total.astype(dtype)

    def body():
        pg, rank = nc.get_default_group(), nc.get_rank()
        for dtype in dtypes:
            for factor in (0.5, 3):
                op = nc.ReduceOp.premul_sum(factor)
                everyone = [make_input(dtype, 19, r, None) for r in range(world_size)]
                expect = reference(dtype, factor, everyone)
                for algorithm in ("ring", "recursive_doubling"):
                    x = everyone[rank].copy()
                    pg.allreduce(x, nc.AllreduceOptions(reduce_op=op,
                                                        algorithm=algorithm)).wait()
                    np.testing.assert_array_equal(x, expect, f"{dtype} {factor} {algorithm}")
                # several local arrays: each is scaled
                xs = [everyone[rank].copy(), everyone[rank].copy()]
                pg.allreduce(xs, op=op).wait()
                np.testing.assert_array_equal(xs[1], reference(dtype, factor, everyone * 2))
                x = everyone[rank].copy()
                pg.reduce([x], op=op, root=world_size - 1).wait()
                if rank == world_size - 1:
                    np.testing.assert_array_equal(x, expect)
                else:
                    np.testing.assert_array_equal(x, everyone[rank])
                big = [make_input(dtype, 2 * world_size, r, None) for r in range(world_size)]
                out = np.empty(2, dtype)
                pg.reduce_scatter_tensor(out, big[rank],
                                         nc.ReduceScatterOptions(reduce_op=op)).wait()
                np.testing.assert_array_equal(
                    out, reference(dtype, factor, big)[2 * rank:2 * rank + 2])
                shares = [make_input(dtype, 3, rank, None, salt=r) for r in range(world_size)]
                out = np.empty(3, dtype)
                pg.reduce_scatter([out], [shares], nc.ReduceScatterOptions(reduce_op=op)).wait()
                np.testing.assert_array_equal(out, reference(
                    dtype, factor, [make_input(dtype, 3, r, None, salt=rank)
                                    for r in range(world_size)]))
        # a complex factor scales complex data
        z = np.full(2, 1 + 1j, np.complex128)
        pg.allreduce(z, op=nc.ReduceOp.premul_sum(1j)).wait()
        np.testing.assert_array_equal(z, np.full(2, world_size * (-1 + 1j)))
        return True

    assert all(_run(body, world_size))


def test_premul_sum_argument_errors_and_identity():
    def body():
        pg = nc.get_default_group()
        for dtype in (np.int32, np.uint8, np.bool_):
            with pytest.raises(ValueError, match="premul_sum.*floating point or complex"):
                pg.allreduce(np.ones(3, dtype), op=nc.ReduceOp.premul_sum(2))
        with pytest.raises(TypeError, match="complex factor"):
            pg.allreduce(np.ones(3, np.float32), op=nc.ReduceOp.premul_sum(2j))
        x = np.ones(3)
        pg.allreduce(x, op=nc.ReduceOp.premul_sum(0.25)).wait()
        return x

    for x in _run(body, 2):
        np.testing.assert_array_equal(x, np.full(3, 0.5))
    with pytest.raises(TypeError, match="needs a number"):
        nc.ReduceOp.premul_sum("2")
    op = nc.ReduceOp.premul_sum(0.5)
    assert op == nc.ReduceOp.premul_sum(0.5) and op != nc.ReduceOp.premul_sum(2)
    assert op != nc.ReduceOp.SUM and repr(op) == "ReduceOp.premul_sum(0.5)"
    assert pickle.loads(pickle.dumps(op)) == op
    assert not op.is_custom and not op.is_bitwise and op.is_premul
