"""Every collective on CUDA arrays, against the NumPy reference, under Numba's CUDA simulator.

The simulator is switched on here, before numba.cuda is first imported, unless
the environment already says otherwise (``NUMBA_ENABLE_CUDASIM=0`` runs the
same tests on a real GPU). Ranks are threads; launches are 4 threads x 2
blocks and segments 64 bytes, so tiny arrays take the multi-segment,
multi-iteration paths. The simulator runs kernels as Python, so sizes stay small.

What the simulator cannot show: real asynchrony (its streams and copies are
synchronous), pinned memory (its "pinned" arrays are plain NumPy), and
Numba's strided-assignment kernel (its device arrays are NumPy arrays).
"""

import sys

from cuda_env import SIMULATED  # noqa: E402 - first: chooses the simulator

import numpy as np  # noqa: E402
import pytest  # noqa: E402

pytestmark = pytest.mark.timeout(180)

from numba import cuda as _numba_cuda  # noqa: E402

# Bound names only: while a simulated kernel runs a custom op defined in this
# module, the simulator swaps this module's references to numba.cuda.
new_stream = _numba_cuda.stream
del _numba_cuda

import numcoll as nc  # noqa: E402
import numcoll.cuda  # noqa: E402
# numba.cuda.to_device refuses bfloat16 on a GPU ("cannot include dtype 'E' in
# a buffer"); numcoll's copies take every dtype numcoll does.
to_device = numcoll.cuda.to_device
from numcoll.cuda import pinned_pool as staging  # noqa: E402
from reference import OPS, assert_reduced, make_input, reduce_reference, valid  # noqa: E402

DTYPES = [np.float32, np.float16, nc.bfloat16, np.int32, np.bool_, np.complex64]
WORLD_SIZES = [1, 2, 3]
COUNTS = [0, 1, 13]


@pytest.fixture(autouse=True)
def tiny(monkeypatch):
    monkeypatch.setenv("NUMCOLL_CUDA_THREADS", "4")
    monkeypatch.setenv("NUMCOLL_CUDA_BLOCKS", "2")
    monkeypatch.setenv("NUMCOLL_SEGMENT_NBYTES", "64")


def _run(fn, world_size):
    return nc.launch(fn, world_size, mode="thread", timeout=150)


def host(d):
    return numcoll.cuda.to_host(d)


# --------------------------------------------------------------------------
# Reductions
# --------------------------------------------------------------------------

