"""How one (reduce op, dtype) pair is computed.

float16/bfloat16 are widened to float32 before the algorithm runs, so partial
sums travel and accumulate in float32 and the result is rounded once at the
end — unlike Gloo, whose ring rounds to 16 bits at every step and drifts
(pytorch#152300). ``half_wire="native"`` (config) keeps 16-bit on the wire for
half the bytes, rounding at every step as Gloo does. AVG is SUM followed by a
division by the world size (before rounding, for halves). PREMUL_SUM
(:meth:`ReduceOp.premul_sum`) is SUM with every input multiplied by the
factor as it is loaded into the wire dtype.

A :class:`Reduction` is the plan: what to compute, and the kernel compiled
for the memory it runs on (``kernel``; ``multiply`` too for PREMUL_SUM on the
device; ``host_kernel``, the CPU kernel, also for device arrays, whose
algorithms reduce in pinned host memory when staged). The steps that apply it have one shape per memory kind:
:class:`numcoll.memory.host.HostSteps` for NumPy arrays, and
:class:`numcoll.cuda.memory.DeviceSteps` for CUDA arrays.
"""

from __future__ import annotations

import numpy as np

from ..dtypes import check_op_dtype, dtype_name, is_half
from ..kernels import cpu
from .host import HostSteps
from ..ops import ReduceOp

__all__ = ["Reduction"]

_FLOAT32 = np.dtype(np.float32)


class Reduction:
    """The plan for reducing arrays of ``dtype`` with ``op`` across ``world_size`` ranks.

    Built on the caller's thread: an op/dtype mismatch, or a custom op that
    does not compile for the dtype, raises here, before anything is queued.
    """

    def __init__(self, op: ReduceOp, dtype: np.dtype, world_size: int, half_wire: str,
                 opname: str, device: bool = False):
        check_op_dtype(op, dtype, opname)
        self.op = op
        self.dtype = np.dtype(dtype)
        self.widen = is_half(self.dtype) and half_wire == "float32"
        self.wire_dtype = _FLOAT32 if self.widen else self.dtype
        # By name (a custom op's is "custom(...)"): cheaper than ReduceOp.__eq__.
        avg, premul = op.name == "AVG", op.name == "PREMUL_SUM"
        self.factor = _premul_factor(op, self.dtype, self.wire_dtype, opname) if premul else None
        #: What the kernels compute: AVG and PREMUL_SUM reduce like SUM.
        self.kernel_op = ReduceOp.SUM if avg or premul else op
        self.device = device
        self.divisor = world_size if avg else None
        self.multiply = None
        try:
            if device:
                # Lazily: numba.cuda is imported only once device arrays are seen.
                from ..cuda import kernels as cuda_kernels

                self.kernel = cuda_kernels.compile_op(self.kernel_op, self.wire_dtype)
                if premul:      # the device multiplies as a PRODUCT with the factors
                    self.multiply = cuda_kernels.compile_op(ReduceOp.PRODUCT, self.wire_dtype)
                # Device data staged through host memory is reduced there
                # (numcoll.cuda.buffer), by the host's kernel for the same op.
                self.host_kernel = cpu.compile_op(self.kernel_op, self.wire_dtype)
            else:
                self.kernel = self.host_kernel = cpu.compile_op(self.kernel_op,
                                                                self.wire_dtype)
        except TypeError as exc:
            raise TypeError(f"{opname}: {exc}") from None
        #: The steps on host memory (stateless, so made once per plan).
        self.host_steps = None if device else HostSteps(self)


def _premul_factor(op: ReduceOp, dtype: np.dtype, wire_dtype: np.dtype, opname: str):
    """PREMUL_SUM's factor as a scalar of the wire dtype (``check_op_dtype``
    has refused integer dtypes already)."""
    if isinstance(op.factor, complex) or np.iscomplexobj(op.factor):
        if dtype.kind != "c":
            raise TypeError(f"{opname}: {op!r} has a complex factor, which cannot scale "
                            f"real dtype {dtype_name(dtype)}")
    return wire_dtype.type(op.factor)
