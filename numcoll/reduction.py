"""How one (reduce op, dtype) pair is computed.

float16/bfloat16 are widened to float32 before the algorithm runs, so partial
sums travel and accumulate in float32 and the result is rounded once at the
end — unlike Gloo, whose ring rounds to 16 bits at every step and drifts
(pytorch#152300). ``half_wire="native"`` (config) keeps 16-bit on the wire for
half the bytes, rounding at every step as Gloo does. AVG is SUM followed by a
division by the world size (before rounding, for halves). PREMUL_SUM
(:meth:`ReduceOp.premul_sum`) is SUM with every input multiplied by the
factor as it is loaded into the wire dtype.

The methods here work on host (NumPy) memory. For device arrays the plan is
built with ``device=True`` (the op is compiled with numba.cuda instead) and
the same steps run on the GPU (:class:`numcoll.cuda.memory.DeviceSteps`).
"""

from __future__ import annotations

import numpy as np

from .dtypes import check_op_dtype, dtype_name, is_half
from .kernels import cpu
from .ops import ReduceOp

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
        try:
            if device:
                # Lazily: numba.cuda is imported only once device arrays are seen.
                from .kernels import cuda as cuda_kernels

                cuda_kernels.compile_op(self.kernel_op, self.wire_dtype)
                if premul:      # the device multiplies as a PRODUCT with the factors
                    cuda_kernels.compile_op(ReduceOp.PRODUCT, self.wire_dtype)
            else:
                cpu.compile_op(self.kernel_op, self.wire_dtype)
        except TypeError as exc:
            raise TypeError(f"{opname}: {exc}") from None
        self.divisor = world_size if avg else None

    def reduce(self, acc: np.ndarray, x: np.ndarray) -> None:
        """acc = op(acc, x), elementwise, in the wire dtype."""
        cpu.reduce_into(self.kernel_op, acc, x)

    def to_wire(self, src: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """``src`` (any layout) as a flat wire-dtype array (a new one unless ``out``)."""
        if out is None:
            out = np.empty(src.size, self.wire_dtype)
        if self.widen:
            cpu.widen_into(np.ascontiguousarray(src).reshape(-1), out)
        else:
            np.copyto(out, src.reshape(-1) if src.flags.c_contiguous else src.ravel())
        if self.factor is not None:
            np.multiply(out, self.factor, out=out)
        return out

    def load(self, arrays: list) -> tuple[np.ndarray, bool]:
        """The flat work buffer holding the local reduction of ``arrays``, and
        whether it *is* ``arrays[0]``'s memory (then results need no copy back)."""
        first = arrays[0]
        if len(arrays) == 1 and not self.widen and first.flags.c_contiguous:
            work = first.reshape(-1)
            if self.factor is not None:
                np.multiply(work, self.factor, out=work)
            return work, True
        work = self.to_wire(first)
        if len(arrays) > 1:
            scratch = np.empty_like(work)
            for a in arrays[1:]:
                self.reduce(work, self.to_wire(a, scratch))
        return work, False

    def finish(self, work: np.ndarray) -> None:
        """Apply what comes after the sum (AVG's division)."""
        if self.divisor is not None and work.size:
            cpu.scale_into(work, self.divisor)

    def store(self, work: np.ndarray, out: np.ndarray) -> None:
        """Write the flat work buffer (or a slice of it) into ``out`` (any layout)."""
        if self.widen:
            if out.flags.c_contiguous:
                cpu.narrow_into(work, out.reshape(-1))
            else:
                tmp = np.empty(out.size, self.dtype)
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