@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_allreduce_every_op_dtype_and_algorithm(world_size):
    def body():
        pg, rank = nc.get_default_group(), nc.get_rank()
        checked = 0
        for dtype in DTYPES:
            for op in OPS:
                if not valid(op, dtype):
                    continue
                for count in COUNTS:
                    for algorithm in ("ring", "recursive_doubling"):
                        x = to_device(make_input(dtype, count, rank, op))
                        work = pg.allreduce(x, nc.AllreduceOptions(reduce_op=op,
                                                                   algorithm=algorithm))
                        assert work.wait() and work.result() == [x]
                        inputs = [make_input(dtype, count, r, op) for r in range(world_size)]
                        assert_reduced(host(x), reduce_reference(op, dtype, inputs), op, dtype,
                                       f"{np.dtype(dtype)} {op} count={count} {algorithm}")
                        checked += 1
        return checked

    counts = _run(body, world_size)
    assert len(set(counts)) == 1 and counts[0] > 150


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_allreduce_several_arrays_coalesced_and_native_half_wire(world_size, monkeypatch):
    monkeypatch.setenv("NUMCOLL_HALF_WIRE", "native")
    op = nc.ReduceOp.SUM

    def body():
        pg, rank = nc.get_default_group(), nc.get_rank()
        for dtype in (np.float32, nc.bfloat16, np.int32):
            # several arrays per rank: all reduced locally first, result in each;
            # one bound to a stream of its own (the collective's stream waits for it)
            xs = [to_device(make_input(dtype, 9, rank, op, salt=k)) for k in range(3)]
            xs[1] = xs[1].bind(new_stream())
            pg.allreduce(xs).wait()
            expect = reduce_reference(op, dtype, [make_input(dtype, 9, r, op, salt=k)
                                                  for r in range(world_size) for k in range(3)])
            for x in xs:
                assert_reduced(host(x), expect, op, dtype, f"multi {np.dtype(dtype)}")
            # coalesced: shapes differ
            shapes = [(2, 3), (5,), (1, 4, 2)]
            ys = [to_device(make_input(dtype, int(np.prod(s)), rank, op, salt=i).reshape(s))
                  for i, s in enumerate(shapes)]
            pg.allreduce_coalesced(ys).wait()
            for i, (s, y) in enumerate(zip(shapes, ys)):
                n = int(np.prod(s))
                expect = reduce_reference(op, dtype, [make_input(dtype, n, r, op, salt=i)
                                                      for r in range(world_size)])
                assert_reduced(host(y), expect.reshape(s), op, dtype, f"coalesced {i}")
        return True

    assert all(_run(body, world_size))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reduce_every_root_and_algorithm(world_size):
    ops = [nc.ReduceOp.SUM, nc.ReduceOp.MAX, nc.ReduceOp.PRODUCT, nc.ReduceOp.AVG]

    def body():
        pg, rank = nc.get_default_group(), nc.get_rank()
        for root in range(world_size):
            for dtype in (np.float32, np.float16, np.int32, np.complex64):
                for op in ops:
                    if not valid(op, dtype):
                        continue
                    for algorithm in ("binomial", "ring"):
                        before = make_input(dtype, 13, rank, op)
                        x = to_device(before)
                        pg.reduce([x], nc.ReduceOptions(reduce_op=op, root_rank=root,
                                                        algorithm=algorithm)).wait()
                        if rank == root:
                            inputs = [make_input(dtype, 13, r, op) for r in range(world_size)]
                            assert_reduced(host(x), reduce_reference(op, dtype, inputs), op,
                                           dtype, f"root {root} {op} {algorithm}")
                        else:
                            np.testing.assert_array_equal(host(x), before)
        return True

    assert all(_run(body, world_size))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reduce_scatter_family(world_size):
    ops = [nc.ReduceOp.SUM, nc.ReduceOp.AVG, nc.ReduceOp.MIN, nc.ReduceOp.BOR]

    def body():
        pg, rank = nc.get_default_group(), nc.get_rank()
        for dtype in (np.float32, nc.bfloat16, np.int32, np.bool_, np.complex64):
            for op in ops:
                if not valid(op, dtype):
                    continue
                for count in (1, 5):
                    opts = nc.ReduceScatterOptions(reduce_op=op)
                    inputs = [make_input(dtype, count * world_size, r, op)
                              for r in range(world_size)]
                    expect = reduce_reference(op, dtype, inputs)
                    out = to_device(np.zeros(count, dtype))
                    pg.reduce_scatter_tensor(out, to_device(inputs[rank]), opts).wait()
                    assert_reduced(host(out), expect[rank * count:(rank + 1) * count], op,
                                   dtype, f"rs_tensor {np.dtype(dtype)} {op}")
                    # two pairs in one ring: shares of each pair travel together
                    other = [make_input(dtype, 3 * world_size, r, op, salt=1)
                             for r in range(world_size)]
                    outs = [to_device(np.zeros(count, dtype)), to_device(np.zeros(3, dtype))]
                    pg.reduce_scatter_tensor_coalesced(
                        outs, [to_device(inputs[rank]), to_device(other[rank])], opts).wait()
                    assert_reduced(host(outs[0]), expect[rank * count:(rank + 1) * count],
                                   op, dtype, "coalesced 0")
                    assert_reduced(host(outs[1]),
                                   reduce_reference(op, dtype, other)[rank * 3:rank * 3 + 3],
                                   op, dtype, "coalesced 1")
                    # reduce_scatter with uneven shares: rank r's share has r + count elements
                    shares = [to_device(make_input(dtype, r + count, rank, op, salt=r))
                              for r in range(world_size)]
                    out = to_device(np.zeros(rank + count, dtype))
                    pg.reduce_scatter([out], [shares], opts).wait()
                    ref = reduce_reference(op, dtype, [make_input(dtype, rank + count, r, op,
                                                                  salt=rank)
                                                       for r in range(world_size)])
                    assert_reduced(host(out), ref, op, dtype, f"rs {np.dtype(dtype)} {op}")
        return True

    assert all(_run(body, world_size))


# --------------------------------------------------------------------------
# Data movement
# --------------------------------------------------------------------------

