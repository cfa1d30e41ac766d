"""``nc.launch`` in process mode: one fresh interpreter per rank.

The launcher's side starts the ranks, hands each its function through one end
of a socket pair, and supervises them (results, deaths, the deadline); the
rank's side (:func:`_rank_entry`) dies with the launcher, loads the function,
joins the default group through the launcher's TCPStore and sends back its
outcome. See :mod:`numcoll.launcher.local` for the guarantees.
"""

from __future__ import annotations

import linecache
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import types
from datetime import timedelta
from multiprocessing.connection import Connection, wait as _wait_ready

import cloudpickle

from ..api import world as dist
from ..bootstrap.tcpstore import TCPStore
from .outcomes import (_ROOT, LaunchError, LaunchTimeoutError, _blocked_on, _describe,
                       _finished, _Outcomes, _timeout_message)
from .parent import die_with_parent
from .payload import dumps as _dumps_payload

#: After the first failure, how long the other ranks get to end on their own
#: before they are stopped: a collective blocked on a rank that stalled fails
#: at the group's deadline and then reports (following the peers' abort notes
#: takes up to a second), so the grace is that deadline, at most
#: _FAILURE_GRACE_MAX_S, plus _FAILURE_MARGIN_S; ranks whose peer is gone fail
#: at once anyway. A rank stuck outside numcoll is asked what it is doing, then
#: stopped.
_FAILURE_GRACE_MAX_S = 15.0
_FAILURE_MARGIN_S = 2.0
#: How long ranks still running at the launch deadline get to say what they
#: are blocked on, and how long stopped ranks get to exit before SIGKILL.
_REPORT_S = 1.0
_STOP_GRACE_S = 2.0
_POLL_S = 0.1


# -- processes: the rank's side ----------------------------------------------------------
class _RankChannel:
    """The rank's end of its socket pair: sends outcomes, answers the parent's
    report requests, and kills the process when the parent is gone."""

    def __init__(self, conn: Connection, main_ident: int, rank: int):
        self.conn = conn
        self._send_lock = threading.Lock()
        self._main_ident = main_ident
        self._rank = rank
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
                    self.send(("report", _blocked_on(self._main_ident, self._rank)))
                except OSError:
                    pass


def _rank_entry(fd: int, parent_pid: int) -> None:
    """Entry point of a rank process (``python -c`` runs it; see ``_spawn``)."""
    die_with_parent(parent_pid)
    conn = Connection(fd)
    start = conn.recv()  # from the parent, through the pipe it made
    sys.path[:] = start["sys_path"]
    rank = start["rank"]
    for filename, lines in start["sources"].items():  # tracebacks show the caller's lines
        linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
    channel = _RankChannel(conn, threading.get_ident(), rank)
    try:
        fn, args = cloudpickle.loads(start["payload"])
    except BaseException as exc:  # noqa: BLE001 - shipped to the parent
        channel.send(("load-error", _describe(exc), _traceback(exc)))
        return
    group_timeout = timedelta(seconds=start["group_timeout_s"])
    # Joining is bounded by the launch's deadline, not the collectives': fresh
    # interpreters on a busy machine start seconds apart.
    store = TCPStore("127.0.0.1", start["port"], world_size=None, is_master=False,
                     timeout=timedelta(seconds=start["join_timeout_s"]))
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
        outcome = ("err", blob, _describe(exc), _traceback(exc))
    else:
        try:
            outcome = ("ok", cloudpickle.dumps(value))
        except Exception as exc:  # noqa: BLE001 - an unpicklable result
            outcome = ("err", None, f"the result of rank {rank} could not be pickled: "
                                    f"{_describe(exc)}", "")
    finally:
        store.close()
    channel.send(outcome)


