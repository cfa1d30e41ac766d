"""CUDA reduction kernels: ``acc[i] = op(acc[i], x[i])`` on device arrays.

The GPU twin of :mod:`numcoll.kernels.cpu`, with the same functions and the
same semantics, operating on CUDA memory: anything with
``__cuda_array_interface__`` (Numba device arrays, CuPy arrays, torch CUDA
tensors). Each public function validates its arguments, then launches a
private ``numba.cuda`` kernel on ``stream`` (``0``, the default stream, or a
``numba.cuda`` stream; wrap a foreign stream with ``cuda.external_stream``).
Launches are asynchronous on a real GPU, like any CUDA kernel launch.

Import this module lazily, only when device arrays are seen: it imports
``numba.cuda``, which ``import numcoll`` must not pay for. It imports without
a GPU (kernels compile at first launch); :func:`is_available` says whether
launching can work.

Launch shape: every kernel is a grid-stride loop, launched with
``min(MAX_BLOCKS, ceil(n / THREADS_PER_BLOCK))`` blocks of
``THREADS_PER_BLOCK`` threads. ``NUMCOLL_CUDA_THREADS`` and
``NUMCOLL_CUDA_BLOCKS`` override the two at call time, so tests can force the
multi-iteration paths with tiny arrays (4 threads x 2 blocks).

Semantics (as on the CPU): AVG reduces like SUM (finish with
:func:`scale_into`); integers wrap; MIN/MAX propagate NaN like ``np.minimum``;
bool SUM/MAX are logical or, PRODUCT/MIN logical and; float16/bfloat16 are
handled as uint16 bit patterns with float32 arithmetic and round-to-nearest-even
conversions, so a half reduction is the float32 operation rounded once. One
GPU difference: arithmetic on a NaN returns the canonical NaN, not the
input's payload (MIN/MAX select an input and keep it).

Under Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) the same kernels run
as Python threads on NumPy memory; CI uses it. It is slow (tens of
microseconds an element), so keep arrays and launch shapes small there.
"""

from __future__ import annotations

import os
import re
import threading
import time
import warnings
from numbers import Real

import numpy as np

try:
    from numba import cuda
    from numba.cuda.cudadrv import devicearray as _devicearray
    from numba.cuda.cudadrv import error as _cuda_errors
except Exception as exc:  # pragma: no cover - depends on the installation
    raise ImportError(
        "numcoll.kernels.cuda needs Numba's CUDA target (numba.cuda); "
        f"it failed to import: {exc}. Install it with `pip install numba-cuda`."
    ) from exc

from ..dtypes import SUPPORTED_DTYPES, bfloat16, dtype_name, is_half
from ..ops import ReduceOp

__all__ = [
    "MAX_BLOCKS",
    "THREADS_PER_BLOCK",
    "ReduceKernel",
    "compile_op",
    "is_available",
    "narrow_into",
    "pinned_empty",
    "reduce_into",
    "scale_into",
    "to_device_async",
    "to_host_async",
    "widen_into",
]

#: Threads per block (override: ``NUMCOLL_CUDA_THREADS``, read at each launch).
#: 256 keeps several blocks resident per SM for these memory-bound loops.
THREADS_PER_BLOCK = 256
#: Most blocks in a grid (override: ``NUMCOLL_CUDA_BLOCKS``). Beyond what the
#: device keeps resident more blocks only add scheduling; the grid-stride loop
#: covers the rest. Not tuned on hardware yet: see benchmarks/bench_cuda.py.
MAX_BLOCKS = 1024

_U16 = np.dtype(np.uint16)
_F32 = np.dtype(np.float32)
_SUPPORTED = frozenset(SUPPORTED_DTYPES)

#: True when numba.cuda is the simulator (decided when numba.cuda was imported).
_SIMULATED = cuda.jit.__module__.startswith("numba.cuda.simulator")
# The simulator keeps a kernel's launch shape on the shared kernel object and
# allows one simulated kernel at a time in the process, so launches from
# several worker threads must take turns. Real launches need no lock.
_SIM_LAUNCH_LOCK = threading.Lock()
# Host code below calls numba.cuda only through these names, never through the
# module: while a simulated kernel runs, the simulator swaps every module-level
# reference to numba.cuda (ours included) for its per-launch fake, which would
# break a host call made at that moment on another thread.
_jit = cuda.jit
_to_device = cuda.to_device
_pinned_array = cuda.pinned_array
_as_cuda_array = getattr(cuda, "as_cuda_array", None)   # absent from the simulator
_cuda_is_available = cuda.is_available
_DRIVER_ERRORS = tuple(
    getattr(_cuda_errors, name)
    for name in ("CudaSupportError", "CudaDriverError", "CudaRuntimeError")
    if hasattr(_cuda_errors, name)
)

