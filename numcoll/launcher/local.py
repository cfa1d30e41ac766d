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

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection, wait as _wait_ready
from typing import Any, Callable

import cloudpickle

from ..api import collectives as dist
from ..errors import CollectiveTimeoutError, GroupPoisonedError, NumcollError, PeerError
from ..bootstrap.store import HashStore
from ..bootstrap.tcpstore import TCPStore

__all__ = ["launch", "RankFailedError", "LaunchError", "LaunchTimeoutError"]

DEFAULT_LAUNCH_TIMEOUT = timedelta(minutes=30)
DEFAULT_GROUP_TIMEOUT = dist.DEFAULT_TIMEOUT
#: How long stragglers get after the first failure (their collectives fail
#: fast once the failed rank is gone) before they are stopped.
_FAILURE_GRACE_S = 15.0
#: How long ranks still running at the launch deadline get to say what they
#: are blocked on, and how long stopped ranks get to exit before SIGKILL.
_REPORT_S = 1.0
_STOP_GRACE_S = 2.0
_POLL_S = 0.1
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class RankFailedError(NumcollError):
    """A rank's function raised (or its process died). ``rank`` names it;
    ``__cause__`` is the original exception when it could be brought back;
    ``results`` holds the return values of the ranks that finished (None
    elsewhere) and ``failures`` maps every failed rank to its message."""

    def __init__(self, message: str, rank: int, results: list | None = None,
                 failures: dict[int, str] | None = None):
        super().__init__(message)
        self.rank = rank
        self.results = results if results is not None else []
        self.failures = failures if failures is not None else {}


class LaunchError(NumcollError):
    """The ranks could not start (their function could not be loaded there)."""


class LaunchTimeoutError(NumcollError, TimeoutError):
    """``launch``'s overall deadline passed. ``ranks`` lists the ranks still
    running then; ``blocked`` maps each to what it was blocked on, if known;
    ``results`` holds the return values of the ranks that finished."""

    def __init__(self, message: str, ranks: list[int], blocked: dict[int, str],
                 results: list | None = None):
        super().__init__(message)
        self.ranks = ranks
        self.blocked = blocked
        self.results = results if results is not None else []


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
    threads : worker threads of each rank's group.

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
        # A rank's own error, or its death or stall, explains the run; the
        # errors of the ranks it left behind (its peer is gone, the group is
        # poisoned, a wait for it timed out) do not, so they come last.
        def consequence(f):
            return isinstance(f[2], (PeerError, GroupPoisonedError, CollectiveTimeoutError))

        _, rank, exc, text = min(self.failures, key=lambda f: (consequence(f), f[0]))
        failed = {r: t for _, r, _, t in sorted(self.failures, key=lambda f: f[0])}
        others = sorted(set(failed) - {rank})
        also = f" (ranks {others} failed too)" if others else ""
        results = [None if r in failed else v for r, v in enumerate(self.results)]
        err = RankFailedError(f"rank {rank} failed{also}: {text}", rank, results, failed)
        raise err from exc


def _finished(outcomes: _Outcomes, stuck: list[int]) -> list:
    failed = {f[1] for f in outcomes.failures} | set(stuck)
    return [None if r in failed else v for r, v in enumerate(outcomes.results)]


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _timeout_message(timeout: timedelta, stuck: list[int], blocked: dict[int, str],
                     note: str = "") -> str:
    lines = [f"Timed out waiting {round(timeout.total_seconds() * 1000)}ms for launch: "
             f"ranks {stuck} still running{note}"]
    lines += [f"  rank {r}: {blocked.get(r, 'unknown')}" for r in stuck]
    return "\n".join(lines)


# -- what a rank is blocked on ---------------------------------------------------------
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PACKAGE_DIRS = tuple(os.path.join(_ROOT, pkg) + os.sep for pkg in ("numcoll", "transports"))
_LIBRARY_DIRS = _PACKAGE_DIRS + (os.path.dirname(threading.__file__) + os.sep,)


def _stack(frame):
    """Frames from outermost to innermost."""
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames[::-1]


