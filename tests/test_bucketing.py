"""Bucket assignment (torch's ComputeBucketAssignmentTest, test_c10d_common.py) and
broadcast_coalesced (CommTest.test_broadcast_coalesced_gloo_cpu)."""

from __future__ import annotations

import numpy as np
import pytest

import numcoll as nc

pytestmark = pytest.mark.timeout(120)
F32, F64 = np.float32, np.float64


def empty(n, dtype=F32):
    return np.empty([n], dtype)


# -- ComputeBucketAssignmentTest ----------------------------------------------------------
def test_single_limit_single_dtype():
    tensors = [empty(100), empty(200), empty(100), empty(50)]
    result, per_bucket_size_limits = nc.compute_bucket_assignment_by_size(tensors, [400])
    assert all(size_lim == 400 for size_lim in per_bucket_size_limits)
    assert result == [[0], [1], [2], [3]]


def test_single_limit_multi_dtype():
    tensors = [empty(50), empty(25, F64), empty(50), empty(25, F64), empty(50), empty(25, F64)]
    result, per_bucket_size_limits = nc.compute_bucket_assignment_by_size(tensors, [400])
    assert all(size_lim == 400 for size_lim in per_bucket_size_limits)
    assert result == [[0, 2], [1, 3], [4], [5]]


def test_multi_limit_single_dtype():
    tensors = [empty(10), empty(10), empty(10), empty(10)]
    result, per_bucket_size_limits = nc.compute_bucket_assignment_by_size(tensors, [40, 80])
    assert per_bucket_size_limits == [40, 80, 80]
    assert result == [[0], [1, 2], [3]]


def test_multi_limit_multi_dtype():
    tensors = [empty(50), empty(25, F64), empty(50), empty(25, F64), empty(50), empty(25, F64)]
    result, per_bucket_size_limits = nc.compute_bucket_assignment_by_size(tensors, [200, 400])
    assert result == [[0], [1], [2, 4], [3, 5]]
    assert per_bucket_size_limits == [200, 200, 400, 400]


# -- the rest of reducer.cpp's rules ------------------------------------------------------
def test_expect_sparse_gradient_gets_a_bucket_of_its_own_with_limit_zero():
    tensors = [empty(10), empty(10), empty(10), empty(10)]
    result, limits = nc.compute_bucket_assignment_by_size(
        tensors, [1000], expect_sparse_gradient=[False, True, False, False])
    assert result == [[0, 2, 3], [1]] and limits == [1000, 0]


def test_tensor_indices_keep_ready_order_and_do_not_sort():
    # arrays given in ready order 3, 2, 1, 0 (what a Reducer's rebuild passes)
    tensors = [empty(10), empty(10), empty(10), empty(10)]
    result, limits = nc.compute_bucket_assignment_by_size(tensors, [40, 80],
                                                          tensor_indices=[3, 2, 1, 0])
    assert result == [[3], [2, 1], [0]] and limits == [40, 80, 80]
    # expect_sparse_gradient is looked up by tensor index, not by position
    result, limits = nc.compute_bucket_assignment_by_size(
        tensors, [1000], expect_sparse_gradient=[True, False, False, False],
        tensor_indices=[3, 2, 1, 0])
    assert result == [[0], [3, 2, 1]] and limits == [0, 1000]


def test_open_buckets_per_dtype_and_sort_by_smallest_index():
    tensors = [empty(1, F64), empty(100), empty(1, F64), empty(1)]
    result, limits = nc.compute_bucket_assignment_by_size(tensors, [400])
    assert result == [[0, 2], [1], [3]] and limits == [400, 400, 400]


@pytest.mark.parametrize("args, error, match", [
    (([], [400]), ValueError, "requires non-empty tensor list"),
    (([empty(1)], []), ValueError, "bucket_size_limits"),
    (([empty(1)], [400], [True, False]), ValueError, "expect_sparse_gradient has 2"),
    (([empty(1)], [400], None, [0, 1]), ValueError, "tensor_indices has 2"),
    (([object()], [400]), TypeError, "invalid tensor type"),
])
def test_bad_arguments(args, error, match):
    with pytest.raises(error, match=match):
        nc.compute_bucket_assignment_by_size(*args)


# -- CommTest.test_broadcast_coalesced_gloo_cpu ---------------------------------------------
def _target():
    chunks = []
    for dtype in (np.float16, F32, np.float16, F64, np.float16, F32):
        chunks += np.array_split(np.arange(60, dtype=dtype), 5)
    return chunks


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_broadcast_coalesced(world_size):
    def body():
        rank = nc.get_rank()
        target = _target()
        for root_rank in range(world_size):
            if rank == root_rank:
                tensors = [t.copy() for t in target]
            else:
                tensors = [np.zeros_like(t) for t in target]
            nc.broadcast_coalesced(tensors, src=root_rank, buffer_size=256)
            for t, want in zip(tensors, target):
                assert t.dtype == want.dtype
                np.testing.assert_array_equal(t, want)

    nc.launch(body, world_size, mode="thread")


def test_broadcast_coalesced_non_contiguous_and_checks():
    def body():
        rank = nc.get_rank()
        base = np.full((4, 6), float(rank), F32)
        column = base[:, 1]                       # not contiguous
        other = np.full(3, rank, np.int64)
        nc.broadcast_coalesced([column, other], src=1, buffer_size=8)
        assert column.tolist() == [1.0] * 4 and other.tolist() == [1, 1, 1]
        assert base[:, 0].tolist() == [float(rank)] * 4
        with pytest.raises(ValueError, match="buffer_size must be a positive"):
            nc.broadcast_coalesced([other], buffer_size=0)
        with pytest.raises(ValueError, match="invalid root rank|not part of the group"):
            nc.broadcast_coalesced([other], src=5)

    nc.launch(body, 2, mode="thread")


_DEVICE_SCRIPT = """
import numpy as np
from numba import cuda
import numcoll as nc

def body():
    rank = nc.get_rank()
    host = [np.arange(n, dtype=dt) * (rank + 1) for n, dt in
            ((3, np.float32), (5, np.int64), (2, np.float32), (4, np.float16))]
    dev = [cuda.to_device(h) for h in host]
    nc.broadcast_coalesced(dev, src=1, buffer_size=8)
    return [d.copy_to_host().tolist() for d in dev]

res = nc.launch(body, 2, mode="thread")
assert res[0] == res[1], res
print(res[0])
"""


def test_broadcast_coalesced_device_arrays_under_the_simulator():
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", _DEVICE_SCRIPT], capture_output=True,
                         text=True, timeout=200, cwd=root,
                         env={**os.environ, "NUMBA_ENABLE_CUDASIM": "1", "PYTHONPATH": root,
                              "NUMCOLL_CUDA_THREADS": "4", "NUMCOLL_CUDA_BLOCKS": "2"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == str([[0.0, 2.0, 4.0], [0, 2, 4, 6, 8], [0.0, 2.0],
                                      [0.0, 2.0, 4.0, 6.0]])