# cache=True: the PTX of the built-in kernels is kept on disk, so only the
# first process on a machine pays the compile (ignored by the simulator).
_JIT = dict(cache=True)


# --------------------------------------------------------------------------
# Scalar helpers (device functions)
# --------------------------------------------------------------------------

if _SIMULATED:
    # Simulated kernels compute on NumPy scalars, which warn on the integer
    # wraparound and inf/NaN arithmetic that a GPU does silently. Each simulated
    # CUDA thread is a new Python thread with NumPy's default error state, so
    # every kernel quiets it for its own thread first.
    @cuda.jit(device=True)
    def _quiet_fp():
        np.seterr(all="ignore")

    @cuda.jit(device=True)
    def _bits_to_f32(bits):
        """Reinterpret the low 32 bits of an integer as a float32."""
        return np.uint32(bits & 0xFFFFFFFF).view(np.float32)

    @cuda.jit(device=True)
    def _f32_to_bits(value):
        """The IEEE bits of a float32 as a non-negative int64."""
        return np.int64(np.float32(value).view(np.uint32))
else:
    from numba.cuda import libdevice

    @cuda.jit(device=True)
    def _quiet_fp():
        pass  # a GPU never traps on integer or IEEE exceptions

    @cuda.jit(device=True)
    def _bits_to_f32(bits):
        """Reinterpret the low 32 bits of an integer as a float32."""
        return libdevice.int_as_float(np.int32(bits))   # np.int32 truncates

    @cuda.jit(device=True)
    def _f32_to_bits(value):
        """The IEEE bits of a float32 as a non-negative int64."""
        return np.int64(libdevice.float_as_int(value)) & 0xFFFFFFFF


# Bit-exact ports of the conversions in kernels/cpu.py (see there for the
# derivations); they use no hardware half support, so every GPU rounds alike.

@cuda.jit(device=True)
def _f16_to_f32(h):
    h = np.int64(h)
    bits = (h & 0x7FFF) << 13                  # exponent and mantissa in float32 place
    exponent = bits & 0x0F800000
    bits += (127 - 15) << 23                   # rebias the exponent
    if exponent == 0x0F800000:                 # inf / NaN: exponent must become 255
        f = _bits_to_f32(bits + ((128 - 16) << 23))
    elif exponent == 0:                        # zero / subnormal: renormalise by subtracting 2**-14
        f = _bits_to_f32(bits + (1 << 23)) - _bits_to_f32(113 << 23)
    else:
        f = _bits_to_f32(bits)
    return _bits_to_f32(_f32_to_bits(f) | ((h & 0x8000) << 16))


@cuda.jit(device=True)
def _f32_to_f16(f):
    u = _f32_to_bits(f)
    sign = (u >> 16) & 0x8000
    u &= 0x7FFFFFFF
    if u >= (127 + 16) << 23:                  # too big for float16, inf or NaN
        if u > 0x7F800000:                     # NaN: keep the top payload bits, force quiet
            h = 0x7E00 | ((u >> 13) & 0x3FF)
        else:
            h = 0x7C00
    elif u < 113 << 23:                        # float16 subnormal or zero
        # Adding 0.5 puts the float16 subnormal grid (2**-24) at the float32
        # mantissa's last bit, so the FPU's round-to-nearest-even does the rounding.
        h = _f32_to_bits(_bits_to_f32(u) + np.float32(0.5)) - 0x3F000000
    else:                                      # normal: rebias, round to nearest even
        h = (u + (0xFFF - ((127 - 15) << 23)) + ((u >> 13) & 1)) >> 13
    return np.uint16(h | sign)


@cuda.jit(device=True)
def _bf16_to_f32(h):
    return _bits_to_f32(np.int64(h) << 16)


@cuda.jit(device=True)
def _f32_to_bf16(f):
    u = _f32_to_bits(f)
    if (u & 0x7FFFFFFF) > 0x7F800000:          # NaN: truncating could make it inf; force quiet
        return np.uint16((u >> 16) | 0x0040)
    # Round to nearest even; a carry out of the mantissa correctly bumps the exponent (to inf).
    return np.uint16((u + 0x7FFF + ((u >> 16) & 1)) >> 16)


# --------------------------------------------------------------------------
# Built-in reduction kernels (grid-stride loops)
# --------------------------------------------------------------------------

@cuda.jit(**_JIT)
def _sum_kernel(acc, x):
    _quiet_fp()
    for i in range(cuda.grid(1), acc.size, cuda.gridsize(1)):
        acc[i] += x[i]                         # integers wrap: the store truncates


@cuda.jit(**_JIT)
def _prod_kernel(acc, x):
    _quiet_fp()
    for i in range(cuda.grid(1), acc.size, cuda.gridsize(1)):
        acc[i] *= x[i]


