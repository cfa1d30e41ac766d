"""CUDA reduction kernels (SUM float32 on device arrays) against plain CUDA baselines.

Run on a machine with a GPU::

    python -m pytest benchmarks/bench_cuda.py --benchmark-min-rounds=10

``NUMCOLL_BENCH_MAX_NBYTES`` caps the array size (default 64 MiB; sizes are
1, 4, 16 and 64 MiB). Skipped, with the reason, where there is no usable GPU
or when the CUDA simulator is on (its timings mean nothing).

Implementations (``impl`` in ``extra_info``):

* ``numcoll``: the public :func:`numcoll.cuda.kernels.reduce_into`, argument
  checks and launch-shape lookup included;
* ``numba-add``: a bare ``@cuda.jit`` kernel ``acc[i] += x[i]``, one thread per
  element, no checks: what a user would write by hand. The gap to ``numcoll``
  is the wrapper's overhead (visible at small sizes) plus any cost of the
  grid-stride loop and capped grid;
* ``d2d-copy``: a device-to-device copy of ``nbytes``: the memory-bandwidth
  roof for streaming kernels (2 x ``nbytes`` of traffic, against the
  reduction's 3 x ``nbytes``).

Every timed call ends with ``cuda.synchronize()``, so times are of finished
work, not of launches. Each case records ``nbytes`` (of one array), ``count``,
``dtype``, ``op``, ``impl``, ``gbps`` (``nbytes`` / median time, GB/s) and
``traffic_gbps`` (the bytes the device memory actually moved / median time).
"""

import os

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(300)

if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
    pytest.skip("NUMBA_ENABLE_CUDASIM is on: simulated kernels have no meaningful timings",
                allow_module_level=True)
try:
    from numba import cuda
except Exception as exc:  # pragma: no cover - depends on the installation
    pytest.skip(f"numba.cuda is not importable: {exc}", allow_module_level=True)
if cuda.jit.__module__.startswith("numba.cuda.simulator"):
    pytest.skip("numba.cuda is the simulator: timings would mean nothing",
                allow_module_level=True)
if not cuda.is_available():
    pytest.skip("no CUDA GPU (numba.cuda.is_available() is False)", allow_module_level=True)

from numcoll.cuda import kernels  # noqa: E402
from numcoll.ops import ReduceOp  # noqa: E402

SIZES_NBYTES = [1 << 20, 4 << 20, 16 << 20, 64 << 20]
MAX_NBYTES = int(os.environ.get("NUMCOLL_BENCH_MAX_NBYTES", str(64 << 20)), 0)
TRAFFIC = {"numcoll": 3, "numba-add": 3, "d2d-copy": 2}   # x nbytes per call


@cuda.jit
def _plain_add(acc, x):
    i = cuda.grid(1)
    if i < acc.size:
        acc[i] += x[i]


def _size_id(nbytes):
    return f"{nbytes >> 20}MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10}KiB"


@pytest.mark.parametrize("impl", list(TRAFFIC))
@pytest.mark.parametrize("nbytes", [n for n in SIZES_NBYTES if n <= MAX_NBYTES] or [MAX_NBYTES],
                         ids=_size_id)
def test_device_reduce_sum_float32(benchmark, nbytes, impl):
    dtype = np.dtype(np.float32)
    count = nbytes // dtype.itemsize
    rng = np.random.default_rng(0)
    # Small values: thousands of in-place rounds stay finite.
    acc = cuda.to_device((rng.random(count) * 4).astype(dtype))
    x = cuda.to_device((rng.random(count) * 4).astype(dtype))

    if impl == "numcoll":
        def run():
            kernels.reduce_into(ReduceOp.SUM, acc, x)
            cuda.synchronize()
    elif impl == "numba-add":
        threads = 256
        blocks = -(-count // threads)

        def run():
            _plain_add[blocks, threads](acc, x)
            cuda.synchronize()
    else:
        def run():
            acc.copy_to_device(x)
            cuda.synchronize()

    run()                                   # compile and warm up outside the timing
    benchmark.group = f"device SUM float32 {_size_id(nbytes)}"
    benchmark.extra_info.update(nbytes=nbytes, count=count, dtype="float32", op="SUM",
                                impl=impl, round_nbytes=nbytes)
    benchmark(run)
    if benchmark.stats is not None:         # None under --benchmark-disable
        median = benchmark.stats.stats.median
        benchmark.extra_info["gbps"] = nbytes / median / 1e9
        benchmark.extra_info["traffic_gbps"] = TRAFFIC[impl] * nbytes / median / 1e9
