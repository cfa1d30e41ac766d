"""numcoll.cuda.kernels against NumPy references, under Numba's CUDA simulator.

The simulator is switched on here, before numba.cuda is first imported, unless
the environment already says otherwise: ``NUMBA_ENABLE_CUDASIM=0 pytest
tests/test_cuda_kernels.py`` runs the same tests on a real GPU. Launches use 4
threads x 2 blocks, so 37 elements take several trips round each grid-stride
loop. One test also compiles every kernel to PTX for a real GPU (no GPU needed,
only NVVM from a CUDA toolkit), which catches what the simulator cannot:
code that runs as Python but does not type or lower for the CUDA target.
"""

import os
import sys

from cuda_env import SIMULATED  # noqa: E402 - first: chooses the simulator

import subprocess  # noqa: E402
import threading  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

pytestmark = pytest.mark.timeout(300)

from numba import cuda  # noqa: E402

import ml_dtypes  # noqa: E402

from numcoll.dtypes import SUPPORTED_DTYPES, bfloat16, dtype_name, is_half  # noqa: E402
from numcoll.cuda import kernels as K  # noqa: E402
# numba.cuda.to_device refuses bfloat16 on a GPU ("cannot include dtype 'E' in a
# buffer"); numcoll's copy takes every dtype numcoll does.
from numcoll.cuda.copies import to_device  # noqa: E402
from numcoll.ops import ReduceOp  # noqa: E402

F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
BUILTIN_OPS = [getattr(ReduceOp, name) for name in ReduceOp._BUILTIN_NAMES]
SIZES = (0, 1, 37)


@pytest.fixture
def tiny_launch(monkeypatch):
    monkeypatch.setenv("NUMCOLL_CUDA_THREADS", "4")
    monkeypatch.setenv("NUMCOLL_CUDA_BLOCKS", "2")


def _bits_dtype(dtype):
    return np.dtype(f"u{np.dtype(dtype).itemsize}")


# --------------------------------------------------------------------------
# Data and references
# --------------------------------------------------------------------------

