"""Every collective against a plain-NumPy reference: world sizes 1, 2, 3, 4, 7
(ranks as threads; ``--world-sizes`` or ``NUMCOLL_TEST_WORLD_SIZES`` choose
others) over the in-process transport, and a slice (3 ranks) over tcp and
ipc; counts 0, 1, non-divisible and larger, every dtype, op and root, every
algorithm, with tiny segments forcing the multi-segment paths."""

import numpy as np
import pytest

import numcoll as nc
from reference import DTYPES, OPS, assert_reduced, make_input, reduce_reference, valid

pytestmark = pytest.mark.timeout(300)

COUNTS = [0, 1, 13, 300]


def _run(fn, placement):
    transport, world_size = placement
    return nc.launch(fn, world_size, mode="thread", transport=transport, timeout=240)


def test_allreduce_every_dtype_op_count_algorithm(placement, tiny_segments):
    world_size = placement[1]
    def body():
        pg, rank = nc.get_default_group(), nc.get_rank()
        checked = 0
        for dtype in DTYPES:
            for op in OPS:
                if not valid(op, dtype):
                    continue
                for count in COUNTS:
                    for algorithm in ("ring", "recursive_doubling"):
                        x = make_input(dtype, count, rank, op)
                        opts = nc.AllreduceOptions(reduce_op=op, algorithm=algorithm)
                        pg.allreduce(x, opts).wait()
                        inputs = [make_input(dtype, count, r, op) for r in range(world_size)]
                        assert_reduced(x, reduce_reference(op, dtype, inputs), op, dtype,
                                       f"{dtype} {op} count={count} {algorithm}")
                        checked += 1
        return checked

    counts = _run(body, placement)
    assert len(set(counts)) == 1 and counts[0] > 500


def test_reduce_every_root_and_algorithm(placement, tiny_segments):
    world_size = placement[1]
    ops = [nc.ReduceOp.SUM, nc.ReduceOp.MAX, nc.ReduceOp.PRODUCT, nc.ReduceOp.BXOR]
    dtypes = [np.float32, np.float16, nc.bfloat16, np.int64, np.uint8, np.bool_, np.complex64]
    # (the arena's reduce reads a non-root's own array, not a copy: checked
    # unchanged below like the others)
    algorithms = ("binomial", "ring") + (("shared",) if placement[0] == "shm" else ())

    def body():
        pg, rank = nc.get_default_group(), nc.get_rank()
        for root in range(world_size):
            for dtype in dtypes:
                for op in ops:
                    if not valid(op, dtype):
                        continue
                    for count in COUNTS:
                        for algorithm in algorithms:
                            x = make_input(dtype, count, rank, op)
                            before = x.copy()
                            opts = nc.ReduceOptions(reduce_op=op, root_rank=root,
                                                    algorithm=algorithm)
                            pg.reduce([x], opts).wait()
                            if rank == root:
                                inputs = [make_input(dtype, count, r, op)
                                          for r in range(world_size)]
                                assert_reduced(x, reduce_reference(op, dtype, inputs), op,
                                               dtype, f"root {root} {dtype} {op} {algorithm}")
                            else:
                                np.testing.assert_array_equal(x, before)

    _run(body, placement)


def test_broadcast_every_root_dtype_and_algorithm(placement, tiny_segments):
    world_size = placement[1]
    def body():
        pg, rank = nc.get_default_group(), nc.get_rank()
        for root in range(world_size):
            for dtype in DTYPES:
                for count in COUNTS:
                    for algorithm in ("binomial", "chain"):
                        x = make_input(dtype, count, rank, None, salt=root)
                        opts = nc.BroadcastOptions(root_rank=root, algorithm=algorithm)
                        pg.broadcast(x, opts).wait()
                        np.testing.assert_array_equal(
                            x, make_input(dtype, count, root, None, salt=root))

    _run(body, placement)


def test_allgather_gather_scatter_alltoall(placement, tiny_segments):
    world_size = placement[1]
    def body():
        pg, rank = nc.get_default_group(), nc.get_rank()
        for dtype in DTYPES:
            for count in COUNTS:
                mine = make_input(dtype, count, rank, None)
                theirs = [make_input(dtype, count, r, None) for r in range(world_size)]
                # allgather
                out = [np.empty(count, dtype) for _ in range(world_size)]
                pg.allgather([out], [mine]).wait()
                for o, t in zip(out, theirs):
                    np.testing.assert_array_equal(o, t)
                # allgather_into_tensor
                flat = np.empty(count * world_size, dtype)
                pg.allgather_into_tensor(flat, mine).wait()
                np.testing.assert_array_equal(flat, np.concatenate(theirs))
                for root in range(world_size):
                    # gather
                    out = [np.empty(count, dtype) for _ in range(world_size)]
                    pg.gather([out] if rank == root else [], [mine],
                              nc.GatherOptions(root_rank=root)).wait()
                    if rank == root:
                        for o, t in zip(out, theirs):
                            np.testing.assert_array_equal(o, t)
                    # scatter: the root sends block r (made with salt=r) to rank r
                    got = np.empty(count, dtype)
                    blocks = [make_input(dtype, count, root, None, salt=r)
                              for r in range(world_size)]
                    pg.scatter([got], [blocks] if rank == root else [],
                               nc.ScatterOptions(root_rank=root)).wait()
                    np.testing.assert_array_equal(got, make_input(dtype, count, root, None,
                                                                  salt=rank))
                # alltoall: block for rank q from rank r is make_input(.., r, salt=q)
                ins = [make_input(dtype, count, rank, None, salt=q) for q in range(world_size)]
                outs = [np.empty(count, dtype) for _ in range(world_size)]
                pg.alltoall(outs, ins).wait()
                for r, o in enumerate(outs):
                    np.testing.assert_array_equal(o, make_input(dtype, count, r, None,
                                                                salt=rank))

    _run(body, placement)