@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_broadcast_every_root_and_algorithm(world_size):
    def body():
        pg, rank = nc.get_default_group(), nc.get_rank()
        for root in range(world_size):
            for dtype in DTYPES:
                for algorithm in ("binomial", "chain"):
                    xs = [to_device(make_input(dtype, 13, rank, None, salt=k)) for k in range(2)]
                    pg.broadcast(xs, nc.BroadcastOptions(root_rank=root, root_tensor=1,
                                                         algorithm=algorithm)).wait()
                    for x in xs:
                        np.testing.assert_array_equal(
                            host(x), make_input(dtype, 13, root, None, salt=1))
        return True

    assert all(_run(body, world_size))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_allgather_family(world_size):
    def body():
        pg, rank = nc.get_default_group(), nc.get_rank()
        for dtype in DTYPES:
            mine = make_input(dtype, 7, rank, None)
            theirs = [make_input(dtype, 7, r, None) for r in range(world_size)]
            # allgather, two inputs per rank
            second = make_input(dtype, 7, rank, None, salt=1)
            outs = [[to_device(np.zeros(7, dtype)) for _ in range(2 * world_size)]
                    for _ in range(2)]
            pg.allgather(outs, [to_device(mine), to_device(second)]).wait()
            for lst in outs:
                for r in range(world_size):
                    np.testing.assert_array_equal(host(lst[2 * r]), theirs[r])
                    np.testing.assert_array_equal(host(lst[2 * r + 1]),
                                                  make_input(dtype, 7, r, None, salt=1))
            # allgather_coalesced: shapes differ
            ins = [to_device(mine.reshape(7, 1)), to_device(make_input(dtype, 4, rank, None))]
            outs = [[to_device(np.zeros((7, 1), dtype)), to_device(np.zeros(4, dtype))]
                    for _ in range(world_size)]
            pg.allgather_coalesced(outs, ins).wait()
            for r, (a, b) in enumerate(outs):
                np.testing.assert_array_equal(host(a).ravel(), theirs[r])
                np.testing.assert_array_equal(host(b), make_input(dtype, 4, r, None))
            # allgather_into_tensor (direct) and its coalesced form (through columns)
            flat = to_device(np.zeros((world_size, 7), dtype))
            pg.allgather_into_tensor(flat, to_device(mine)).wait()
            np.testing.assert_array_equal(host(flat), np.stack(theirs))
            extra = make_input(dtype, 2, rank, None, salt=2)
            outs = [to_device(np.zeros(7 * world_size, dtype)),
                    to_device(np.zeros(2 * world_size, dtype))]
            pg.allgather_into_tensor_coalesced(outs, [to_device(mine), to_device(extra)]).wait()
            np.testing.assert_array_equal(host(outs[0]), np.concatenate(theirs))
            np.testing.assert_array_equal(
                host(outs[1]), np.concatenate([make_input(dtype, 2, r, None, salt=2)
                                               for r in range(world_size)]))
        return True

    assert all(_run(body, world_size))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_gather_scatter_alltoall(world_size):
    def body():
        pg, rank = nc.get_default_group(), nc.get_rank()
        for dtype in (np.float32, nc.bfloat16, np.bool_, np.complex64):
            mine = make_input(dtype, 9, rank, None)
            theirs = [make_input(dtype, 9, r, None) for r in range(world_size)]
            for root in range(world_size):
                out = [to_device(np.zeros(9, dtype)) for _ in range(world_size)]
                work = pg.gather([out] if rank == root else [], [to_device(mine)],
                                 nc.GatherOptions(root_rank=root))
                work.wait()
                if rank == root:
                    assert work.result() == out
                    for o, t in zip(out, theirs):
                        np.testing.assert_array_equal(host(o), t)
                got = to_device(np.zeros(9, dtype))
                blocks = [to_device(make_input(dtype, 9, root, None, salt=r))
                          for r in range(world_size)]
                pg.scatter([got], [blocks] if rank == root else [],
                           nc.ScatterOptions(root_rank=root)).wait()
                np.testing.assert_array_equal(host(got),
                                              make_input(dtype, 9, root, None, salt=rank))
            # alltoall: block for rank q from rank r is make_input(.., r, salt=q)
            ins = [to_device(make_input(dtype, 5, rank, None, salt=q)) for q in range(world_size)]
            outs = [to_device(np.zeros(5, dtype)) for _ in range(world_size)]
            pg.alltoall(outs, ins).wait()
            for r, o in enumerate(outs):
                np.testing.assert_array_equal(host(o), make_input(dtype, 5, r, None, salt=rank))
            # alltoall_base with uneven splits: rank r sends q + 1 rows to rank q
            sends = [q + 1 for q in range(world_size)]
            recvs = [rank + 1] * world_size
            inp = make_input(dtype, 2 * sum(sends), rank, None).reshape(-1, 2)
            out = to_device(np.zeros((sum(recvs), 2), dtype))
            pg.alltoall_base(out, to_device(inp), recvs, sends).wait()
            expect = [make_input(dtype, 2 * sum(sends), r, None).reshape(-1, 2)
                      [sum(sends[:rank]):sum(sends[:rank + 1])] for r in range(world_size)]
            np.testing.assert_array_equal(host(out), np.concatenate(expect))
        return True

    assert all(_run(body, world_size))


