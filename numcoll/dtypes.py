"""The dtypes numcoll moves and reduces, and the rules for which op takes which.

float16 and bfloat16 (from ``ml_dtypes``) are reduced with float32 arithmetic:
kernels see them as uint16 bit patterns and convert on the fly, so nothing
depends on the CPU having F16C or on Numba's float16 support.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .ops import ReduceOp

__all__ = ["SUPPORTED_DTYPES", "bfloat16", "check_op_dtype", "op_dtype_refusal", "is_half",
           "dtype_name"]

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


def op_dtype_refusal(op_name: str, dtype: np.dtype) -> str | None:
    """Why the op named ``op_name`` cannot reduce ``dtype``, or None if it can.

    The one rule for which op takes which dtype: the collectives' checks at
    the call, the kernels' tables, AVG's division and PREMUL_SUM's scaling
    all ask it. Bitwise ops take integers and bool; MIN/MAX (and bitwise ops)
    do not take complex numbers; AVG and PREMUL_SUM need floating point or
    complex (an integer average or scaling would have to round).
    """
    dtype = np.dtype(dtype)
    kind = "f" if is_half(dtype) else dtype.kind
    name = dtype_name(dtype)
    if op_name in ("BAND", "BOR", "BXOR") and kind not in "iub":
        return (f"Cannot use ReduceOp.{op_name} with non-integral dtype {name}: bitwise ops "
                "take integer and bool dtypes only")
    if op_name in ("MIN", "MAX") and kind == "c":
        return (f"ReduceOp.{op_name} is not defined for complex dtype {name} (complex numbers "
                "have no order); use SUM, AVG or PRODUCT")
    if op_name == "AVG" and kind in "iub":
        return (f"ReduceOp.AVG needs a floating point or complex dtype, got {name} (an "
                "integer average would have to round; use SUM and divide)")
    if op_name == "PREMUL_SUM" and kind in "iub":
        return (f"ReduceOp.premul_sum needs a floating point or complex dtype, got {name} "
                "(scaling integers would have to round)")
    return None


def check_op_dtype(op: ReduceOp, dtype: np.dtype, opname: str) -> None:
    """Raise ``ValueError`` if ``op`` cannot reduce ``dtype`` (``TypeError`` if
    ``op`` is not a ReduceOp). Called on the caller's thread before the
    collective is queued."""
    if not isinstance(op, ReduceOp):
        raise TypeError(f"{opname}: reduce_op must be a numcoll.ReduceOp, got {op!r}")
    why = op_dtype_refusal(op.name, dtype)
    if why is not None:
        raise ValueError(f"{opname}: {why}")
