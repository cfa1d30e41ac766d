"""CPU reduction kernels: ``acc[i] = op(acc[i], x[i])`` for every numcoll dtype.

The public functions validate their arguments (ndarray, dtype, size,
contiguity, writability) and then call private Numba kernels compiled with
``nogil=True`` (worker threads overlap reduction with transfers) and
``cache=True`` (the machine code is stored in ``__pycache__`` next to this file,
so only the first process on a machine pays the compile time).

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

float16 and bfloat16 never touch F16C or Numba's float16 type: the kernels see
the arrays as uint16 and convert each element to float32 and back with integer
bit manipulation (round to nearest even; inf, NaN and subnormals handled), so
a half reduction is the float32 operation rounded once.
"""

from __future__ import annotations

import threading
import time
from numbers import Real

import numba.core.cpu
import numpy as np
from llvmlite import ir
from numba import from_dtype, njit, types
from numba.extending import intrinsic, is_jitted

from ..dtypes import SUPPORTED_DTYPES, bfloat16, dtype_name, is_half
from ..ops import ReduceOp

__all__ = [
    "ReduceKernel",
    "compile_op",
    "narrow_into",
    "precompile",
    "reduce_into",
    "scale_into",
    "widen_into",
]

# nogil: worker threads overlap reductions with transfers. cache: see above.
# _nrt=False: the kernels allocate nothing, and without Numba's reference-counting
# runtime each array is unboxed without allocating a MemInfo, 0.1 us less per
# call (of about 0.2). It is an underscore option, so only where Numba has it.
_JIT = dict(nogil=True, cache=True)
if hasattr(numba.core.cpu.CPUTargetOptions, "_nrt"):
    _JIT["_nrt"] = False
_U16 = np.dtype(np.uint16)
_F32 = np.dtype(np.float32)
_SUPPORTED = frozenset(SUPPORTED_DTYPES)


# --------------------------------------------------------------------------
# Scalar building blocks: LLVM intrinsics, inlined into the loops
# --------------------------------------------------------------------------

