"""The host work of one device-array allreduce: Python calls, device copies and slices per call.

Runs anywhere (under the CUDA simulator when there is no GPU)::

    NUMBA_ENABLE_CUDASIM=1 python benchmarks/profile_cuda_calls.py
    NUMBA_ENABLE_CUDASIM=1 NUMCOLL_SEGMENT_NBYTES=16384 python benchmarks/profile_cuda_calls.py

Two ranks as threads allreduce float32 device arrays (SUM, ``ring``) of
several sizes. For each size it prints, per rank and per call: the Python
function calls (``call`` and ``c_call`` profile events, as cProfile counts
them) made on numcoll's threads -- the simulator's own kernel threads, which
stand in for the GPU, are not counted; waits that poll (the simulator's
launcher, lock waits) add calls in proportion to the time waited -- then the
calls of numcoll's own Python functions (``numcoll fns``: work, not waiting;
the launcher's harness left out), and how many device copies
(``copy_to_host``/``copy_to_device``) and device-array slices
(``__getitem__``) the call made. The point is the trend: whether the host
work grows with the array's size.
"""

from __future__ import annotations

import os
import sys
import threading

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import numpy as np  # noqa: E402

import numcoll as nc  # noqa: E402
import numcoll.cuda  # noqa: E402

SIZES = (64 << 10, 256 << 10, 1 << 20)
CALLS = 3
_NUMCOLL = os.sep + "numcoll" + os.sep
_LAUNCHER = os.sep + "launcher" + os.sep       # the ranks' harness, not the collective


def _classes():
    from numba import cuda

    arr = cuda.device_array(4, np.float32)
    kinds = {type(arr), type(arr[1:])}
    try:
        from numba.cuda.simulator.kernel import BlockManager, BlockThread
    except ImportError:         # a real GPU: no simulated kernels to leave out
        return kinds, (), None
    return kinds, BlockThread, BlockManager.run.__code__


def main() -> None:
    kinds, block_thread, simulated_run = _classes()
    counts = {"calls": 0, "numcoll": 0, "copies": 0, "slices": 0}
    active = threading.Event()
    lock = threading.Lock()

    local = threading.local()

    def profile(frame, event, arg):
        # Counted: calls on numcoll's threads, outside a simulated kernel's
        # execution (the simulator's block threads, and its launcher's polling
        # of them, stand in for the GPU).
        if not active.is_set() or isinstance(threading.current_thread(), block_thread):
            return
        depth = getattr(local, "depth", 0)
        if frame.f_code is simulated_run:
            if event == "call":
                local.depth = depth + 1
            elif event == "return":
                local.depth = depth - 1
        if event in ("call", "c_call") and not depth:
            own = event == "call" and _NUMCOLL in frame.f_code.co_filename and \
                _LAUNCHER not in frame.f_code.co_filename
            with lock:
                counts["calls"] += 1
                counts["numcoll"] += own

    originals = {}
    for cls in kinds:
        for name, key in (("copy_to_host", "copies"), ("copy_to_device", "copies"),
                          ("__getitem__", "slices")):
            fn = getattr(cls, name)
            if (cls, name) in originals:
                continue
            originals[(cls, name)] = fn

            def counted(self, *args, _fn=fn, _key=key, **kwargs):
                if active.is_set() and not getattr(local, "depth", 0) and not isinstance(
                        threading.current_thread(), block_thread):
                    counts[_key] += 1
                return _fn(self, *args, **kwargs)

            setattr(cls, name, counted)

    print(f"segment_nbytes={nc.config.get('segment_nbytes')} simulator="
          f"{os.environ.get('NUMBA_ENABLE_CUDASIM')}")
    print(f"{'nbytes':>10} {'python calls':>13} {'numcoll fns':>12} {'copies':>7} "
          f"{'slices':>7}   (per rank, per call)")
    for nbytes in SIZES:
        count = nbytes // 4

        def body():
            rank = nc.get_rank()
            x = numcoll.cuda.to_device(np.full(count, rank + 1.0, np.float32))
            nc.all_reduce(x)                         # warm-up: compiles, pins
            nc.barrier()
            if rank == 0:
                for key in counts:
                    counts[key] = 0
                active.set()
            nc.barrier()
            for _ in range(CALLS):
                nc.all_reduce(x)
            nc.barrier()
            if rank == 0:
                active.clear()
            assert float(numcoll.cuda.to_host(x)[0]) == 3.0 * 2 ** CALLS
            return dict(counts)

        # Installed before the ranks' threads start, so that every thread of the
        # group (and the simulator's, which the profile then skips) has it.
        threading.setprofile(profile)
        sys.setprofile(profile)
        try:
            got = nc.launch(body, 2, mode="thread", timeout=600)[0]
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
        per = CALLS * 2
        print(f"{nbytes:>10} {got['calls'] // per:>13} {got['numcoll'] // per:>12} "
              f"{got['copies'] // per:>7} {got['slices'] // per:>7}")


if __name__ == "__main__":
    main()
