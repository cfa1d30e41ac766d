"""Coalescing: packing 1,000 arrays into one buffer and unpacking them again.

Run with ``python -m pytest benchmarks/bench_pack.py --benchmark-min-rounds=5``, or
``python benchmarks/bench_pack.py`` for a table. The arrays are float32 with sizes
drawn uniformly from 1 to ``max_count`` elements; ``NUMCOLL_BENCH_MAX_NBYTES`` caps
``max_count * 4`` (CI runs the suite tiny).

impl (each does a pack and an unpack; results land in the original arrays):

* ``plan``: a :class:`~numcoll.kernels.pack_plan.PackPlan` built once and reused
  (what the Reducer and every bucket after the first step do): two Numba calls.
* ``plan+build``: the same, building the plan in the timed region (a one-off pack).
* ``copyto-loop``: a Python loop of ``np.copyto`` into and out of buffer slices.
* ``concatenate``: ``np.concatenate(..., out=buf)``, then a loop of ``np.copyto``
  from slices of ``buf`` back into the arrays.

The table adds ``2 copies``: two ``np.copyto`` of one contiguous array holding all
the bytes -- the memory-bandwidth floor no implementation can beat.
"""

from __future__ import annotations

import os
import timeit

import numpy as np
import pytest

from numcoll.kernels.pack_plan import PackPlan

pytestmark = pytest.mark.timeout(300)

N_ARRAYS = 1000
MAX_COUNTS = [1, 64, 1024, 4096]
MAX_NBYTES = int(os.environ.get("NUMCOLL_BENCH_MAX_NBYTES", str(16 << 20)), 0)
IMPLS = ["plan", "plan+build", "copyto-loop", "concatenate"]


def make_arrays(max_count: int, n: int = N_ARRAYS, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(int(k)).astype(np.float32)
            for k in rng.integers(1, max_count + 1, n)]


def make_round_trip(impl: str, arrays: list[np.ndarray]):
    """A zero-argument function doing one pack + unpack with ``impl``."""
    plan = PackPlan(arrays)
    buf = plan.empty()
    bounds = list(zip(plan.offsets.tolist(), plan.counts.tolist()))
    if impl == "plan":
        def run():
            plan.pack(buf)
            plan.unpack(buf)
    elif impl == "plan+build":
        def run():
            p = PackPlan(arrays)
            p.pack(buf)
            p.unpack(buf)
    elif impl == "copyto-loop":
        def run():
            for a, (o, n) in zip(arrays, bounds):
                np.copyto(buf[o:o + n], a)
            for a, (o, n) in zip(arrays, bounds):
                np.copyto(a, buf[o:o + n])
    elif impl == "concatenate":
        def run():
            np.concatenate(arrays, out=buf)
            for a, (o, n) in zip(arrays, bounds):
                np.copyto(a, buf[o:o + n])
    else:
        raise ValueError(impl)
    return run


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("max_count", [m for m in MAX_COUNTS if m * 4 <= MAX_NBYTES] or [1])
def test_pack_unpack(benchmark, max_count, impl):
    arrays = make_arrays(max_count)
    want = [a.copy() for a in arrays]
    run = make_round_trip(impl, arrays)
    benchmark.group = f"pack+unpack {N_ARRAYS} float32 arrays of 1-{max_count}"
    benchmark.extra_info.update(impl=impl, arrays=N_ARRAYS, max_count=max_count,
                                nbytes=sum(a.nbytes for a in arrays))
    benchmark(run)
    assert all(np.array_equal(a, w) for a, w in zip(arrays, want))


def table(repeat: int = 7) -> str:
    """Median-free best-of-``repeat`` microseconds per pack+unpack, as a Markdown table."""
    lines = ["| arrays of 1..N elements | MiB | " + " | ".join(IMPLS) +
             " | 2 copies | plan vs copyto-loop | plan vs concatenate |",
             "|---" * (len(IMPLS) + 5) + "|"]
    for max_count in MAX_COUNTS:
        arrays = make_arrays(max_count)
        times = {}
        for impl in IMPLS:
            run = make_round_trip(impl, arrays)
            run()
            number = max(1, int(0.05 / max(1e-7, timeit.timeit(run, number=1))))
            times[impl] = min(timeit.repeat(run, number=number, repeat=repeat)) / number * 1e6
        mib = sum(a.nbytes for a in arrays) / 2**20
        flat = np.concatenate(arrays)
        other = np.empty_like(flat)
        floor = min(timeit.repeat(lambda: (np.copyto(other, flat), np.copyto(flat, other)),
                                  number=number, repeat=repeat)) / number * 1e6
        lines.append(f"| {max_count} | {mib:.2f} | " +
                     " | ".join(f"{times[i]:.0f} us" for i in IMPLS) + f" | {floor:.0f} us" +
                     f" | {times['copyto-loop'] / times['plan']:.1f}x"
                     f" | {times['concatenate'] / times['plan']:.1f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