def _blocked_on(rank_ident: int, helper_prefix: str | None) -> str:
    """Describe what the thread ``rank_ident`` (a rank's main thread) is doing:
    the user's line, the numcoll call it is in, and, if a collective is waiting
    on a peer (on that thread or a worker whose name starts with
    ``helper_prefix``), which collective and which peer. Best effort."""
    try:
        frames = sys._current_frames()
        names = {t.ident: t.name for t in threading.enumerate()}
        parts = []
        stack = _stack(frames.get(rank_ident))
        user = [f for f in stack if not f.f_code.co_filename.startswith(_LIBRARY_DIRS)]
        if user:
            f = user[-1]
            where = f"{f.f_code.co_name} ({os.path.basename(f.f_code.co_filename)}:{f.f_lineno})"
            after = stack[stack.index(f) + 1:]
            call = next((g for g in after if g.f_code.co_filename.startswith(_PACKAGE_DIRS)), None)
            parts.append(f"in numcoll's {call.f_code.co_name}() called from {where}"
                         if call is not None else f"running {where}")
        idents = [rank_ident] + [i for i, n in names.items()
                                 if helper_prefix and n.startswith(helper_prefix)]
        for ident in idents:
            for f in reversed(_stack(frames.get(ident))):
                waiting = _comm_wait(f)
                if waiting:
                    parts.append(waiting)
                    break
        return "; ".join(parts) or "no numcoll call in progress"
    except Exception as exc:  # noqa: BLE001 - a diagnosis must never raise
        return f"unknown ({_describe(exc)})"


def _comm_wait(frame) -> str | None:
    """'allreduce (collective #3) waiting to recv from rank 0' for a frame of
    ``Comm.wait``; None for any other frame."""
    if frame.f_code.co_name != "wait":
        return None
    comm, pending = frame.f_locals.get("self"), frame.f_locals.get("pending")
    if type(comm).__name__ != "Comm" or pending is None:
        return None
    direction = "from" if pending.what == "recv" else "to"
    return (f"{comm.op_name} (collective #{comm.seq}) waiting to {pending.what} "
            f"{direction} rank {pending.peer}")


# -- threads -----------------------------------------------------------------------------
def _launch_threads(fn, world_size, args, transport, timeout, group_timeout, threads):
    store = HashStore(group_timeout)
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
    for w in workers:
        w.join(max(0.0, deadline - time.monotonic()))
    stuck = [r for r, w in enumerate(workers) if w.is_alive()]
    if stuck:
        blocked = {r: _blocked_on(workers[r].ident, f"numcoll-r{r}-") for r in stuck}
        _abort_groups([worlds[r] for r in stuck], f"launch timed out after {timeout}")
        for r in stuck:
            workers[r].join(_STOP_GRACE_S)
        alive = [r for r in stuck if workers[r].is_alive()]
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


# -- processes: the rank's side ----------------------------------------------------------
def _die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux), and
    exit now if the parent died before we asked."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the watchdog thread still covers it
    if os.getppid() != parent_pid:
        os._exit(1)


class _RankChannel:
    """The rank's end of its socket pair: sends outcomes, answers the parent's
    report requests, and kills the process when the parent is gone."""

    def __init__(self, conn: Connection, main_ident: int):
        self.conn = conn
        self._send_lock = threading.Lock()
        self._main_ident = main_ident
        threading.Thread(target=self._watch, name="numcoll-launch-watchdog",
                         daemon=True).start()

    def send(self, message) -> None:
        with self._send_lock:
            self.conn.send(message)

    def _watch(self) -> None:
        while True:
            try:
                request = self.conn.recv()
            except (EOFError, OSError):
                os.kill(os.getpid(), signal.SIGKILL)  # the launcher is gone
                return
            if request == "report":
                try:
                    self.send(("report", _blocked_on(self._main_ident, "numcoll-")))
                except OSError:
                    pass


