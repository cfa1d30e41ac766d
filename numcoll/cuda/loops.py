"""The CUDA kernels behind :mod:`.cuda`: grid-stride loops and the device functions they call.

Everything here is private: :mod:`.cuda` validates the arguments and launches
these kernels. Each reduces ``x`` into ``acc`` elementwise, or converts or
scales one array, in a grid-stride loop; :func:`_builtin_kernel` and
:func:`_custom_kernel`, at the end, pick the kernel for an ``(op, dtype)``.

The kernels share this one file with every device function they call on
purpose: Numba's disk cache (``cache=True``) checks only the timestamp of the
file that defines a kernel, so a kernel cached here would not be recompiled
after a change to a device function defined in another file.

Like every CUDA module of numcoll, import it lazily (it loads ``numba.cuda``).
"""

from __future__ import annotations

import numpy as np

from ..dtypes import bfloat16, is_half
from ..ops import ReduceOp
from ..kernels.selection import loop_tables, pick_builtin

# cuda: for the kernels and device functions, and swapped by the simulator while
# they run; host code here calls numba.cuda only through _jit (see device).
from .device import _SIMULATED, _jit, cuda

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


# Bit-exact ports of the conversions in kernels/cpu_loops.py (see there for the
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
# a factory) so that the disk cache can key them, as in kernels/cpu_loops.py.

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


_KERNELS, _HALF_KERNELS, _BOOL_KERNELS, _WIDEN, _NARROW, _SCALE_HALF = loop_tables(globals())


def _builtin_kernel(op: ReduceOp, dtype: np.dtype):
    """The kernel for a built-in ``op`` on ``dtype``; TypeError if it has none."""
    return pick_builtin(op, dtype, _KERNELS, _HALF_KERNELS, _BOOL_KERNELS)


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
