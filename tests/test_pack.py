"""Pack plans and the coalescing kernels against plain NumPy."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from numcoll.kernels.pack_plan import PackPlan
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


# -- the CUDA pack kernel: under the simulator, and compiled to PTX for a real GPU -----------
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CUDA_SCRIPT = """
import numpy as np
from numba import cuda
from numcoll.dtypes import bfloat16
from numcoll.cuda.pack import DevicePackPlan
rng = np.random.default_rng(0)
for dtype in (np.float32, np.complex128, np.int8, bfloat16):
    host = [(rng.standard_normal(n) * 9).astype(dtype) for n in (1, 0, 37, 5, 19)]
    dev = [cuda.to_device(h.view(np.uint16) if dtype == bfloat16 else h) for h in host]
    if dtype == bfloat16:
        dev = [d.view(np.float16) for d in dev]      # a half dtype Numba can hold
    plan = DevicePackPlan(dev)
    buf = plan.pack()
    want = np.concatenate(host)
    got = buf.copy_to_host()
    assert got.tobytes() == want.tobytes(), dtype
    outs = [cuda.device_array(h.size, np.uint16 if dtype == bfloat16 else dtype) for h in host]
    if dtype == bfloat16:
        outs = [o.view(np.float16) for o in outs]
    DevicePackPlan(outs).unpack(buf)
    assert all(o.copy_to_host().tobytes() == h.tobytes() for o, h in zip(outs, host)), dtype
f32 = [cuda.to_device(np.arange(n, dtype=np.float32)) for n in (3, 1, 6)]
plan = DevicePackPlan(f32)
assert plan.pack(scale=0.5).copy_to_host().tolist() == [0, .5, 1, 0, 0, .5, 1, 1.5, 2, 2.5]
plan.unpack(plan.pack())
print("ok", plan.launches)
"""


def _run(script, **env):
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=200, cwd=_ROOT, env={**os.environ, **env})


def test_cuda_pack_under_the_simulator():
    out = _run(_CUDA_SCRIPT, NUMBA_ENABLE_CUDASIM="1", NUMCOLL_CUDA_THREADS="4",
               NUMCOLL_CUDA_BLOCKS="2", PYTHONPATH=_ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["ok", "3"]   # one launch each: scaled pack, pack, unpack


_PTX_SCRIPT = """
import types as pytypes
import numpy as np
from numba.cuda.cudadrv import nvvm
if not nvvm.is_available():
    print("SKIP no NVVM (CUDA toolkit) found"); raise SystemExit(0)
import numba.cuda.dispatcher as dispatcher
dispatcher.get_current_device = lambda: pytypes.SimpleNamespace(compute_capability=(8, 0))
from numba import cuda, from_dtype, types
from numcoll.cuda import pack as cuda_pack
assert not cuda_pack._SIMULATED

def arr(dtype):
    return types.Array(from_dtype(np.dtype(dtype)), 1, "C")

i64 = arr(np.int64)
try:  # the first compile finds out whether NVRTC (the rest of the toolkit) is there
    cuda.compile_ptx(cuda_pack._pack_kernel.py_func, (arr(np.uint8), i64, i64), cc=(8, 0))
except Exception as exc:
    text = f"{type(exc).__name__}: {exc}"
    if "nvrtc" in text.lower() and any(w in text for w in ("not found", "No such file",
                                                             "NotFound", "cannot find")):
        print("SKIP no NVRTC (CUDA toolkit) found:", text.splitlines()[0][:200])
        raise SystemExit(0)
    raise
for word in (np.uint8, np.uint16, np.uint32, np.uint64):
    for kernel in (cuda_pack._pack_kernel, cuda_pack._unpack_kernel):
        cuda.compile_ptx(kernel.py_func, (arr(word), i64, i64), cc=(8, 0))
for f in (np.float32, np.float64):
    cuda.compile_ptx(cuda_pack._pack_scaled_kernel.py_func,
                     (arr(f), i64, i64, from_dtype(np.dtype(f))), cc=(8, 0))
print("OK")
"""


def test_cuda_pack_compiles_to_ptx_for_a_real_gpu():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = _ROOT
    out = subprocess.run([sys.executable, "-c", _PTX_SCRIPT], capture_output=True, text=True,
                         timeout=200, cwd=_ROOT, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    if out.stdout.startswith("SKIP"):
        pytest.skip(out.stdout.strip())
    assert out.stdout.strip() == "OK"
