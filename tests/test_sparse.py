"""SparseCOO and sparse allreduce: torch's tests (test_c10d_gloo.py) ported, plus
NumPy references at several world sizes, the dense fallback, SciPy conversion and
the device path under the CUDA simulator."""

from __future__ import annotations

import os
import subprocess
import sys
from functools import partial, reduce

import numpy as np
import pytest

import numcoll as nc
from numcoll import config

pytestmark = pytest.mark.timeout(120)


def sparse_coo(indices, values, shape):
    return nc.SparseCOO(np.array(indices, np.int64).reshape(len(indices), -1),
                        np.array(values, np.float32), shape)


def assert_sparse_equal(a: nc.SparseCOO, b: nc.SparseCOO):
    a, b = a.coalesce(), b.coalesce()
    assert a.shape == b.shape
    np.testing.assert_array_equal(a.indices, b.indices)
    np.testing.assert_array_equal(a.values, b.values)


# -- torch: simple_sparse_reduce_tests (common_distributed.py) -----------------------------
def _generate(rank, world_size, sparse_dims=1, dense_dims=0):
    # First sparse dimension is [0..rank]; the others are always 0, so any two
    # ranks' arrays intersect.
    indices = [list(range(rank + 1))]
    shape = [world_size] + [2 for _ in range(dense_dims)]
    for _ in range(sparse_dims - 1):
        indices.append([0] * (rank + 1))
        shape.append(world_size)
    values = np.ones([rank + 1] + [2 for _ in range(dense_dims)], np.float32)
    return nc.SparseCOO(np.array(indices, np.int64), values, shape)


def _add(a, b):
    return nc.SparseCOO(np.concatenate([a.indices, b.indices], axis=1),
                        np.concatenate([a.values, b.values]), a.shape).coalesce()


def simple_sparse_reduce_tests(rank, world_size, num_inputs=1):
    def compute_sum(fn, world_size):
        return reduce(_add, [fn(r, world_size) for r in range(world_size)])

    return [
        ([fn(num_inputs * rank + i, num_inputs * world_size) for i in range(num_inputs)],
         [compute_sum(fn, num_inputs * world_size) for _ in range(num_inputs)])
        for fn in [partial(_generate, sparse_dims=1), partial(_generate, sparse_dims=2),
                   partial(_generate, sparse_dims=3), partial(_generate, dense_dims=1),
                   partial(_generate, dense_dims=2), partial(_generate, dense_dims=3)]
    ]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_sparse_allreduce_basics(world_size):
    def body():
        pg = nc.get_default_group()
        rank = pg.rank()
        for num_inputs_per_rank in [1, 2]:
            for inputs, outputs in simple_sparse_reduce_tests(rank, world_size,
                                                              num_inputs=num_inputs_per_rank):
                fut = pg.allreduce(inputs).get_future()
                fut.wait()
                result = fut.value()
                for t, out, res in zip(inputs, outputs, result):
                    assert res is t
                    assert t.is_coalesced()
                    assert_sparse_equal(t, out)

    nc.launch(body, world_size, mode="thread")


def test_sparse_allreduce_checks():
    def body():
        pg = nc.get_default_group()
        t1 = np.zeros([1], np.float32)
        t2 = sparse_coo([[0]], [1], (2,))
        t3 = sparse_coo([[0]], [1], (4,))
        with pytest.raises(ValueError, match="requires non-empty tensor list"):
            pg.allreduce([], nc.AllreduceOptions())
        with pytest.raises(ValueError, match="invalid tensor layout"):
            pg.allreduce([t1, t2], nc.AllreduceOptions())
        with pytest.raises(ValueError, match="invalid tensor layout"):
            pg.allreduce([t2, t1], nc.AllreduceOptions())
        with pytest.raises(ValueError, match="invalid tensor size"):
            pg.allreduce([t2, t3], nc.AllreduceOptions())
        # Sparse allreduce only works with ReduceOp.SUM.
        for op in [nc.ReduceOp.PRODUCT, nc.ReduceOp.MIN, nc.ReduceOp.MAX]:
            with pytest.raises(ValueError, match="unsupported reduction operation"):
                pg.allreduce([t3], nc.AllreduceOptions(reduce_op=op))
        # nothing was queued: the group still works
        pg.allreduce([t3]).wait()
        assert t3.values.tolist() == [nc.get_world_size()]

    nc.launch(body, 2, mode="thread")


