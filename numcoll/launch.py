"""``numcoll.launch``: run a function on N local ranks and collect the results.

Thread mode runs each rank as a thread of this process over the in-process
transport (fast; what notebooks and most tests use). Process mode spawns one
fresh Python process per rank (``spawn``, never ``fork``: ZeroMQ contexts and
Numba state do not survive a fork), ships the function with cloudpickle (so
functions defined in a notebook or ``__main__`` work), and meets through a
TCPStore served by this process. Results come back through the store.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import cloudpickle

from . import distributed as dist
from .errors import GroupPoisonedError, NumcollError, PeerError
from .store import HashStore
from .tcpstore import TCPStore

__all__ = ["launch", "RankFailedError"]

DEFAULT_LAUNCH_TIMEOUT = timedelta(minutes=30)
#: How long stragglers get after the first failure (their collectives fail
#: fast once the failed rank is gone) before they are terminated.
_FAILURE_GRACE_S = 15.0
_POLL_S = 0.05
_EXIT_HINT = (" (its stderr says why; note that ranks are spawned, so a script that calls "
              "launch() must do so under `if __name__ == \"__main__\":`)")


class RankFailedError(NumcollError):
    """A rank's function raised (or its process died). ``rank`` names it;
    ``__cause__`` is the original exception when it could be brought back."""

    def __init__(self, message: str, rank: int):
        super().__init__(message)
        self.rank = rank


def launch(fn: Callable, world_size: int, args: tuple = (), *, mode: str = "process",
           transport: str | None = None, timeout: timedelta | float | None = None,
           threads: int = 2) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` ranks; return the list of results (index = rank).

    On every rank the default group is initialised first (so ``nc.get_rank()``
    and ``nc.all_reduce(...)`` work inside ``fn``) and destroyed afterwards.
    The first failure is re-raised as :class:`RankFailedError` naming its rank
    (a rank's own error is preferred over the errors its peers get because it
    left). Nothing outlives the call: threads are joined, processes terminated.

    Parameters
    ----------
    mode : "process" (one spawned process per rank, ZeroMQ between them) or
        "thread" (threads of this process, in-process transport by default).
    transport : the ProcessGroup transport ("tcp", "ipc", "inproc"); None chooses.
    timeout : overall deadline (timedelta or seconds), also each collective's
        default deadline. Default 30 minutes.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"launch: world_size must be a positive int, got {world_size!r}")
    if mode not in ("process", "thread"):
        raise ValueError(f"launch: mode must be 'process' or 'thread', got {mode!r}")
    if timeout is None:
        timeout = DEFAULT_LAUNCH_TIMEOUT
    elif not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    runner = _launch_threads if mode == "thread" else _launch_processes
    return runner(fn, world_size, tuple(args), transport, timeout, threads)


# -- outcome bookkeeping ---------------------------------------------------------------
class _Outcomes:
    def __init__(self, world_size: int):
        self.results: list[Any] = [None] * world_size
        self.failures: list[tuple[float, int, BaseException | None, str]] = []
        self.lock = threading.Lock()

    def fail(self, rank: int, exc: BaseException | None, text: str) -> None:
        with self.lock:
            self.failures.append((time.monotonic(), rank, exc, text))

    def raise_first(self) -> None:
        if not self.failures:
            return
        # A rank's own error explains the run; the PeerErrors of the ranks it
        # left behind do not, so they come last.
        def consequence(f):
            return isinstance(f[2], (PeerError, GroupPoisonedError))

        _, rank, exc, text = min(self.failures, key=lambda f: (consequence(f), f[0]))
        others = sorted({r for _, r, _, _ in self.failures} - {rank})
        also = f" (ranks {others} failed too)" if others else ""
        err = RankFailedError(f"rank {rank} failed{also}: {text}", rank)
        raise err from exc


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


# -- threads -----------------------------------------------------------------------------
def _launch_threads(fn, world_size, args, transport, timeout, threads):
    store = HashStore(timeout)
    outcomes = _Outcomes(world_size)

    def body(rank: int) -> None:
        dist._use_thread_world()
        try:
            dist.init_process_group(store=store, rank=rank, world_size=world_size,
                                    timeout=timeout, transport=transport or "inproc",
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
    for w in workers:
        w.join(max(0.0, deadline - time.monotonic()))
    stuck = [r for r, w in enumerate(workers) if w.is_alive()]
    if stuck:
        raise TimeoutError(f"Timed out waiting {round(timeout.total_seconds() * 1000)}ms for "
                           f"launch: ranks {stuck} still running (threads cannot be killed; "
                           "they end when their collectives time out)")
    outcomes.raise_first()
    return outcomes.results


# -- processes -------------------------------------------------------------------------
def _rank_main(rank, world_size, port, payload, transport, timeout_s, threads):
    """Entry point of a spawned rank process."""
    store = TCPStore("127.0.0.1", port, world_size=None, is_master=False,
                     timeout=timedelta(seconds=timeout_s))
    try:
        try:
            fn, args = cloudpickle.loads(payload)
            dist.init_process_group(store=store, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=timeout_s), transport=transport,
                                    threads=threads)
            try:
                value = fn(*args)
            finally:
                dist.destroy_process_group()
            outcome = ("ok", value)
        except BaseException as exc:  # noqa: BLE001 - shipped to the parent
            outcome = ("err", exc, traceback.format_exc())
        try:
            blob = cloudpickle.dumps(outcome)
        except Exception as exc:  # noqa: BLE001 - an unpicklable result or exception
            blob = cloudpickle.dumps(("err", None, f"result of rank {rank} could not be "
                                      f"pickled: {_describe(exc)}"))
        store.set(f"launch/result/{rank}", blob)
    finally:
        store.close()


def _launch_processes(fn, world_size, args, transport, timeout, threads):
    payload = cloudpickle.dumps((fn, args))
    outcomes = _Outcomes(world_size)
    ctx = multiprocessing.get_context("spawn")
    with TCPStore("127.0.0.1", 0, world_size=None, is_master=True, timeout=timeout) as store:
        procs = [ctx.Process(target=_rank_main, name=f"numcoll-rank{r}",
                             args=(r, world_size, store.port, payload, transport,
                                   timeout.total_seconds(), threads))
                 for r in range(world_size)]
        try:
            for p in procs:
                p.start()
            _collect(procs, store, outcomes, timeout)
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
            for p in procs:
                p.join(5)
                if p.is_alive():
                    p.kill()
                    p.join(5)
    outcomes.raise_first()
    return outcomes.results


def _collect(procs, store, outcomes, timeout) -> None:
    deadline = time.monotonic() + timeout.total_seconds()
    pending = set(range(len(procs)))
    first_failure_at = None
    while pending:
        for rank in sorted(pending):
            key = f"launch/result/{rank}"
            if store.check([key]):
                outcome = cloudpickle.loads(store.get(key))
                if outcome[0] == "ok":
                    outcomes.results[rank] = outcome[1]
                else:
                    exc, text = outcome[1], outcome[2]
                    summary = _describe(exc) if exc is not None else text
                    outcomes.fail(rank, exc, f"{summary}\n--- traceback of rank {rank} ---\n{text}")
                pending.discard(rank)
            elif not procs[rank].is_alive() and procs[rank].exitcode is not None:
                # Give a result written just before exit a moment to show up.
                if not store.check([key]):
                    time.sleep(_POLL_S)
                    if store.check([key]):
                        continue
                    outcomes.fail(rank, None, f"process exited with code {procs[rank].exitcode} "
                                              f"without reporting a result{_EXIT_HINT}")
                    pending.discard(rank)
        if outcomes.failures and first_failure_at is None:
            first_failure_at = time.monotonic()
        now = time.monotonic()
        if first_failure_at is not None and now - first_failure_at > _FAILURE_GRACE_S:
            for rank in pending:
                outcomes.fail(rank, None, "terminated: still running "
                                          f"{_FAILURE_GRACE_S:.0f}s after another rank failed")
            return
        if now > deadline:
            raise TimeoutError(f"Timed out waiting {round(timeout.total_seconds() * 1000)}ms "
                               f"for launch: ranks {sorted(pending)} did not finish")
        if pending:
            time.sleep(_POLL_S)