@pytest.mark.parametrize("world_size", [2, 3])
def test_send_recv_and_recv_anysource(world_size):
    def body():
        pg, rank = nc.get_default_group(), nc.get_rank()
        for dtype in (np.float32, nc.bfloat16, np.int32):
            data = make_input(dtype, 21, rank, None)
            if rank == 0:
                for peer in range(1, world_size):
                    got = to_device(np.zeros(21, dtype))
                    pg.recv([got], peer, tag=3).wait()
                    np.testing.assert_array_equal(host(got), make_input(dtype, 21, peer, None))
                seen = set()
                for _ in range(1, world_size):
                    got = to_device(np.zeros(21, dtype))
                    work = pg.recv_anysource([got], tag=4)
                    work.wait()
                    seen.add(work.source_rank())
                    np.testing.assert_array_equal(
                        host(got), make_input(dtype, 21, work.source_rank(), None))
                assert seen == set(range(1, world_size))
            else:
                pg.send([to_device(data)], 0, tag=3).wait()
                pg.send([to_device(data)], 0, tag=4).wait()
            pg.barrier().wait()
        return True

    assert all(_run(body, world_size))


# --------------------------------------------------------------------------
# Layouts, argument errors, custom ops
# --------------------------------------------------------------------------

def test_non_contiguous_device_arrays_are_copied_in_and_out():
    """Strided device views work like strided NumPy arrays: the collective works
    on a contiguous device copy and writes the result back into the view."""
    world_size = 2

    def body():
        pg, rank = nc.get_default_group(), nc.get_rank()
        base = make_input(np.float32, 4 * 6, rank, None).reshape(4, 6)
        whole = to_device(base)
        view = whole[:, ::2]                       # 4 x 3, strided
        assert not view.is_c_contiguous()
        pg.allreduce(view).wait()
        expect = base.copy()
        expect[:, ::2] = sum(make_input(np.float32, 24, r, None).reshape(4, 6)[:, ::2]
                             for r in range(world_size))
        np.testing.assert_array_equal(host(whole), expect)   # untouched between the columns
        # bfloat16 through the widen/narrow path, and a strided broadcast
        half = to_device(make_input(nc.bfloat16, 12, rank, None).reshape(3, 4))
        pg.allreduce(half[::2, 1:]).wait()
        b = to_device(np.zeros((3, 4), np.int32) + rank)
        pg.broadcast(b[:, 1::2], root=1).wait()
        assert (host(b)[:, 1::2] == 1).all() and (host(b)[:, ::2] == rank).all()
        # alltoall_base keeps Gloo's rule
        with pytest.raises(ValueError, match="Tensors must be contiguous"):
            pg.alltoall_base(to_device(np.zeros((2, 2), np.float32))[:, :1],
                             to_device(np.zeros((2, 1), np.float32)))
        return host(half)

    halves = _run(body, world_size)
    inputs = [make_input(nc.bfloat16, 12, r, None).reshape(3, 4) for r in range(world_size)]
    expect = inputs[0].copy()
    expect[::2, 1:] = reduce_reference(nc.ReduceOp.SUM, nc.bfloat16,
                                       [i[::2, 1:] for i in inputs])
    np.testing.assert_array_equal(halves[0], expect)