@cuda.jit(**_JIT)
def _min_kernel(acc, x):
    _quiet_fp()
    for i in range(cuda.grid(1), acc.size, cuda.gridsize(1)):
        a = acc[i]
        b = x[i]
        acc[i] = a if (a <= b or a != a) else b   # NaN in either input wins, as np.minimum


@cuda.jit(**_JIT)
def _max_kernel(acc, x):
    _quiet_fp()
    for i in range(cuda.grid(1), acc.size, cuda.gridsize(1)):
        a = acc[i]
        b = x[i]
        acc[i] = a if (a >= b or a != a) else b


@cuda.jit(**_JIT)
def _band_kernel(acc, x):
    _quiet_fp()
    for i in range(cuda.grid(1), acc.size, cuda.gridsize(1)):
        acc[i] &= x[i]


@cuda.jit(**_JIT)
def _bor_kernel(acc, x):
    _quiet_fp()
    for i in range(cuda.grid(1), acc.size, cuda.gridsize(1)):
        acc[i] |= x[i]


@cuda.jit(**_JIT)
def _bxor_kernel(acc, x):
    _quiet_fp()
    for i in range(cuda.grid(1), acc.size, cuda.gridsize(1)):
        acc[i] ^= x[i]


# Half kernels work on uint16 views, written out per format (not generated by
# a factory) so that the disk cache can key them, as in kernels/cpu.py.

@cuda.jit(**_JIT)
def _f16_sum_kernel(acc, x):
    _quiet_fp()
    for i in range(cuda.grid(1), acc.size, cuda.gridsize(1)):
        acc[i] = _f32_to_f16(_f16_to_f32(acc[i]) + _f16_to_f32(x[i]))


@cuda.jit(**_JIT)
def _f16_prod_kernel(acc, x):
    _quiet_fp()
    for i in range(cuda.grid(1), acc.size, cuda.gridsize(1)):
        acc[i] = _f32_to_f16(_f16_to_f32(acc[i]) * _f16_to_f32(x[i]))


@cuda.jit(**_JIT)
def _f16_min_kernel(acc, x):
    _quiet_fp()
    for i in range(cuda.grid(1), acc.size, cuda.gridsize(1)):
        a = _f16_to_f32(acc[i])
        b = _f16_to_f32(x[i])
        acc[i] = _f32_to_f16(a if (a <= b or a != a) else b)


@cuda.jit(**_JIT)
def _f16_max_kernel(acc, x):
    _quiet_fp()
    for i in range(cuda.grid(1), acc.size, cuda.gridsize(1)):
        a = _f16_to_f32(acc[i])
        b = _f16_to_f32(x[i])
        acc[i] = _f32_to_f16(a if (a >= b or a != a) else b)


@cuda.jit(**_JIT)
def _bf16_sum_kernel(acc, x):
    _quiet_fp()
    for i in range(cuda.grid(1), acc.size, cuda.gridsize(1)):
        acc[i] = _f32_to_bf16(_bf16_to_f32(acc[i]) + _bf16_to_f32(x[i]))


@cuda.jit(**_JIT)
def _bf16_prod_kernel(acc, x):
    _quiet_fp()
    for i in range(cuda.grid(1), acc.size, cuda.gridsize(1)):
        acc[i] = _f32_to_bf16(_bf16_to_f32(acc[i]) * _bf16_to_f32(x[i]))


@cuda.jit(**_JIT)
def _bf16_min_kernel(acc, x):
    _quiet_fp()
    for i in range(cuda.grid(1), acc.size, cuda.gridsize(1)):
        a = _bf16_to_f32(acc[i])
        b = _bf16_to_f32(x[i])
        acc[i] = _f32_to_bf16(a if (a <= b or a != a) else b)


@cuda.jit(**_JIT)
def _bf16_max_kernel(acc, x):
    _quiet_fp()
    for i in range(cuda.grid(1), acc.size, cuda.gridsize(1)):
        a = _bf16_to_f32(acc[i])
        b = _bf16_to_f32(x[i])
        acc[i] = _f32_to_bf16(a if (a >= b or a != a) else b)


# --------------------------------------------------------------------------
# Conversions and AVG scaling
# --------------------------------------------------------------------------

@cuda.jit(**_JIT)
def _f16_widen_kernel(src, out):
    _quiet_fp()
    for i in range(cuda.grid(1), src.size, cuda.gridsize(1)):
        out[i] = _f16_to_f32(src[i])


@cuda.jit(**_JIT)
def _bf16_widen_kernel(src, out):
    _quiet_fp()
    for i in range(cuda.grid(1), src.size, cuda.gridsize(1)):
        out[i] = _bf16_to_f32(src[i])


@cuda.jit(**_JIT)
def _f16_narrow_kernel(src, out):
    _quiet_fp()
    for i in range(cuda.grid(1), src.size, cuda.gridsize(1)):
        out[i] = _f32_to_f16(src[i])


