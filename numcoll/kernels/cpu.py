"""CPU reduction kernels: ``acc[i] = op(acc[i], x[i])`` for every numcoll dtype.

The public functions validate their arguments (ndarray, dtype, size,
contiguity, writability) and then call private Numba kernels, the loops in
:mod:`.cpu_loops`, compiled with ``nogil=True`` (worker threads overlap
reduction with transfers) and ``cache=True`` (the machine code is stored in
``__pycache__`` next to :mod:`.cpu_loops`, so only the first process on a
machine pays the compile time).

Compilation is lazy and per ``(op, dtype)``: :func:`compile_op` compiles one
pair (or loads it from the cache) and memoises it for the process. Each kernel
is compiled for exactly one signature -- ``acc`` writable, ``x`` read-only --
and called through its entry point: a writable ``x`` is passed to the
read-only variant as is, so a pair never costs two specialisations, and the
call skips Numba's type dispatch (the wrappers have already checked the types).

Measured on the 2-core AMD EPYC (AVX-512) development machine, Numba 0.68.1:

* cold compile: 0.1-0.5 s per ``(op, dtype)`` pair; all 87 specialisations
  (every built-in pair plus the half conversions and scaling, see
  :func:`precompile`) about 12 s;
* warm, from the disk cache: ``import numcoll.kernels.cpu`` 0.3 s (mostly
  ``import numba``); the first kernel loaded 0.3 s (Numba sets up LLVM once per
  process), every further pair about 2 ms; all 87 together 0.2 s;
* a user-defined op (:meth:`ReduceOp.custom`) is compiled in every process --
  Numba's disk cache cannot key a kernel that closes over the user's function --
  at 0.1-0.3 s per dtype on first use;
* per call, a kernel costs 0.13 us and the argument checks in front of it
  about 0.3 us, where NumPy's in-place ufunc costs 0.36 us in all: NumPy wins
  on 1 KiB (0.7 vs 0.55 us), from 64 KiB on the two are even (memory bound at
  1 MiB and beyond), and float16 is 2.5-12x faster than NumPy's.

float16 and bfloat16 are reduced in float32 and rounded once, with integer bit
manipulation rather than F16C (see :mod:`.cpu_loops`).
"""

from __future__ import annotations

import threading
import time
from numbers import Real

import numpy as np
from numba import from_dtype, types

from ..dtypes import SUPPORTED_DTYPES, dtype_name, is_half
from ..ops import ReduceOp
from .checks import F32 as _F32, U16 as _U16
from .checks import check_conversion, check_divisor, check_dtype, check_op, check_pair
from .cpu_loops import (
    _NARROW,
    _SCALE_HALF,
    _WIDEN,
    _builtin_dispatcher,
    _custom_dispatcher,
    _scale_kernel,
)

__all__ = [
    "ReduceKernel",
    "compile_op",
    "narrow_into",
    "precompile",
    "reduce_into",
    "scale_into",
    "widen_into",
]



# --------------------------------------------------------------------------
# Compilation and memoisation
# --------------------------------------------------------------------------

_lock = threading.Lock()
_entries: dict = {}           # (dispatcher, argument description) -> entry point
# id(op) -> {dtype: ReduceKernel}. Keyed by id() because ReduceOp.__hash__ is
# Python code, too slow for the per-call lookup; every ReduceKernel holds its op,
# so a memoised id can never be reused by another object.
_by_op_id: dict[int, dict[np.dtype, "ReduceKernel"]] = {}


def _entry(dispatcher, *args: tuple[np.dtype, bool] | np.dtype):
    """Compile (or load from the disk cache) one signature; return its entry point.

    ``args`` describe the arguments: ``(dtype, readonly)`` for a 1-D C array,
    a bare dtype for a scalar. Memoised on that description, because building
    Numba types costs microseconds. The entry point unboxes its arguments as
    the signature says without checking them, so callers must have validated
    dtype, layout and size.
    """
    key = (dispatcher, args)
    entry = _entries.get(key)
    if entry is None:
        with _lock:
            entry = _entries.get(key)
            if entry is None:
                argtypes = tuple(
                    types.Array(from_dtype(a[0]), 1, "C", readonly=a[1])
                    if isinstance(a, tuple) else from_dtype(a) for a in args)
                entry = _entries[key] = dispatcher.compile(argtypes)
    return entry


