"""CPU reduction kernels against NumPy's in-place ufuncs.

Run with ``python -m pytest benchmarks/bench_kernels.py --benchmark-min-rounds=3``.
``NUMCOLL_BENCH_MAX_NBYTES`` caps the array size (default 16 MiB), so CI can
run the suite tiny, e.g. ``NUMCOLL_BENCH_MAX_NBYTES=1024``.

Each case records in ``extra_info``: ``nbytes`` (of one array), ``count``,
``dtype``, ``op``, ``impl`` ("numcoll", "numcoll-kernel" or "numpy") and ``gbps``: ``nbytes``
divided by the median time, in GB/s (the memory traffic is three times that:
``acc`` and ``x`` read, ``acc`` written), shown after each name in the table.
Quick mode (``--quick`` or ``NUMCOLL_BENCH_QUICK=1``): 1 KiB and 1 MiB only.
"""

import os

import numpy as np
import pytest

from numcoll.dtypes import dtype_name
from numcoll.kernels import cpu
from numcoll.ops import ReduceOp

pytestmark = pytest.mark.timeout(300)

QUICK = os.environ.get("NUMCOLL_BENCH_QUICK", "0") not in ("", "0")
SIZES_NBYTES = [1 << 10, 1 << 20] if QUICK else [1 << 10, 64 << 10, 1 << 20, 16 << 20]
MAX_NBYTES = int(os.environ.get("NUMCOLL_BENCH_MAX_NBYTES", str(16 << 20)), 0)
CASES = [
    (ReduceOp.SUM, np.float32, np.add),
    (ReduceOp.SUM, np.float16, np.add),
    (ReduceOp.SUM, np.int32, np.add),
    (ReduceOp.MAX, np.float32, np.maximum),
]


def _size_id(nbytes):
    return f"{nbytes >> 20}MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10}KiB"


@pytest.mark.parametrize("impl", ["numcoll", "numcoll-kernel", "numpy"])
@pytest.mark.parametrize("nbytes", [n for n in SIZES_NBYTES if n <= MAX_NBYTES] or [MAX_NBYTES],
                         ids=_size_id)
@pytest.mark.parametrize("op, dtype, ufunc", CASES,
                         ids=[f"{op.name}-{np.dtype(dt).name}" for op, dt, _ in CASES])
def test_reduce_into(benchmark, op, dtype, ufunc, nbytes, impl):
    """impl "numcoll" is the public, argument-checking ``reduce_into``;
    "numcoll-kernel" calls the compiled loop's entry point directly (what is
    left without the checks, i.e. the kernel itself); "numpy" is
    ``ufunc(acc, x, out=acc)``."""
    dtype = np.dtype(dtype)
    count = nbytes // dtype.itemsize
    rng = np.random.default_rng(0)
    # Small values: thousands of in-place rounds neither overflow nor reach inf.
    acc = (rng.random(count) * 4).astype(dtype)
    x = (rng.random(count) * 4).astype(dtype)
    benchmark.group = f"{op.name} {dtype_name(dtype)} {_size_id(nbytes)}"
    benchmark.extra_info.update(nbytes=nbytes, count=count, dtype=dtype_name(dtype),
                                op=op.name, impl=impl, round_nbytes=nbytes)
    if impl == "numpy":
        benchmark(ufunc, acc, x, out=acc)
    else:
        kernel = cpu.compile_op(op, dtype)              # compile outside the timing
        if impl == "numcoll":
            benchmark(cpu.reduce_into, op, acc, x)
        elif kernel._view is None:
            benchmark(kernel._entry, acc, x)
        else:
            benchmark(kernel._entry, acc.view(kernel._view), x.view(kernel._view))
    if benchmark.stats is not None:                     # None under --benchmark-disable
        benchmark.extra_info["gbps"] = nbytes / benchmark.stats.stats.median / 1e9