@cuda.jit(**_JIT)
def _bf16_narrow_kernel(src, out):
    _quiet_fp()
    for i in range(cuda.grid(1), src.size, cuda.gridsize(1)):
        out[i] = _f32_to_bf16(src[i])


@cuda.jit(**_JIT)
def _scale_kernel(acc, divisor):
    _quiet_fp()
    for i in range(cuda.grid(1), acc.size, cuda.gridsize(1)):
        acc[i] /= divisor


@cuda.jit(**_JIT)
def _f16_scale_kernel(acc, divisor):
    _quiet_fp()
    for i in range(cuda.grid(1), acc.size, cuda.gridsize(1)):
        acc[i] = _f32_to_f16(_f16_to_f32(acc[i]) / divisor)


@cuda.jit(**_JIT)
def _bf16_scale_kernel(acc, divisor):
    _quiet_fp()
    for i in range(cuda.grid(1), acc.size, cuda.gridsize(1)):
        acc[i] = _f32_to_bf16(_bf16_to_f32(acc[i]) / divisor)


_HALF_KERNELS = {
    (np.dtype(np.float16), "SUM"): _f16_sum_kernel,
    (np.dtype(np.float16), "PRODUCT"): _f16_prod_kernel,
    (np.dtype(np.float16), "MIN"): _f16_min_kernel,
    (np.dtype(np.float16), "MAX"): _f16_max_kernel,
    (bfloat16, "SUM"): _bf16_sum_kernel,
    (bfloat16, "PRODUCT"): _bf16_prod_kernel,
    (bfloat16, "MIN"): _bf16_min_kernel,
    (bfloat16, "MAX"): _bf16_max_kernel,
}
_BOOL_KERNELS = {  # bool: SUM/MAX are logical or, PRODUCT/MIN logical and
    "SUM": _bor_kernel, "MAX": _bor_kernel, "BOR": _bor_kernel,
    "PRODUCT": _band_kernel, "MIN": _band_kernel, "BAND": _band_kernel,
    "BXOR": _bxor_kernel,
}
_KERNELS = {
    "SUM": _sum_kernel, "PRODUCT": _prod_kernel, "MIN": _min_kernel, "MAX": _max_kernel,
    "BAND": _band_kernel, "BOR": _bor_kernel, "BXOR": _bxor_kernel,
}
_WIDEN = {np.dtype(np.float16): _f16_widen_kernel, bfloat16: _bf16_widen_kernel}
_NARROW = {np.dtype(np.float16): _f16_narrow_kernel, bfloat16: _bf16_narrow_kernel}
_SCALE_HALF = {np.dtype(np.float16): _f16_scale_kernel, bfloat16: _bf16_scale_kernel}


def _builtin_kernel(op: ReduceOp, dtype: np.dtype):
    """The kernel for a built-in ``op`` on ``dtype`` (same refusals as kernels/cpu.py)."""
    name = "SUM" if op.name == "AVG" else op.name     # the caller divides by the count
    kind = dtype.kind
    if is_half(dtype):
        kernel = _HALF_KERNELS.get((dtype, name))
    elif kind == "b":
        kernel = _BOOL_KERNELS[name]
    elif kind == "c" and name not in ("SUM", "PRODUCT"):
        raise TypeError(
            f"ReduceOp.{op.name} cannot reduce {dtype_name(dtype)}: complex numbers have no "
            "order and no bits to combine; use SUM, AVG or PRODUCT"
        )
    elif kind == "f" and op.is_bitwise:
        kernel = None
    else:
        kernel = _KERNELS[name]
    if kernel is None:
        raise TypeError(
            f"ReduceOp.{op.name} cannot reduce {dtype_name(dtype)}: "
            "bitwise ops take integer and bool dtypes only"
        )
    return kernel


def _custom_kernel(op: ReduceOp, dtype: np.dtype):
    """A grid-stride kernel around ``op.fn`` for ``dtype`` (half: in float32).

    Not disk-cached: the closure holds the user's function.
    """
    fn = _jit(device=True)(getattr(op.fn, "py_func", op.fn))  # @njit'ed fns too
    if dtype == bfloat16:
        def _custom(acc, x):
            _quiet_fp()
            for i in range(cuda.grid(1), acc.size, cuda.gridsize(1)):
                acc[i] = _f32_to_bf16(np.float32(fn(_bf16_to_f32(acc[i]), _bf16_to_f32(x[i]))))
    elif is_half(dtype):
        def _custom(acc, x):
            _quiet_fp()
            for i in range(cuda.grid(1), acc.size, cuda.gridsize(1)):
                acc[i] = _f32_to_f16(np.float32(fn(_f16_to_f32(acc[i]), _f16_to_f32(x[i]))))
    else:
        def _custom(acc, x):
            _quiet_fp()
            for i in range(cuda.grid(1), acc.size, cuda.gridsize(1)):
                acc[i] = fn(acc[i], x[i])
    return _jit(_custom)


