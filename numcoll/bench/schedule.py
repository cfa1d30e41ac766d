"""Interleaved rounds: how the regression gate times its rows on a shared machine.

pytest-benchmark times one case after another, so a burst of load from
another process (a test suite, a compile) lands on the few cases that run
during it, and those look slower: a false alarm. Here every *round* times
every row once, in a new random order, and a row's figure is its best round
(:mod:`numcoll.bench.gate`): a burst spoils one round of many rows, not
every round of one row, and the best round of each row is one the burst
missed.

Ranks are processes started once per world size with :func:`numcoll.launch`
(the default transport and algorithms, exactly what users get) and kept
between rounds. They take their orders from this process over a local socket
(:mod:`multiprocessing.connection`, with a random key), waiting in a blocking
read between orders, so idle ranks cost no CPU while other rows are timed.
For one row and round, each rank meets the others in a barrier, then times
``iters`` iterations one by one (an untimed barrier before each for rooted
collectives); an iteration's time is the slowest rank's, the round's figure
the median over its iterations. Rows of this process (kernels, references)
are timed here the same way.

Ranks that fit the CPUs are pinned one per CPU (:func:`_pin`): unpinned, the
scheduler sometimes keeps two ranks on one core for minutes. Bursts are not
the only load either: on the 2-core development VM a process busy
elsewhere for minutes made 2-rank rows 2-5x slower in every round. So the
share of the CPUs that *other* processes used is read from ``/proc`` around
each round (``busy[name]``); a round above :data:`QUIET_SHARE` does not count
as quiet, and the next one waits for the machine to calm down. A row slowed
by where its processes happened to run is timed again after :meth:`restart`
(new rank processes).

Usage::

    with Schedule(rows) as schedule:
        schedule.run(rounds=9)                 # every row, 9 quiet rounds
        schedule.restart()                     # new rank processes
        schedule.run(rounds=6, names=[...])    # more rounds for some rows
    schedule.rounds[name]                     # seconds per iteration, one per round
"""

from __future__ import annotations

import os
import random
import secrets
import shutil
import tempfile
import threading
import time
from multiprocessing.connection import Client, Connection, Listener
from typing import Callable

import numpy as np

from .rows import Row, exchange_file_nbytes, local_step, missing_api, rank_step, usable_cpus
from .steps import last_algorithm

__all__ = ["Schedule", "ScheduleError", "WARMUP_ITERS"]

#: Untimed iterations of each row before its first round (compiles kernels,
#: maps the arena's pages, fills pools).
WARMUP_ITERS = 5
#: Deadline of one order to the ranks (a row's round, its preparation), in seconds.
ORDER_TIMEOUT_S = 120.0
#: A round is quiet when other processes (and the hypervisor's steal) used at
#: most this fraction of all CPUs' time while it ran. On the 2-core development
#: VM one busy process elsewhere made 2-rank rows 2-5x slower in every round
#: (not in bursts that the best round escapes), so such rounds cannot count.
QUIET_SHARE = 0.15
#: After a busy round, wait at most this long (probing every QUIET_PROBE_S) for
#: the machine to calm down before the next round.
WAIT_QUIET_S = 5.0
QUIET_PROBE_S = 0.25
#: The longest one :meth:`Schedule.run` goes on without a deadline of its own.
RUN_LIMIT_S = 600.0


class ScheduleError(RuntimeError):
    """The ranks could not be started or failed while measuring."""


# -- in the ranks ------------------------------------------------------------------------
def _serve(address: str, authkey: bytes) -> None:
    """A rank's loop: build, warm up and time rows as the driver orders."""
    import numcoll as nc

    rank, world_size = nc.get_rank(), nc.get_world_size()
    steps: dict[str, tuple[Callable[[], object], bool]] = {}
    pinned = _pin(rank, world_size)
    with Client(address, authkey=authkey) as conn:
        conn.send((world_size, rank, os.getpid()))
        while True:
            order = conn.recv()
            if order[0] == "prepare":
                _, name, spec = order
                step, sync = steps[name] = rank_step(spec)
                _timed(step, sync, WARMUP_ITERS)
                conn.send({"algorithm": last_algorithm(rank),
                           "transport": nc.get_default_group().transport_kind,
                           "pinned_cpu": pinned})
            elif order[0] == "time":
                _, name, iters = order
                conn.send(_timed(*steps[name], iters))
            elif order[0] == "stop":
                conn.send("stopped")
                return