def test_reduce_scatter_family(placement, tiny_segments):
    world_size = placement[1]
    ops = [nc.ReduceOp.SUM, nc.ReduceOp.AVG, nc.ReduceOp.MIN, nc.ReduceOp.BOR]
    dtypes = [np.float32, np.float64, np.float16, nc.bfloat16, np.int32, np.uint16,
              np.bool_, np.complex128]

    def body():
        pg, rank = nc.get_default_group(), nc.get_rank()
        for dtype in dtypes:
            for op in ops:
                if not valid(op, dtype):
                    continue
                for count in COUNTS:
                    inputs = {r: make_input(dtype, count * world_size, r, op)
                              for r in range(world_size)}
                    expect = reduce_reference(op, dtype, list(inputs.values()))
                    mine = expect[rank * count:(rank + 1) * count]
                    # reduce_scatter_tensor
                    out = np.empty(count, dtype)
                    pg.reduce_scatter_tensor(out, inputs[rank],
                                             nc.ReduceScatterOptions(reduce_op=op)).wait()
                    assert_reduced(out, mine, op, dtype, f"rs_tensor {dtype} {op} {count}")
                    # reduce_scatter with uneven shares: rank r's share has r + count elements
                    shares = [make_input(dtype, r + count, rank, op, salt=r)
                              for r in range(world_size)]
                    out = np.empty(rank + count, dtype)
                    pg.reduce_scatter([out], [shares],
                                      nc.ReduceScatterOptions(reduce_op=op)).wait()
                    ref = reduce_reference(op, dtype, [make_input(dtype, rank + count, r, op,
                                                                  salt=rank)
                                                       for r in range(world_size)])
                    assert_reduced(out, ref, op, dtype, f"rs {dtype} {op} {count}")

    _run(body, placement)


@pytest.mark.parametrize("world_size", [2, 3])
def test_large_arrays_default_segments(world_size):
    """Multi-megabyte buffers through the default (1 MiB) segments and ring."""
    n = 3_000_001

    def body():
        pg, rank = nc.get_default_group(), nc.get_rank()
        x = np.full(n, rank + 1, np.float32)
        pg.allreduce(x).wait()
        assert np.all(x == world_size * (world_size + 1) / 2)
        y = np.arange(n, dtype=np.float64) * (rank == 1)
        pg.broadcast(y, root=1).wait()
        assert np.array_equal(y, np.arange(n, dtype=np.float64))
        out = np.empty(n * world_size, np.int16)
        pg.allgather_into_tensor(out, np.full(n, rank, np.int16)).wait()
        assert np.array_equal(out, np.repeat(np.arange(world_size, dtype=np.int16), n))
        return True

    assert all(_run(body, ("inproc", world_size)))


def test_float16_sums_do_not_drift():
    """Gloo rounds to float16 at every ring step (pytorch#152300); numcoll sums
    in float32 and rounds once, so the result is the correctly rounded sum."""
    world_size, n = 7, 4096

    def data(rank):
        rng = np.random.default_rng(rank)
        return ((rng.random(n) * 2 - 1) * 65504 / world_size / 4).astype(np.float16)

    def body():
        pg, rank = nc.get_default_group(), nc.get_rank()
        x = data(rank)
        pg.allreduce(x, nc.AllreduceOptions(algorithm="ring")).wait()
        return x

    results = _run(body, ("inproc", world_size))
    exact = np.sum([data(r).astype(np.float64) for r in range(world_size)], axis=0)
    once = exact.astype(np.float32).astype(np.float16)
    for x in results:
        np.testing.assert_array_equal(x, results[0])  # identical on every rank
        # exact float32 sum of float16 values rounded once: within half an ulp
        err = np.abs(x.astype(np.float64) - exact)
        ulp = np.spacing(np.abs(once)).astype(np.float64)
        assert np.all(err <= ulp * 0.5 + 1e-12)


