"""The CPU loops behind :mod:`.cpu`: Numba kernels and the LLVM-IR scalar ops they inline.

Everything here is private: :mod:`.cpu` validates the arguments, compiles a
loop for one signature and calls it. Each loop reduces ``x`` into ``acc``
elementwise, or converts or scales one array; :func:`_builtin_dispatcher` and
:func:`_custom_dispatcher`, at the end, pick the loop for an ``(op, dtype)``.

The loops share this one file with every function they inline on purpose:
Numba's disk cache (``cache=True``) checks only the timestamp of the file that
defines a kernel, so a loop cached here would not be recompiled after a change
to a scalar op defined in another file.

float16 and bfloat16 never touch F16C or Numba's float16 type: the kernels see
the arrays as uint16 and convert each element to float32 and back with integer
bit manipulation (round to nearest even; inf, NaN and subnormals handled), so
a half reduction is the float32 operation rounded once.
"""

from __future__ import annotations

import numba.core.cpu
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, is_jitted

from ..dtypes import dtype_name, is_half
from ..ops import ReduceOp
from .selection import loop_tables, pick_builtin

# nogil: worker threads overlap reductions with transfers. cache: only the
# first process on a machine compiles (see .cpu for the timings).
# _nrt=False: the kernels allocate nothing, and without Numba's reference-counting
# runtime each array is unboxed without allocating a MemInfo, 0.1 us less per
# call (of about 0.2). It is an underscore option, so only where Numba has it.
_JIT = dict(nogil=True, cache=True)
if hasattr(numba.core.cpu.CPUTargetOptions, "_nrt"):
    _JIT["_nrt"] = False


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


_KERNELS, _HALF_KERNELS, _BOOL_KERNELS, _WIDEN, _NARROW, _SCALE_HALF = loop_tables(globals())


# --------------------------------------------------------------------------
# Choosing the loop for an (op, dtype) pair
# --------------------------------------------------------------------------

_custom_dispatchers: dict = {}  # (op, "plain" | "float16" | "bfloat16") -> dispatcher


def _builtin_dispatcher(op: ReduceOp, dtype: np.dtype):
    """The cached loop for a built-in ``op`` on ``dtype``; TypeError if it has none."""
    return pick_builtin(op, dtype, _KERNELS, _HALF_KERNELS, _BOOL_KERNELS)


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
