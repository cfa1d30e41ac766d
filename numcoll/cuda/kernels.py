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

This module validates, compiles, memoises and launches. The kernels are in
:mod:`.loops`, the import of ``numba.cuda`` and the device-array checks
in :mod:`.device`, and the pinned buffers and copies (re-exported here)
in :mod:`.copies`.
"""

from __future__ import annotations

import threading
import time
from numbers import Real

import numpy as np

from .. import config
from ..dtypes import dtype_name, is_half
from ..errors import NumcollError
from ..kernels.checks import F32 as _F32, U16 as _U16
from ..kernels.checks import check_conversion, check_divisor, check_dtype, check_op, check_pair
from ..ops import ReduceOp
from .device import (
    _DRIVER_ERRORS,
    _SIMULATED,
    _as_device,
    _flat,
    _reason,
    _to_device,
    is_available,
)
from .loops import (
    _NARROW,
    _SCALE_HALF,
    _WIDEN,
    _builtin_kernel,
    _custom_kernel,
    _scale_kernel,
)
from .copies import pinned_empty, to_device_async, to_host_async

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

#: The default launch shape (config ``cuda_threads`` / ``cuda_blocks``, read at each launch).
THREADS_PER_BLOCK = config.Config.cuda_threads
MAX_BLOCKS = config.Config.cuda_blocks


# The simulator keeps a kernel's launch shape on the shared kernel object and
# allows one simulated kernel at a time in the process, so launches from
# several worker threads must take turns. Real launches need no lock.
_SIM_LAUNCH_LOCK = threading.Lock()


# --------------------------------------------------------------------------
# Launching
# --------------------------------------------------------------------------

def _launch_shape(count: int) -> tuple[int, int]:
    """(blocks, threads) for ``count`` elements (config ``cuda_threads``, ``cuda_blocks``)."""
    threads = config.get("cuda_threads")
    max_blocks = config.get("cuda_blocks")
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
# Validation (device-array views: device)
# --------------------------------------------------------------------------

def _operands(where: str, acc, x):
    """Check an (acc, x) pair for a reduction; return both as flat device views."""
    acc_d = _as_device(where, "acc", acc, writable=True)
    x_d = _as_device(where, "x", x)
    check_pair(where, acc_d, x_d)
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
        check_pair("reduce_into", acc_d, x_d, self.dtype)
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


#: What works together (the ``cuda`` extra pins these): numba-cuda 0.30 calls
#: ``np.row_stack``, which NumPy 2.5 removed.
SUPPORTED_TOOLCHAIN = "numba-cuda>=0.20,<0.31 with numpy<2.5"


def _toolchain_error(op: ReduceOp, dtype: np.dtype, exc: Exception) -> NumcollError:
    """The one error for a numba.cuda that cannot compile numcoll's built-in kernels."""
    import numba

    try:
        from importlib.metadata import version
        numba_cuda = version("numba-cuda")
    except Exception:  # noqa: BLE001 - not installed as a distribution: numba's own
        numba_cuda = "not installed (numba's built-in numba.cuda)"
    return NumcollError(
        f"numba.cuda cannot compile numcoll's {op!r} kernel for {dtype_name(dtype)} "
        f"({type(exc).__name__}: {_reason(exc)}); this installation has numba "
        f"{numba.__version__}, numba-cuda {numba_cuda}, numpy {np.__version__}. "
        f'Install versions that work together: pip install "numcoll[cuda]" '
        f"({SUPPORTED_TOOLCHAIN})")


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
    NumcollError
        If numba.cuda cannot compile numcoll's own (built-in) kernels: an
        installation whose versions do not work together; the message names
        the versions found and what to install.
    """
    check_op("compile_op", op)
    dtype = check_dtype("compile_op", dtype)
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
        try:
            _trial_launch(launchable, kernel_dtype, dtype)
        except _DRIVER_ERRORS:
            raise                               # no usable device: the driver says so
        except Exception as exc:  # noqa: BLE001 - numcoll's own kernels must compile
            raise _toolchain_error(op, dtype, exc) from exc
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
    check_op("reduce_into", op)
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
    dtype = check_divisor("scale_into", divisor, dev.dtype)
    work = _flat("scale_into", "acc", dev)
    if is_half(dtype):
        _launch(_SCALE_HALF[dtype], work.size, stream, work.view(_U16), np.float32(divisor))
    else:
        real = np.dtype(dtype.char.lower())             # complex64 -> float32 pairs, ...
        parts = work.view(real) if real != dtype else work
        _launch(_scale_kernel, parts.size, stream, parts, real.type(divisor))


def _convert(where: str, kernels: dict, src, out, widen: bool, stream) -> None:
    src_d = _as_device(where, "src", src)
    out_d = _as_device(where, "out", out, writable=True)
    check_conversion(where, src_d, out_d, widen)
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
    _convert("widen_into", _WIDEN, src, out, True, stream)


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
    _convert("narrow_into", _NARROW, src, out, False, stream)
