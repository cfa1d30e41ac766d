"""The argument checks the CPU kernels (:mod:`.cpu`) and the CUDA kernels
(:mod:`numcoll.cuda.kernels`) share: one owner for every rule and message, so
the twins cannot drift. Each raises with the public function's name first
(``reduce_into: dtype mismatch: ...``); how an array is unwrapped (NumPy view,
device view) stays with each twin.
"""

from __future__ import annotations

from numbers import Real

import numpy as np

from ..dtypes import SUPPORTED_DTYPES, dtype_name, is_half, op_dtype_refusal
from ..ops import ReduceOp

__all__ = ["check_op", "check_dtype", "check_pair", "check_divisor", "check_conversion",
           "F32", "U16"]

F32 = np.dtype(np.float32)
U16 = np.dtype(np.uint16)
_SUPPORTED = frozenset(SUPPORTED_DTYPES)


def check_op(where: str, op) -> ReduceOp:
    if not isinstance(op, ReduceOp):
        raise TypeError(f"{where}: op must be a numcoll.ReduceOp, got {op!r}")
    return op


def check_dtype(where: str, dtype) -> np.dtype:
    """``dtype`` as a NumPy dtype numcoll reduces; ``TypeError`` otherwise."""
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


def check_pair(where: str, acc, x, expected=None) -> None:
    """An (acc, x) pair of a reduction: one supported dtype (``expected``'s, if
    given) and as many elements in each."""
    if expected is not None and acc.dtype != expected:
        raise TypeError(f"{where}: acc has dtype {dtype_name(acc.dtype)}, "
                        f"expected {dtype_name(expected)}")
    if acc.dtype != x.dtype:
        raise TypeError(f"{where}: dtype mismatch: acc is {dtype_name(acc.dtype)}, "
                        f"x is {dtype_name(x.dtype)}")
    check_dtype(where, acc.dtype)
    if acc.size != x.size:
        raise ValueError(f"{where}: size mismatch: acc has {acc.size} elements, "
                         f"x has {x.size}")


def check_divisor(where: str, divisor, dtype) -> np.dtype:
    """AVG's division of ``dtype`` by ``divisor``: a non-zero real, a dtype AVG takes."""
    if not isinstance(divisor, Real) or isinstance(divisor, (bool, np.bool_)):
        raise TypeError(f"{where}: divisor must be a real number, got {divisor!r}")
    if divisor == 0:
        raise ValueError(f"{where}: divisor must be non-zero")
    dtype = check_dtype(where, dtype)
    why = op_dtype_refusal("AVG", dtype)
    if why is not None:
        raise TypeError(f"{where}: cannot divide {dtype_name(dtype)} in place: {why}")
    return dtype


def check_conversion(where: str, src, out, widen: bool) -> None:
    """A float16/bfloat16 <-> float32 conversion: ``widen`` from half to float32,
    else from float32 to half; equal sizes."""
    half_src, half_out = is_half(src.dtype), is_half(out.dtype)
    ok = (half_src and out.dtype == F32) if widen else (src.dtype == F32 and half_out)
    if not ok:
        raise TypeError(f"{where}: converts float16/bfloat16 <-> float32 only, got src "
                        f"{dtype_name(src.dtype)} and out {dtype_name(out.dtype)}")
    if src.size != out.size:
        raise ValueError(f"{where}: size mismatch: src has {src.size} elements, "
                         f"out has {out.size}")