def _rank_entry(fd: int, parent_pid: int) -> None:
    """Entry point of a rank process (``python -c`` runs it; see ``_spawn``)."""
    _die_with_parent(parent_pid)
    conn = Connection(fd)
    start = conn.recv()  # from the parent, through the pipe it made
    sys.path[:] = start["sys_path"]
    channel = _RankChannel(conn, threading.get_ident())
    rank = start["rank"]
    try:
        fn, args = cloudpickle.loads(start["payload"])
    except BaseException as exc:  # noqa: BLE001 - shipped to the parent
        channel.send(("load-error", _describe(exc), traceback.format_exc()))
        return
    group_timeout = timedelta(seconds=start["group_timeout_s"])
    store = TCPStore("127.0.0.1", start["port"], world_size=None, is_master=False,
                     timeout=group_timeout)
    try:
        dist.init_process_group(store=store, rank=rank, world_size=start["world_size"],
                                timeout=group_timeout, transport=start["transport"],
                                threads=start["threads"])
        try:
            value = fn(*args)
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - shipped to the parent
        try:
            blob = cloudpickle.dumps(exc)
        except Exception:  # noqa: BLE001 - the text below still says what happened
            blob = None
        outcome = ("err", blob, _describe(exc), traceback.format_exc())
    else:
        try:
            outcome = ("ok", cloudpickle.dumps(value))
        except Exception as exc:  # noqa: BLE001 - an unpicklable result
            outcome = ("err", None, f"the result of rank {rank} could not be pickled: "
                                    f"{_describe(exc)}", "")
    finally:
        store.close()
    channel.send(outcome)


# -- processes: the launcher's side ------------------------------------------------------
_BOOTSTRAP = ("import sys; sys.path.insert(0, {root!r}); "
              "from numcoll.launcher.local import _rank_entry; _rank_entry({fd}, {ppid})")


class _RankProcess:
    """The launcher's handle on one rank: its process and its end of the pipe."""

    def __init__(self, rank: int, world_size: int, start: dict):
        self.rank = rank
        ours, theirs = socket.socketpair()
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank),
                   WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                   GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(start["port"]))
        try:
            code = _BOOTSTRAP.format(root=_ROOT, fd=theirs.fileno(), ppid=os.getpid())
            # stdin is not shared: a script piped on stdin belongs to the launcher.
            self.proc = subprocess.Popen([sys.executable, "-c", code], env=env,
                                         pass_fds=(theirs.fileno(),),
                                         stdin=subprocess.DEVNULL)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        self.report: str | None = None
        self._send_lock = threading.Lock()
        # Sent from a thread: a large payload fills the pipe until the rank has
        # imported numcoll and reads it, and the ranks should import at once.
        self._sender = threading.Thread(target=self.send, args=(dict(start, rank=rank),),
                                        name=f"numcoll-launch-send-r{rank}", daemon=True)
        self._sender.start()

    def send(self, message) -> None:
        try:
            with self._send_lock:
                self.conn.send(message)
        except OSError:
            pass  # it died: the supervisor reports its exit

    def close(self) -> None:
        """Close our end once the process is gone (which fails a send still
        blocked on a rank that never read it)."""
        self._sender.join(_STOP_GRACE_S)
        self.conn.close()

    def exit_text(self) -> str:
        try:
            code = self.proc.wait(_REPORT_S)
        except subprocess.TimeoutExpired:
            return "closed its pipe to the launcher without reporting a result"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"process was killed by {name} without reporting a result"
        return f"process exited with code {code} without reporting a result"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                os.kill(self.proc.pid, signal.SIGCONT)  # a stopped rank must see its SIGTERM
            except OSError:
                pass


def _pickled(fn, args) -> bytes:
    try:
        return cloudpickle.dumps((fn, args))
    except Exception as exc:  # noqa: BLE001 - one clear error instead of pickle's
        raise TypeError(
            f"launch(mode='process'): cannot send {getattr(fn, '__qualname__', fn)!r} and its "
            f"arguments to the rank processes: {_describe(exc)}. Each rank is a fresh Python "
            "process, so the function, its arguments and what it refers to are pickled "
            "(with cloudpickle); locks, sockets, open files, generators and threads cannot "
            "be. Create such objects inside the function, or use mode='thread'.") from None


def _launch_processes(fn, world_size, args, transport, timeout, group_timeout, threads):
    if os.name != "posix":
        raise NotImplementedError("launch(mode='process') needs a POSIX system; "
                                  "use mode='thread'")
    payload = _pickled(fn, args)
    outcomes = _Outcomes(world_size)
    with TCPStore("127.0.0.1", 0, world_size=None, is_master=True,
                  timeout=group_timeout) as store:
        start = dict(sys_path=list(sys.path), payload=payload, port=store.port,
                     world_size=world_size, transport=transport, threads=threads,
                     group_timeout_s=group_timeout.total_seconds())
        ranks: list[_RankProcess] = []
        try:
            for r in range(world_size):
                ranks.append(_RankProcess(r, world_size, start))
            _supervise(ranks, outcomes, timeout)
        finally:
            _stop_all(ranks)
    outcomes.raise_first()
    return outcomes.results


