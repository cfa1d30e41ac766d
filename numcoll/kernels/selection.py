"""Which compiled loop reduces a built-in op on a dtype — one rule for the CPU
loops (cpu_loops.py) and the CUDA kernels (numcoll/cuda/loops.py), which differ only
in their tables. Plain Python: nothing here is compiled or cached by Numba."""

from __future__ import annotations

import numpy as np

from ..dtypes import bfloat16, dtype_name, is_half, op_dtype_refusal
from ..ops import ReduceOp

__all__ = ["pick_builtin", "loop_tables"]

_BUILTIN_LOOPS = {"SUM": "sum", "PRODUCT": "prod", "MIN": "min", "MAX": "max",
                  "BAND": "band", "BOR": "bor", "BXOR": "bxor"}
_HALVES = {"f16": np.dtype(np.float16), "bf16": bfloat16}


def loop_tables(loops: dict) -> tuple[dict, dict, dict, dict, dict, dict]:
    """The lookup tables of a loops module (CPU or CUDA: both name their loops
    alike, ``_sum_kernel``, ``_f16_min_kernel``, ``_bf16_widen_kernel`` ...),
    built from its namespace: (kernels, half_kernels, bool_kernels, widen,
    narrow, scale_half). One table layout for both targets."""
    kernels = {op: loops[f"_{name}_kernel"] for op, name in _BUILTIN_LOOPS.items()}
    half = {(dt, op): loops[f"_{pre}_{_BUILTIN_LOOPS[op]}_kernel"]
            for pre, dt in _HALVES.items() for op in ("SUM", "PRODUCT", "MIN", "MAX")}
    # bool: SUM/MAX are logical or, PRODUCT/MIN logical and
    bools = {"SUM": kernels["BOR"], "MAX": kernels["BOR"], "BOR": kernels["BOR"],
             "PRODUCT": kernels["BAND"], "MIN": kernels["BAND"], "BAND": kernels["BAND"],
             "BXOR": kernels["BXOR"]}
    widen = {dt: loops[f"_{pre}_widen_kernel"] for pre, dt in _HALVES.items()}
    narrow = {dt: loops[f"_{pre}_narrow_kernel"] for pre, dt in _HALVES.items()}
    scale_half = {dt: loops[f"_{pre}_scale_kernel"] for pre, dt in _HALVES.items()}
    return kernels, half, bools, widen, narrow, scale_half


def pick_builtin(op: ReduceOp, dtype: np.dtype, kernels: dict, half_kernels: dict,
                 bool_kernels: dict):
    """The loop for built-in ``op`` on ``dtype`` from the given tables.

    ``kernels`` maps op names to loops for numeric dtypes, ``half_kernels``
    maps (dtype, name) to float16/bfloat16 loops, ``bool_kernels`` maps names
    to bool loops. AVG uses SUM's loop (the caller divides by the count).
    TypeError, naming the op and dtype, when the op is not defined for it.
    """
    # AVG reduces like SUM here (the caller divides), so ask the rule for SUM.
    name = "SUM" if op.name == "AVG" else op.name
    why = op_dtype_refusal(name, dtype)
    if why is not None:
        raise TypeError(f"ReduceOp.{op.name} cannot reduce {dtype_name(dtype)}: {why}")
    if is_half(dtype):
        return half_kernels[(dtype, name)]
    if dtype.kind == "b":
        return bool_kernels[name]
    return kernels[name]
