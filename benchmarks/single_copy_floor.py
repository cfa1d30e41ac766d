"""The floor of a single-copy allgather step: two processes, nothing else.

    python benchmarks/single_copy_floor.py                  # 64 KiB .. 4 MiB, 3 runs
    python benchmarks/single_copy_floor.py --sizes 64K,1M --touch 0,256K,1M --runs 5

A single-copy call (``cma``: docs/performance/single-copy.md) is two
synchronisations around one ``process_vm_readv``: every rank says it is
there, reads the peer's part of the buffer straight into its own, says it is
done, and waits until the peer is done too. This times exactly that, as one
compiled loop between a process and a forked child bound to the first two
CPUs (an allgather of ``size`` bytes in place: each reads the other's half),
so it shows what a fused single-copy step could take with no Python around
it -- and, with ``--touch``, what the same loop takes when each call first
writes that many other bytes, as the interpreter's own work between two
calls does (its objects, frames and arrays pass through the same caches, and
push out the lines the copy would have found there).

Each figure is µs per call on the parent's clock; each run prints a cache
line's round trip between the two CPUs first (on a VM, where the hypervisor
put them: :mod:`numcoll.bench.placement`). Every run checks that each half
arrived whole (it raises otherwise). Exit status 2 where the machine cannot
run it (fewer than two CPUs, or the kernel refuses the read).
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import time

import numpy as np
from numba import njit

from numcoll.bench.placement import first_two_cpus, round_trip_us
from numcoll.bench.sweep import format_nbytes, parse_nbytes
from transports.shm.ring import _cpu_relax, _load_acquire, _monotonic_ns, _store_release
from transports.shm.single_copy_steps import READ, _copy

#: Calls per figure: enough to move 256 MiB, at least this many.
MIN_ITERS = 50
#: A figure's deadline (seconds); a process whose peer is gone gives up then.
DEADLINE_S = 60.0
#: prctl(PR_SET_PTRACER): where Yama's ptrace scope is 1, a process names who may read it.
_PR_SET_PTRACER = 0x59616D61


@njit(nogil=True, inline="always")
def _await(flags, at, value, deadline_ns):
    """Spin until ``flags[at] >= value``; False once ``deadline_ns`` passed
    or the peer gave up (a negative word)."""
    k = 0
    while True:
        seen = _load_acquire(flags, at)
        if seen >= value:
            return True
        if seen < 0:
            return False
        _cpu_relax()
        k += 1
        if (k & 1023) == 0 and _monotonic_ns() > deadline_ns:
            return False


@njit(nogil=True)
def _calls(flags, me, peer_pid, local, remote, nbytes, junk, first, iters, deadline_ns):
    """``iters`` single-copy steps from step number ``first``: touch ``junk``,
    say *there*, wait for the peer's, read ``nbytes`` from ``remote`` in the
    peer into ``local``, say *done*, wait for the peer's. Returns how many
    calls were made (fewer: a refused read or the deadline)."""
    iov = np.empty(4, np.int64)
    me_at, peer_at = 8 * me, 8 * (1 - me)
    for i in range(iters):
        for j in range(0, junk.size, 64):  # one write per cache line
            junk[j] += 1
        step = first + 2 * i
        _store_release(flags, me_at, step + 1)
        if not _await(flags, peer_at, step + 1, deadline_ns):
            return i
        if nbytes and not _copy(READ, peer_pid, local, remote, nbytes, iov):
            _store_release(flags, me_at, -1)  # (the peer gives up too)
            return i
        _store_release(flags, me_at, step + 2)
        if not _await(flags, peer_at, step + 2, deadline_ns):
            return i
    return iters


def _shown(us: float) -> str:
    """``us`` to one decimal, or to three significant figures below 1 µs:
    the synchronisations alone can take a few hundredths of a microsecond,
    which one decimal would print as 0.0."""
    return f"{us:.1f}" if us >= 1 else f"{us:.3g}"


def floor_us(nbytes: int, touch: int, iters: int, cpus: tuple[int, int]) -> float:
    """Microseconds per single-copy step of an in-place allgather of
    ``nbytes`` (each process reads the other's half) between the two
    ``cpus``, each call first writing ``touch`` other bytes (``nbytes`` 0:
    the two synchronisations and the writes, no copy); raises if a read is
    refused, the child does not finish, or a half arrives changed."""
    half = nbytes // 2 // 8 * 8
    shared = mmap.mmap(-1, 4096)  # the two step words (MAP_SHARED: the child sees them)
    flags = np.frombuffer(shared, np.int64)
    buf = np.zeros(2 * half, np.uint8)
    junk = np.zeros(touch, np.uint8)
    parent = os.getpid()
    pid = os.fork()
    me = 1 if pid == 0 else 0
    if pid == 0:
        code = 1
        try:
            code = _run(flags, me, parent, buf, half, junk, iters, cpus[1]) is None
        finally:
            os._exit(code)
    try:
        ctypes.CDLL(None).prctl(_PR_SET_PTRACER, pid, 0, 0, 0)  # (best effort: Yama scope 1)
        took = _run(flags, me, pid, buf, half, junk, iters, cpus[0])
    finally:
        deadline = time.monotonic() + DEADLINE_S + 5
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                break
            time.sleep(0.001)
    if took is None:
        raise RuntimeError(f"single-copy floor of {nbytes} bytes between CPUs {cpus}: a read "
                           "was refused or the child did not keep up within "
                           f"{DEADLINE_S:.0f} s")
    if half and not (buf[half:] == _pattern(1, half)).all():
        raise RuntimeError(f"single-copy floor of {nbytes} bytes: the child's half arrived "
                           "changed")
    return took / iters * 1e6


def _pattern(me: int, n: int) -> np.ndarray:
    return (np.arange(n, dtype=np.int64) * (3 + 2 * me) + me).astype(np.uint8)


def _run(flags, me: int, peer_pid: int, buf, half: int, junk, iters: int, cpu: int):
    """One side of :func:`floor_us`: seconds for the timed calls, or None."""
    os.sched_setaffinity(0, {cpu})
    buf[me * half:(me + 1) * half] = _pattern(me, half)  # (its own pages, after the fork)
    junk[:] = me
    here = buf.ctypes.data
    # The fork left both at the same virtual addresses: the peer's half of
    # its buffer lies where this process's copy of that half does.
    local = remote = here + (1 - me) * half
    deadline_ns = time.monotonic_ns() + int(DEADLINE_S * 1e9)
    warm = 5
    if _calls(flags, me, peer_pid, local, remote, half, junk, 0, warm, deadline_ns) < warm:
        return None
    began = time.perf_counter()
    done = _calls(flags, me, peer_pid, local, remote, half, junk, 2 * warm, iters, deadline_ns)
    took = time.perf_counter() - began
    return took if done == iters else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="64K,256K,1M,4M",
                   help="allgather sizes (both halves), comma-separated")
    p.add_argument("--touch", default="0,256K",
                   help="bytes each call writes elsewhere first, comma-separated")
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args(argv)
    cpus = first_two_cpus()
    if cpus is None:
        print("single_copy_floor: needs two CPUs")
        return 2
    sizes = [parse_nbytes(s) for s in args.sizes.split(",")]
    touches = [0 if s.strip() == "0" else parse_nbytes(s) for s in args.touch.split(",")]
    try:
        floor_us(4096, 64, 2, cpus)  # compiled before anything is timed
    except RuntimeError as exc:
        print(f"single_copy_floor: {exc}")
        return 2
    print(f"# one single-copy allgather step (in place, 2 processes on CPUs {cpus[0]} and "
          f"{cpus[1]}); us per call, each call first writing "
          + " / ".join(format_nbytes(t) if t else "0 B" for t in touches) + " elsewhere ('none':"
          " no copy, the synchronisations and the writes alone)")
    for _ in range(args.runs):
        trip = round_trip_us(cpus)
        cells = []
        for nbytes in [0] + sizes:
            iters = max(MIN_ITERS, (256 << 20) // max(nbytes, 64 << 10))
            figures = " / ".join(_shown(floor_us(nbytes, t, iters, cpus)) for t in touches)
            cells.append(f"{format_nbytes(nbytes) if nbytes else 'none'} {figures}")
        shown = "?" if trip is None else f"{trip:.3f}"
        print(f"round trip {shown} us | " + " | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
