"""Numba kernels: elementwise reductions and float16/bfloat16 conversions.

Kernels work on arrays only; they never see ranks or sockets. :mod:`.cpu`
holds the validating wrappers of the CPU kernels (re-exported here), and
:mod:`.cpu_loops` the Numba loops themselves; :mod:`.selection` is the rule,
shared with the GPU kernels, for which compiled loop reduces an op on a
dtype. The GPU twins live with everything else about CUDA in
:mod:`numcoll.cuda` (imported on demand, so ``import numcoll`` never loads
``numba.cuda``).
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