def test_mixing_host_and_device_arrays_is_refused_at_the_call():
    world_size = 2

    def body():
        pg, rank = nc.get_default_group(), nc.get_rank()
        d, h = to_device(np.ones(4, np.float32)), np.ones(4, np.float32)
        calls = {
            "allreduce": lambda: pg.allreduce([d, h]),
            "allreduce_coalesced": lambda: pg.allreduce_coalesced([h, d]),
            "broadcast": lambda: pg.broadcast([h, d]),
            "allgather": lambda: pg.allgather([[h, h]], [d]),
            "allgather_coalesced": lambda: pg.allgather_coalesced([[h], [h]], [d]),
            "allgather_into_tensor": lambda: pg.allgather_into_tensor(np.ones(8, np.float32), d),
            "reduce_scatter": lambda: pg.reduce_scatter([h], [[d, d]]),
            "reduce_scatter_tensor": lambda: pg.reduce_scatter_tensor(
                h[:2], to_device(np.ones(4, np.float32))),
            "alltoall": lambda: pg.alltoall([h, h], [d, d]),
            "alltoall_base": lambda: pg.alltoall_base(h, d),
        }
        if rank == 0:       # non-roots pass no list to mix with (and must not call then)
            calls["gather"] = lambda: pg.gather([[d, h]], [d])
            calls["scatter"] = lambda: pg.scatter([h], [[d, d]])
            calls["scatter "] = lambda: pg.scatter([d], [[h, h]])
        for name, call in calls.items():
            with pytest.raises(TypeError, match="cannot mix host .NumPy. and device .CUDA."):
                call()
        # nothing was queued: the ranks are still in step
        x = to_device(np.full(3, rank + 1.0, np.float32))
        pg.allreduce(x).wait()
        return host(x)

    for x in _run(body, world_size):
        np.testing.assert_array_equal(x, [3.0, 3.0, 3.0])


class Foreign:
    """A non-Numba CUDA array seen only through __cuda_array_interface__ (see
    test_cuda_kernels.py): under the simulator it describes host memory."""

    def __init__(self, array, readonly=False):
        self._array = array
        if SIMULATED:
            desc = dict(array.__array_interface__)
            desc.pop("descr", None)
            desc["stream"] = None
        else:
            desc = dict(array.__cuda_array_interface__)
        desc["data"] = (desc["data"][0], readonly)
        desc["version"] = 3
        self.__cuda_array_interface__ = desc


def test_foreign_cuda_arrays_and_read_only_outputs():
    def body():
        pg, rank = nc.get_default_group(), nc.get_rank()
        backing = np.full(5, rank + 1, np.int32) if SIMULATED else to_device(
            np.full(5, rank + 1, np.int32))
        x = Foreign(backing)
        pg.allreduce(x).wait()
        work = pg.allreduce(x)
        assert work.wait() and work.result() == [x]      # the caller's own object
        got = backing if SIMULATED else host(backing)
        np.testing.assert_array_equal(got, np.full(5, 2 * 3, np.int32))   # summed twice
        frozen = Foreign(np.ones(5, np.int32) if SIMULATED else to_device(np.ones(5, np.int32)),
                         readonly=True)
        with pytest.raises(ValueError, match="read-only"):
            pg.allreduce(frozen)
        out = to_device(np.zeros(10, np.int32))
        pg.allgather_into_tensor(out, frozen).wait()        # read-only inputs are fine
        np.testing.assert_array_equal(host(out), np.ones(10, np.int32))
        return True

    assert all(_run(body, 2))


max_abs = nc.ReduceOp.custom(lambda a, b: a if abs(a) >= abs(b) else b, name="max_abs")
bits_and = nc.ReduceOp.custom(lambda a, b: a & b, name="bits_and")


def _signed_distinct(dtype, count, rank):
    """Values whose magnitudes differ across ranks, element by element (no ties)."""
    i = np.arange(count)
    return (((i % 5) + 1) * (rank + 1) * np.where((i + rank) % 2, -1, 1)).astype(dtype)