def _floats(dtype, n, rng, specials=True):
    """Finite values of several magnitudes; with ``specials``, NaN/inf/-0/subnormals first."""
    info = ml_dtypes.finfo(dtype) if dtype == bfloat16 else np.finfo(dtype)
    values = (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(np.float64)
    out = values.astype(F32 if is_half(dtype) else dtype).astype(dtype)
    if specials:
        special = np.array([np.nan, np.inf, -np.inf, -0.0, float(info.smallest_subnormal),
                            -float(info.smallest_subnormal), float(info.max), 1.0])
        k = min(n, len(special))
        out[:k] = special[rng.permutation(len(special))[:k]].astype(dtype)
    return out


def _sample(dtype, n, seed):
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        return rng.random(n) < 0.5
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
    if dtype.kind == "c":
        real = np.dtype(dtype.char.lower())
        return (_floats(real, n, rng, False) + 1j * _floats(real, n, rng, False)).astype(dtype)
    return _floats(dtype, n, rng)


_UFUNCS = {"SUM": np.add, "PRODUCT": np.multiply, "MIN": np.minimum, "MAX": np.maximum,
           "BAND": np.bitwise_and, "BOR": np.bitwise_or, "BXOR": np.bitwise_xor}
_BOOL_UFUNCS = {"SUM": np.logical_or, "MAX": np.logical_or, "BOR": np.logical_or,
                "PRODUCT": np.logical_and, "MIN": np.logical_and, "BAND": np.logical_and,
                "BXOR": np.logical_xor}


def _reference(op, acc, x):
    name = "SUM" if op.name == "AVG" else op.name
    with np.errstate(all="ignore"):
        if acc.dtype.kind == "b":
            return _BOOL_UFUNCS[name](acc, x)
        if is_half(acc.dtype):   # the float32 operation, rounded once
            return _UFUNCS[name](acc.astype(F32), x.astype(F32)).astype(acc.dtype)
        return _UFUNCS[name](acc, x)


def _refused(op, dtype):
    kind = dtype.kind
    if op.is_bitwise and (kind in "fc" or is_half(dtype)):
        return True
    return kind == "c" and op.name in ("MIN", "MAX")


def _assert_same(got, want, what=""):
    """Bit-exact, except that any NaN matches any NaN (a GPU returns the canonical NaN)."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    if got.dtype.kind == "c":
        real = np.dtype(got.dtype.char.lower())
        return _assert_same(got.view(real), want.view(real), what)
    if got.dtype.kind in "biu":
        np.testing.assert_array_equal(got, want, err_msg=what)
        return
    with np.errstate(invalid="ignore"):     # NaN bit patterns cast noisily
        nan = np.isnan(want.astype(np.float64))
        np.testing.assert_array_equal(np.isnan(got.astype(np.float64)), nan, err_msg=what)
    bits = _bits_dtype(got.dtype)
    np.testing.assert_array_equal(got.view(bits)[~nan], want.view(bits)[~nan], err_msg=what)


# --------------------------------------------------------------------------
# Every built-in op on every dtype
# --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("op", BUILTIN_OPS, ids=lambda op: op.name)
def test_builtin_op_matches_numpy(op, dtype, tiny_launch):
    if _refused(op, dtype):
        with pytest.raises(TypeError, match=rf"ReduceOp\.{op.name} cannot reduce {dtype_name(dtype)}"):
            K.compile_op(op, dtype)
        acc = to_device(_sample(dtype, 3, 1))
        with pytest.raises(TypeError, match=op.name):
            K.reduce_into(op, acc, to_device(_sample(dtype, 3, 2)))
        return
    for n in SIZES:
        acc, x = _sample(dtype, n, 10 + n), _sample(dtype, n, 20 + n)
        acc_d, x_d = to_device(acc), to_device(x)
        K.reduce_into(op, acc_d, x_d)
        x_after = x_d.copy_to_host()
        if dtype.kind == "c" and op.name == "PRODUCT":
            # A GPU may fuse the complex multiply's a*c - b*d into an FMA.
            np.testing.assert_allclose(acc_d.copy_to_host(), _reference(op, acc, x),
                                       rtol=4 * np.finfo(dtype).eps)
        else:
            _assert_same(acc_d.copy_to_host(), _reference(op, acc, x), f"{op} {dtype} n={n}")
        _assert_same(x_after, x, "x must not change")


def test_compile_op_is_memoised_and_kernel_is_callable(tiny_launch):
    kernel = K.compile_op(ReduceOp.MAX, np.int16)
    assert kernel is K.compile_op(ReduceOp.MAX, np.dtype(np.int16))
    assert kernel.op == ReduceOp.MAX and kernel.dtype == np.int16 and kernel.compile_seconds >= 0
    acc, x = _sample(np.int16, 37, 1), _sample(np.int16, 37, 2)
    acc_d = to_device(acc)
    kernel(acc_d, to_device(x), stream=cuda.stream())
    cuda.synchronize()
    np.testing.assert_array_equal(acc_d.copy_to_host(), np.maximum(acc, x))
    with pytest.raises(TypeError, match="expected int16"):
        kernel(to_device(np.zeros(3, np.int32)), to_device(np.zeros(3, np.int32)))


def test_multidimensional_arrays_are_flattened(tiny_launch):
    acc, x = _sample(np.float32, 15, 1).reshape(3, 5), _sample(np.float32, 15, 2).reshape(3, 5)
    acc_d = to_device(acc)
    K.reduce_into(ReduceOp.SUM, acc_d, to_device(x))
    _assert_same(acc_d.copy_to_host(), acc + x)


def test_acc_and_x_may_be_the_same_array(tiny_launch):
    acc = _sample(np.int32, 37, 1)
    acc_d = to_device(acc)
    K.reduce_into(ReduceOp.SUM, acc_d, acc_d)
    np.testing.assert_array_equal(acc_d.copy_to_host(), acc + acc)


def test_default_launch_shape(monkeypatch):
    monkeypatch.delenv("NUMCOLL_CUDA_THREADS", raising=False)
    monkeypatch.delenv("NUMCOLL_CUDA_BLOCKS", raising=False)
    assert K._launch_shape(1) == (1, K.THREADS_PER_BLOCK)
    assert K._launch_shape(10**9) == (K.MAX_BLOCKS, K.THREADS_PER_BLOCK)


def test_launches_from_several_threads(tiny_launch):
    """numcoll's worker threads reduce concurrently; the simulator must take turns."""
    pairs = [(to_device(np.zeros(37, np.float64)), to_device(np.ones(37)))
             for _ in range(3)]
    errors = []

    def work(acc_d, x_d):
        try:
            for _ in range(4):
                K.reduce_into(ReduceOp.SUM, acc_d, x_d)
        except Exception as exc:  # re-raised on the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=pair) for pair in pairs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for acc_d, _ in pairs:
        np.testing.assert_array_equal(acc_d.copy_to_host(), np.full(37, 4.0))


# --------------------------------------------------------------------------
# Custom ops
# --------------------------------------------------------------------------

def absmax(a, b):
    return a if abs(a) >= abs(b) else b


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, F16, bfloat16],
                         ids=dtype_name)
