"""The dtypes numcoll moves and reduces, and the rules for which op takes which.

float16 and bfloat16 (from ``ml_dtypes``) are reduced with float32 arithmetic:
kernels see them as uint16 bit patterns and convert on the fly, so nothing
depends on the CPU having F16C or on Numba's float16 support.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .ops import ReduceOp

__all__ = ["SUPPORTED_DTYPES", "bfloat16", "check_op_dtype", "is_half", "dtype_name"]

bfloat16 = np.dtype(ml_dtypes.bfloat16)

SUPPORTED_DTYPES: tuple[np.dtype, ...] = tuple(
    np.dtype(d)
    for d in (
        np.float16, bfloat16, np.float32, np.float64,
        np.int8, np.int16, np.int32, np.int64,
        np.uint8, np.uint16, np.uint32, np.uint64,
        np.bool_, np.complex64, np.complex128,
    )
)
_SUPPORTED = frozenset(SUPPORTED_DTYPES)


def is_half(dtype: np.dtype) -> bool:
    """True for the 16-bit floats that are reduced in float32 (float16, bfloat16)."""
    return dtype == np.float16 or dtype == bfloat16


def is_supported(dtype: np.dtype) -> bool:
    return np.dtype(dtype) in _SUPPORTED


def dtype_name(dtype: np.dtype) -> str:
    return "bfloat16" if dtype == bfloat16 else np.dtype(dtype).name


def check_op_dtype(op: ReduceOp, dtype: np.dtype, opname: str) -> None:
    """Raise ``ValueError``/``TypeError`` if ``op`` cannot reduce ``dtype``.

    Called on the caller's thread before the collective is queued.
    """
    if not isinstance(op, ReduceOp):
        raise TypeError(f"{opname}: reduce_op must be a numcoll.ReduceOp, got {op!r}")
    kind = np.dtype(dtype).kind
    if op.is_bitwise and kind not in "iub":
        raise ValueError(f"{opname}: Cannot use ReduceOp.{op.name} with non-integral dtype "
                         f"{dtype_name(dtype)}")
    if kind == "c" and op.name in ("MIN", "MAX"):
        raise ValueError(
            f"{opname}: ReduceOp.{op.name} is not defined for complex dtype {dtype_name(dtype)} "
            "(complex numbers have no order); use SUM, AVG or PRODUCT"
        )
    if op.name == "AVG" and kind in "iub":
        raise ValueError(
            f"{opname}: ReduceOp.AVG needs a floating point or complex dtype, got "
            f"{dtype_name(dtype)} (an integer average would have to round; use SUM and divide)"
        )
