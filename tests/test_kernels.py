"""numcoll.kernels.cpu against plain-NumPy references.

Every (op, dtype) pair is compiled here, so a cold run pays the whole compile
bill once (15-20 s on 2 cores); later runs load the kernels from Numba's disk
cache (about 4 s, most of it the custom ops, which are never cached).
"""

import threading
import zlib

import numpy as np
import pytest
from numba import njit

from numcoll.dtypes import SUPPORTED_DTYPES, bfloat16, dtype_name, is_half
from numcoll.kernels import cpu, cpu_loops
from numcoll.ops import ReduceOp

pytestmark = pytest.mark.timeout(300)

F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
BUILTIN_OPS = [getattr(ReduceOp, name) for name in ReduceOp._BUILTIN_NAMES]
SIZES = [0, 1, 7, 1000, 5003]       # 5003: past the 4 KiB alignment-peel threshold


def _supports(op, dtype):
    kind = dtype.kind
    if op.is_bitwise:
        return kind in "iub" and not is_half(dtype)
    return not (kind == "c" and op.name in ("MIN", "MAX"))


PAIRS = [pytest.param(op, dt, id=f"{op.name}-{dtype_name(dt)}")
         for op in BUILTIN_OPS for dt in SUPPORTED_DTYPES if _supports(op, dt)]
UNSUPPORTED = [pytest.param(op, dt, id=f"{op.name}-{dtype_name(dt)}")
               for op in BUILTIN_OPS for dt in SUPPORTED_DTYPES if not _supports(op, dt)]