def test_custom_op(dtype, tiny_launch):
    op = ReduceOp.custom(lambda a, b: a if abs(a) >= abs(b) else b, name="absmax")
    dtype = np.dtype(dtype)
    assert K.compile_op(op, dtype) is K.compile_op(op, dtype)
    for n in SIZES:
        acc = _sample(dtype, n, 30 + n)
        x = _sample(dtype, n, 40 + n)
        if dtype.kind == "i":   # abs(INT_MIN) overflows; keep to the defined range
            acc, x = acc // 2, x // 2
        acc_d = to_device(acc)
        K.reduce_into(op, acc_d, to_device(x))
        wide_a, wide_x = (acc.astype(F32), x.astype(F32)) if is_half(dtype) else (acc, x)
        with np.errstate(invalid="ignore"):
            want = np.where(np.abs(wide_a) >= np.abs(wide_x), wide_a, wide_x).astype(dtype)
        _assert_same(acc_d.copy_to_host(), want, f"{dtype} n={n}")


def test_custom_op_from_an_njit_function(tiny_launch):
    import numba

    op = ReduceOp.custom(numba.njit(absmax))
    acc, x = np.array([1.0, -5.0, 3.0]), np.array([-2.0, 4.0, -3.0])
    acc_d = to_device(acc)
    K.reduce_into(op, acc_d, to_device(x))
    np.testing.assert_array_equal(acc_d.copy_to_host(), [-2.0, -5.0, 3.0])


def test_custom_op_that_does_not_compile_for_complex(tiny_launch):
    op = ReduceOp.custom(lambda a, b: (a + b) % 360, name="angle_sum")
    K.compile_op(op, np.float64)          # fine for reals
    with pytest.raises(TypeError, match=r"custom\(angle_sum\).*complex64"):
        K.compile_op(op, np.complex64)
    acc = np.array([1 + 1j, 2], np.complex64)
    acc_d = to_device(acc)
    with pytest.raises(TypeError, match="complex64"):
        K.reduce_into(op, acc_d, to_device(acc))
    np.testing.assert_array_equal(acc_d.copy_to_host(), acc)


# --------------------------------------------------------------------------
# float16 / bfloat16 conversions and AVG scaling
# --------------------------------------------------------------------------

def _half_patterns(dtype, rng):
    """Special bit patterns (zeros, subnormals, normals' edges, inf, NaNs) plus random ones."""
    if dtype == F16:
        special = [0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0400, 0x3C00, 0x7BFF, 0xFBFF,
                   0x7C00, 0xFC00, 0x7C01, 0x7E00, 0xFE00, 0x7FFF]
    else:
        special = [0x0000, 0x8000, 0x0001, 0x8001, 0x007F, 0x0080, 0x3F80, 0x7F7F, 0xFF7F,
                   0x7F80, 0xFF80, 0x7F81, 0x7FC0, 0xFFC0, 0x7FFF]
    bits = np.concatenate([np.array(special, np.uint16),
                           rng.integers(0, 1 << 16, 256, dtype=np.uint16)])
    return bits.view(dtype)


def _f32_samples(dtype, rng):
    """float32 values that exercise rounding: ties, overflow edges, subnormals, NaN."""
    if dtype == F16:
        special = [1 + 2**-11, 1 + 3 * 2**-11, 65504.0, 65519.99, 65520.0, 2**-24, 2**-25,
                   3 * 2**-25, 2**-26, 2**-14 - 2**-25, 2**-14 - 2**-26, -(2**-25) * 3]
    else:
        special = [1 + 2**-8, 1 + 3 * 2**-8, 3.3895314e38, 3.4028235e38, 2**-133, 2**-149,
                   -(2**-149), 1.0000001, -1.0000001]
    special += [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan]
    # NaNs whose payload is only in the low bits: truncation alone would make them inf.
    low_nans = np.array([0x7F800001, 0xFF800001, 0x7FBFFFFF], np.uint32).view(F32)
    random = rng.integers(0, 1 << 32, 256, dtype=np.uint64).astype(np.uint32).view(F32)
    return np.concatenate([np.array(special, F32), low_nans, random])