# --------------------------------------------------------------------------
# Launching
# --------------------------------------------------------------------------

def _env_count(var: str, default: int, most: int) -> int:
    raw = os.environ.get(var)
    if raw is None:
        return default
    try:
        value = int(raw, 0)
    except ValueError:
        raise ValueError(f"{var}={raw!r} is not an integer") from None
    if not 1 <= value <= most:
        raise ValueError(f"{var}={value} is out of range: expected 1..{most}")
    return value


def _launch_shape(count: int) -> tuple[int, int]:
    """(blocks, threads) for ``count`` elements, with the env overrides applied."""
    threads = _env_count("NUMCOLL_CUDA_THREADS", THREADS_PER_BLOCK, 1024)  # CUDA's block limit
    max_blocks = _env_count("NUMCOLL_CUDA_BLOCKS", MAX_BLOCKS, 2**31 - 1)
    return min(max_blocks, -(-count // threads)), threads


def _launch(kernel, count: int, stream, *args) -> None:
    if count == 0:
        return              # an empty grid is a launch error in CUDA
    blocks, threads = _launch_shape(count)
    if _SIMULATED:
        with _SIM_LAUNCH_LOCK:
            kernel[blocks, threads, stream](*args)
    else:
        kernel[blocks, threads, stream](*args)


# --------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------

class _SimulatedForeign:
    """Exposes a foreign ``__cuda_array_interface__`` to NumPy (simulator only)."""

    def __init__(self, owner, desc):
        self._owner = owner                      # keeps the memory alive
        self.__array_interface__ = {
            "data": tuple(desc["data"]), "shape": tuple(desc["shape"]),
            "strides": desc.get("strides"), "typestr": desc["typestr"], "version": 3,
        }


def _as_device(where: str, name: str, obj, writable: bool = False):
    """``obj`` as a Numba device array (a view, never a copy)."""
    if _devicearray.is_cuda_ndarray(obj):
        return obj                               # Numba's own: never read-only
    if not hasattr(obj, "__cuda_array_interface__"):
        raise TypeError(
            f"{where}: {name} must be a CUDA device array (an object with "
            f"__cuda_array_interface__: Numba device array, CuPy, torch CUDA tensor), got "
            f"{type(obj).__name__}; host arrays go to numcoll.kernels.cpu"
        )
    desc = obj.__cuda_array_interface__
    if writable and desc["data"][1]:
        raise ValueError(f"{where}: {name} is read-only")
    if not _SIMULATED:
        # Syncs the producer's stream if it exported one (the interface's v3 rule).
        return _as_cuda_array(obj)
    # The simulator has no as_cuda_array; its "device" memory is host memory,
    # so a foreign interface there can only point at host memory too.
    return _devicearray.FakeCUDAArray(np.asarray(_SimulatedForeign(obj, desc)))


def _device_pointer(dev) -> int:
    if _SIMULATED:
        return dev._ary.__array_interface__["data"][0]
    return dev.__cuda_array_interface__["data"][0]


def _flat(where: str, name: str, dev):
    """Check a device array's layout; return it as a 1-D view."""
    if not dev.is_c_contiguous():
        raise ValueError(
            f"{where}: {name} must be C-contiguous, got shape {tuple(dev.shape)} with "
            f"strides {tuple(dev.strides)}; copy it to a contiguous device array first"
        )
    # A view at an odd offset into a byte buffer would fault on the GPU
    # ("misaligned address"), which poisons the whole CUDA context.
    itemsize = dev.dtype.itemsize
    if dev.size and _device_pointer(dev) % itemsize:
        raise ValueError(
            f"{where}: {name} is not aligned to its {itemsize}-byte items "
            f"(device address {_device_pointer(dev):#x})"
        )
    return dev if dev.ndim == 1 else dev.reshape(dev.size)


def _check_dtype(where: str, dtype) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype not in _SUPPORTED:
        order = " (non-native byte order)" if not dtype.isnative else ""
        raise TypeError(
            f"{where}: unsupported dtype {dtype}{order}; numcoll reduces "
            + ", ".join(dtype_name(d) for d in SUPPORTED_DTYPES)
        )
    return dtype


def _operands(where: str, acc, x):
    """Check an (acc, x) pair for a reduction; return both as flat device views."""
    acc_d = _as_device(where, "acc", acc, writable=True)
    x_d = _as_device(where, "x", x)
    if acc_d.dtype != x_d.dtype:
        raise TypeError(f"{where}: dtype mismatch: acc is {dtype_name(acc_d.dtype)}, "
                        f"x is {dtype_name(x_d.dtype)}")
    _check_dtype(where, acc_d.dtype)
    if acc_d.size != x_d.size:
        raise ValueError(f"{where}: size mismatch: acc has {acc_d.size} elements, "
                         f"x has {x_d.size}")
    return _flat(where, "acc", acc_d), _flat(where, "x", x_d)


# --------------------------------------------------------------------------
# Compilation and memoisation
# --------------------------------------------------------------------------

_lock = threading.Lock()
_compiled: dict[tuple, "ReduceKernel"] = {}


class ReduceKernel:
    """``op`` compiled for ``dtype``: ``kernel(acc, x, stream=0)`` reduces ``x`` into ``acc``.

    Returned by :func:`compile_op`; the call validates its arguments exactly
    as :func:`reduce_into` does (and that they have this kernel's dtype).

    Attributes
    ----------
    op : ReduceOp
    dtype : numpy.dtype
    compile_seconds : float
        Wall time :func:`compile_op` spent compiling (or loading from the disk cache).
    """

    __slots__ = ("op", "dtype", "compile_seconds", "_kernel", "_view")

    def __init__(self, op, dtype, kernel, view, compile_seconds):
        self.op = op
        self.dtype = dtype
        self.compile_seconds = compile_seconds
        self._kernel = kernel
        self._view = view                  # uint16 for half dtypes, else None

    def __repr__(self):
        return f"<cuda ReduceKernel {self.op!r} {dtype_name(self.dtype)}>"

    def __call__(self, acc, x, stream=0) -> None:
        acc_d, x_d = _operands("reduce_into", acc, x)
        if acc_d.dtype != self.dtype:
            raise TypeError(f"reduce_into: acc has dtype {dtype_name(acc_d.dtype)}, "
                            f"expected {dtype_name(self.dtype)}")
        self._launch(acc_d, x_d, stream)

    def _launch(self, acc_d, x_d, stream) -> None:
        if self._view is not None:
            acc_d, x_d = acc_d.view(self._view), x_d.view(self._view)
        _launch(self._kernel, acc_d.size, stream, acc_d, x_d)


def _trial_launch(kernel, kernel_dtype: np.dtype, dtype: np.dtype) -> None:
    """Run ``kernel`` once on one element, so that it compiles now.

    A real GPU compiles a kernel at its first launch, and the simulator only
    meets a Python error when it runs the code, so this is what makes
    :func:`compile_op` fail at the call rather than inside a collective.
    """
    ones = np.ones(1, dtype).view(kernel_dtype)
    _launch(kernel, 1, 0, _to_device(ones), _to_device(ones))


def _reason(exc: Exception) -> str:
    """The telling line of a Numba typing error (it opens with "Failed in ... pipeline")."""
    lines = [line.strip() for line in re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).splitlines()]
    lines = [line for line in lines if line and not line.startswith("Failed in")]
    if not lines:
        return type(exc).__name__
    if lines[0].endswith(":") and len(lines) > 1:    # "... found for signature:" + the call
        return f"{lines[0]} {lines[1]}"
    return lines[0]


def compile_op(op: ReduceOp, dtype) -> ReduceKernel:
    """Compile ``op`` for ``dtype`` on the current device now, and memoise it.

    The collective layer calls this on the caller's thread before queueing
    work, so an op that cannot reduce the dtype fails at the call. It needs a
    usable device (or the simulator): it launches the kernel once on scratch
    memory, which is where CUDA compiles.

    Parameters
    ----------
    op : ReduceOp
        A built-in op or one from :meth:`ReduceOp.custom` (its ``fn`` is
        compiled with ``cuda.jit(device=True)``). AVG compiles to SUM.
    dtype : numpy.dtype or dtype-like
        One of :data:`numcoll.dtypes.SUPPORTED_DTYPES`.

    Returns
    -------
    ReduceKernel
        Callable as ``kernel(acc, x, stream=0)``.

    Raises
    ------
    TypeError
        If ``op`` is not a ReduceOp, the dtype is unsupported, the op is not
        defined for the dtype (bitwise on floats, MIN/MAX/bitwise on complex),
        or a custom function does not compile for it; the message names the
        op and the dtype.
    """
    if not isinstance(op, ReduceOp):
        raise TypeError(f"compile_op: op must be a numcoll.ReduceOp, got {op!r}")
    dtype = _check_dtype("compile_op", dtype)
    key = (op, dtype)
    kernel = _compiled.get(key)
    if kernel is not None:
        return kernel
    view = _U16 if is_half(dtype) else None
    kernel_dtype = view if view is not None else dtype
    start = time.perf_counter()
    if op.is_custom:
        try:
            launchable = _custom_kernel(op, dtype)
            _trial_launch(launchable, kernel_dtype, dtype)
        except _DRIVER_ERRORS:
            raise                               # no usable device: not the function's fault
        except Exception as exc:  # Numba raises many kinds; all mean "does not compile"
            how = " (reduced in float32)" if view is not None else ""
            raise TypeError(
                f"{op!r} cannot reduce dtype {dtype_name(dtype)}{how}: its function does not "
                f"compile with numba.cuda for {dtype_name(_F32 if view is not None else dtype)} "
                f"arguments: {_reason(exc)}"
            ) from exc
    else:
        launchable = _builtin_kernel(op, dtype)
        _trial_launch(launchable, kernel_dtype, dtype)
    kernel = ReduceKernel(op, dtype, launchable, view, time.perf_counter() - start)
    with _lock:
        return _compiled.setdefault(key, kernel)


# --------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------

def reduce_into(op: ReduceOp, acc, x, stream=0) -> None:
    """Reduce device array ``x`` into device array ``acc``: ``acc[i] = op(acc[i], x[i])``.

    Parameters
    ----------
    op : ReduceOp
        SUM, PRODUCT, MIN, MAX, AVG (reduces like SUM; finish with
        :func:`scale_into`), BAND, BOR, BXOR or a :meth:`ReduceOp.custom` op.
    acc : device array
        Anything with ``__cuda_array_interface__``; writable, C-contiguous
        (any shape: it is flattened), aligned, one of the supported dtypes.
    x : device array
        Same dtype and number of elements as ``acc``, C-contiguous. ``acc``
        and ``x`` may be the same array but must not otherwise overlap.
    stream : numba.cuda stream or 0
        The stream to launch on (asynchronous on a real GPU).

    Raises
    ------
    TypeError
        Not device arrays, mismatched or unsupported dtypes, an op that is not
        defined for the dtype or a custom op that does not compile for it.
    ValueError
        Mismatched sizes, non-contiguous, misaligned or read-only arrays, or a
        bad ``NUMCOLL_CUDA_THREADS``/``NUMCOLL_CUDA_BLOCKS``.
    """
    if not isinstance(op, ReduceOp):
        raise TypeError(f"reduce_into: op must be a numcoll.ReduceOp, got {op!r}")
    acc_d, x_d = _operands("reduce_into", acc, x)
    compile_op(op, acc_d.dtype)._launch(acc_d, x_d, stream)


def scale_into(acc, divisor: Real, stream=0) -> None:
    """Divide device array ``acc`` in place by a real ``divisor`` (the AVG finalisation).

    Floats divide in their own precision (``divisor`` converted to the dtype,
    as NumPy does for a Python scalar); float16/bfloat16 divide in float32
    and round once; complex divides the real and imaginary parts separately.

    Raises
    ------
    TypeError
        For integer and bool dtypes, or a divisor that is not a real number.
    ValueError
        For a zero divisor, or an ``acc`` that is not a writable C-contiguous device array.
    """
    dev = _as_device("scale_into", "acc", acc, writable=True)
    if not isinstance(divisor, Real) or isinstance(divisor, (bool, np.bool_)):
        raise TypeError(f"scale_into: divisor must be a real number, got {divisor!r}")
    if divisor == 0:
        raise ValueError("scale_into: divisor must be non-zero")
    dtype = _check_dtype("scale_into", dev.dtype)
    if dtype.kind not in "fc" and not is_half(dtype):
        raise TypeError(
            f"scale_into: cannot divide {dtype_name(dtype)} in place (an integer average "
            "would have to round); AVG needs a floating point or complex dtype"
        )
    work = _flat("scale_into", "acc", dev)
    if is_half(dtype):
        _launch(_SCALE_HALF[dtype], work.size, stream, work.view(_U16), np.float32(divisor))
    else:
        real = np.dtype(dtype.char.lower())             # complex64 -> float32 pairs, ...
        parts = work.view(real) if real != dtype else work
        _launch(_scale_kernel, parts.size, stream, parts, real.type(divisor))


def _convert(where: str, kernels: dict, src, out, src_ok, out_ok, stream) -> None:
    src_d = _as_device(where, "src", src)
    out_d = _as_device(where, "out", out, writable=True)
    if not (src_ok(src_d.dtype) and out_ok(out_d.dtype)):
        raise TypeError(
            f"{where}: converts float16/bfloat16 <-> float32 only, got src "
            f"{dtype_name(src_d.dtype)} and out {dtype_name(out_d.dtype)}"
        )
    if src_d.size != out_d.size:
        raise ValueError(f"{where}: size mismatch: src has {src_d.size} elements, "
                         f"out has {out_d.size}")
    source = _flat(where, "src", src_d)
    work = _flat(where, "out", out_d)
    half = source.dtype if is_half(source.dtype) else work.dtype
    source = source.view(_U16) if is_half(source.dtype) else source
    work = work.view(_U16) if is_half(work.dtype) else work
    _launch(kernels[half], source.size, stream, source, work)


def widen_into(src, out, stream=0) -> None:
    """Convert a float16 or bfloat16 device array to float32, exactly, into ``out``.

    Raises
    ------
    TypeError
        If ``src`` is not float16/bfloat16 or ``out`` is not float32, or either
        is not a device array.
    ValueError
        Mismatched sizes, non-contiguous or misaligned arrays, read-only ``out``.
    """
    _convert("widen_into", _WIDEN, src, out, is_half, lambda d: d == _F32, stream)


def narrow_into(src, out, stream=0) -> None:
    """Round a float32 device array to float16 or bfloat16 (nearest even) into ``out``.

    Values beyond the format's range become inf; NaN stays NaN (quiet, sign
    and leading payload bits kept).

    Raises
    ------
    TypeError
        If ``src`` is not float32 or ``out`` is not float16/bfloat16, or either
        is not a device array.
    ValueError
        Mismatched sizes, non-contiguous or misaligned arrays, read-only ``out``.
    """
    _convert("narrow_into", _NARROW, src, out, lambda d: d == _F32, is_half, stream)


# --------------------------------------------------------------------------
# Device and staging helpers
# --------------------------------------------------------------------------

def is_available() -> bool:
    """True if kernels can be launched here: a usable CUDA GPU, or the simulator."""
    try:
        return bool(_cuda_is_available())
    except Exception:  # a broken driver installation means "no"
        return False


_pinning_warned = False


def pinned_empty(nbytes: int) -> np.ndarray:
    """An uninitialised page-locked (pinned) host buffer of ``nbytes`` bytes (uint8).

    Copies between pinned memory and the device run asynchronously on a
    stream and at full PCIe/NVLink speed; that is what the staging buffers
    of device-array collectives need.

    Where pinning is not possible the buffer is ordinary (pageable) NumPy
    memory, which works the same but makes copies synchronous with the host:
    always under the simulator (its ``pinned_array`` is plain NumPy), and on a
    real GPU when the driver refuses (e.g. the locked-memory limit), with a
    RuntimeWarning the first time.
    """
    nbytes = int(nbytes)
    if nbytes < 0:
        raise ValueError(f"pinned_empty: nbytes must be >= 0, got {nbytes}")
    if nbytes == 0 or _SIMULATED:
        return np.empty(nbytes, np.uint8)
    try:
        return _pinned_array(nbytes, dtype=np.uint8)
    except Exception as exc:  # driver errors, out of lockable memory, no device
        global _pinning_warned
        if not _pinning_warned:
            _pinning_warned = True
            warnings.warn(f"numcoll: cannot pin {nbytes} host bytes ({_reason(exc)}); staging "
                          "through pageable memory (slower, synchronous copies)",
                          RuntimeWarning, stacklevel=2)
        return np.empty(nbytes, np.uint8)


def _byte_views(where: str, dev_view, host_view, host_writable: bool):
    dev = _flat(where, "dev_view", _as_device(where, "dev_view", dev_view,
                                              writable=not host_writable))
    if not isinstance(host_view, np.ndarray):
        raise TypeError(f"{where}: host_view must be a numpy.ndarray, "
                        f"got {type(host_view).__name__}")
    if not host_view.flags.c_contiguous:
        raise ValueError(f"{where}: host_view must be C-contiguous")
    if host_writable and not host_view.flags.writeable:
        raise ValueError(f"{where}: host_view is read-only")
    dev_nbytes = dev.size * dev.dtype.itemsize
    if dev_nbytes != host_view.nbytes:
        raise ValueError(f"{where}: size mismatch: dev_view has {dev_nbytes} bytes, "
                         f"host_view has {host_view.nbytes}")
    # Byte views: the copy then needs no dtype or shape agreement, only the size.
    return dev.view(np.uint8), host_view.reshape(-1).view(np.uint8)


def to_host_async(dev_view, host_view: np.ndarray, stream=0) -> None:
    """Copy a device array into a host array of the same byte size, on ``stream``.

    Asynchronous when ``host_view`` is pinned (see :func:`pinned_empty`) and
    ``stream`` is not 0: synchronise the stream before reading ``host_view``.
    Dtypes may differ (the bytes are copied); both must be C-contiguous.
    """
    dev, host = _byte_views("to_host_async", dev_view, host_view, True)
    if dev.size:
        dev.copy_to_host(host, stream=stream)


def to_device_async(host_view: np.ndarray, dev_view, stream=0) -> None:
    """Copy a host array into a device array of the same byte size, on ``stream``.

    Asynchronous when ``host_view`` is pinned and ``stream`` is not 0: do not
    overwrite ``host_view`` before the stream has passed the copy.
    """
    dev, host = _byte_views("to_device_async", dev_view, host_view, False)
    if dev.size:
        dev.copy_to_device(host, stream=stream)