def _traceback(exc: BaseException) -> str:
    """``exc``'s traceback from the caller's function on (the frames of this
    entry point say nothing the user wrote)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _sources(fn, args) -> dict[str, list[str]]:
    """The source lines this process holds for code of ``fn`` and ``args`` that
    is in no file the ranks could read -- notebook cells, ``exec``'d code,
    ``python -c`` -- so that the ranks' tracebacks and reports show the
    caller's lines (a traceback shows a line only where linecache finds it)."""
    codes, seen = [], set()
    todo = [fn, *args]
    while todo:
        obj = todo.pop()
        code = getattr(obj, "__code__", obj)
        if isinstance(code, types.CodeType) and id(code) not in seen:
            seen.add(id(code))
            codes.append(code)
            todo.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
            if not os.path.isfile(code.co_filename):  # its neighbours: functions it calls
                todo.extend(v for v in getattr(obj, "__globals__", {}).values()
                            if isinstance(v, types.FunctionType))
    sources = {}
    for filename in {c.co_filename for c in codes}:
        if os.path.isfile(filename):
            continue
        lines = linecache.getlines(filename)
        if not lines and filename == "<string>" and "-c" in getattr(sys, "orig_argv", ()):
            argv = sys.orig_argv
            lines = argv[argv.index("-c") + 1].splitlines(keepends=True)
        if lines:
            sources[filename] = lines
    return sources


# -- processes: the launcher's side ------------------------------------------------------
_BOOTSTRAP = ("import sys; sys.path.insert(0, {root!r}); "
              "from numcoll.launcher.processes import _rank_entry; _rank_entry({fd}, {ppid})")


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
        return _dumps_payload((fn, args))
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
    with TCPStore("127.0.0.1", 0, world_size=None, is_master=True, timeout=timeout) as store:
        start = dict(sys_path=list(sys.path), payload=payload, port=store.port,
                     world_size=world_size, transport=transport, threads=threads,
                     group_timeout_s=group_timeout.total_seconds(),
                     join_timeout_s=timeout.total_seconds(),
                     sources=_sources(fn, args))
        ranks: list[_RankProcess] = []
        try:
            for r in range(world_size):
                ranks.append(_RankProcess(r, world_size, start))
            _supervise(ranks, outcomes, timeout, failure_grace_s(group_timeout))
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


def failure_grace_s(group_timeout: timedelta) -> float:
    """How long the ranks still running get after the first failure (see
    :data:`_FAILURE_GRACE_MAX_S`): the deadline the user gave them, bounded."""
    return min(group_timeout.total_seconds(), _FAILURE_GRACE_MAX_S) + _FAILURE_MARGIN_S


def _supervise(ranks: list[_RankProcess], outcomes: _Outcomes, timeout: timedelta,
               grace_s: float) -> None:
    deadline = time.monotonic() + timeout.total_seconds()
    pending = {r.rank: r for r in ranks}
    load_errors: dict[int, str] = {}
    first_failure_at = None
    while pending:
        now = time.monotonic()
        if now > deadline:
            _timed_out(pending, outcomes, load_errors, timeout)
            return
        for conn in _wait_ready([r.conn for r in pending.values()],
                                min(_POLL_S, max(0.0, deadline - now))):
            r = next(r for r in pending.values() if r.conn is conn)
            if _receive(r, outcomes, load_errors):
                del pending[r.rank]
        if load_errors:
            _raise_load_error(load_errors)
        if outcomes.failures and first_failure_at is None:
            first_failure_at = time.monotonic()
        if first_failure_at is not None and time.monotonic() - first_failure_at > grace_s:
            first = min(outcomes.failures, key=lambda f: f[0])[1]
            for rank, report in _ask(pending, outcomes, load_errors).items():
                outcomes.fail(rank, None, f"stopped: still running {grace_s:.1f}s after rank "
                                          f"{first} failed; {report}", stopped=True)
            return


def _ask(pending: dict, outcomes: _Outcomes, load_errors: dict) -> dict[int, str]:
    """Ask the ranks still running what they are doing (within _REPORT_S); the
    reports of those still running, by rank (ranks that finish meanwhile leave
    ``pending`` with their outcome)."""
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
    return {rank: pending[rank].report or "no answer (stopped, or stuck outside Python)"
            for rank in sorted(pending)}


def _timed_out(pending: dict, outcomes: _Outcomes, load_errors: dict, timeout: timedelta):
    """Ask the ranks still running what they are blocked on; raise LaunchTimeoutError."""
    blocked = _ask(pending, outcomes, load_errors)
    if not blocked:
        return  # they all finished while we asked
    stuck = sorted(blocked)
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