@pytest.mark.parametrize("dtype", [F16, bfloat16], ids=dtype_name)
def test_widen_narrow_round_trip(dtype, tiny_launch):
    rng = np.random.default_rng(7)
    half = _half_patterns(dtype, rng)
    wide_d = cuda.device_array(half.size, F32)
    K.widen_into(to_device(half), wide_d)
    wide = wide_d.copy_to_host()
    _assert_same(wide, half.astype(F32), "widen")
    back_d = cuda.device_array(half.size, dtype)
    K.narrow_into(wide_d, back_d)
    _assert_same(back_d.copy_to_host(), half, "narrow(widen(h)) == h")

    samples = _f32_samples(dtype, rng)
    out_d = cuda.device_array(samples.size, dtype)
    K.narrow_into(to_device(samples), out_d)
    with np.errstate(over="ignore", invalid="ignore"):   # inf and NaN are what is tested
        got, want = out_d.copy_to_host(), samples.astype(dtype)
    _assert_same(got, want, "narrow")
    nan = np.isnan(samples)   # NaN keeps its sign
    with np.errstate(invalid="ignore"):
        np.testing.assert_array_equal(np.signbit(got[nan].astype(F32)), np.signbit(samples[nan]))

    for n in (0, 1):    # edge sizes
        K.widen_into(to_device(half[:n]), cuda.device_array(n, F32))
        K.narrow_into(to_device(samples[:n]), cuda.device_array(n, dtype))


@pytest.mark.parametrize("dtype", [F16, bfloat16, np.float32, np.float64, np.complex64,
                                   np.complex128], ids=dtype_name)
def test_scale_into(dtype, tiny_launch):
    dtype = np.dtype(dtype)
    for n in SIZES:
        acc = _sample(dtype, n, 50 + n)
        acc_d = to_device(acc)
        K.scale_into(acc_d, 3)
        with np.errstate(all="ignore"):
            if is_half(dtype):
                want = (acc.astype(F32) / np.float32(3)).astype(dtype)
            else:
                real = np.dtype(dtype.char.lower())   # parts divided separately
                want = (acc.view(real) / real.type(3)).view(dtype)
        _assert_same(acc_d.copy_to_host(), want, f"{dtype} n={n}")


def test_scale_into_refusals():
    with pytest.raises(TypeError, match="int32"):
        K.scale_into(to_device(np.ones(3, np.int32)), 2)
    with pytest.raises(TypeError, match="bool"):
        K.scale_into(to_device(np.ones(3, np.bool_)), 2)
    with pytest.raises(ValueError, match="non-zero"):
        K.scale_into(to_device(np.ones(3)), 0)
    for bad in ("2", True, 1j):
        with pytest.raises(TypeError, match="real number"):
            K.scale_into(to_device(np.ones(3)), bad)


# --------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------

class Foreign:
    """A non-Numba device array, seen only through __cuda_array_interface__.

    Under the simulator device memory is host memory, so this wraps a NumPy
    array; on a real GPU it wraps a Numba device array's interface.
    """

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


def _foreign(values, readonly=False):
    return Foreign(values if SIMULATED else to_device(values), readonly)


def _host_of(foreign):
    arr = foreign._array
    return arr if SIMULATED else arr.copy_to_host()


def test_foreign_cuda_array_interface(tiny_launch):
    acc = _foreign(np.arange(37, dtype=np.float32))
    K.reduce_into(ReduceOp.SUM, acc, _foreign(np.ones(37, np.float32), readonly=True))
    np.testing.assert_array_equal(_host_of(acc), np.arange(37) + 1.0)
    with pytest.raises(ValueError, match="acc is read-only"):
        K.reduce_into(ReduceOp.SUM, _foreign(np.ones(3, np.float32), readonly=True),
                      to_device(np.ones(3, np.float32)))


