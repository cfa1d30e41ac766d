"""Pack plans and the coalescing kernels against plain NumPy."""

from __future__ import annotations

import numpy as np
import pytest

from numcoll.data_parallel.pack import PackPlan
from numcoll.dtypes import bfloat16

pytestmark = pytest.mark.timeout(120)
DTYPES = [np.float32, np.float64, np.int8, np.int64, np.complex64, np.float16, bfloat16,
          np.bool_]


def _arrays(dtype, rng, sizes=(0, 1, 7, 33, 4096, 3)):
    return [(rng.standard_normal(n) * 5).astype(dtype).reshape(-1, 1) if n % 2 else
            (rng.standard_normal(n) * 5).astype(dtype) for n in sizes]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_pack_unpack_round_trip(dtype):
    rng = np.random.default_rng(0)
    arrays = _arrays(dtype, rng)
    plan = PackPlan(arrays)
    buf = plan.pack()
    np.testing.assert_array_equal(buf, np.concatenate([a.reshape(-1) for a in arrays]))
    assert plan.count == buf.size and plan.offsets.tolist() == [0, 0, 1, 8, 41, 4137]
    outs = [np.zeros_like(a) for a in arrays]
    PackPlan(outs).unpack(buf)
    for a, o in zip(arrays, outs):
        np.testing.assert_array_equal(a, o)
    for a, v in zip(arrays, plan.views(buf)):
        assert v.shape == a.shape and (a.size == 0 or np.shares_memory(v, buf))
        np.testing.assert_array_equal(a, v)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex128, np.float16, bfloat16],
                         ids=lambda d: np.dtype(d).name)
def test_pack_scaled_matches_numpy(dtype):
    rng = np.random.default_rng(1)
    arrays = _arrays(dtype, rng)
    buf = PackPlan(arrays).pack(scale=0.25)
    want = np.concatenate([a.reshape(-1) for a in arrays]).astype(np.complex128) * 0.25
    np.testing.assert_array_equal(buf.astype(np.complex128), want)   # exact: power of two
    buf = PackPlan(arrays).pack(scale=1 / 3)
    tol = 1e-2 if np.dtype(dtype).itemsize == 2 else 1e-6
    np.testing.assert_allclose(buf.astype(np.complex128), want * 4 / 3, rtol=tol, atol=tol)


def test_pack_into_given_buffer_and_errors():
    a, b = np.arange(3, dtype=np.float32), np.arange(4, dtype=np.float32)
    plan = PackPlan([a, b])
    buf = np.full(7, -1, np.float32)
    assert plan.pack(buf) is buf and buf.tolist() == [0, 1, 2, 0, 1, 2, 3]
    with pytest.raises(ValueError, match="7 elements"):
        plan.pack(np.empty(6, np.float32))
    with pytest.raises(ValueError, match="float32"):
        plan.unpack(np.empty(7, np.float64))
    with pytest.raises(TypeError, match="same type"):
        PackPlan([a, b.astype(np.float64)])
    with pytest.raises(ValueError, match="not contiguous"):
        PackPlan([np.zeros((4, 4), np.float32)[:, 0]])
    with pytest.raises(ValueError, match="requires non-empty tensor list"):
        PackPlan([])
    with pytest.raises(TypeError, match="cannot scale int64"):
        PackPlan([np.arange(3)]).pack(scale=0.5)