def test_allreduce_coalesced_sparse_checks():
    # the sparse part of torch's test_allreduce_coalesced_checks
    def body():
        pg = nc.get_default_group()
        t1 = np.zeros(1, np.float32)
        t3 = sparse_coo([[0]], [1], (1,))
        with pytest.raises(ValueError, match="invalid tensor layout at index"):
            pg.allreduce_coalesced([t1, t3], nc.AllreduceCoalescedOptions())
        with pytest.raises(ValueError, match="unsupported layout"):
            pg.allreduce_coalesced([t3, t3.copy()], nc.AllreduceCoalescedOptions())

    nc.launch(body, 1, mode="thread")


# -- NumPy references ------------------------------------------------------------------------
def _random_sparse(rank, shape, sparse_dims, nnz, dtype, seed=0):
    rng = np.random.default_rng(seed + rank)
    indices = np.stack([rng.integers(0, s, nnz) for s in shape[:sparse_dims]]).astype(np.int64)
    values = (rng.standard_normal((nnz,) + tuple(shape[sparse_dims:])) * 4).astype(dtype)
    return nc.SparseCOO(indices, values, shape)


@pytest.mark.parametrize("world_size", [1, 3, 7])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64, np.float16])
def test_sparse_allreduce_matches_numpy_and_is_identical_on_every_rank(world_size, dtype):
    shape, sparse_dims = (50, 3), 1

    def body():
        rank = nc.get_rank()
        sp = _random_sparse(rank, shape, sparse_dims, 7, dtype)  # duplicates likely
        nc.all_reduce(sp)
        return sp.indices, sp.values

    results = nc.launch(body, world_size, mode="thread")
    inputs = [_random_sparse(r, shape, sparse_dims, 7, dtype) for r in range(world_size)]
    wide = np.float32 if dtype == np.float16 else dtype
    expected = sum(s.to_dense().astype(wide) for s in inputs).astype(dtype)
    touched = np.unique(np.concatenate([s.indices for s in inputs], axis=1), axis=1)
    for indices, values in results:
        np.testing.assert_array_equal(indices, touched)
        got = nc.SparseCOO(indices, values, shape).to_dense()
        tol = dict(rtol=1e-3) if dtype == np.float16 else dict(rtol=1e-6)
        np.testing.assert_allclose(got.astype(np.float64), expected.astype(np.float64), **tol)
        # bitwise identical on every rank
        assert values.tobytes() == results[0][1].tobytes()


@pytest.mark.parametrize("transport", ["inproc", "shm"])
@pytest.mark.parametrize("ratio", [0.0, 1e9])
def test_dense_fallback_gives_the_sparse_result(monkeypatch, ratio, transport):
    """ratio 0 forces the dense allreduce, 1e9 the gather; both give the same sum with
    the same indices, including explicit zeros and entries that cancel."""
    monkeypatch.setenv("NUMCOLL_SPARSE_DENSE_RATIO", str(ratio))
    assert config.current().sparse_dense_ratio == ratio
    shape = (6, 2)

    def body():
        rank = nc.get_rank()
        sign = 1.0 if rank == 0 else -1.0
        sp = nc.SparseCOO(np.array([[1, 4, rank]]), np.array([[sign, 2.0], [0.0, 0.0],
                                                             [1.0, 1.0]], np.float32), shape)
        nc.all_reduce(sp)
        return sp.indices.tolist(), sp.values.tolist()

    # shm: the group has a shared arena, which the sparse call's inner allreduce must not use
    results = nc.launch(body, 2, mode="thread", transport=transport)
    assert results[0] == results[1]
    assert results[0] == ([[0, 1, 4]], [[1.0, 1.0], [1.0, 5.0], [0.0, 0.0]])


