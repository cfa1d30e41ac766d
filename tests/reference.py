"""Plain-NumPy references for the collectives tests.

Inputs are small integers (or {-1, 1, 2} for PRODUCT), so float sums and
products are exact in every dtype — even bfloat16 — and results can be
compared bit for bit; only AVG (a division) needs a tolerance.
"""

from __future__ import annotations

import numpy as np

import numcoll as nc
from numcoll.dtypes import SUPPORTED_DTYPES, dtype_name

OPS = [nc.ReduceOp.SUM, nc.ReduceOp.PRODUCT, nc.ReduceOp.MIN, nc.ReduceOp.MAX,
       nc.ReduceOp.AVG, nc.ReduceOp.BAND, nc.ReduceOp.BOR, nc.ReduceOp.BXOR]
DTYPES = list(SUPPORTED_DTYPES)


def valid(op, dtype) -> bool:
    kind = np.dtype(dtype).kind
    if op.is_bitwise:
        return kind in "iub"
    if op.name in ("MIN", "MAX"):
        return kind != "c"
    if op.name == "AVG":
        return kind in "fcV" or dtype_name(dtype) == "bfloat16"
    return True


def make_input(dtype, count: int, rank: int, op, salt: int = 0) -> np.ndarray:
    """Rank-dependent small-integer data (deterministic)."""
    dtype = np.dtype(dtype)
    i = np.arange(count, dtype=np.int64)
    if dtype.kind == "b":
        return ((i * 7 + rank * 3 + salt) % 3 == 0)
    if op is not None and op.name == "PRODUCT":
        vals = np.array([1, 2, -1 if dtype.kind not in "u" else 1])[(i + rank + salt) % 3]
    else:
        vals = (i * 5 + rank * 3 + salt) % 7 - (3 if dtype.kind not in "u" else 0)
    if dtype.kind == "c":
        return (vals + 1j * ((vals + rank) % 3)).astype(dtype)
    return vals.astype(dtype)


def reduce_reference(op, dtype, inputs: list[np.ndarray]) -> np.ndarray:
    dtype = np.dtype(dtype)
    stack = np.stack(inputs)
    if dtype.kind == "b":
        ufunc = {"SUM": np.logical_or, "MAX": np.logical_or, "BOR": np.logical_or,
                 "PRODUCT": np.logical_and, "MIN": np.logical_and, "BAND": np.logical_and,
                 "BXOR": np.logical_xor}[op.name]
        return ufunc.reduce(stack, axis=0)
    wide = np.complex128 if dtype.kind == "c" else (np.float64 if dtype.kind in "fV"
                                                      or dtype_name(dtype) == "bfloat16"
                                                      else dtype)
    if dtype.kind in "iu":
        wide = dtype  # integers wrap in their own width, as the kernels do
    stack = stack.astype(wide)
    name = op.name
    if name in ("SUM", "AVG"):
        out = np.add.reduce(stack, axis=0, dtype=wide)
        if name == "AVG":
            out = out / len(inputs)
    elif name == "PRODUCT":
        out = np.multiply.reduce(stack, axis=0, dtype=wide)
    elif name == "MIN":
        out = np.minimum.reduce(stack, axis=0)
    elif name == "MAX":
        out = np.maximum.reduce(stack, axis=0)
    else:
        out = {"BAND": np.bitwise_and, "BOR": np.bitwise_or,
               "BXOR": np.bitwise_xor}[name].reduce(stack, axis=0)
    return out.astype(dtype)


def assert_reduced(actual, expected, op, dtype, context: str = "") -> None:
    dtype = np.dtype(dtype)
    if op.name == "AVG":
        a = np.asarray(actual).astype(np.complex128 if dtype.kind == "c" else np.float64)
        e = np.asarray(expected).astype(a.dtype)
        tol = 1e-2 if dtype.itemsize <= 2 else 1e-6
        np.testing.assert_allclose(a, e, rtol=tol, atol=tol, err_msg=context)
    else:
        np.testing.assert_array_equal(np.asarray(actual), np.asarray(expected), err_msg=context)
