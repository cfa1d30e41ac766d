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
device). The steps that apply it have one shape per memory kind:
:class:`HostSteps` here for NumPy arrays, and
:class:`numcoll.cuda.memory.DeviceSteps` for CUDA arrays.
"""

from __future__ import annotations

import numpy as np

from ..dtypes import check_op_dtype, dtype_name, is_half
from ..kernels import cpu
from ..ops import ReduceOp

__all__ = ["Reduction", "HostSteps"]

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
            else:
                self.kernel = cpu.compile_op(self.kernel_op, self.wire_dtype)
        except TypeError as exc:
            raise TypeError(f"{opname}: {exc}") from None
        #: The steps on host memory (stateless, so made once per plan).
        self.host_steps = None if device else HostSteps(self)


class HostSteps:
    """A :class:`Reduction` applied to NumPy arrays: the host twin of
    :class:`numcoll.cuda.memory.DeviceSteps`, with the same methods."""

    __slots__ = ("_red", "wire_dtype", "reduce")

    def __init__(self, red: Reduction):
        self._red = red
        self.wire_dtype = red.wire_dtype
        #: acc = op(acc, x), elementwise, in the wire dtype: the plan's compiled kernel.
        self.reduce = red.kernel

    def to_wire(self, src: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """``src`` (any layout) as a flat wire-dtype array (a new one unless ``out``)."""
        red = self._red
        if out is None:
            out = np.empty(src.size, red.wire_dtype)
        if red.widen:
            cpu.widen_into(np.ascontiguousarray(src).reshape(-1), out)
        else:
            np.copyto(out, src.reshape(-1) if src.flags.c_contiguous else src.ravel())
        if red.factor is not None:
            np.multiply(out, red.factor, out=out)
        return out

    def load(self, arrays: list) -> tuple[np.ndarray, bool]:
        """The flat work buffer holding the local reduction of ``arrays``, and
        whether it *is* ``arrays[0]``'s memory (then results need no copy back)."""
        red = self._red
        first = arrays[0]
        if len(arrays) == 1 and not red.widen and first.flags.c_contiguous:
            work = first.reshape(-1)
            if red.factor is not None:
                np.multiply(work, red.factor, out=work)
            return work, True
        work = self.to_wire(first)
        if len(arrays) > 1:
            scratch = np.empty_like(work)
            for a in arrays[1:]:
                self.reduce(work, self.to_wire(a, scratch))
        return work, False

    def finish(self, work: np.ndarray) -> None:
        """Apply what comes after the sum (AVG's division)."""
        if self._red.divisor is not None and work.size:
            cpu.scale_into(work, self._red.divisor)

    def store(self, work: np.ndarray, out: np.ndarray) -> None:
        """Write the flat work buffer (or a slice of it) into ``out`` (any layout)."""
        red = self._red
        if red.widen:
            if out.flags.c_contiguous:
                cpu.narrow_into(work, out.reshape(-1))
            else:
                tmp = np.empty(out.size, red.dtype)
                cpu.narrow_into(work, tmp)
                np.copyto(out, tmp.reshape(out.shape))
        else:
            np.copyto(out, work.reshape(out.shape))


def _premul_factor(op: ReduceOp, dtype: np.dtype, wire_dtype: np.dtype, opname: str):
    """PREMUL_SUM's factor as a scalar of the wire dtype (``check_op_dtype``
    has refused integer dtypes already)."""
    if isinstance(op.factor, complex) or np.iscomplexobj(op.factor):
        if dtype.kind != "c":
            raise TypeError(f"{opname}: {op!r} has a complex factor, which cannot scale "
                            f"real dtype {dtype_name(dtype)}")
    return wire_dtype.type(op.factor)