def _pin(rank: int, world_size: int) -> int | None:
    """Rank r on CPU r (every thread of this process) when there are enough CPUs.

    Left alone, the scheduler sometimes keeps both ranks of a 2-rank group on
    one core for minutes (a woken rank follows its waker), which made the 1 MiB
    rows 3x slower at random on the 2-core VM: a state of the machine, not of
    the code, so the gate fixes the placement. Returns the CPU, or None when
    the ranks outnumber the CPUs (they then share them as users' do)."""
    cpus = usable_cpus()
    if world_size > len(cpus):
        return None
    cpu = cpus[rank]
    for tid in os.listdir("/proc/self/task"):  # the group's worker threads too
        try:
            os.sched_setaffinity(int(tid), {cpu})
        except OSError:
            pass  # a thread that just ended
    return cpu


def _timed(step: Callable[[], object], sync: bool, iters: int) -> np.ndarray:
    import numcoll as nc

    clock = time.perf_counter
    times = np.empty(iters)
    nc.barrier()  # the ranks start the round together
    for i in range(iters):
        if sync:
            nc.barrier()
        start = clock()
        step()
        times[i] = clock() - start
    return times


# -- the driver --------------------------------------------------------------------------
class _Launch:
    """One world size's ranks: the launch thread and this side of their sockets."""

    def __init__(self, world_size: int, address: str, authkey: bytes, timeout_s: float):
        self.world_size = world_size
        self.conns: list[Connection | None] = [None] * world_size
        self.pids: list[int] = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(address, authkey, timeout_s),
                                       name=f"numcoll-gate-launch-{world_size}", daemon=True)

    def _run(self, address: str, authkey: bytes, timeout_s: float) -> None:
        from ..launcher.local import launch

        try:
            launch(_serve, self.world_size, args=(address, authkey), mode="process",
                   timeout=timeout_s, group_timeout=ORDER_TIMEOUT_S)
        except BaseException as exc:  # noqa: BLE001 - reported by the driver
            self.error = exc

    def order(self, message, ranks=None) -> None:
        for r in (range(self.world_size) if ranks is None else ranks):
            self.conns[r].send(message)

    def reply(self, rank: int, what: str):
        conn = self.conns[rank]
        if not conn.poll(ORDER_TIMEOUT_S):
            raise ScheduleError(f"{what}: rank {rank} of {self.world_size} did not answer "
                                f"within {ORDER_TIMEOUT_S:.0f} s" + self._why())
        try:
            return conn.recv()
        except (EOFError, OSError) as exc:
            self.thread.join(30)
            raise ScheduleError(f"{what}: rank {rank} of {self.world_size} is gone"
                                + self._why()) from exc

    def _why(self) -> str:
        return f" ({type(self.error).__name__}: {self.error})" if self.error else ""


