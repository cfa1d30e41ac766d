"""``numcoll.launch``: run a function on N local ranks and collect the results.

Thread mode runs each rank as a thread of this process over the in-process
transport (fast; what notebooks and most tests use). Process mode starts one
fresh Python interpreter per rank and meets through a TCPStore served by this
process.

What process mode guarantees, and how:

- **Results come back over a channel only the ranks can write.** Each rank
  gets one end of a socket pair this process created (inherited as a file
  descriptor, never a listening address); its result or error comes back
  through it. The store carries only the rendezvous, and nothing read from
  the store is ever unpickled here.
- **Ranks die with the launcher**, even on SIGKILL: on Linux every rank asks
  for SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)``, then checks
  that its parent is still the launcher, closing the race with a parent that
  died first); everywhere, a watchdog thread in the rank kills it when its end
  of the socket pair reports that the launcher is gone.
- **Ranks start without re-running the caller's script**: the function and
  its arguments travel with cloudpickle and the rank interpreter runs only
  numcoll's entry point, so scripts without an ``if __name__ == "__main__":``
  guard, code piped on stdin, ``python -c`` and notebooks all work. What cannot
  work (a function or argument that cannot be pickled, a module the ranks
  cannot import) fails with one error that says why and what to do.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any, Callable

from ..api import world as dist
from ..bootstrap.store import HashStore
from .outcomes import (LaunchError, LaunchTimeoutError, RankFailedError, _blocked_on,
                       _describe, _finished, _Outcomes, _timeout_message)
from .processes import _STOP_GRACE_S, _launch_processes, failure_grace_s

__all__ = ["launch", "RankFailedError", "LaunchError", "LaunchTimeoutError"]

DEFAULT_LAUNCH_TIMEOUT = timedelta(minutes=30)
_POLL_S = 0.05
DEFAULT_GROUP_TIMEOUT = dist.DEFAULT_TIMEOUT


def launch(fn: Callable, world_size: int, args: tuple = (), *, mode: str = "process",
           transport: str | None = None, timeout: timedelta | float | None = None,
           group_timeout: timedelta | float | None = None, threads: int = 2) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` ranks; return the list of results (index = rank).

    On every rank the default group is initialised first (so ``nc.get_rank()``
    and ``nc.all_reduce(...)`` work inside ``fn``) and destroyed afterwards.
    The first failure is re-raised as :class:`RankFailedError` naming its rank
    (a rank's own error is preferred over the errors its peers get because it
    left). Nothing outlives the call: threads are joined, processes stopped —
    also when the launching process is killed.

    Parameters
    ----------
    mode : "process" (one fresh interpreter per rank, ZeroMQ between them) or
        "thread" (threads of this process, in-process transport by default).
    transport : the ProcessGroup transport ("tcp", "ipc", "inproc"); None chooses.
    timeout : deadline of the whole call (timedelta or seconds; default 30
        minutes). When it passes, :class:`LaunchTimeoutError` names the ranks
        still running and what each was blocked on.
    group_timeout : the default group's collective deadline (timedelta or
        seconds; default 30 minutes, as ``init_process_group``): a collective
        that waits longer fails with its own error naming the op and the peer.
        Joining the group is bounded by ``timeout`` instead. Once a rank has
        failed, the others get this deadline (at most 15 s) plus 2 s to end on
        their own; then those still running are asked what they are doing and
        stopped, and the error leads with the first rank's own failure (or,
        when a rank stalled, with the timeout that found it).
    threads : worker threads of each rank's group.

    Notes
    -----
    In process mode, ``fn`` and ``args`` must be picklable by cloudpickle
    (functions defined in a script, a notebook or on stdin are), and the ranks
    see ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
    ``MASTER_ADDR`` and ``MASTER_PORT`` as under torchrun.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"launch: world_size must be a positive int, got {world_size!r}")
    if mode not in ("process", "thread"):
        raise ValueError(f"launch: mode must be 'process' or 'thread', got {mode!r}")
    if not callable(fn):
        raise TypeError(f"launch: fn must be callable, got {type(fn).__name__}")
    timeout = _as_timedelta("timeout", timeout, DEFAULT_LAUNCH_TIMEOUT)
    group_timeout = _as_timedelta("group_timeout", group_timeout, DEFAULT_GROUP_TIMEOUT)
    runner = _launch_threads if mode == "thread" else _launch_processes
    return runner(fn, world_size, tuple(args), transport, timeout, group_timeout, threads)


def _as_timedelta(name: str, value, default: timedelta) -> timedelta:
    if value is None:
        return default
    if not isinstance(value, timedelta):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"launch: {name} must be a timedelta or seconds, got {value!r}")
        value = timedelta(seconds=value)
    if value <= timedelta(0):
        raise ValueError(f"launch: {name} must be positive, got {value}")
    return value


# -- threads -----------------------------------------------------------------------------
def _launch_threads(fn, world_size, args, transport, timeout, group_timeout, threads):
    store = HashStore(timeout)  # joining: the launch's deadline (see processes.py)
    outcomes = _Outcomes(world_size)
    worlds: list = [None] * world_size

    def body(rank: int) -> None:
        dist._use_thread_world()
        worlds[rank] = dist._world()
        try:
            dist.init_process_group(store=store, rank=rank, world_size=world_size,
                                    timeout=group_timeout, transport=transport or "inproc",
                                    threads=threads)
            outcomes.results[rank] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the caller's thread
            outcomes.fail(rank, exc, _describe(exc))
        finally:
            try:
                dist.destroy_process_group()
            except BaseException as exc:  # noqa: BLE001
                outcomes.fail(rank, exc, _describe(exc))
            dist._drop_thread_world()

    workers = [threading.Thread(target=body, args=(r,), name=f"numcoll-rank{r}", daemon=True)
               for r in range(world_size)]
    for w in workers:
        w.start()
    deadline = time.monotonic() + timeout.total_seconds()
    grace_s, failed_at = failure_grace_s(group_timeout), None
    # Until the deadline, or the grace after the first failure (see processes.py).
    while any(w.is_alive() for w in workers) and time.monotonic() < deadline:
        next(w for w in workers if w.is_alive()).join(_POLL_S)
        if failed_at is None and outcomes.failures:
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > grace_s:
            break
    stuck = [r for r, w in enumerate(workers) if w.is_alive()]
    if stuck:
        blocked = {r: _blocked_on(workers[r].ident, r) for r in stuck}
        why = (f"launch timed out after {timeout}" if failed_at is None else
               f"still running {grace_s:.1f}s after another rank failed")
        _abort_groups([worlds[r] for r in stuck], why)
        for r in stuck:
            workers[r].join(_STOP_GRACE_S)
        alive = [r for r in stuck if workers[r].is_alive()]
        if failed_at is not None:
            first = min(outcomes.failures, key=lambda f: f[0])[1]
            for r in alive:   # threads cannot be killed: they are left behind, said so
                outcomes.fail(r, None, f"stopped waiting for it: still running {grace_s:.1f}s "
                                       f"after rank {first} failed (a thread cannot be "
                                       f"killed: it is left running); {blocked[r]}",
                              stopped=True)
            outcomes.raise_first()
        note = (f"; ranks {alive} are still running code outside numcoll (threads cannot "
                "be killed)") if alive else "; their groups were aborted"
        raise LaunchTimeoutError(_timeout_message(timeout, stuck, blocked, note), stuck, blocked,
                                 _finished(outcomes, stuck))
    outcomes.raise_first()
    return outcomes.results


def _abort_groups(worlds, reason: str) -> None:
    """Abort every group of the given thread worlds, so threads blocked in
    collectives return at once."""
    for world in worlds:
        for pg in list(getattr(world, "groups", {}) or {}):
            try:
                pg.abort(reason)
            except Exception:  # noqa: BLE001 - best effort; the threads are daemons
                pass