def _extremum(which: str):
    """An intrinsic computing ``np.minimum`` / ``np.maximum`` of two equal-typed scalars.

    Floats use LLVM's ``llvm.minimum`` / ``llvm.maximum``, which propagate NaN
    as NumPy does and vectorise to vminps/vmaxps plus a NaN fix-up. Spelling it
    as a select instead lets LLVM turn ``acc[i] = a if ... else b`` into a
    masked store, about 5% slower on large, memory-bound arrays. Signed zeros
    order as -0.0 < +0.0 (NumPy returns its second operand when they tie).
    """
    float_name = f"llvm.{which}"
    keep_first = "<=" if which == "minimum" else ">="

    def typer(typingctx, a, b):
        if a != b or not isinstance(a, (types.Float, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            x, y = args
            if isinstance(sig.args[0], types.Float):
                fn = builder.module.declare_intrinsic(
                    float_name, [x.type], ir.FunctionType(x.type, [x.type, x.type]))
                return builder.call(fn, [x, y])
            compare = builder.icmp_signed if sig.args[0].signed else builder.icmp_unsigned
            return builder.select(compare(keep_first, x, y), x, y)

        return a(a, b), codegen

    typer.__name__ = f"_{which}"
    return intrinsic(typer)


_minimum = _extremum("minimum")
_maximum = _extremum("maximum")


# The float16/bfloat16 <-> float32 conversions are written in LLVM IR: Numba
# widens integer arithmetic to 64 bits, which keeps the vector loops in 64-bit
# lanes; in 32-bit IR they run 1.5-3x faster. Every branch is a select, so the
# loops that call them vectorise. The float16 bit tricks follow Fabian Giesen's
# public-domain half_to_float_fast4 and float_to_half_fast3_rtne.

_I32 = ir.IntType(32)
_F32_IR = ir.FloatType()


def _i32(value: int) -> ir.Constant:
    return ir.Constant(_I32, value)


@intrinsic
def _f16_to_f32(typingctx, h):
    """float16 bits (uint16) -> float32, exactly."""
    if h != types.uint16:
        return None

    def codegen(context, builder, sig, args):
        h = builder.zext(args[0], _I32)
        bits = builder.shl(builder.and_(h, _i32(0x7FFF)), _i32(13))   # exponent, mantissa
        exponent = builder.and_(bits, _i32(0x0F800000))
        bits = builder.add(bits, _i32((127 - 15) << 23))                # rebias
        normal = builder.bitcast(bits, _F32_IR)
        # inf / NaN: the exponent must become 255, not 31 + 112
        inf_nan = builder.bitcast(builder.add(bits, _i32((128 - 16) << 23)), _F32_IR)
        # zero / subnormal: set the implicit bit, then subtract it as a float
        # (2**-14), which renormalises exactly
        subnormal = builder.fsub(builder.bitcast(builder.add(bits, _i32(1 << 23)), _F32_IR),
                                 ir.Constant(_F32_IR, 2.0 ** -14))
        is_inf_nan = builder.icmp_unsigned("==", exponent, _i32(0x0F800000))
        is_subnormal = builder.icmp_unsigned("==", exponent, _i32(0))
        f = builder.select(is_inf_nan, inf_nan, builder.select(is_subnormal, subnormal, normal))
        sign = builder.shl(builder.and_(h, _i32(0x8000)), _i32(16))
        return builder.bitcast(builder.or_(builder.bitcast(f, _I32), sign), _F32_IR)

    return types.float32(h), codegen


@intrinsic
def _f32_to_f16(typingctx, f):
    """float32 -> float16 bits (uint16), rounded to nearest even."""
    if f != types.float32:
        return None

    def codegen(context, builder, sig, args):
        u = builder.bitcast(args[0], _I32)
        sign = builder.and_(builder.lshr(u, _i32(16)), _i32(0x8000))
        u = builder.and_(u, _i32(0x7FFFFFFF))
        # |f| >= 2**16 (or inf, NaN): inf; NaN keeps its top payload bits, made quiet
        nan = builder.or_(_i32(0x7E00), builder.and_(builder.lshr(u, _i32(13)), _i32(0x3FF)))
        big = builder.select(builder.icmp_unsigned(">", u, _i32(0x7F800000)), nan, _i32(0x7C00))
        # |f| < 2**-14: adding 0.5 puts the float16 subnormal grid (2**-24) at the
        # float32 mantissa's last bit, so the FPU's round-to-nearest-even rounds
        summed = builder.fadd(builder.bitcast(u, _F32_IR), ir.Constant(_F32_IR, 0.5))
        subnormal = builder.sub(builder.bitcast(summed, _I32), _i32(0x3F000000))
        # normal: rebias the exponent and round to nearest even (a carry out of
        # the mantissa bumps the exponent, up to inf)
        odd = builder.and_(builder.lshr(u, _i32(13)), _i32(1))
        rebiased = builder.add(u, _i32(0xFFF - ((127 - 15) << 23)))
        normal = builder.lshr(builder.add(rebiased, odd), _i32(13))
        h = builder.select(
            builder.icmp_unsigned(">=", u, _i32((127 + 16) << 23)), big,
            builder.select(builder.icmp_unsigned("<", u, _i32(113 << 23)), subnormal, normal))
        return builder.trunc(builder.or_(h, sign), ir.IntType(16))

    return types.uint16(f), codegen


@intrinsic
def _bf16_to_f32(typingctx, h):
    """bfloat16 bits (uint16) -> float32, exactly: they are its top 16 bits."""
    if h != types.uint16:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.shl(builder.zext(args[0], _I32), _i32(16)), _F32_IR)

    return types.float32(h), codegen


@intrinsic
def _f32_to_bf16(typingctx, f):
    """float32 -> bfloat16 bits (uint16), rounded to nearest even."""
    if f != types.float32:
        return None

    def codegen(context, builder, sig, args):
        u = builder.bitcast(args[0], _I32)
        high = builder.lshr(u, _i32(16))
        # A carry out of the mantissa correctly bumps the exponent (up to inf).
        odd = builder.and_(high, _i32(1))
        rounded = builder.lshr(builder.add(builder.add(u, _i32(0x7FFF)), odd), _i32(16))
        # NaN: rounding could carry it into inf or another sign; truncate, force quiet
        is_nan = builder.icmp_unsigned(">", builder.and_(u, _i32(0x7FFFFFFF)), _i32(0x7F800000))
        h = builder.select(is_nan, builder.or_(high, _i32(0x0040)), rounded)
        return builder.trunc(h, ir.IntType(16))

    return types.uint16(f), codegen


# --------------------------------------------------------------------------
# Built-in reduction kernels: one Python function per op, specialised by dtype
# --------------------------------------------------------------------------

@njit(inline="always")
def _aligned_parts(acc, x):
    """Split the operands where ``acc`` reaches a 64-byte boundary.

    Vector stores that straddle cache lines cost 10-15% once the arrays outgrow
    L2, and NumPy's allocator only promises 16-byte alignment; so the kernels
    run their loop on a short head, then on the aligned rest. Small arrays skip
    it (it costs ~30 ns).
    """
    head = 0
    if acc.size * acc.itemsize >= 4096:
        head = ((64 - (acc.ctypes.data & 63)) & 63) // acc.itemsize
    return ((acc[:head], x[:head]), (acc[head:], x[head:]))


@njit(**_JIT)
def _sum_kernel(acc, x):
    for a, b in _aligned_parts(acc, x):
        for i in range(a.size):
            a[i] += b[i]                       # integers wrap: the store truncates like NumPy


@njit(**_JIT)
def _prod_kernel(acc, x):
    for a, b in _aligned_parts(acc, x):
        for i in range(a.size):
            a[i] *= b[i]


@njit(**_JIT)
def _min_kernel(acc, x):
    for a, b in _aligned_parts(acc, x):
        for i in range(a.size):
            a[i] = _minimum(a[i], b[i])       # NaN wins, as in np.minimum


@njit(**_JIT)
def _max_kernel(acc, x):
    for a, b in _aligned_parts(acc, x):
        for i in range(a.size):
            a[i] = _maximum(a[i], b[i])


@njit(**_JIT)
def _band_kernel(acc, x):
    for a, b in _aligned_parts(acc, x):
        for i in range(a.size):
            a[i] &= b[i]


@njit(**_JIT)
def _bor_kernel(acc, x):
    for a, b in _aligned_parts(acc, x):
        for i in range(a.size):
            a[i] |= b[i]


@njit(**_JIT)
def _bxor_kernel(acc, x):
    for a, b in _aligned_parts(acc, x):
        for i in range(a.size):
            a[i] ^= b[i]


# Half kernels work on uint16 views. They are written out per format rather than
# generated by a factory: Numba's disk cache cannot key closures over jitted
# functions, so generated kernels would recompile in every process.

@njit(**_JIT)
def _f16_sum_kernel(acc, x):
    for i in range(acc.size):
        acc[i] = _f32_to_f16(_f16_to_f32(acc[i]) + _f16_to_f32(x[i]))


@njit(**_JIT)
def _f16_prod_kernel(acc, x):
    for i in range(acc.size):
        acc[i] = _f32_to_f16(_f16_to_f32(acc[i]) * _f16_to_f32(x[i]))


@njit(**_JIT)
def _f16_min_kernel(acc, x):
    for i in range(acc.size):
        acc[i] = _f32_to_f16(_minimum(_f16_to_f32(acc[i]), _f16_to_f32(x[i])))


@njit(**_JIT)
def _f16_max_kernel(acc, x):
    for i in range(acc.size):
        acc[i] = _f32_to_f16(_maximum(_f16_to_f32(acc[i]), _f16_to_f32(x[i])))


@njit(**_JIT)
def _bf16_sum_kernel(acc, x):
    for i in range(acc.size):
        acc[i] = _f32_to_bf16(_bf16_to_f32(acc[i]) + _bf16_to_f32(x[i]))


@njit(**_JIT)
def _bf16_prod_kernel(acc, x):
    for i in range(acc.size):
        acc[i] = _f32_to_bf16(_bf16_to_f32(acc[i]) * _bf16_to_f32(x[i]))


@njit(**_JIT)
def _bf16_min_kernel(acc, x):
    for i in range(acc.size):
        acc[i] = _f32_to_bf16(_minimum(_bf16_to_f32(acc[i]), _bf16_to_f32(x[i])))


@njit(**_JIT)
def _bf16_max_kernel(acc, x):
    for i in range(acc.size):
        acc[i] = _f32_to_bf16(_maximum(_bf16_to_f32(acc[i]), _bf16_to_f32(x[i])))


# --------------------------------------------------------------------------
# Conversions and AVG scaling
# --------------------------------------------------------------------------

@njit(**_JIT)
def _f16_widen_kernel(src, out):
    for i in range(src.size):
        out[i] = _f16_to_f32(src[i])


@njit(**_JIT)
def _bf16_widen_kernel(src, out):
    for i in range(src.size):
        out[i] = _bf16_to_f32(src[i])


@njit(**_JIT)
def _f16_narrow_kernel(src, out):
    for i in range(src.size):
        out[i] = _f32_to_f16(src[i])


@njit(**_JIT)
def _bf16_narrow_kernel(src, out):
    for i in range(src.size):
        out[i] = _f32_to_bf16(src[i])


@njit(**_JIT)
def _scale_kernel(acc, divisor):
    for i in range(acc.size):
        acc[i] /= divisor


@njit(**_JIT)
def _f16_scale_kernel(acc, divisor):
    for i in range(acc.size):
        acc[i] = _f32_to_f16(_f16_to_f32(acc[i]) / divisor)


@njit(**_JIT)
def _bf16_scale_kernel(acc, divisor):
    for i in range(acc.size):
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


# --------------------------------------------------------------------------
# Compilation and memoisation
# --------------------------------------------------------------------------

_lock = threading.Lock()
_entries: dict = {}           # (dispatcher, argument description) -> entry point
_custom_dispatchers: dict = {}  # (op, "plain" | "float16" | "bfloat16") -> dispatcher
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


def _custom_dispatcher(op: ReduceOp, dtype: np.dtype):
    """The elementwise loop around ``op.fn`` for ``dtype`` (half dtypes: in float32)."""
    flavour = dtype_name(dtype) if is_half(dtype) else "plain"
    dispatcher = _custom_dispatchers.get((op, flavour))
    if dispatcher is not None:
        return dispatcher
    fn = op.fn if is_jitted(op.fn) else njit(op.fn)
    # No cache=True: the closure holds a dispatcher, which Numba's disk cache
    # cannot key across processes (each process would add a stale entry).
    if flavour == "plain":
        @njit(nogil=True)
        def _custom_kernel(acc, x):
            for i in range(acc.size):
                acc[i] = fn(acc[i], x[i])
    elif flavour == "bfloat16":
        @njit(nogil=True)
        def _custom_kernel(acc, x):
            for i in range(acc.size):
                acc[i] = _f32_to_bf16(np.float32(fn(_bf16_to_f32(acc[i]), _bf16_to_f32(x[i]))))
    else:
        @njit(nogil=True)
        def _custom_kernel(acc, x):
            for i in range(acc.size):
                acc[i] = _f32_to_f16(np.float32(fn(_f16_to_f32(acc[i]), _f16_to_f32(x[i]))))
    _custom_dispatchers[(op, flavour)] = _custom_kernel
    return _custom_kernel


def _check_dtype(where: str, dtype) -> np.dtype:
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{where}: {dtype!r} is not a dtype") from None
    if dtype not in _SUPPORTED:
        order = " (non-native byte order)" if not dtype.isnative else ""
        raise TypeError(
            f"{where}: unsupported dtype {dtype}{order}; numcoll reduces "
            + ", ".join(dtype_name(d) for d in SUPPORTED_DTYPES)
        )
    return dtype


def _builtin_dispatcher(op: ReduceOp, dtype: np.dtype):
    name = "SUM" if op.name == "AVG" else op.name     # the caller divides by the count
    kind = dtype.kind
    if is_half(dtype):
        dispatcher = _HALF_KERNELS.get((dtype, name))
    elif kind == "b":
        dispatcher = _BOOL_KERNELS[name]
    elif kind == "c" and name not in ("SUM", "PRODUCT"):
        raise TypeError(
            f"ReduceOp.{op.name} cannot reduce {dtype_name(dtype)}: complex numbers have no "
            "order and no bits to combine; use SUM, AVG or PRODUCT"
        )
    elif kind == "f" and op.is_bitwise:
        dispatcher = None
    else:
        dispatcher = _KERNELS[name]
    if dispatcher is None:
        raise TypeError(
            f"ReduceOp.{op.name} cannot reduce {dtype_name(dtype)}: "
            "bitwise ops take integer and bool dtypes only"
        )
    return dispatcher


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

    __slots__ = ("op", "dtype", "compile_seconds", "_entry", "_view")

    def __init__(self, op, dtype, entry, view, compile_seconds):
        self.op = op
        self.dtype = dtype
        self.compile_seconds = compile_seconds
        self._entry = entry
        self._view = view            # uint16 for half dtypes, else None

    def __repr__(self):
        return f"<ReduceKernel {self.op!r} {dtype_name(self.dtype)}>"

    def __call__(self, acc: np.ndarray, x: np.ndarray) -> None:
        # The fast path checks, in a few attribute reads, everything the entry
        # point relies on (it unboxes without checking); the rest goes through
        # _checked, which explains what is wrong. Mirrored in reduce_into.
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
    if not isinstance(op, ReduceOp):
        raise TypeError(f"compile_op: op must be a numcoll.ReduceOp, got {op!r}")
    dtype = _check_dtype("compile_op", dtype)
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
    if dtype is not None and acc.dtype != dtype:
        raise TypeError(f"{where}: acc has dtype {dtype_name(acc.dtype)}, "
                        f"expected {dtype_name(dtype)}")
    if acc.dtype != x.dtype:
        raise TypeError(f"{where}: dtype mismatch: acc is {dtype_name(acc.dtype)}, "
                        f"x is {dtype_name(x.dtype)}")
    if acc.size != x.size:
        raise ValueError(f"{where}: size mismatch: acc has {acc.size} elements, "
                         f"x has {x.size}")
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
    # Per-call overhead matters for small messages, so this inlines
    # ReduceKernel.__call__'s fast path rather than calling it.
    try:
        kernel = _by_op_id[id(op)][acc.dtype]
        fx = x.flags
        fast = (acc.flags.carray and fx.c_contiguous and fx.aligned
                and acc.ndim == 1 == x.ndim and len(acc) == len(x)
                and (x.dtype is acc.dtype or x.dtype == acc.dtype))
    except (KeyError, AttributeError, TypeError):
        fast = False
    if not fast:
        _check_arrays("reduce_into", acc=acc, x=x)
        compile_op(op, acc.dtype)._checked(acc, x)
    elif kernel._view is None:
        kernel._entry(acc, x)
    else:
        kernel._entry(acc.view(kernel._view), x.view(kernel._view))


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
    if not isinstance(divisor, Real) or isinstance(divisor, (bool, np.bool_)):
        raise TypeError(f"scale_into: divisor must be a real number, got {divisor!r}")
    if divisor == 0:
        raise ValueError("scale_into: divisor must be non-zero")
    dtype = _check_dtype("scale_into", acc.dtype)
    if dtype.kind not in "fc" and not is_half(dtype):
        raise TypeError(
            f"scale_into: cannot divide {dtype_name(dtype)} in place (an integer average "
            "would have to round); AVG needs a floating point or complex dtype"
        )
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


def _convert(where: str, kernels: dict, src, out, src_ok, out_ok) -> None:
    try:
        entry = _conversions[(id(kernels), src.dtype, out.dtype)]
    except (KeyError, AttributeError, TypeError):
        entry = None
    if entry is not None and _is_plain(out, src):
        entry(src.view(_U16) if src.dtype != _F32 else src,
              out.view(_U16) if out.dtype != _F32 else out)
        return
    _check_arrays(where, src=src, out=out)
    if not (src_ok(src.dtype) and out_ok(out.dtype)):
        raise TypeError(
            f"{where}: converts float16/bfloat16 <-> float32 only, got src "
            f"{dtype_name(src.dtype)} and out {dtype_name(out.dtype)}"
        )
    if src.size != out.size:
        raise ValueError(f"{where}: size mismatch: src has {src.size} elements, "
                         f"out has {out.size}")
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
    _convert("widen_into", _WIDEN, src, out_f32, is_half, lambda d: d == _F32)


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
    _convert("narrow_into", _NARROW, src_f32, out, lambda d: d == _F32, is_half)


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