def test_argument_errors(monkeypatch):
    dev = to_device(np.ones(8, np.float32))
    with pytest.raises(TypeError, match="acc must be a CUDA device array.*ndarray"):
        K.reduce_into(ReduceOp.SUM, np.ones(8, np.float32), dev)
    with pytest.raises(TypeError, match="x must be a CUDA device array.*list"):
        K.reduce_into(ReduceOp.SUM, dev, [1.0] * 8)
    with pytest.raises(TypeError, match="dtype mismatch: acc is float32, x is float64"):
        K.reduce_into(ReduceOp.SUM, dev, to_device(np.ones(8)))
    with pytest.raises(ValueError, match="size mismatch: acc has 8 elements, x has 7"):
        K.reduce_into(ReduceOp.SUM, dev, to_device(np.ones(7, np.float32)))
    with pytest.raises(ValueError, match="x must be C-contiguous"):
        K.reduce_into(ReduceOp.SUM, to_device(np.ones(4, np.float32)), dev[::2])
    with pytest.raises(TypeError, match="non-native byte order"):
        big = to_device(np.ones(4, ">f4"))
        K.reduce_into(ReduceOp.SUM, big, big)
    with pytest.raises(TypeError, match="must be a numcoll.ReduceOp"):
        K.reduce_into("sum", dev, dev)
    with pytest.raises(TypeError, match="must be a numcoll.ReduceOp"):
        K.compile_op(np.add, np.float32)
    with pytest.raises(TypeError, match="unsupported dtype"):
        K.compile_op(ReduceOp.SUM, "U4")

    raw = to_device(np.zeros(20, np.uint8))
    misaligned = raw[1:17].view(np.float32)
    with pytest.raises(ValueError, match="not aligned to its 4-byte items"):
        K.reduce_into(ReduceOp.SUM, misaligned, misaligned)

    with pytest.raises(TypeError, match="float16/bfloat16 <-> float32 only"):
        K.widen_into(dev, cuda.device_array(8, F32))
    with pytest.raises(TypeError, match="float16/bfloat16 <-> float32 only"):
        K.narrow_into(cuda.device_array(8, F16), cuda.device_array(8, F16))
    with pytest.raises(ValueError, match="size mismatch"):
        K.narrow_into(dev, cuda.device_array(7, bfloat16))
    with pytest.raises(TypeError, match="src must be a CUDA device array"):
        K.widen_into(np.ones(8, F16), dev)

    for var, value in [("NUMCOLL_CUDA_THREADS", "0"), ("NUMCOLL_CUDA_THREADS", "2048"),
                       ("NUMCOLL_CUDA_BLOCKS", "many")]:
        monkeypatch.setenv(var, value)
        with pytest.raises(ValueError, match=var):
            K.reduce_into(ReduceOp.SUM, dev, dev)
        monkeypatch.delenv(var)


# --------------------------------------------------------------------------
# Staging helpers
# --------------------------------------------------------------------------

def test_is_available():
    assert K.is_available() is True


def test_pinned_empty():
    buf = K.pinned_empty(64)
    assert isinstance(buf, np.ndarray) and buf.dtype == np.uint8 and buf.shape == (64,)
    assert K.pinned_empty(0).size == 0
    with pytest.raises(ValueError, match=">= 0"):
        K.pinned_empty(-1)


def test_staging_round_trip():
    values = np.arange(12, dtype=np.float32).reshape(3, 4)
    staging = K.pinned_empty(values.nbytes)
    staging.view(np.float32)[:] = values.reshape(-1)
    dev = cuda.device_array(12, np.float32)
    stream = cuda.stream()
    K.to_device_async(staging, dev, stream)       # bytes in, float32 out: only sizes must agree
    back = np.empty((3, 4), np.float32)
    K.to_host_async(dev, back, stream)
    stream.synchronize()
    np.testing.assert_array_equal(back, values)
    K.to_host_async(cuda.device_array(0, np.float32), np.empty(0, np.uint8), 0)


