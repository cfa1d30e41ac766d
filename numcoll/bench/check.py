"""The ``#wrong`` column: inputs filled with rank-dependent values, results checked.

After the timed iterations of a size (which run on zeros, so repeated SUMs
never overflow), every rank fills its input with :func:`fill`, runs the
collective once more and counts the elements of its result that differ from
:func:`expected` (computed here with NumPy from the same fill rule, so no data
travels for the check). ``#wrong`` in the table is the sum over ranks, as in
nccl-tests; 0 is the only right answer.

The values are small positive integers (1..11): every supported dtype holds
them, and their sums over a few dozen ranks, exactly (float16, bfloat16
included), so the expected result does not depend on the order of the
additions. They depend on both the rank and the element index, so a block
landing at the wrong offset or from the wrong rank is caught as surely as a
wrong sum. Values are never 0, so a result that was never written (left as
the zeros the timing ran on) is wrong too.
"""

from __future__ import annotations

import numpy as np

from .sweep import Case, Plan

__all__ = ["fill", "expected", "prepare_check", "count_wrong", "check_case"]


def fill(rank: int, count: int, dtype: np.dtype, offset: int = 0) -> np.ndarray:
    """Rank ``rank``'s input values for elements ``offset .. offset + count - 1``."""
    index = np.arange(offset, offset + count, dtype=np.int64)
    values = (index * 7 + rank * 3) % 11 + 1
    if np.dtype(dtype) == np.bool_:
        return np.ones(count, dtype=np.bool_)  # SUM on bool is OR: anything else reads as wrong
    return values.astype(dtype)


def _sum(parts: list[np.ndarray]) -> np.ndarray:
    total = parts[0].copy()
    for part in parts[1:]:
        total = total + part  # in the array's own dtype: exact for these small values
    return total


def expected(plan: Plan, case: Case, rank: int) -> np.ndarray | None:
    """What rank ``rank``'s result buffer must hold after the check run
    (None: nothing to check there, the non-root ranks of reduce)."""
    n, dtype, count = plan.world_size, plan.numpy_dtype, case.count
    if plan.op == "allreduce":
        return _sum([fill(k, count, dtype) for k in range(n)])
    if plan.op == "broadcast":
        return fill(0, count, dtype)
    if plan.op == "reduce":
        return _sum([fill(k, count, dtype) for k in range(n)]) if rank == 0 else None
    block = count // n
    if plan.op == "allgather":
        return np.concatenate([fill(k, block, dtype) for k in range(n)])
    if plan.op == "reduce_scatter":
        return _sum([fill(k, block, dtype, offset=rank * block) for k in range(n)])
    if plan.op == "alltoall":  # block j of the result is block `rank` of rank j's input
        return np.concatenate([fill(j, block, dtype, offset=rank * block) for j in range(n)])
    if plan.op == "gather":  # the root's output: every rank's input in rank order
        return np.concatenate([fill(k, block, dtype) for k in range(n)]) if rank == 0 else None
    if plan.op == "scatter":  # block `rank` of the root's input
        return fill(0, block, dtype, offset=rank * block)
    raise ValueError(f"{plan.op} has no result to check")


def _result(plan: Plan, inp: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    return inp if out is None else out


def prepare_check(plan: Plan, case: Case, rank: int, inp: np.ndarray,
                  out: np.ndarray | None) -> None:
    """Fill ``inp`` with this rank's values and zero the output (so a result
    that is never written counts as wrong)."""
    if out is not None:
        out[...] = 0  # first: in the in-place forms ``inp`` is a view into ``out``
    inp[...] = fill(rank, inp.size, plan.numpy_dtype)


def count_wrong(plan: Plan, case: Case, rank: int, inp: np.ndarray,
                out: np.ndarray | None) -> int:
    """Elements of this rank's result that differ from :func:`expected`."""
    want = expected(plan, case, rank)
    if want is None:
        return 0
    got = _result(plan, inp, out).reshape(-1)
    if got.shape != want.shape:
        return int(want.size)
    return int(np.count_nonzero(got != want))


def check_case(plan: Plan, case: Case, rank: int, inp: np.ndarray, out: np.ndarray | None,
               step, barrier) -> int | None:
    """After timing ``case``: fill this rank's inputs with known values, run
    ``step`` once more once every rank is here (``barrier``), and count the
    wrong elements of its result; None when ``plan`` is not checked."""
    if not plan.check:
        return None
    prepare_check(plan, case, rank, inp, out)
    barrier()  # the check starts once every rank has finished timing
    step()
    return count_wrong(plan, case, rank, inp, out)
