"""Where the microseconds of one small call go: the same 8-byte allreduce
timed layer by layer, from the module API down to the arena's bare step.

    python benchmarks/small_calls.py              # 2 ranks, medians of 5 runs of 20000 calls
    python benchmarks/small_calls.py -n 4 --runs 3
    NUMCOLL_FR_BUFFER_SIZE=0 python benchmarks/small_calls.py   # without the flight recorder

Every rank runs each variant the same number of times, in lockstep, bound to
a CPU of its own where there is one per rank (as ``numcoll-bench`` binds). Each
call is timed on its own (``perf_counter`` around it, included in every
row) and a run's figure is the median call on rank 0 -- on a shared
machine a few calls preempted for milliseconds would otherwise dominate a
mean. The table gives the median and the lowest of ``--runs`` runs
(variants interleaved, so a busy moment of the machine spreads over all).
The rows, from the top:

``nc.all_reduce(x)``, ordinary
    a new array object each time, the group's plans by form forgotten before
    each call: the full path (builder, checks, plan cache, the group's
    submit, Work, Comm, Record, one arena step);
``nc.all_reduce(x)``, new array
    a new array object each time, run through its form's plan
    (:mod:`numcoll.fast.forms`; the array's allocation included);
``pg.allreduce(x, blocking=True)``
    the same array: the builder's plan-cache hit, then the full submit;
``persistent, ordinary``
    ``req.start(); req.wait()`` forced onto the ordinary persistent path;
``nc.all_reduce(x)``, repeat
    the same array again: recognised, run as one fused step;
``persistent, fused``
    ``req.start(); req.wait()``: two compiled calls;
``FusedCall.run()``
    the fused step with the group's bookkeeping (lock, number, hold), no
    repeat check, no API;
``compiled step``
    the compiled step alone (one call of its entry point, the flight
    recorder's row, the stamp check, the reduction included);
``bare arena step, N in one call``
    the arena's put and wait (stamps compared) and the reduction, N steps in
    one compiled loop: no Python and no dispatch -- the floor;
``bare arena step, no stamp check``
    the same without comparing the peers' headers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
from numba import njit

import numcoll as nc
from numcoll.collectives import fused_step
from transports.shm.arena import LINE_WORDS, _put, _wait
from transports.shm.ring import _cpu_relax, _load_acquire, _monotonic_ns, _sched_yield

#: Steps per timed batch of the bare rows.
BATCH = 50
ROWS = ["nc.all_reduce(x), ordinary", "pg.allreduce(x, blocking=True)", "persistent, ordinary",
        "nc.all_reduce(x), new array", "nc.all_reduce(x), repeat", "persistent, fused",
        "FusedCall.run()", "compiled step", "bare arena step, N in one call",
        "bare arena step, no stamp check"]


@njit(nogil=True, cache=True)
def _bare_steps(region, plan, x, first_step, seq, n, check):
    """``n`` arena steps (put, wait, combine) in one compiled loop; with
    ``check`` false the peers' headers are not compared."""
    ctrl = region[:plan[fused_step.CTRL_NBYTES]].view(np.int64)
    rank, size, stride = plan[fused_step.RANK], plan[fused_step.SIZE], plan[fused_step.STRIDE]
    s0, s1 = plan[fused_step.STAMP], plan[fused_step.STAMP + 1]
    for k in range(n):
        step = first_step + k
        first = plan[fused_step.FIRST + (step & 1)]
        _put(region, ctrl, rank, step, first + rank * stride, seq, s0, s1, x.view(np.uint8),
             x.nbytes, x.nbytes)
        spin_until = _monotonic_ns() + plan[fused_step.SPIN]
        if check:  # a wait that never gives up (the peers run the same loop)
            got = _wait(ctrl, size, step, seq, s0, s1, spin_until, 1 << 62)
            if got != -1:
                return got
        else:
            for r in range(size):
                while _load_acquire(ctrl, r * LINE_WORDS) <= step:
                    if _monotonic_ns() < spin_until:
                        _cpu_relax()
                    else:
                        _sched_yield()
        fused_step._combine(region, plan, x, step)
    return -1