@pytest.mark.parametrize("world_size", [1, 3])
def test_custom_op_and_premul_sum_on_device(world_size):
    def body():
        pg, rank = nc.get_default_group(), nc.get_rank()
        for dtype in (np.float32, nc.bfloat16, np.int32):
            for algorithm in ("ring", "recursive_doubling"):
                x = to_device(_signed_distinct(dtype, 11, rank))
                pg.allreduce(x, nc.AllreduceOptions(reduce_op=max_abs,
                                                    algorithm=algorithm)).wait()
                stack = np.stack([_signed_distinct(dtype, 11, r).astype(np.float64)
                                  for r in range(world_size)])
                expect = stack[np.abs(stack).argmax(axis=0), np.arange(11)].astype(dtype)
                np.testing.assert_array_equal(host(x), expect)
        out = to_device(np.zeros(2, np.float32))
        pg.reduce_scatter_tensor(out, to_device(_signed_distinct(np.float32, 2 * world_size,
                                                                 rank)),
                                 nc.ReduceScatterOptions(reduce_op=max_abs)).wait()
        # a function that does not compile for the dtype fails at the call, here
        with pytest.raises(TypeError, match=r"custom\(bits_and\).*float32"):
            pg.allreduce(to_device(np.ones(3, np.float32)), op=bits_and)
        y = to_device(np.ones(3, np.int32) * (rank + 1))
        pg.allreduce(y, op=bits_and).wait()                 # compiles for int32
        # premul_sum: every input scaled before the sum, halves in float32
        for dtype in (np.float32, np.float16, np.complex64):
            z = to_device(make_input(dtype, 13, rank, None))
            pg.allreduce(z, op=nc.ReduceOp.premul_sum(0.5)).wait()
            expect = sum(0.5 * make_input(dtype, 13, r, None).astype(np.complex128)
                         for r in range(world_size))
            np.testing.assert_array_equal(host(z), expect.astype(dtype)
                                          if np.dtype(dtype).kind == "c" else
                                          expect.real.astype(dtype))
        with pytest.raises(ValueError, match="floating point or complex"):
            pg.allreduce(to_device(np.ones(3, np.int32)), op=nc.ReduceOp.premul_sum(2))
        return host(y)

    expect = np.bitwise_and.reduce(np.arange(1, world_size + 1))
    for y in _run(body, world_size):
        np.testing.assert_array_equal(y, np.full(3, expect, np.int32))


def test_module_level_api_on_device():
    world_size = 3

    def body():
        rank = nc.get_rank()
        x = to_device(np.full(4, rank + 1.0, np.float32))
        nc.all_reduce(x, op=nc.ReduceOp.MAX)
        single = to_device(np.zeros(world_size, np.int64))
        nc.all_to_all_single(single, to_device(np.arange(world_size) + 10 * rank))
        out = to_device(np.zeros(2 * world_size, np.float64))
        nc.all_gather_into_tensor(out, to_device(np.full(2, float(rank))))
        work = nc.broadcast(x, src=1, async_op=True)
        work.wait()
        return host(x), host(single), host(out)

    for rank, (x, single, out) in enumerate(_run(body, world_size)):
        np.testing.assert_array_equal(x, np.full(4, 3.0))
        np.testing.assert_array_equal(single, 10 * np.arange(world_size) + rank)
        np.testing.assert_array_equal(out, np.repeat(np.arange(world_size, dtype=float), 2))


# --------------------------------------------------------------------------
# Staging
# --------------------------------------------------------------------------

def test_staging_memory_is_pooled_and_reused():
    pinned = []

    def body():
        pg, rank = nc.get_default_group(), nc.get_rank()
        for i in range(6):
            x = to_device(np.full(40, rank + i, np.float64))
            pg.allreduce(x, nc.AllreduceOptions(algorithm="ring")).wait()
            if i == 1:
                pg.barrier().wait()
                if rank == 0:
                    pinned.append(staging.POOL.pinned_nbytes)
        pg.barrier().wait()
        return True

    _run(body, 2)
    assert staging.POOL.pinned_nbytes == pinned[0]       # later calls pinned nothing new
    assert staging.block_nbytes(1) == staging.MIN_BLOCK_NBYTES
    assert staging.block_nbytes((1 << 20) + 1) == (1 << 20) + (1 << 17)
    pool = staging.StagingPool(pin=lambda n: np.empty(n, np.uint8))
    block = pool.take(100_000)
    pool.give(block)
    assert pool.take(90_000) is block and pool.pinned_nbytes == block.size
    pool.give(block)
    assert pool.take(10 * block.size) is not block       # far too small: a new one
    assert pool.release_idle() == block.size