class ReduceKernel:
    """``op`` compiled for ``dtype``: call it as ``kernel(acc, x)`` to reduce ``x`` into ``acc``.

    Returned by :func:`compile_op`. The call checks its arguments exactly as
    :func:`reduce_into` does (and that they have this kernel's dtype).

    Attributes
    ----------
    op : ReduceOp
    dtype : numpy.dtype
    compile_seconds : float
        Wall time :func:`compile_op` spent compiling or loading from the disk cache.
    """

    __slots__ = ("op", "dtype", "compile_seconds", "unchecked", "plain_sum", "_entry", "_view")

    def __init__(self, op, dtype, entry, view, compile_seconds):
        self.op = op
        self.dtype = dtype
        self.compile_seconds = compile_seconds
        self._entry = entry
        self._view = view            # uint16 for half dtypes, else None
        #: The compiled entry point itself, for callers that guarantee what the
        #: checks in ``__call__`` verify (1-D, C-contiguous, aligned operands of
        #: equal length and this dtype): numcoll's own work buffers. None for
        #: 16-bit floats, whose bits must be viewed as uint16 first.
        self.unchecked = entry if view is None else None
        #: True where the kernel is ``acc[i] += x[i]`` and nothing else (SUM, or
        #: AVG before its division, of ints, floats and complex but 16-bit
        #: floats and bool): compiled code elsewhere may add in its place.
        self.plain_sum = (op is ReduceOp.SUM or op is ReduceOp.AVG) and view is None \
            and np.dtype(dtype).kind in "iufc"

    def __repr__(self):
        return f"<ReduceKernel {self.op!r} {dtype_name(self.dtype)}>"

    def __call__(self, acc: np.ndarray, x: np.ndarray) -> None:
        # The fast path checks, in a few attribute reads, everything the entry
        # point relies on (it unboxes without checking); the rest goes through
        # _checked, which explains what is wrong.
        try:
            fx = x.flags
            fast = (acc.flags.carray and fx.c_contiguous and fx.aligned
                    and acc.ndim == 1 == x.ndim and len(acc) == len(x)
                    and (acc.dtype is self.dtype or acc.dtype == self.dtype)
                    and (x.dtype is self.dtype or x.dtype == self.dtype))
        except (AttributeError, TypeError):
            fast = False
        if not fast:
            self._checked(acc, x)
        elif self._view is None:
            self._entry(acc, x)
        else:
            self._entry(acc.view(self._view), x.view(self._view))

    def _checked(self, acc, x) -> None:
        work, x = _operands("reduce_into", acc, x, self.dtype)
        if self._view is not None:
            self._entry(work.view(self._view), x.view(self._view))
        else:
            self._entry(work, x)
        _write_back(work, acc)


def compile_op(op: ReduceOp, dtype) -> ReduceKernel:
    """Compile ``op`` for ``dtype`` now (or load it from the disk cache) and memoise it.

    The collective layer calls this on the caller's thread before queueing
    work, so an op that cannot reduce the dtype fails at the call on every rank.

    Parameters
    ----------
    op : ReduceOp
        A built-in op or one from :meth:`ReduceOp.custom`. AVG compiles to SUM.
    dtype : numpy.dtype or dtype-like
        One of :data:`numcoll.dtypes.SUPPORTED_DTYPES`.

    Returns
    -------
    ReduceKernel
        Callable as ``kernel(acc, x)``.

    Raises
    ------
    TypeError
        If ``op`` is not a ReduceOp, the dtype is unsupported, the op is not
        defined for the dtype (bitwise on floats, MIN/MAX/bitwise on complex),
        or a custom function does not compile for it; the message names the
        op and the dtype.
    """
    try:
        return _by_op_id[id(op)][dtype]
    except (KeyError, TypeError):                       # TypeError: an unhashable "dtype"
        pass
    check_op("compile_op", op)
    dtype = check_dtype("compile_op", dtype)
    view = _U16 if is_half(dtype) else None
    kernel_dtype = view if view is not None else dtype
    start = time.perf_counter()
    if op.is_custom:
        try:
            dispatcher = _custom_dispatcher(op, dtype)
            entry = _entry(dispatcher, (kernel_dtype, False), (kernel_dtype, True))
        except Exception as exc:  # Numba raises many kinds; all mean "does not compile"
            how = " (reduced in float32)" if view is not None else ""
            first = str(exc).strip().splitlines()
            raise TypeError(
                f"{op!r} cannot reduce dtype {dtype_name(dtype)}{how}: its function does not "
                f"compile with Numba for {dtype_name(_F32 if view is not None else dtype)} "
                f"arguments: {first[0] if first else type(exc).__name__}"
            ) from exc
    else:
        dispatcher = _builtin_dispatcher(op, dtype)
        entry = _entry(dispatcher, (kernel_dtype, False), (kernel_dtype, True))
    kernel = ReduceKernel(op, dtype, entry, view, time.perf_counter() - start)
    with _lock:
        kernel = _by_op_id.setdefault(id(op), {}).setdefault(dtype, kernel)
    return kernel