@pytest.mark.parametrize("transport", ["inproc", "tcp", "ipc", "shm"])
def test_every_collective_on_every_transport(transport, tiny_segments):
    """Every collective, 3 ranks, over each transport (the rest of this file
    runs on inproc; the ported Gloo tests run on ipc between processes)."""
    world_size, dtypes, counts = 3, [np.float32, np.int64, np.float16], [0, 1, 13, 700]

    def body():
        pg, rank = nc.get_default_group(), nc.get_rank()
        done = set()
        for dtype in dtypes:
            for count in counts:
                theirs = [make_input(dtype, count, r, None) for r in range(world_size)]
                mine = theirs[rank]
                for algorithm in ("ring", "recursive_doubling"):
                    x = mine.copy()
                    pg.allreduce(x, nc.AllreduceOptions(algorithm=algorithm)).wait()
                    np.testing.assert_array_equal(
                        x, reduce_reference(nc.ReduceOp.SUM, dtype, theirs))
                done.add("allreduce")
                x = [mine.copy(), mine.copy()]
                pg.allreduce_coalesced(x).wait()
                np.testing.assert_array_equal(x[1], reduce_reference(nc.ReduceOp.SUM, dtype,
                                                                     theirs))
                done.add("allreduce_coalesced")
                for algorithm in ("binomial", "ring"):
                    x = mine.copy()
                    pg.reduce([x], nc.ReduceOptions(root_rank=1, algorithm=algorithm)).wait()
                    if rank == 1:
                        np.testing.assert_array_equal(
                            x, reduce_reference(nc.ReduceOp.SUM, dtype, theirs))
                done.add("reduce")
                for algorithm in ("binomial", "chain"):
                    x = mine.copy()
                    pg.broadcast(x, nc.BroadcastOptions(root_rank=2, algorithm=algorithm)).wait()
                    np.testing.assert_array_equal(x, theirs[2])
                done.add("broadcast")
                out = [np.empty(count, dtype) for _ in range(world_size)]
                pg.allgather([out], [mine]).wait()
                [np.testing.assert_array_equal(o, t) for o, t in zip(out, theirs)]
                done.add("allgather")
                outs = [[np.empty(count, dtype)] for _ in range(world_size)]
                pg.allgather_coalesced(outs, [mine]).wait()
                [np.testing.assert_array_equal(o[0], t) for o, t in zip(outs, theirs)]
                done.add("allgather_coalesced")
                flat = np.empty(count * world_size, dtype)
                pg.allgather_into_tensor(flat, mine).wait()
                np.testing.assert_array_equal(flat, np.concatenate(theirs))
                done.add("allgather_into_tensor")
                out = [np.empty(count, dtype) for _ in range(world_size)]
                pg.gather([out] if rank == 0 else [], [mine]).wait()
                if rank == 0:
                    [np.testing.assert_array_equal(o, t) for o, t in zip(out, theirs)]
                done.add("gather")
                got = np.empty(count, dtype)
                pg.scatter([got], [theirs] if rank == 0 else []).wait()
                np.testing.assert_array_equal(got, theirs[rank])
                done.add("scatter")
                big = [make_input(dtype, count * world_size, r, None) for r in range(world_size)]
                out = np.empty(count, dtype)
                pg.reduce_scatter_tensor(out, big[rank]).wait()
                np.testing.assert_array_equal(out, reduce_reference(
                    nc.ReduceOp.SUM, dtype, big)[rank * count:(rank + 1) * count])
                done.add("reduce_scatter_tensor")
                out = np.empty(count, dtype)
                pg.reduce_scatter([out], [[mine] * world_size]).wait()
                np.testing.assert_array_equal(out, reduce_reference(nc.ReduceOp.SUM, dtype,
                                                                    theirs))
                done.add("reduce_scatter")
                outs = [np.empty(count, dtype) for _ in range(world_size)]
                pg.alltoall(outs, [mine] * world_size).wait()
                [np.testing.assert_array_equal(o, t) for o, t in zip(outs, theirs)]
                done.add("alltoall")
                out = np.empty(count * world_size, dtype)
                pg.alltoall_base(out, np.tile(mine, world_size)).wait()
                np.testing.assert_array_equal(out, np.concatenate(theirs))
                done.add("alltoall_base")
                got = np.empty(count, dtype)
                recv = pg.recv([got], (rank - 1) % world_size, tag=5)
                pg.send([mine], (rank + 1) % world_size, tag=5).wait()
                recv.wait()
                np.testing.assert_array_equal(got, theirs[(rank - 1) % world_size])
                done.add("send/recv")
                pg.barrier().wait()
                done.add("barrier")
        return sorted(done)

    results = nc.launch(body, world_size, mode="thread", transport=transport, timeout=240)
    assert results[0] == results[-1] and len(results[0]) == 15


@pytest.mark.parametrize("world_size", [2, 3])
def test_alltoall_base_with_the_same_array_in_and_out(world_size):
    """Aliased input and output: every block sent is the caller's input, not a
    block another rank already wrote into the shared memory."""
    def body():
        pg, rank = nc.get_default_group(), nc.get_rank()
        x = np.array([rank * 10 + q for q in range(world_size)], np.int64)
        pg.alltoall_base(x, x).wait()
        return x

    for rank, got in enumerate(_run(body, ("inproc", world_size))):
        np.testing.assert_array_equal(got, [q * 10 + rank for q in range(world_size)])