def test_staging_errors():
    dev = to_device(np.ones(4, np.float32))
    with pytest.raises(ValueError, match="dev_view has 16 bytes, host_view has 12"):
        K.to_host_async(dev, np.empty(3, np.float32))
    with pytest.raises(TypeError, match="host_view must be a numpy.ndarray"):
        K.to_device_async(b"0123456789abcdef", dev)
    with pytest.raises(ValueError, match="host_view is read-only"):
        readonly = np.empty(4, np.float32)
        readonly.flags.writeable = False
        K.to_host_async(dev, readonly)
    with pytest.raises(ValueError, match="host_view must be C-contiguous"):
        K.to_host_async(dev, np.empty(8, np.float32)[::2])
    with pytest.raises(ValueError, match="dev_view must be C-contiguous"):
        K.to_device_async(np.empty(2, np.float32), dev[::2])
    with pytest.raises(TypeError, match="dev_view must be a CUDA device array"):
        K.to_device_async(np.empty(4, np.float32), np.empty(4, np.float32))


# --------------------------------------------------------------------------
# The kernels compile for a real GPU
# --------------------------------------------------------------------------

_PTX_CHECK = r"""
import types as pytypes
import numpy as np
from numba.cuda.cudadrv import nvvm
if not nvvm.is_available():
    print("SKIP no NVVM (CUDA toolkit) found"); raise SystemExit(0)
import numba.cuda.dispatcher as dispatcher
# Device functions ask the current GPU for its compute capability; there is none.
dispatcher.get_current_device = lambda: pytypes.SimpleNamespace(compute_capability=(8, 0))
from numba import cuda, from_dtype, types
from numcoll.dtypes import SUPPORTED_DTYPES, bfloat16, is_half
from numcoll.cuda import device as cuda_device, loops as cuda_loops
from numcoll.ops import ReduceOp
assert not cuda_device._SIMULATED

def arr(dtype):
    return types.Array(from_dtype(np.dtype(dtype)), 1, "C")

def ptx(kernel, *argtypes):
    cuda.compile_ptx(getattr(kernel, "py_func", kernel), argtypes, cc=(8, 0))

# Probe the toolchain with a trivial kernel first: failing here is about this
# machine (e.g. numba-cuda also wants NVRTC), not about numcoll's kernels.
@cuda.jit(device=True)
def _probe_twice(v):
    return v * 2

def _probe(a):
    a[0] = _probe_twice(a[0])

try:
    ptx(_probe, arr(np.float32))
except Exception as exc:
    print("SKIP cannot compile PTX here:", str(exc).strip().splitlines()[-1][:300])
    raise SystemExit(0)

done = set()
absmax = ReduceOp.custom(lambda a, b: a if abs(a) >= abs(b) else b)
for dtype in SUPPORTED_DTYPES:
    bits = np.dtype(np.uint16) if is_half(dtype) else dtype
    for name in ReduceOp._BUILTIN_NAMES:
        try:
            kernel = cuda_loops._builtin_kernel(getattr(ReduceOp, name), dtype)
        except TypeError:
            continue
        if (kernel, bits) not in done:
            done.add((kernel, bits))
            ptx(kernel, arr(bits), arr(bits))
    if dtype.kind in "fiu" or is_half(dtype):
        ptx(cuda_loops._custom_kernel(absmax, dtype), arr(bits), arr(bits))
    if dtype.kind in "fc" and not is_half(dtype):
        real = np.dtype(dtype.char.lower())
        ptx(cuda_loops._scale_kernel, arr(real), from_dtype(real))
for half in (np.dtype(np.float16), bfloat16):
    ptx(cuda_loops._WIDEN[half], arr(np.uint16), arr(np.float32))
    ptx(cuda_loops._NARROW[half], arr(np.float32), arr(np.uint16))
    ptx(cuda_loops._SCALE_HALF[half], arr(np.uint16), types.float32)
angle_sum = ReduceOp.custom(lambda a, b: (a + b) % 360)
try:
    ptx(cuda_loops._custom_kernel(angle_sum, np.dtype(np.complex64)),
        arr(np.complex64), arr(np.complex64))
except Exception:
    pass
else:
    raise AssertionError("complex % should not compile for CUDA")
print("OK", len(done))
"""


@pytest.mark.slow
def test_kernels_compile_to_ptx_for_a_real_gpu():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-c", _PTX_CHECK], capture_output=True, text=True,
                          env=env, cwd=root, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    if done.stdout.startswith("SKIP"):
        pytest.skip(done.stdout.strip())
    assert done.stdout.startswith("OK"), done.stdout