# --------------------------------------------------------------------------
# Validation and public entry points
# --------------------------------------------------------------------------

def _flat(where: str, name: str, arr: np.ndarray, writable: bool) -> np.ndarray:
    """``arr`` as an aligned 1-D base-class ndarray: a view, or a copy if misaligned."""
    if not arr.flags.c_contiguous:
        raise ValueError(
            f"{where}: {name} must be C-contiguous, got shape {arr.shape} with strides "
            f"{arr.strides}; use np.ascontiguousarray(...) (and copy the result back)"
        )
    if writable and not arr.flags.writeable:
        raise ValueError(f"{where}: {name} is read-only")
    # reshape(-1) of a C-contiguous array is a view; view(np.ndarray) drops subclasses.
    flat = arr.reshape(-1).view(np.ndarray)
    # The kernels assume natural alignment, which a frame sliced at an odd offset
    # may lack. A copied output is written back by _write_back.
    return flat if flat.flags.aligned else flat.copy()


def _write_back(work: np.ndarray, out: np.ndarray) -> None:
    if work.base is None:                               # _flat's aligned copy, not a view
        out.reshape(-1)[...] = work


def _check_arrays(where: str, **arrays) -> None:
    for name, arr in arrays.items():
        if not isinstance(arr, np.ndarray):
            raise TypeError(
                f"{where}: {name} must be a numpy.ndarray, got {type(arr).__name__} "
                "(wrap buffers with np.frombuffer / np.asarray first)"
            )


def _operands(where: str, acc, x, dtype=None):
    """Check an (acc, x) pair for a reduction; return both via :func:`_flat`."""
    _check_arrays(where, acc=acc, x=x)
    check_pair(where, acc, x, dtype)
    return _flat(where, "acc", acc, True), _flat(where, "x", x, False)


def reduce_into(op: ReduceOp, acc: np.ndarray, x: np.ndarray) -> None:
    """Reduce ``x`` into ``acc`` in place: ``acc[i] = op(acc[i], x[i])``.

    Parameters
    ----------
    op : ReduceOp
        SUM, PRODUCT, MIN, MAX, AVG (reduces like SUM; finish with
        :func:`scale_into`), BAND, BOR, BXOR or a :meth:`ReduceOp.custom` op.
    acc : numpy.ndarray
        Writable, C-contiguous, any shape; one of the supported dtypes.
    x : numpy.ndarray
        Same dtype and number of elements as ``acc``, C-contiguous; may be
        read-only (e.g. ``np.frombuffer`` over a received frame). ``acc`` and
        ``x`` may be the same array but must not otherwise overlap.

    Notes
    -----
    Integers wrap like NumPy. MIN/MAX propagate NaN like ``np.minimum`` /
    ``np.maximum``. bool: SUM and MAX are logical or, PRODUCT and MIN logical
    and. float16/bfloat16: each element is computed in float32 and rounded
    once (round to nearest even).

    Raises
    ------
    TypeError
        Wrong argument types, mismatched or unsupported dtypes, an op that is
        not defined for the dtype.
    ValueError
        Mismatched sizes, non-contiguous arrays, read-only ``acc``.
    """
    try:
        kernel = _by_op_id[id(op)][acc.dtype]
    except (KeyError, AttributeError, TypeError):
        _check_arrays("reduce_into", acc=acc, x=x)
        kernel = compile_op(op, acc.dtype)
    kernel(acc, x)


def _is_plain(out, src) -> bool:
    """Whether ``out`` and ``src`` need no reshaping, copying or explaining:
    1-D, C-contiguous and aligned ndarrays of equal length, ``out`` writable."""
    try:
        fs = src.flags
        return bool(out.flags.carray and fs.c_contiguous and fs.aligned
                    and out.ndim == 1 == src.ndim and len(out) == len(src))
    except (AttributeError, TypeError):
        return False


_scales: dict = {}        # dtype -> (entry point, view dtype, divisor type); see scale_into