def test_concurrent_device_collectives_and_a_failed_one():
    """Several device collectives in flight at once (each on its own stream and
    staging); a collective that fails at run time reports through its Work and
    gives no staging back to the pool (a send might still hold it)."""
    world_size = 2

    def body():
        pg, rank = nc.get_default_group(), nc.get_rank()
        xs = [to_device(np.full(30, rank + k, np.float32)) for k in range(6)]
        works = [pg.allreduce(x, nc.AllreduceOptions(algorithm="ring")) for x in xs]
        outs = [to_device(np.zeros(10, np.int32)) for _ in range(world_size)]
        works.append(pg.allgather([outs], [to_device(np.full(10, rank, np.int32))]))
        for w in works:
            w.wait()
        for k, x in enumerate(xs):
            np.testing.assert_array_equal(host(x), np.full(30, 1 + 2 * k, np.float32))
        assert [host(o)[0] for o in outs] == list(range(world_size))
        return True

    assert all(_run(body, world_size))

    def failing():
        pg = nc.get_default_group()
        # What only the arguments can tell is refused at the call: the rank
        # would send itself 3 rows and expect 2.
        with pytest.raises(ValueError, match=r"sends itself 4 elements but expects [26]\b"):
            pg.alltoall_base(to_device(np.zeros((4, 2), np.float32)),
                             to_device(np.zeros((4, 2), np.float32)), [3, 1], [2, 2])
        # Ranks that disagree (30 vs 31 elements) fail at run time, through the Work.
        idle = staging.POOL._idle_nbytes
        work = pg.allreduce(to_device(np.zeros(30 + nc.get_rank(), np.float32)))
        with pytest.raises(nc.NumcollError):
            work.wait()
        assert staging.POOL._idle_nbytes <= idle
        return True

    assert all(_run(failing, 2))


@pytest.mark.parametrize("world_size", [2, 3])
def test_shared_algorithms_over_the_shm_arena(world_size, monkeypatch):
    """Device arrays through the shared arena of the shm transport: the
    algorithms stage through the buffer's host mirror as they do over rings."""
    monkeypatch.setenv("NUMCOLL_ARENA_SLOT_NBYTES", "4096")  # several rounds
    op, count = nc.ReduceOp.SUM, 1500

    def body():
        pg, rank = nc.get_default_group(), nc.get_rank()
        size = world_size
        for algorithm in ("shared", "shared_split"):
            x = to_device(make_input(np.float32, count, rank, op))
            pg.allreduce(x, nc.AllreduceOptions(algorithm=algorithm)).wait()
            inputs = [make_input(np.float32, count, r, op) for r in range(size)]
            assert_reduced(host(x), reduce_reference(op, np.float32, inputs), op, np.float32,
                           algorithm)
        b = to_device(make_input(np.int32, count, rank, op))
        pg.broadcast(b, nc.BroadcastOptions(root_rank=size - 1, algorithm="shared")).wait()
        np.testing.assert_array_equal(host(b), make_input(np.int32, count, size - 1, op))
        out = to_device(np.zeros(size * count, np.float32))
        work = pg.allgather_into_tensor(out, to_device(make_input(np.float32, count, rank, op)))
        work.wait()
        np.testing.assert_array_equal(host(out), np.concatenate(
            [make_input(np.float32, count, r, op) for r in range(size)]))
        part = to_device(np.zeros(count, np.float32))
        pg.reduce_scatter_tensor(part, to_device(make_input(np.float32, size * count, rank,
                                                            op))).wait()
        whole = reduce_reference(op, np.float32, [make_input(np.float32, size * count, r, op)
                                                  for r in range(size)])
        assert_reduced(host(part), whole[rank * count:(rank + 1) * count], op, np.float32,
                       "reduce_scatter")
        return work.call.algorithm, pg.transport_kind

    assert nc.launch(body, world_size, mode="thread", transport="shm", timeout=150) == \
        [("shared", "shm")] * world_size


# --------------------------------------------------------------------------
# torch CUDA tensors (a stand-in: torch itself is not needed)
# --------------------------------------------------------------------------

class _TorchDtype:
    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"torch.{self.name}"