def _stop_all(ranks: list[_RankProcess]) -> None:
    for r in ranks:
        r.stop()
    deadline = time.monotonic() + _STOP_GRACE_S
    for r in ranks:
        try:
            r.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            r.proc.kill()
            r.proc.wait()
        r.close()


def _receive(r: _RankProcess, outcomes: _Outcomes, load_errors: dict) -> bool:
    """Handle one message (or the end) of rank ``r``; True once it is done."""
    try:
        message = r.conn.recv()
    except (EOFError, OSError):
        outcomes.fail(r.rank, None, r.exit_text())
        return True
    kind = message[0]
    if kind == "report":
        r.report = message[1]
        return False
    if kind == "ok":
        try:
            outcomes.results[r.rank] = cloudpickle.loads(message[1])
        except Exception as exc:  # noqa: BLE001 - e.g. a class the launcher cannot import
            outcomes.fail(r.rank, exc, f"its result could not be unpickled here: "
                                       f"{_describe(exc)}")
    elif kind == "load-error":
        load_errors[r.rank] = message[1]
    else:
        _, blob, summary, text = message
        exc = None
        if blob is not None:
            try:
                exc = cloudpickle.loads(blob)
            except Exception:  # noqa: BLE001 - e.g. an exception class the launcher lacks
                exc = None
        outcomes.fail(r.rank, exc, f"{summary}\n--- traceback of rank {r.rank} ---\n{text}")
    return True


def _supervise(ranks: list[_RankProcess], outcomes: _Outcomes, timeout: timedelta) -> None:
    deadline = time.monotonic() + timeout.total_seconds()
    pending = {r.rank: r for r in ranks}
    load_errors: dict[int, str] = {}
    first_failure_at = None
    while pending:
        now = time.monotonic()
        if now > deadline:
            _timed_out(pending, outcomes, load_errors, timeout)
        for conn in _wait_ready([r.conn for r in pending.values()],
                                min(_POLL_S, max(0.0, deadline - now))):
            r = next(r for r in pending.values() if r.conn is conn)
            if _receive(r, outcomes, load_errors):
                del pending[r.rank]
        if load_errors:
            _raise_load_error(load_errors)
        if outcomes.failures and first_failure_at is None:
            first_failure_at = time.monotonic()
        if first_failure_at is not None and time.monotonic() - first_failure_at > _FAILURE_GRACE_S:
            for rank in pending:
                outcomes.fail(rank, None, "terminated: still running "
                                          f"{_FAILURE_GRACE_S:g}s after another rank failed "
                                          "(stopped, or blocked outside numcoll?)")
            return


def _timed_out(pending: dict, outcomes: _Outcomes, load_errors: dict, timeout: timedelta):
    """Ask the ranks still running what they are blocked on; raise LaunchTimeoutError."""
    for r in pending.values():
        r.send("report")
    asked = dict(pending)
    until = time.monotonic() + _REPORT_S
    while time.monotonic() < until and any(r.report is None for r in asked.values()):
        for conn in _wait_ready([r.conn for r in asked.values() if r.report is None], _POLL_S):
            r = next(r for r in asked.values() if r.conn is conn)
            if _receive(r, outcomes, load_errors):
                asked.pop(r.rank)
                pending.pop(r.rank, None)
    stuck = sorted(pending)
    if not stuck:
        return  # they all finished while we asked
    blocked = {rank: pending[rank].report or "no answer (stopped, or stuck outside Python)"
               for rank in stuck}
    raise LaunchTimeoutError(_timeout_message(timeout, stuck, blocked), stuck, blocked,
                             _finished(outcomes, stuck))


def _raise_load_error(load_errors: dict[int, str]) -> None:
    text = load_errors[min(load_errors)]  # every rank loads the same bytes
    raise LaunchError(
        f"launch: the ranks could not load the function: {text}. Each rank is a fresh "
        "Python process: functions defined in the script, a notebook or on stdin travel by "
        "value, but a function from a module is imported there by name, so that module "
        "must be importable by the ranks (on sys.path or PYTHONPATH, installed, or "
        "defined in the script itself)") from None