def test_dense_fallback_is_chosen_for_dense_data(monkeypatch):
    """With everything touched, the sparse entries outweigh the dense array: the same
    answer comes from the dense path (checked against NumPy)."""
    def body():
        rank = nc.get_rank()
        a = np.arange(40, dtype=np.float64).reshape(20, 2) * (rank + 1)
        sp = nc.SparseCOO.from_dense(a)
        nc.all_reduce(sp)
        return sp.to_dense()

    for got in nc.launch(body, 3, mode="thread"):
        np.testing.assert_array_equal(got, np.arange(40).reshape(20, 2) * 6.0)


def test_coalesce_from_dense_to_dense():
    sp = nc.SparseCOO([[2, 0, 2, 1]], np.array([[1, 2], [3, 4], [5, 6], [0, 0]], np.float32),
                      (3, 2))
    assert not sp.is_coalesced()
    c = sp.coalesce()
    assert c.is_coalesced() and c.indices.tolist() == [[0, 1, 2]]
    assert c.values.tolist() == [[3, 4], [0, 0], [6, 8]]
    np.testing.assert_array_equal(sp.to_dense(), [[3, 4], [0, 0], [6, 8]])
    dense = np.zeros((3, 4, 2), np.float32)
    dense[1, 2] = [1, 0]
    dense[0, 3, 1] = 5
    f = nc.SparseCOO.from_dense(dense, sparse_dims=2)
    assert f.indices.tolist() == [[0, 1], [3, 2]] and f.shape == (3, 4, 2)
    np.testing.assert_array_equal(f.to_dense(), dense)
    with pytest.raises(ValueError, match="indices out of range"):
        nc.SparseCOO([[0, 5]], [1.0, 2.0], (4,))
    with pytest.raises(ValueError, match="nnz = 2 rows"):
        nc.SparseCOO([[0, 1]], [1.0], (4,))


def test_scipy_round_trip():
    scipy_sparse = pytest.importorskip("scipy.sparse")
    m = scipy_sparse.random(5, 7, density=0.3, format="csr", random_state=1, dtype=np.float32)
    sp = nc.SparseCOO.from_scipy(m)
    np.testing.assert_array_equal(sp.to_dense(), m.toarray())
    back = sp.to_scipy()
    np.testing.assert_array_equal(back.toarray(), m.toarray())


def test_bucket_assignment_refuses_sparse():
    with pytest.raises(TypeError, match="No support for sparse tensors."):
        nc.compute_bucket_assignment_by_size([sparse_coo([[0]], [1], (2,))], [400])


_DEVICE_SCRIPT = """
import numpy as np
from numba import cuda
import numcoll as nc

def body():
    rank = nc.get_rank()
    idx = cuda.to_device(np.array([[0, rank + 1]], np.int64))
    val = cuda.to_device(np.array([1.0, 2.0], np.float32))
    sp = nc.SparseCOO(idx, val, (4,))
    nc.all_reduce(sp)
    assert sp.on_device
    return sp.indices.copy_to_host().tolist(), sp.values.copy_to_host().tolist()

print(nc.launch(body, 2, mode="thread"))
"""


def test_device_sparse_through_host_staging():
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    out = subprocess.run([sys.executable, "-c", _DEVICE_SCRIPT], capture_output=True,
                         text=True, timeout=100, env=env, cwd=os.path.dirname(
                             os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == str([([[0, 1, 2]], [2.0, 2.0, 2.0])] * 2)


@pytest.mark.parametrize("ratio", ["1.0", "0"])
def test_empty_inputs(monkeypatch, ratio):
    monkeypatch.setenv("NUMCOLL_SPARSE_DENSE_RATIO", ratio)

    def body():
        rank = nc.get_rank()
        none = nc.SparseCOO(np.zeros((1, 0), np.int64), np.zeros((0, 2), np.float32), (5, 2))
        nc.all_reduce(none)
        only1 = nc.SparseCOO([[1]] if rank == 1 else np.zeros((1, 0), np.int64),
                             np.ones((int(rank == 1), 2), np.float32), (5, 2))
        nc.all_reduce(only1)
        return none.nnz, only1.indices.tolist(), only1.values.tolist()

    assert nc.launch(body, 3, mode="thread") == [(0, [[1]], [[1.0, 1.0]])] * 3