def _fake_torch():
    """A module that looks like torch to numcoll's intake: ``Tensor``,
    ``bfloat16``, ``int16``, tensors with ``detach()``, ``view(dtype)``,
    ``device.type`` and ``dtype``."""
    import types

    torch = types.ModuleType("torch")
    torch.bfloat16 = _TorchDtype("bfloat16")
    torch.float32 = _TorchDtype("float32")
    torch.int16 = _TorchDtype("int16")

    class Tensor:
        """A CUDA tensor as torch shows it: ``__cuda_array_interface__`` over
        device memory it owns (a Numba device array on a GPU; under the
        simulator, whose device memory is host memory, a NumPy array). Like
        torch, a bfloat16 tensor has no interface: only its int16 view does."""

        def __init__(self, memory, dtype):
            self.memory = memory
            self.dtype = dtype
            self.device = types.SimpleNamespace(type="cuda", index=0)
            if dtype is not torch.bfloat16:
                desc = (memory.__array_interface__ if SIMULATED
                        else memory.__cuda_array_interface__)
                self.__cuda_array_interface__ = {
                    "data": (desc["data"][0], False), "shape": tuple(memory.shape),
                    "strides": None, "typestr": memory.dtype.str, "version": 3,
                    "stream": None}

        def detach(self):
            return self

        def view(self, dtype):
            assert dtype is torch.int16 and self.dtype is torch.bfloat16
            return Tensor(self.memory.view(np.int16), torch.int16)

    def cuda_tensor(values, dtype):
        """A fake CUDA tensor holding ``values`` (a NumPy array); bfloat16 by its bits."""
        if dtype is torch.bfloat16:
            values = values.view(np.int16)
        return Tensor(values.copy() if SIMULATED else to_device(values), dtype)

    def contents(tensor, like):
        memory = tensor.memory if SIMULATED else host(tensor.memory)
        return memory.view(like)

    torch.Tensor = Tensor
    torch.cuda_tensor, torch.contents = cuda_tensor, contents
    return torch


def test_torch_cuda_tensors_are_reduced_in_their_own_memory(monkeypatch):
    """torch CUDA tensors go to the device path and their own memory holds the
    result; bfloat16 ones (which torch gives no __cuda_array_interface__) are
    viewed through their int16 view, without a copy, and reduced in float32."""
    torch = _fake_torch()
    monkeypatch.setitem(sys.modules, "torch", torch)
    world_size = 2

    def body():
        rank = nc.get_rank()
        tensor = torch.cuda_tensor(np.full(5, rank + 1.0, np.float32), torch.float32)
        nc.all_reduce(tensor)
        values = make_input(nc.bfloat16, 7, rank, nc.ReduceOp.SUM)
        half = torch.cuda_tensor(values, torch.bfloat16)
        work = nc.all_reduce(half, async_op=True)
        assert work.wait() and work.result() == [half]       # the caller's own object
        return torch.contents(tensor, np.float32), torch.contents(half, nc.bfloat16)

    expect = reduce_reference(nc.ReduceOp.SUM, nc.bfloat16,
                              [make_input(nc.bfloat16, 7, r, nc.ReduceOp.SUM)
                               for r in range(world_size)])
    for memory, half in _run(body, world_size):
        np.testing.assert_array_equal(memory, np.full(5, 3.0, np.float32))
        assert_reduced(half, expect, nc.ReduceOp.SUM, nc.bfloat16, "torch bfloat16")


@pytest.mark.parametrize("transport", ["inproc", "shm"])
def test_device_views_that_share_memory(transport):
    """numcoll.memory.overlap on CUDA arrays: an output that is a view of the
    input other than this rank's share gets what separate arrays would get;
    torch's in-place forms run in place; outputs that overlap are refused."""
    world_size, n = 2, 4

    def body():
        pg, rank = nc.get_default_group(), nc.get_rank()
        got = {}
        for lo in (0, 2, 4):
            y = to_device(np.arange(2 * n, dtype=np.float32) + 10 * rank)
            pg.reduce_scatter_tensor(y[lo:lo + n], y).wait()
            got[lo] = host(y)[lo:lo + n].tolist()
        out = to_device(np.zeros(2 * n, np.float32))
        out[rank * n:(rank + 1) * n] = to_device(np.full(n, rank + 1.0, np.float32))
        pg.allgather_into_tensor(out, out[rank * n:(rank + 1) * n]).wait()
        got["gathered"] = host(out).tolist()
        with pytest.raises(ValueError, match="outputs 0 and 1 refer to the same memory"):
            pg.allgather([[out[0:n], out[2:2 + n]]], [out[n:]])
        return got

    for rank, got in enumerate(nc.launch(body, world_size, mode="thread",
                                         transport=transport, timeout=150)):
        expect = (np.arange(2 * n, dtype=np.float32) * 2 + 10)[rank * n:(rank + 1) * n]
        for lo in (0, 2, 4):
            assert got[lo] == expect.tolist(), (rank, lo, got)
        assert got["gathered"] == [1.0] * n + [2.0] * n