def _random(dtype, n, rng):
    """Values that exercise the dtype: full-range integers (so SUM/PRODUCT wrap),
    exactly representable floats for the half types."""
    if dtype.kind == "b":
        return rng.random(n) < 0.5
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, n, endpoint=True, dtype=dtype)
    if dtype.kind == "c":
        return (rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(dtype)
    return (rng.standard_normal(n) * 8).astype(dtype)


_NUMPY = {
    "SUM": np.add, "AVG": np.add, "PRODUCT": np.multiply,
    "MIN": np.minimum, "MAX": np.maximum,
    "BAND": np.bitwise_and, "BOR": np.bitwise_or, "BXOR": np.bitwise_xor,
}
_NUMPY_BOOL = {
    "SUM": np.logical_or, "AVG": np.logical_or, "MAX": np.logical_or, "BOR": np.logical_or,
    "PRODUCT": np.logical_and, "MIN": np.logical_and, "BAND": np.logical_and,
    "BXOR": np.logical_xor,
}


def _reference(op, a, b):
    """NumPy's answer; half dtypes: the float32 op, then one cast."""
    with np.errstate(all="ignore"):
        if is_half(a.dtype):
            return _reference(op, a.astype(F32), b.astype(F32)).astype(a.dtype)
        if a.dtype.kind == "b":
            return _NUMPY_BOOL[op.name](a, b)
        return _NUMPY[op.name](a, b)


def _bits(arr):
    return arr.view(f"u{arr.dtype.itemsize}") if arr.dtype.kind != "c" else arr.view(
        f"u{arr.dtype.itemsize // 2}")


def assert_matches(op, actual, expected):
    """assert_same, except complex PRODUCT: NumPy's SIMD loops fuse the
    multiply-adds (the last bit then depends on the CPU), the kernel does not."""
    if op.name == "PRODUCT" and actual.dtype.kind == "c":
        eps = np.finfo(actual.dtype).eps
        np.testing.assert_allclose(actual, expected, rtol=4 * eps, atol=0)
    else:
        assert_same(actual, expected)


def assert_same(actual, expected):
    """Bit-exact, except that any NaN matches any NaN (payloads may differ)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.dtype.kind in "fc" or is_half(actual.dtype):
        with np.errstate(invalid="ignore"):                   # signalling NaNs
            a_nan, e_nan = np.isnan(actual), np.isnan(expected)
        np.testing.assert_array_equal(a_nan, e_nan)
        np.testing.assert_array_equal(_bits(actual[~a_nan]), _bits(expected[~e_nan]))
    else:
        np.testing.assert_array_equal(actual, expected)


# --------------------------------------------------------------------------
# every built-in (op, dtype) pair
# --------------------------------------------------------------------------

@pytest.mark.parametrize("op, dtype", PAIRS)
def test_reduce_matches_numpy(op, dtype):
    rng = np.random.default_rng(zlib.crc32(f"{op.name}-{dtype_name(dtype)}".encode()))
    for n in SIZES:
        a, b = _random(dtype, n, rng), _random(dtype, n, rng)
        expected = _reference(op, a, b)
        # acc one element into a buffer, so it starts mid cache line and the
        # large sizes exercise the alignment peel.
        acc = np.empty(n + 1, dtype)[1:]
        acc[...] = a
        cpu.reduce_into(op, acc, b)
        assert_matches(op, acc, expected)
        # x read-only, as np.frombuffer over a received frame is
        acc[...] = a
        cpu.compile_op(op, dtype)(acc, np.frombuffer(b.tobytes(), dtype))
        assert_matches(op, acc, expected)


@pytest.mark.parametrize("op, dtype", UNSUPPORTED)
def test_unsupported_pairs_raise_type_error(op, dtype):
    with pytest.raises(TypeError, match=rf"ReduceOp\.{op.name}.*{dtype_name(dtype)}"):
        cpu.compile_op(op, dtype)
    with pytest.raises(TypeError, match=dtype_name(dtype)):
        cpu.reduce_into(op, np.zeros(3, dtype), np.zeros(3, dtype))


def test_avg_reduces_like_sum_and_scale_finishes_it():
    a = np.arange(10, dtype=np.float32)
    cpu.reduce_into(ReduceOp.AVG, a, np.ones(10, np.float32))
    cpu.scale_into(a, 2)
    np.testing.assert_array_equal(a, (np.arange(10, dtype=np.float32) + 1) / np.float32(2))


@pytest.mark.parametrize("dtype", [np.float16, bfloat16, np.float32, np.float64])
@pytest.mark.parametrize("op", [ReduceOp.MIN, ReduceOp.MAX], ids=lambda op: op.name)
def test_min_max_propagate_nan(op, dtype):
    dtype = np.dtype(dtype)
    nan, inf = float("nan"), float("inf")
    a = np.array([nan, 1, nan, 2, -inf, inf, nan, 3] * 130, dtype)   # > 4 KiB for float64
    b = np.array([1, nan, nan, 2, 5, -5, -inf, -3] * 130, dtype)
    acc = a.copy()
    cpu.reduce_into(op, acc, b)
    assert_same(acc, _reference(op, a, b))
    assert np.isnan(acc.astype(np.float64)[[0, 1, 2, 6]]).all()


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.uint16,
                                   np.int32, np.uint32, np.int64, np.uint64])
def test_integers_wrap_like_numpy(dtype):
    info = np.iinfo(dtype)
    acc = np.array([info.max, info.min, info.max, 3], dtype)
    cpu.reduce_into(ReduceOp.SUM, acc, np.array([1, -1 if info.min else 0, info.max, 4], dtype))
    np.testing.assert_array_equal(acc[:2], [info.min, info.max if info.min else 0])
    acc = np.array([info.max, 2 ** (8 * acc.itemsize - 2)], dtype)
    x = np.array([2, 4], dtype)
    expected = acc * x                                 # NumPy wraps
    cpu.reduce_into(ReduceOp.PRODUCT, acc, x)
    np.testing.assert_array_equal(acc, expected)


# --------------------------------------------------------------------------
# argument checking
# --------------------------------------------------------------------------

def test_accepts_any_shape_with_equal_sizes():
    acc = np.ones((3, 4), np.float64)
    cpu.reduce_into(ReduceOp.SUM, acc, np.arange(12.0))
    np.testing.assert_array_equal(acc, 1 + np.arange(12.0).reshape(3, 4))
    scalar = np.array(2.0)
    cpu.reduce_into(ReduceOp.PRODUCT, scalar, np.array([3.0]))
    assert scalar == 6.0


def test_half_arrays_of_any_shape():
    acc = np.full((2, 3), 1.5, bfloat16)
    cpu.reduce_into(ReduceOp.SUM, acc, np.full(6, 0.25, bfloat16))
    assert acc.dtype == bfloat16 and (acc.astype(F32) == 1.75).all()


def test_kernels_release_the_gil_and_are_cached():
    """Worker threads overlap reductions with transfers only if the kernels drop
    the GIL; cache=True keeps the compile bill to the first process."""
    kernels = {name: obj for name, obj in vars(cpu_loops).items()
               if name.endswith("_kernel") and hasattr(obj, "targetoptions")}
    assert len(kernels) >= 20
    for name, dispatcher in kernels.items():
        assert dispatcher.targetoptions.get("nogil") is True, name
        assert dispatcher._cache.__class__.__name__ != "NullCache", name


def test_accepts_subclasses_and_misaligned_buffers():
    class Tagged(np.ndarray):
        pass

    acc = np.arange(6, dtype=np.int32).view(Tagged)
    cpu.reduce_into(ReduceOp.SUM, acc, np.ones(6, np.int32).view(Tagged))
    np.testing.assert_array_equal(acc, np.arange(1, 7))
    # float64 at byte offset 1: a frame sliced at an odd offset
    raw = bytearray(8 * 5 + 1)
    acc = np.frombuffer(raw, np.float64, count=5, offset=1)
    acc[...] = np.arange(5)
    x = np.frombuffer(bytes(1) + np.full(5, 2.0).tobytes(), np.float64, offset=1)
    assert not acc.flags.aligned and not x.flags.aligned and not x.flags.writeable
    cpu.reduce_into(ReduceOp.SUM, acc, x)
    np.testing.assert_array_equal(acc, np.arange(5) + 2.0)


def test_rejects_non_contiguous():
    acc = np.zeros(10, np.float32)
    with pytest.raises(ValueError, match=r"x must be C-contiguous.*strides \(8,\)"):
        cpu.reduce_into(ReduceOp.SUM, acc[:5], acc[::2])
    with pytest.raises(ValueError, match="acc must be C-contiguous"):
        cpu.reduce_into(ReduceOp.SUM, acc[::2], np.zeros(5, np.float32))
    with pytest.raises(ValueError, match="acc must be C-contiguous"):
        cpu.reduce_into(ReduceOp.SUM, np.zeros((4, 4), np.float32).T, np.zeros(16, np.float32))


def test_rejects_mismatched_sizes_and_dtypes():
    with pytest.raises(ValueError, match="size mismatch: acc has 4 elements, x has 5"):
        cpu.reduce_into(ReduceOp.SUM, np.zeros(4), np.zeros(5))
    with pytest.raises(TypeError, match="dtype mismatch: acc is float32, x is float64"):
        cpu.reduce_into(ReduceOp.SUM, np.zeros(4, np.float32), np.zeros(4))
    with pytest.raises(TypeError, match="dtype mismatch: acc is bfloat16, x is float16"):
        cpu.reduce_into(ReduceOp.SUM, np.zeros(4, bfloat16), np.zeros(4, np.float16))
    kernel = cpu.compile_op(ReduceOp.SUM, np.int32)
    with pytest.raises(TypeError, match="acc has dtype int64, expected int32"):
        kernel(np.zeros(4, np.int64), np.zeros(4, np.int64))


def test_rejects_read_only_acc_and_non_arrays():
    acc = np.zeros(4)
    acc.flags.writeable = False
    with pytest.raises(ValueError, match="acc is read-only"):
        cpu.reduce_into(ReduceOp.SUM, acc, np.zeros(4))
    with pytest.raises(TypeError, match="x must be a numpy.ndarray, got list"):
        cpu.reduce_into(ReduceOp.SUM, np.zeros(4), [0.0] * 4)
    with pytest.raises(TypeError, match="acc must be a numpy.ndarray, got bytes"):
        cpu.reduce_into(ReduceOp.SUM, b"abcd", np.zeros(4))


def test_rejects_unsupported_dtypes_and_ops():
    for dtype in (">f4", np.float128 if hasattr(np, "float128") else "O", "U3"):
        with pytest.raises(TypeError, match="unsupported dtype"):
            cpu.reduce_into(ReduceOp.SUM, np.zeros(2, dtype), np.zeros(2, dtype))
    with pytest.raises(TypeError, match="must be a numcoll.ReduceOp"):
        cpu.compile_op("SUM", np.float32)


def test_compile_op_memoises_and_is_thread_safe():
    assert cpu.compile_op(ReduceOp.SUM, np.float32) is cpu.compile_op(ReduceOp.SUM, "float32")
    op = ReduceOp.custom(lambda a, b: a if a >= b else b, name="thread_max")
    kernels = []
    threads = [threading.Thread(target=lambda: kernels.append(cpu.compile_op(op, np.int16)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(kernels) == 4 and all(k is kernels[0] for k in kernels)
    assert kernels[0].compile_seconds >= 0 and "thread_max" in repr(kernels[0])


# --------------------------------------------------------------------------
# user-defined ops
# --------------------------------------------------------------------------

max_abs = ReduceOp.custom(lambda a, b: a if abs(a) >= abs(b) else b, name="max_abs")


@njit
def _gcd(a, b):
    a, b = abs(a), abs(b)
    while b:
        a, b = b, a % b
    return a


gcd = ReduceOp.custom(_gcd)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int16, np.int64, np.uint8,
                                   np.complex128, np.float16, bfloat16], ids=dtype_name)
def test_custom_max_abs_matches_numpy(dtype):
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(7)
    for n in (0, 1, 7, 1000):
        if dtype.kind in "iu":          # stay clear of abs(INT_MIN)
            a, b = (rng.integers(0 if dtype.kind == "u" else -100, 100, n).astype(dtype)
                    for _ in range(2))
        else:
            a, b = _random(dtype, n, rng), _random(dtype, n, rng)
        wide = (lambda v: v.astype(F32)) if is_half(dtype) else (lambda v: v)
        expected = np.where(np.abs(wide(a)) >= np.abs(wide(b)), wide(a), wide(b)).astype(dtype)
        acc = a.copy()
        cpu.reduce_into(max_abs, acc, np.frombuffer(b.tobytes(), dtype))
        assert_same(acc, expected)


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint16])
def test_custom_njit_gcd_matches_numpy(dtype):
    rng = np.random.default_rng(3)
    a = rng.integers(1, 5000, 999).astype(dtype) * 6
    b = rng.integers(1, 5000, 999).astype(dtype) * 4
    acc = a.copy()
    cpu.reduce_into(gcd, acc, b)
    np.testing.assert_array_equal(acc, np.gcd(a, b))


def test_custom_op_that_does_not_compile_names_op_and_dtype():
    bits_and = ReduceOp.custom(lambda a, b: a & b, name="bits_and")
    cpu.compile_op(bits_and, np.int32)                       # fine for integers
    with pytest.raises(TypeError, match=r"custom\(bits_and\).*float32"):
        cpu.compile_op(bits_and, np.float32)
    with pytest.raises(TypeError, match=r"bfloat16 \(reduced in float32\)"):
        cpu.reduce_into(bits_and, np.zeros(2, bfloat16), np.zeros(2, bfloat16))
    ordered = ReduceOp.custom(lambda a, b: a if a > b else b, name="ordered")
    with pytest.raises(TypeError, match="complex64"):
        cpu.compile_op(ordered, np.complex64)


# --------------------------------------------------------------------------
# float16 / bfloat16 conversions and AVG scaling
# --------------------------------------------------------------------------

ALL_BITS = np.arange(1 << 16, dtype=np.uint16)


@pytest.mark.parametrize("dtype", [F16, bfloat16], ids=dtype_name)
def test_widen_is_exact_for_every_bit_pattern(dtype):
    src = ALL_BITS.view(dtype)
    out = np.empty(src.size, F32)
    cpu.widen_into(src, out)
    assert_same(out, src.astype(F32))


@pytest.mark.parametrize("dtype", [F16, bfloat16], ids=dtype_name)
def test_narrow_round_trips_every_bit_pattern(dtype):
    wide = ALL_BITS.view(dtype).astype(F32)
    out = np.empty(wide.size, dtype)
    cpu.narrow_into(wide, out)
    assert_same(out, ALL_BITS.view(dtype))
    nan = np.isnan(wide)
    np.testing.assert_array_equal(out.view(np.uint16)[~nan], ALL_BITS[~nan])


def _rounding_cases(dtype):
    """float32 values at, and one float32 ulp either side of, the midpoint
    between every pair of neighbouring finite values of ``dtype``, plus random
    bit patterns."""
    half = ALL_BITS.view(dtype).astype(F32)
    lo = half[np.isfinite(half)].astype(np.float64)
    mantissa_bits, min_exponent = (10, -14) if dtype == F16 else (7, -126)
    exponent = np.frexp(np.maximum(np.abs(lo), 2.0 ** min_exponent))[1] - 1
    ulp = 2.0 ** (exponent - mantissa_bits)                 # subnormals: the fixed spacing
    mid = (lo + np.copysign(ulp / 2, lo)).astype(F32)      # exact in float32
    rng = np.random.default_rng(11)
    noise = rng.integers(0, 2 ** 32, 1 << 18, dtype=np.uint64).astype(np.uint32).view(F32)
    up, down = np.nextafter(mid, np.float32(np.inf)), np.nextafter(mid, np.float32(-np.inf))
    edges = np.float32([65519.996, 65520.0, 3.4e38, -3.4e38, np.inf, 1e-45])
    return np.concatenate([mid, up, down, noise, edges])


@pytest.mark.parametrize("dtype", [F16, bfloat16], ids=dtype_name)
def test_narrow_rounds_to_nearest_even_like_numpy(dtype):
    src = _rounding_cases(dtype)
    out = np.empty(src.size, dtype)
    cpu.narrow_into(src, out)
    with np.errstate(over="ignore", invalid="ignore"):       # inf and signalling NaN inputs
        assert_same(out, src.astype(dtype))


def test_conversions_take_any_shape_and_misaligned_buffers():
    src = np.arange(12, dtype=np.float32).reshape(3, 4)
    out = np.frombuffer(bytearray(12 * 2 + 1), F16, count=12, offset=1)   # misaligned
    assert not out.flags.aligned
    cpu.narrow_into(src, out)
    np.testing.assert_array_equal(out, np.arange(12))
    wide = np.empty((2, 6), np.float32)
    cpu.widen_into(out, wide)
    np.testing.assert_array_equal(wide.ravel(), np.arange(12))


def test_conversion_arguments_are_checked():
    with pytest.raises(TypeError, match="float16/bfloat16 <-> float32 only"):
        cpu.widen_into(np.zeros(3, np.float32), np.zeros(3, np.float32))
    with pytest.raises(TypeError, match="float16/bfloat16 <-> float32 only"):
        cpu.narrow_into(np.zeros(3, np.float64), np.zeros(3, np.float16))
    with pytest.raises(ValueError, match="size mismatch"):
        cpu.widen_into(np.zeros(3, np.float16), np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="src must be C-contiguous"):
        cpu.narrow_into(np.zeros(6, np.float32)[::2], np.zeros(3, bfloat16))
    ro = np.zeros(3, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="out is read-only"):
        cpu.widen_into(np.zeros(3, np.float16), ro)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex64, np.complex128,
                                   np.float16, bfloat16], ids=dtype_name)
def test_scale_into_matches_numpy(dtype):
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(5)
    for n in (0, 1, 1000):
        a = _random(dtype, n, rng)
        if is_half(dtype):
            expected = (a.astype(F32) / np.float32(3)).astype(dtype)
        elif dtype.kind == "c":
            # Part by part: NumPy's complex division (reciprocal, then multiply)
            # can be 1 ulp off the correctly rounded quotient the kernel gives.
            real = np.dtype(dtype.char.lower())
            expected = (a.view(real) / real.type(3)).view(dtype)
        else:
            expected = a / dtype.type(3)
        for divisor in (3, np.float64(3.0)):           # a Python and a NumPy scalar
            acc = a.copy()
            cpu.scale_into(acc, divisor)
            assert_same(acc, expected)


def test_scale_into_refuses_integers_and_zero():
    with pytest.raises(TypeError, match="int32.*AVG needs a floating point"):
        cpu.scale_into(np.zeros(3, np.int32), 2)
    with pytest.raises(ValueError, match="non-zero"):
        cpu.scale_into(np.zeros(3), 0)
    with pytest.raises(TypeError, match="real number"):
        cpu.scale_into(np.zeros(3), 1j)
