"""How far apart two CPUs are: the round trip of one cache line between them.

On a virtual machine the guest's CPUs are wherever the hypervisor put them,
and that changes while the guest runs. On the 2-core development VM a line
went from one vCPU to the other and back in 0.03, 0.07 or 0.3 us, one state
or another for seconds at a time; in the 0.3 us state numcoll's arena
collectives took 4.5x their time in the 0.07 us state (2 ranks, allreduce of
16 MiB: 8.2 against 1.8 ms; 256 KiB: 130 against 30 us), where Open MPI's
16 MiB allreduce took 3.8-4.2 ms in both. A timing from such a machine
means little without the state it was taken in: ``numcoll-bench`` measures
it before and after each run (:func:`round_trip_us`) and prints it.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
from numba import njit

from transports.shm.ring import _cpu_relax, _load_acquire, _monotonic_ns, _store_release

__all__ = ["round_trip_us", "first_two_cpus"]

#: Round trips per measurement, and the measurement's deadline (a CPU that
#: never runs one of the two threads must not hang the caller).
TRIPS = 20_000
DEADLINE_S = 2.0


@njit(nogil=True, cache=True)
def _bounce(word, trips, me, deadline_ns):
    """``trips`` round trips of ``word[0]`` with the other thread (``me``: 0
    or 1): thread 0 writes even numbers, thread 1 answers with the next odd
    one. Returns False if the deadline passed first."""
    for i in range(trips):
        mine = 2 * i + me
        if me == 0:
            _store_release(word, 0, mine)
        wanted = mine + 1 if me == 0 else mine - 1
        k = 0
        while _load_acquire(word, 0) != wanted:
            _cpu_relax()
            k += 1
            if (k & 1023) == 0 and _monotonic_ns() > deadline_ns:
                return False
        if me == 1:
            _store_release(word, 0, mine)
    return True


def first_two_cpus() -> tuple[int, int] | None:
    """The first two CPUs this process may run on (None: fewer than two)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    return (cpus[0], cpus[1]) if len(cpus) >= 2 else None


def round_trip_us(cpus: tuple[int, int] | None = None, trips: int = TRIPS) -> float | None:
    """Microseconds for one cache line to go from CPU ``cpus[0]`` to ``cpus[1]``
    and back (default :func:`first_two_cpus`): two threads, each bound to one
    of them, bounce a counter ``trips`` times; the lower of two such runs.
    None where it cannot be measured (fewer than two CPUs, no affinity
    control, or a thread that did not get its CPU within DEADLINE_S)."""
    cpus = cpus or first_two_cpus()
    if cpus is None:
        return None
    best = None
    for _ in range(2):
        word = np.full(16, -1, np.int64)  # (only word 0 is written: no other word of its line)
        deadline_ns = time.monotonic_ns() + int(DEADLINE_S * 1e9)
        done = [False, False]
        took = [0.0]
        start = threading.Barrier(2)

        def run(me: int) -> None:
            try:
                os.sched_setaffinity(0, {cpus[me]})  # (this thread only)
                start.wait(DEADLINE_S)
            except (OSError, threading.BrokenBarrierError):
                return
            began = time.perf_counter()
            done[me] = _bounce(word, trips, me, deadline_ns)
            if me == 0:
                took[0] = time.perf_counter() - began

        _bounce(word, 0, 0, 0)  # compiled (or loaded) before any thread starts
        threads = [threading.Thread(target=run, args=(me,), daemon=True) for me in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(DEADLINE_S + 1.0)
        if not all(done):
            return None
        us = took[0] / trips * 1e6  # (timed by thread 0, from the barrier both passed)
        best = us if best is None else min(best, us)
    return best
