"""One core writes a buffer, another copies it out: plain stores against
non-temporal ones, beside where the two cores are.

    python benchmarks/handoff.py                 # 64 KiB .. 4 MiB, 3 runs
    python benchmarks/handoff.py --sizes 64K,1M --runs 5

Every arena step hands bytes from one core to another the same way: the
writer copies into its slot, the reader copies out of it. With plain stores
the lines the reader wants sit, modified, in the writer's cache, and the
reader pulls them from there; with non-temporal stores (``movnti``, then
``sfence`` before the flag) the writer sends them towards memory and the
reader reads them from there. Which is faster depends on where the two
cores are, which on a VM is where the hypervisor put the vCPUs
(:mod:`numcoll.bench.placement`), so every run prints a cache line's round
trip between them.

Two threads of this process, bound to the first two CPUs, hand one buffer
back and forth ``--iters`` times (the writer waits until the reader took the
last one): a figure is the time per handoff, write and read, on the
reader's clock. numcoll's arena does not use non-temporal stores (yet): this
measures whether it should.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from numcoll.bench.placement import first_two_cpus, round_trip_us
from numcoll.bench.sweep import format_nbytes, parse_nbytes
from transports.shm.ring import (_cpu_relax, _item_pointer, _load_acquire, _monotonic_ns,
                                 _store_release)

#: Handoffs per figure: enough buffers to pass 64 MiB, at least this many.
MIN_ITERS = 20
#: A figure's deadline (seconds): 64 MiB of handoffs take well under one.
DEADLINE_S = 60.0


@intrinsic
def _store_nontemporal(typingctx, arr, idx, val):
    """``arr[idx] = val`` as a non-temporal store (x86: ``movnti``)."""
    sig = types.void(arr, idx, val)

    def codegen(context, builder, sig, args):
        pointer = _item_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        store = builder.store(args[2], pointer, align=8)
        store.set_metadata("nontemporal", builder.module.add_metadata(
            [ir.Constant(ir.IntType(32), 1)]))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _sfence(typingctx):
    """Order this thread's non-temporal stores before its later stores."""
    sig = types.void()

    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module,
                                            ir.FunctionType(ir.VoidType(), []),
                                            "llvm.x86.sse.sfence")
        builder.call(fn, [])
        return context.get_dummy_value()

    return sig, codegen


@njit(nogil=True, inline="always")
def _await(flag, at, value, deadline_ns):
    """Spin until ``flag[at] == value``; False once ``deadline_ns`` passed."""
    k = 0
    while _load_acquire(flag, at) != value:
        _cpu_relax()
        k += 1
        if (k & 1023) == 0 and _monotonic_ns() > deadline_ns:
            return False
    return True


@njit(nogil=True)
def _write(flag, slot, src, iters, nontemporal, deadline_ns):
    for i in range(iters):
        if not _await(flag, 8, i, deadline_ns):  # the reader took the last one
            return
        if nontemporal:
            for k in range(src.size):
                _store_nontemporal(slot, k, src[k])
            _sfence()
        else:
            for k in range(src.size):
                slot[k] = src[k]
        _store_release(flag, 0, i + 1)


@njit(nogil=True)
def _read(flag, slot, dst, iters, deadline_ns):
    """True once all ``iters`` handoffs were copied out before the deadline."""
    for i in range(iters):
        if not _await(flag, 0, i + 1, deadline_ns):
            return False
        for k in range(slot.size):
            dst[k] = slot[k]
        _store_release(flag, 8, i + 1)
    return True


def handoff_us(nbytes: int, nontemporal: bool, iters: int, cpus: tuple[int, int]) -> float:
    """Microseconds per handoff of ``nbytes`` from a thread on ``cpus[0]`` to
    one on ``cpus[1]``; raises if the reader's copy is not the writer's."""
    n = max(1, nbytes // 8)
    flag, slot = np.zeros(16, np.int64), np.zeros(n, np.int64)
    src, dst = np.arange(n, dtype=np.int64) * 3 + 1, np.zeros(n, np.int64)
    took = []
    # (a thread that never gets its CPU must not leave the other spinning)
    deadline_ns = time.monotonic_ns() + int(DEADLINE_S * 1e9)

    def write():
        os.sched_setaffinity(0, {cpus[0]})
        _write(flag, slot, src, iters, nontemporal, deadline_ns)

    def read():
        os.sched_setaffinity(0, {cpus[1]})
        began = time.perf_counter()
        if _read(flag, slot, dst, iters, deadline_ns):
            took.append(time.perf_counter() - began)

    threads = [threading.Thread(target=write, daemon=True),
               threading.Thread(target=read, daemon=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S + 5)
    if not took:
        raise RuntimeError(f"handoff of {nbytes} bytes between CPUs {cpus[0]} and {cpus[1]}: "
                           f"not done within {DEADLINE_S:.0f} s")
    if not np.array_equal(dst, src):
        raise RuntimeError(f"handoff of {nbytes} bytes: the reader's copy is not the writer's")
    return took[0] / iters * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="64K,256K,1M,4M")
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args(argv)
    cpus = first_two_cpus()
    if cpus is None:
        print("handoff: needs two CPUs")
        return 2
    sizes = [parse_nbytes(s) for s in args.sizes.split(",")]
    handoff_us(4096, True, 2, cpus)  # compiled before anything is timed
    handoff_us(4096, False, 2, cpus)
    print(f"# one handoff (write, then read on another CPU), CPUs {cpus[0]} and {cpus[1]}; "
          "us per handoff: plain stores / non-temporal")
    for _ in range(args.runs):
        trip = round_trip_us(cpus)
        cells = []
        for nbytes in sizes:
            iters = max(MIN_ITERS, (64 << 20) // nbytes)
            cells.append(f"{format_nbytes(nbytes)} {handoff_us(nbytes, False, iters, cpus):.1f}"
                         f" / {handoff_us(nbytes, True, iters, cpus):.1f}")
        print(f"round trip {trip:.3f} us | " + " | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
