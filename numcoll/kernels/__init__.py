"""Numba kernels: elementwise reductions and float16/bfloat16 conversions.

Kernels work on arrays only; they never see ranks or sockets. :mod:`.cpu`
holds the validating wrappers of the CPU kernels (re-exported here), and
:mod:`.cpu_loops` the Numba loops themselves. :mod:`.cuda` is the GPU twin,
with its kernels in :mod:`.cuda_loops`, the ``numba.cuda`` import and
device-array checks in :mod:`.cuda_device` and pinned staging buffers in
:mod:`.cuda_staging`; all ``cuda*`` modules are imported on demand so that
``import numcoll`` never loads ``numba.cuda``.
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