class Schedule:
    """Times ``rows`` in interleaved rounds (see the module docstring).

    ``rounds[name]``: the row's figure per round (seconds per iteration);
    ``info[name]``: what the ranks reported when preparing it (the algorithm
    the flight recorder saw run, the transport); ``skipped[name]``: why a row
    could not run here (issue 19's rows before that API exists).
    """

    def __init__(self, rows: list[Row], *, timeout_s: float = 1800.0, seed: int = 0):
        self.rows = {row.name: row for row in rows}
        if len(self.rows) != len(rows):
            raise ValueError("Schedule: row names must be unique")
        self.rounds: dict[str, list[float]] = {}
        self.info: dict[str, dict] = {}
        self.skipped: dict[str, str] = {}
        self._timeout_s = timeout_s
        self._rng = random.Random(seed)
        self._launches: dict[int, _Launch] = {}
        self._local: dict[str, Callable[[], object]] = {}
        self.busy: dict[str, list[float | None]] = {}
        #: Which rank processes timed each round: 0 until the first restart(), then 1, ...
        self.launch: dict[str, list[int]] = {}
        self._generation = 0
        #: Seconds spent waiting for other processes to leave the CPUs alone.
        self.waited_s = 0.0
        self._tmp: str | None = None
        self._address, self._authkey = "", b""
        self._listener: Listener | None = None

    # -- lifetime ------------------------------------------------------------------
    def __enter__(self) -> Schedule:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> None:
        for name, row in self.rows.items():
            why = missing_api(row.spec["kind"])
            if why:
                self.skipped[name] = why
        live = [row for name, row in self.rows.items() if name not in self.skipped]
        for row in live:
            self.rounds[row.name], self.busy[row.name], self.launch[row.name] = [], [], []
            if not row.world_size:
                step = self._local[row.name] = local_step(row.spec)
                for _ in range(WARMUP_ITERS):
                    step()
        self._tmp = tempfile.mkdtemp(prefix="numcoll-gate-")
        self._authkey = secrets.token_bytes(16)
        self._address = os.path.join(self._tmp, "orders")
        self._listener = Listener(self._address, family="AF_UNIX", authkey=self._authkey)
        self._start_ranks()

    def restart(self) -> None:
        """New rank processes for the rows on ranks (their rounds are kept): a
        row slowed by where the old ones ran (two ranks sharing a core beside a
        busy process) is timed again from a fresh start."""
        self._stop_ranks()
        self._generation += 1
        self._start_ranks()

    def _start_ranks(self) -> None:
        live = [row for name, row in self.rows.items()
                if row.world_size and name not in self.skipped]
        sizes = sorted({row.world_size for row in live})
        for n in sizes:
            self._launches[n] = _Launch(n, self._address, self._authkey, self._timeout_s)
            self._launches[n].thread.start()
        accepted, failed = [], []

        def accept():
            try:
                for _ in range(sum(sizes)):
                    accepted.append(self._listener.accept())
            except BaseException as exc:  # noqa: BLE001 - the listener closed, or a bad key
                failed.append(exc)

        acceptor = threading.Thread(target=accept, name="numcoll-gate-accept", daemon=True)
        acceptor.start()
        deadline = time.monotonic() + ORDER_TIMEOUT_S
        while acceptor.is_alive() and time.monotonic() < deadline:
            if any(launch.error for launch in self._launches.values()):
                break
            acceptor.join(0.1)
        if acceptor.is_alive() or failed:
            self._listener.close()  # unblocks accept()
            self._listener = None
            acceptor.join(5)
            errors = [f"{n} ranks: {type(l.error).__name__}: {l.error}"
                      for n, l in self._launches.items() if l.error]
            raise ScheduleError("the rank processes did not all connect within "
                                f"{ORDER_TIMEOUT_S:.0f} s" + (f" ({'; '.join(errors)})"
                                                              if errors else ""))
        for conn in accepted:
            world_size, rank, pid = conn.recv()
            self._launches[world_size].conns[rank] = conn
            self._launches[world_size].pids.append(pid)
        for row in live:
            self._prepare_ranks(row)

    def _prepare_ranks(self, row: Row) -> None:
        launch, spec = self._launches[row.world_size], row.spec
        if spec["kind"] == "ref_exchange":  # the memory the ranks share: a file of zeros
            path = os.path.join(self._tmp, f"exchange-{row.world_size}-{spec['nbytes']}")
            with open(path, "wb") as f:
                f.truncate(exchange_file_nbytes(row.world_size, spec["nbytes"]))
            spec = {**spec, "path": path}
        launch.order(("prepare", row.name, spec))
        replies = [launch.reply(r, f"preparing {row.name}") for r in range(row.world_size)]
        self.info[row.name] = replies[0]

    def _stop_ranks(self) -> None:
        """Order the ranks to return (so their launches end), and wait for them."""
        for launch in self._launches.values():
            try:
                if all(launch.conns):
                    launch.order(("stop",))
                    for r in range(launch.world_size):
                        launch.reply(r, "stopping")
            except (ScheduleError, OSError):
                pass  # a rank that failed: its launch ends (and stops the others) anyway
            finally:
                for conn in launch.conns:
                    if conn is not None:
                        conn.close()
        for launch in self._launches.values():
            launch.thread.join(self._timeout_s)
        self._launches.clear()

    def close(self) -> None:
        """Stop the ranks and remove the socket and the shared files."""
        self._stop_ranks()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    # -- measuring -----------------------------------------------------------------
    def run(self, rounds: int, names: list[str] | None = None, *,
            deadline: float | None = None,
            progress: Callable[[int, int], None] | None = None) -> int:
        """Make ``rounds`` quiet rounds of the rows named (default: every row that
        runs here), each in a new random order, or as many as fit before
        ``deadline`` (``time.monotonic()``; default :data:`RUN_LIMIT_S` from
        now); return how many were quiet.

        A round during which other processes used more than
        :data:`QUIET_SHARE` of the CPUs' time is kept, marked busy
        (``busy[name]``: the others' share in each round), and, when some of
        the rows run on ranks (rows in this process hold up under load), the
        next round waits (up to the deadline) for the machine to calm down.
        ``progress(quiet, rounds)`` after each round."""
        names = [n for n in (self.rounds if names is None else names) if n in self.rounds]
        on_ranks = any(self.rows[n].world_size for n in names)
        if deadline is None:
            deadline = time.monotonic() + RUN_LIMIT_S
        quiet = 0
        while quiet < rounds and time.monotonic() < deadline:
            order = list(names)
            self._rng.shuffle(order)
            start = self._cpu_snapshot()
            values = {name: self._round(self.rows[name]) for name in order}
            share = _others_share(start, self._cpu_snapshot())
            for name, times in values.items():
                self.rounds[name].append(float(np.median(times)))
                self.busy[name].append(share)
                self.launch[name].append(self._generation if self.rows[name].world_size else 0)
            if share is None or share <= QUIET_SHARE or not on_ranks:
                quiet += 1
            else:
                self._wait_quiet(deadline)
            if progress is not None:
                progress(quiet, rounds)
        return quiet

    def _cpu_snapshot(self) -> tuple[int, int, int] | None:
        pids = [os.getpid()] + [pid for launch in self._launches.values() for pid in launch.pids]
        return _cpu_jiffies(pids)

    def _wait_quiet(self, deadline: float) -> None:
        """Sleep while other processes keep the CPUs busy (at most until ``deadline``,
        and at most :data:`WAIT_QUIET_S`), so that rounds are timed when they are not."""
        stop = min(time.monotonic() + WAIT_QUIET_S, deadline)
        while time.monotonic() < stop:
            start = self._cpu_snapshot()
            time.sleep(QUIET_PROBE_S)
            share = _others_share(start, self._cpu_snapshot())
            self.waited_s += QUIET_PROBE_S
            if share is None or share <= QUIET_SHARE:
                return

    def _round(self, row: Row) -> np.ndarray:
        if row.world_size:
            launch = self._launches[row.world_size]
            launch.order(("time", row.name, row.iters))
            per_rank = np.stack([launch.reply(r, f"timing {row.name}")
                                 for r in range(row.world_size)])
            return per_rank.max(axis=0)
        step, clock = self._local[row.name], time.perf_counter
        times = np.empty(row.iters)
        for i in range(row.iters):
            start = clock()
            step()
            times[i] = clock() - start
        return times


def _others_share(start, end) -> float | None:
    """The fraction of all CPUs' time that processes other than ours used
    between two :func:`_cpu_jiffies` snapshots (None: unknown)."""
    if start is None or end is None or end[1] <= start[1]:
        return None
    (busy0, total0, ours0), (busy1, total1, ours1) = start, end
    return max(0, (busy1 - busy0) - (ours1 - ours0)) / (total1 - total0)


def _cpu_jiffies(pids: list[int]) -> tuple[int, int, int] | None:
    """(busy, total) jiffies of all CPUs since boot (steal counts as busy: another
    guest had the core) and the CPU time of ``pids`` (None without /proc)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
        ours = 0
        for pid in pids:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read().rsplit(")", 1)[1].split()
            ours += int(stat[11]) + int(stat[12])  # utime, stime (fields 14, 15)
    except (OSError, ValueError, IndexError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    busy = user + nice + system + irq + softirq + steal
    return busy, busy + idle + iowait, ours
