"""Numba kernels: elementwise reductions and float16/bfloat16 conversions.

Kernels work on arrays only; they never see ranks or sockets. :mod:`.cpu`
holds the CPU kernels and their validating wrappers (re-exported here);
:mod:`.cuda`, the GPU ones, is imported on demand so that ``import numcoll``
never loads ``numba.cuda``.
"""

from .cpu import (
    ReduceKernel,
    compile_op,
    narrow_into,
    precompile,
    reduce_into,
    scale_into,
    widen_into,
)

__all__ = ["ReduceKernel", "compile_op", "narrow_into", "precompile", "reduce_into",
           "scale_into", "widen_into"]