def _body(calls: int, runs: int) -> dict:
    from numcoll.api.world import get_default_group
    from numcoll.collectives import persistent
    from numcoll.collectives.persistent import PersistentRequest
    from numcoll.bench.forms import bind_to_core
    from numcoll.fast.step import FusedCall

    bind_to_core()  # one CPU per rank where they fit, as numcoll-bench and mpirun bind
    pg = get_default_group()
    x = np.ones(2, np.float32)
    req = nc.all_reduce_init(x)
    # the ordinary persistent request (what all_reduce_init makes where nothing is fused)
    plain = PersistentRequest(pg.submit, persistent.allreduce(pg.context,
                                                              [np.ones(2, np.float32)]))
    for _ in range(5):
        nc.all_reduce(x)  # learnt, then repeated
    seen = pg.repeats._seen[id(x)]
    fused: FusedCall = seen.fused
    arena = fused.arena

    forms = pg.repeats.forms

    def ordinary():
        forms.clear()  # (else the second new array plans its form: new_array below)
        nc.all_reduce(np.ones(2, np.float32))

    def new_array():
        nc.all_reduce(np.ones(2, np.float32))

    def method():
        pg.allreduce(x, blocking=True)

    def persistent_plain():
        plain.start()
        plain.wait()

    def repeat():
        nc.all_reduce(x)

    def persistent():
        req.start()
        req.wait()

    def run():
        fused.run()

    def compiled():
        # (it claims the group's number and the arena's step itself; no lock)
        got = fused._start(fused.address, fused.x, fused.spin_ns)
        if got == -1:
            return
        if got == fused_step.NOT_TAKEN:
            raise RuntimeError("the fused step was not taken")
        step, seq = fused.step, fused.seq
        if got != fused_step.DONE_HELD:
            got = fused._finish(fused.address, fused.x, step, seq)
        if got != -1:  # a peer slower than the spin and yield phases (a busy machine)
            arena.wait(step, seq, fused.call.stamp, time.monotonic() + 60)
            fused._combine(fused.address, fused.x, step)
        # Done here, outside the group: let go of the claim (FusedCall.hold's job),
        # else every later call of the group waits for it to be held.
        pg._word[fused_step.GROUP_CLAIMED] = 0

    def bare(check):
        def loop(n):
            seq = pg._word[fused_step.GROUP_SEQ]
            pg._word[fused_step.GROUP_SEQ] = seq + 1  # every step of the loop under one number
            step = arena.next_step
            got = _bare_steps(fused.region, fused.plan, fused.x, step, seq, n, check)
            if got != -1:
                raise RuntimeError(f"bare steps: {got}")
            arena.step_word()[0] = step + n
        return loop

    loops = {"nc.all_reduce(x), ordinary": ordinary, "pg.allreduce(x, blocking=True)": method,
             "persistent, ordinary": persistent_plain, "nc.all_reduce(x), new array": new_array,
             "nc.all_reduce(x), repeat": repeat,
             "persistent, fused": persistent, "FusedCall.run()": run, "compiled step": compiled}
    times: dict[str, list] = {name: [] for name in ROWS}
    for name in ("bare arena step, N in one call", "bare arena step, no stamp check"):
        bare(name.endswith("one call"))(10)  # compiled before timing
    clock = time.perf_counter
    each = np.empty(calls)
    for _ in range(runs):
        for name in ROWS:
            pg.barrier().wait()
            if name.startswith("bare"):  # batches of BATCH steps, per step
                loop = bare(name.endswith("one call"))
                for i in range(calls // BATCH):
                    t0 = clock()
                    loop(BATCH)
                    each[i] = (clock() - t0) / BATCH
                got = each[:calls // BATCH]
            else:
                f = loops[name]
                for i in range(calls):
                    t0 = clock()
                    f()
                    each[i] = clock() - t0
                got = each
            times[name].append(float(np.median(got)) * 1e6)
    return times


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--world-size", type=int, default=2)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv)
    results = nc.launch(_body, args.world_size, args=(args.calls, args.runs), mode="process",
                        timeout=600)
    times = results[0]
    fr = os.environ.get("NUMCOLL_FR_BUFFER_SIZE", "default")
    print(f"# 8-byte float32 allreduce, {args.world_size} ranks, {args.calls} calls x "
          f"{args.runs} runs, flight recorder buffer: {fr}; load {os.getloadavg()[0]:.1f}")
    print(f"{'layer':40s} {'median us':>10s} {'min us':>8s}")
    for name in ROWS:
        print(f"{name:40s} {statistics.median(times[name]):10.2f} {min(times[name]):8.2f}")


if __name__ == "__main__":
    main()