def scale_into(acc: np.ndarray, divisor: Real) -> None:
    """Divide ``acc`` in place by a real ``divisor`` (the AVG finalisation).

    Floats divide in their own precision (``divisor`` is converted to the
    dtype first, as NumPy does for a Python scalar). float16/bfloat16 divide in
    float32 and round once. complex divides the real and imaginary parts by
    ``divisor``: correctly rounded, where NumPy's complex division can be 1 ulp
    off, and a -0.0 part stays -0.0.

    Raises
    ------
    TypeError
        For integer and bool dtypes (an integer average would have to round)
        or a divisor that is not a real number.
    ValueError
        For a zero divisor, or an ``acc`` that is not a writable C-contiguous array.
    """
    try:
        entry, view, scalar = _scales[acc.dtype]
        fast = type(divisor) in (int, float) and divisor != 0 and _is_plain(acc, acc)
    except (KeyError, AttributeError, TypeError):
        fast = False
    if fast:
        entry(acc.view(view), scalar(divisor))
        return
    _check_arrays("scale_into", acc=acc)
    dtype = check_divisor("scale_into", divisor, acc.dtype)
    if is_half(dtype):
        entry, view, scalar = _entry(_SCALE_HALF[dtype], (_U16, False), _F32), _U16, np.float32
    else:
        real = np.dtype(dtype.char.lower())             # complex64 -> float32 pairs, ...
        entry, view, scalar = _entry(_scale_kernel, (real, False), real), real, real.type
    _scales[dtype] = entry, view, scalar
    work = _flat("scale_into", "acc", acc, True)
    entry(work.view(view), scalar(divisor))
    _write_back(work, acc)


_conversions: dict = {}   # (kernels id, src dtype, out dtype) -> entry point; see _convert


def _convert(where: str, kernels: dict, src, out, widen: bool) -> None:
    try:
        entry = _conversions[(id(kernels), src.dtype, out.dtype)]
    except (KeyError, AttributeError, TypeError):
        entry = None
    if entry is not None and _is_plain(out, src):
        entry(src.view(_U16) if src.dtype != _F32 else src,
              out.view(_U16) if out.dtype != _F32 else out)
        return
    _check_arrays(where, src=src, out=out)
    check_conversion(where, src, out, widen)
    source = _flat(where, "src", src, False)
    work = _flat(where, "out", out, True)
    half = src.dtype if is_half(src.dtype) else out.dtype
    source_bits = source.view(_U16) if is_half(source.dtype) else source
    work_bits = work.view(_U16) if is_half(work.dtype) else work
    entry = _entry(kernels[half], (source_bits.dtype, True), (work_bits.dtype, False))
    _conversions[(id(kernels), src.dtype, out.dtype)] = entry
    entry(source_bits, work_bits)
    _write_back(work, out)


def widen_into(src: np.ndarray, out_f32: np.ndarray) -> None:
    """Convert a float16 or bfloat16 array to float32, exactly, into ``out_f32``.

    Raises
    ------
    TypeError
        If ``src`` is not float16/bfloat16 or ``out_f32`` is not float32.
    ValueError
        Mismatched sizes, non-contiguous arrays or a read-only ``out_f32``.
    """
    _convert("widen_into", _WIDEN, src, out_f32, widen=True)


def narrow_into(src_f32: np.ndarray, out: np.ndarray) -> None:
    """Round a float32 array to float16 or bfloat16 (nearest even) into ``out``.

    Values beyond the format's range become inf; NaN stays NaN (quiet, sign
    and leading payload bits kept).

    Raises
    ------
    TypeError
        If ``src_f32`` is not float32 or ``out`` is not float16/bfloat16.
    ValueError
        Mismatched sizes, non-contiguous arrays or a read-only ``out``.
    """
    _convert("narrow_into", _NARROW, src_f32, out, widen=False)


def precompile(ops=None, dtypes=None) -> float:
    """Compile (or load from the disk cache) the built-in kernels ahead of use.

    Parameters
    ----------
    ops : iterable of ReduceOp, optional
        Default: every built-in op.
    dtypes : iterable of dtype-like, optional
        Default: every supported dtype. Half dtypes also get their
        widen/narrow/scale kernels, float and complex dtypes their scale kernel.

    Returns
    -------
    float
        Seconds spent. Pairs an op does not support are skipped.
    """
    start = time.perf_counter()
    ops = [getattr(ReduceOp, n) for n in ReduceOp._BUILTIN_NAMES] if ops is None else list(ops)
    dtypes = SUPPORTED_DTYPES if dtypes is None else [np.dtype(d) for d in dtypes]
    for dtype in dtypes:
        for op in ops:
            try:
                compile_op(op, dtype)
            except TypeError:
                pass
        if is_half(dtype):
            widen_into(np.zeros(1, dtype), np.zeros(1, _F32))
            narrow_into(np.zeros(1, _F32), np.zeros(1, dtype))
        if dtype.kind in "fc" or is_half(dtype):
            scale_into(np.ones(1, dtype), 1)
    return time.perf_counter() - start
