"""Which compiled loop reduces a built-in op on a dtype — one rule for the CPU
loops (cpu_loops.py) and the CUDA kernels (cuda_loops.py), which differ only
in their tables. Plain Python: nothing here is compiled or cached by Numba."""

from __future__ import annotations

import numpy as np

from ..dtypes import dtype_name, is_half, op_dtype_refusal
from ..ops import ReduceOp

__all__ = ["pick_builtin"]


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
