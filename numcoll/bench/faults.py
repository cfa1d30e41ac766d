"""Fault injection: what the surviving ranks see when one rank dies, stalls or
leaves early, when ranks call mismatched collectives, when the store's host
dies, when strangers connect and stay silent or crowd the store, and whether
long runs of collectives stay correct without growing.

``python -m numcoll.faults`` (:mod:`numcoll.bench.fault_table`) runs the
scenarios on ranks launched as processes and prints the fault table;
``--markdown`` prints it as ``docs/guide/faults.md`` has it. ``tests/test_faults.py`` runs
the same scenarios, asserts on the figures and checks the docs' table.

Detection time is measured from the fault (the culprit writes the time, from
the system-wide monotonic clock, just before it kills, stops or returns; for a
mismatch, the call) to the moment each survivor's call raised.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import re
import signal
import socket
import tempfile
import threading
import time
from datetime import timedelta

import numpy as np

from .. import api as dist
from ..launcher.local import LaunchTimeoutError, RankFailedError, launch
from ..bootstrap.tcpstore import TCPStore
from ..ops import ReduceOp

__all__ = ["Figures", "run_scenario", "run_strangers", "run_mismatches", "run_store_gone",
           "SCENARIOS", "MISMATCHES", "soak"]

#: Ranks of the kill / stop / early scenarios by default; the culprit is the last.
WORLD_SIZE = 4
BIG_COUNT = (16 << 20) // 4  # 16 MiB of float32
_GROUP_KEYS = "numcoll/default/0/transport"  # where the default group's transport meets
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclasses.dataclass
class Figures:
    """What one scenario measured. Per survivor: ``detect_s`` (fault to error),
    ``errors`` (type and message), ``named`` (the first rank other than itself
    that its error names). ``leftovers`` lists what outlived the launch."""

    scenario: str
    culprit: int | None
    detect_s: dict[int, float]
    errors: dict[int, str]
    named: dict[int, int | None]
    hung: list[int]
    wrong_results: int
    leftovers: dict[str, list[str]]
    wall_s: float
    notes: dict = dataclasses.field(default_factory=dict)


# -- inside the ranks --------------------------------------------------------------------
def _store_client() -> TCPStore:
    return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                    is_master=False, timeout=timedelta(seconds=10))


def _artifacts() -> dict[str, list[str]]:
    """The files the default group made: ipc socket paths and shared-memory slabs
    (none for transports that publish no ZeroMQ endpoint, e.g. shm)."""
    store, size = _store_client(), dist.get_world_size()
    try:
        # Each ZeroMQ rank publishes "endpoint nonce mode": the endpoint is the first word.
        keys = [f"{_GROUP_KEYS}/addr/{r}" for r in range(size)]
        addrs = ([store.get(k).decode().split()[0] for k in keys] if store.check(keys)
                 else [])
        slabs = []
        for r in range(size):
            for p in range(size):
                key = f"{_GROUP_KEYS}/shm/{r}/{p}"
                if r != p and store.check([key]):
                    slabs.append(store.get(key).decode())
    finally:
        store.close()
    return {"addrs": addrs, "slabs": [s for s in slabs if s != "none"]}


def _mark(workdir: str, name: str, text: str = "") -> None:
    with open(os.path.join(workdir, name), "w") as f:
        f.write(text)


def _rank_in_fault(kind: str, workdir: str, rounds_before: int) -> dict:
    """All ranks run 16 MiB allreduces; the last rank is killed ("kill"), stopped
    ("stop") or returns ("early") in the middle; the others report what they saw."""
    rank, culprit = dist.get_rank(), dist.get_world_size() - 1
    x = np.empty(BIG_COUNT, np.float32)
    expected = float(sum(range(1, dist.get_world_size() + 1)))
    dist.barrier()
    info = {"pid": os.getpid(), "artifacts": _artifacts() if rank == 0 else None,
            "transport": dist.get_default_group().transport_kind}
    if rank == culprit:
        for _ in range(rounds_before):
            x.fill(rank + 1)
            dist.all_reduce(x)
        if kind == "early":
            _mark(workdir, "fault", f"{time.monotonic()} {os.getpid()}")
            return info  # skips the collectives the others still call
        x.fill(rank + 1)
        dist.all_reduce(x, async_op=True)
        time.sleep(0.005)  # let it get under way
        _mark(workdir, "fault", f"{time.monotonic()} {os.getpid()}")
        os.kill(os.getpid(), signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
        time.sleep(60)  # a stopped rank is killed by the driver once the others are done
    wrong = 0
    for _ in range(rounds_before + 50):
        x.fill(rank + 1)
        try:
            dist.all_reduce(x)
        except Exception as exc:  # noqa: BLE001 - what this scenario measures
            info.update(t_error=time.monotonic(), error=f"{type(exc).__name__}: {exc}",
                        peer=getattr(exc, "peer", None))
            break
        wrong += int(not np.all(x == expected))
    info["wrong"] = wrong
    _mark(workdir, f"done-{rank}")
    return info


def _rank_among_strangers(silent: int, crowd: int, rounds: int) -> dict:
    """Rank 0 opens ``silent`` raw connections that never speak to the store and
    to every rank's transport endpoint, and ``crowd`` store clients at once that
    each add 1; meanwhile every rank runs 1 MiB allreduces and makes a new group."""
    rank, size = dist.get_rank(), dist.get_world_size()
    dist.barrier()
    info = {"pid": os.getpid(), "artifacts": _artifacts() if rank == 0 else None}
    held = []
    if rank == 0:
        started = time.monotonic()
        targets = ["tcp://" + os.environ["MASTER_ADDR"] + ":" + os.environ["MASTER_PORT"]]
        targets += info["artifacts"]["addrs"]
        held = [_silent_connection(t) for t in targets for _ in range(silent)]
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            clients = list(pool.map(lambda _: _store_client(), range(crowd)))
            info["crowd_count"] = max(pool.map(lambda c: c.add("crowd", 1), clients),
                                      default=0)
        held += clients
        info["strangers_s"] = time.monotonic() - started
    dist.barrier()
    x = np.empty(1 << 18, np.float32)
    wrong, started = 0, time.monotonic()
    for _ in range(rounds):
        x.fill(rank + 1)
        dist.all_reduce(x)
        wrong += int(not np.all(x == size * (size + 1) / 2))
    sub = dist.new_group(list(range(size)))  # the store still serves rendezvous
    y = np.ones(4)
    dist.all_reduce(y, group=sub)
    wrong += int(not np.all(y == size))
    info.update(wrong=wrong, collectives_s=time.monotonic() - started)
    dist.barrier()
    for h in held:
        h.close()
    return info


def _silent_connection(endpoint: str) -> socket.socket:
    scheme, _, where = endpoint.partition("://")
    if scheme == "ipc":
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # ZeroMQ spells a Linux abstract socket "@name"; the kernel, "\0name".
        s.connect("\0" + where[1:] if where.startswith("@") else where)
    else:
        host, port = where.rsplit(":", 1)
        s = socket.create_connection((host, int(port)), timeout=5)
    return s


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def _rank_soak(n_async: int, n_sequential: int) -> dict:
    """``n_async`` allreduces in flight at once (the group's worker threads run
    them), then ``n_sequential`` small ones back to back; every result checked."""
    rank, size = dist.get_rank(), dist.get_world_size()
    base = size * (size - 1) // 2
    wrong = 0
    # Warm up: kernels compiled, pools and buffers sized -- the repeated call's
    # compiled step too (one array, again and again), whose first compile in a
    # fresh checkout (no Numba cache yet) takes tens of MiB that are no leak.
    x = np.empty(8, np.int64)
    for i in range(200):
        dist.all_reduce(np.full(8, i + rank, np.int64))
        x.fill(i + rank)
        dist.all_reduce(x)
    rss = [_rss_bytes()]
    started = time.monotonic()
    xs = [np.full(8, i + rank, np.int64) for i in range(n_async)]
    works = [dist.all_reduce(x, async_op=True) for x in xs]
    for i, (w, x) in enumerate(zip(works, xs)):
        w.wait()
        wrong += int(not np.all(x == size * i + base))
    async_s = time.monotonic() - started
    rss.append(_rss_bytes())
    started = time.monotonic()
    x = np.empty(8, np.int64)
    for i in range(n_sequential):
        x.fill(i + rank)
        dist.all_reduce(x)
        wrong += int(not np.all(x == size * i + base))
    sequential_s = time.monotonic() - started
    rss.append(_rss_bytes())
    return {"wrong": wrong, "rss": rss, "async_s": async_s, "sequential_s": sequential_s}


# -- the driver --------------------------------------------------------------------------
def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _child_pids() -> list[int]:
    me, kids = os.getpid(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == me and fields[0] != "Z":
                kids.append(int(entry))
    return kids


def _leftovers(artifacts: dict | None, pids: list[int]) -> dict[str, list[str]]:
    artifacts = artifacts or {"addrs": [], "slabs": []}
    sockets = [a.partition("://")[2] for a in artifacts["addrs"] if a.startswith("ipc://")]
    return {
        "shm": [p for p in artifacts["slabs"] if os.path.exists(p)],
        "files": [p for p in sockets if os.path.exists(p)]
        + sorted({os.path.dirname(p) for p in sockets if os.path.isdir(os.path.dirname(p))}),
        "processes": [str(p) for p in pids if _alive(p)],
    }


def _first_rank_named(message: str, own: int) -> int | None:
    for m in re.finditer(r"\brank (\d+)", message):
        if int(m.group(1)) != own:
            return int(m.group(1))
    return None


def _reap_when_done(workdir: str, survivors: list[int], limit_s: float) -> threading.Thread:
    """Kill the culprit once every survivor has reported (a stopped rank would
    otherwise hold the launch until its deadline), as an operator would."""
    def reap():
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            if all(os.path.exists(os.path.join(workdir, f"done-{r}")) for r in survivors):
                break
            time.sleep(0.05)
        try:
            with open(os.path.join(workdir, "fault")) as f:
                pid = int(f.read().split()[1])
            os.kill(pid, signal.SIGKILL)
        except (OSError, IndexError, ValueError):
            pass

    t = threading.Thread(target=reap, name="numcoll-faults-reaper", daemon=True)
    t.start()
    return t


def run_scenario(kind: str, *, world_size: int = WORLD_SIZE, group_timeout_s: float = 2.0,
                 transport: str | None = None) -> Figures:
    """Run one of :data:`SCENARIOS` on ``world_size`` process ranks (the last is
    the culprit); return its figures."""
    if kind not in SCENARIOS:
        raise ValueError(f"unknown scenario {kind!r}; choose one of {', '.join(SCENARIOS)}")
    if world_size < 2:
        raise ValueError(f"a fault needs a culprit and a survivor: world_size >= 2, "
                         f"got {world_size}")
    culprit = world_size - 1
    survivors = list(range(culprit))
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="numcoll-faults-") as workdir:
        reaper = _reap_when_done(workdir, survivors, 60) if kind == "stop" else None
        try:
            results = launch(_rank_in_fault, world_size, args=(kind, workdir, 2),
                             transport=transport, timeout=90, group_timeout=group_timeout_s)
        except (RankFailedError, LaunchTimeoutError) as exc:
            results = getattr(exc, "results", None) or [None] * world_size
        if reaper is not None:
            reaper.join()
        with open(os.path.join(workdir, "fault")) as f:
            fault_at, culprit_pid = f.read().split()
        fault_at = float(fault_at)
    wall = time.monotonic() - started
    detect, errors, named, hung, wrong = {}, {}, {}, [], 0
    for r in survivors:
        info = results[r] or {}
        wrong += info.get("wrong", 0)
        if "t_error" not in info:
            hung.append(r)
            continue
        detect[r] = info["t_error"] - fault_at
        errors[r] = info["error"]
        named[r] = _first_rank_named(info["error"], r)
    pids = [int(culprit_pid)] + [res["pid"] for res in results if res]
    leftovers = _leftovers((results[0] or {}).get("artifacts"), pids)
    leftovers["processes"] += [str(p) for p in _child_pids()]
    return Figures(kind, culprit, detect, errors, named, hung, wrong, leftovers, wall,
                   {"transport": _transport_used(results), "world_size": world_size,
                    "group_timeout_s": group_timeout_s})


def _transport_used(results) -> str | None:
    return next((r.get("transport") for r in results if r and r.get("transport")), None)


def run_strangers(silent: int = 2, crowd: int = 200, rounds: int = 10,
                  transport: str = "tcp", world_size: int = WORLD_SIZE) -> Figures:
    """Strangers that connect and never speak, and a crowd of store clients,
    while the ranks work; every result checked."""
    started = time.monotonic()
    results = launch(_rank_among_strangers, world_size, args=(silent, crowd, rounds),
                     transport=transport, timeout=90, group_timeout=30)
    wall = time.monotonic() - started
    info = results[0]
    leftovers = _leftovers(info["artifacts"], [r["pid"] for r in results])
    leftovers["processes"] += [str(p) for p in _child_pids()]
    notes = {"crowd_count": info["crowd_count"], "strangers_s": info["strangers_s"],
             "collectives_s": max(r["collectives_s"] for r in results), "crowd": crowd,
             "silent": silent}
    return Figures(f"{silent} silent connections to the store and each {transport} endpoint, "
                   f"{crowd} store clients at once", None, {}, {}, {}, [],
                   sum(r["wrong"] for r in results), leftovers, wall, notes)


def soak(world_size: int = 2, n_async: int = 1000, n_sequential: int = 10_000,
         threads: int = 8) -> Figures:
    """1,000 async allreduces on ``threads`` worker threads, then 10,000 small
    ones back to back, on process ranks; RSS (bytes) per rank before/after."""
    started = time.monotonic()
    results = launch(_rank_soak, world_size, args=(n_async, n_sequential), threads=threads,
                     timeout=300, group_timeout=60)
    notes = {"rss": [r["rss"] for r in results],
             "async_s": max(r["async_s"] for r in results),
             "sequential_s": max(r["sequential_s"] for r in results)}
    return Figures(f"soak: {n_async:,} async allreduces on {threads} worker threads, then "
                   f"{n_sequential:,} sequential, {world_size} ranks",
                   None, {}, {}, {}, [], sum(r["wrong"] for r in results),
                   {"processes": [str(p) for p in _child_pids()]},
                   time.monotonic() - started, notes)


#: Mismatched calls, rank 0's beside the others': what differs -> (call, call).
MISMATCHES = ("dtype", "count", "op", "collective", "root")


def _mismatched_call(kind: str, rank: int):
    x = np.zeros(4, np.float32)
    if kind == "dtype":
        return lambda: dist.all_reduce(x if rank == 0 else np.zeros(4, np.float64))
    if kind == "count":
        return lambda: dist.all_reduce(x if rank == 0 else np.zeros(5, np.float32))
    if kind == "op":
        return lambda: dist.all_reduce(
            x, op=ReduceOp.SUM if rank == 0 else ReduceOp.MAX)
    if kind == "collective":
        return (lambda: dist.all_reduce(x)) if rank == 0 else (lambda: dist.broadcast(x, 0))
    if kind == "root":
        return lambda: dist.broadcast(x, src=0 if rank == 0 else 1)
    raise ValueError(f"unknown mismatch {kind!r}")


def _rank_mismatch(kind: str) -> dict:
    """Rank 0 makes one call, every other rank another (see :data:`MISMATCHES`)."""
    rank = dist.get_rank()
    call = _mismatched_call(kind, rank)
    dist.barrier()
    started = time.monotonic()
    info = {"pid": os.getpid(), "transport": dist.get_default_group().transport_kind}
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - what this scenario measures
        info.update(t_error=time.monotonic() - started, error=f"{type(exc).__name__}: {exc}")
    return info


def run_mismatches(world_size: int = 2, transport: str | None = None,
                   kinds=MISMATCHES, group_timeout_s: float = 30.0) -> Figures:
    """Each of :data:`MISMATCHES` in a launch of its own (a mismatch poisons the
    group); every rank must raise, long before ``group_timeout_s``. The figures
    are per rank the slowest detection over the kinds and the message of the
    first kind; ``notes["kinds"]`` has every kind's messages."""
    started = time.monotonic()
    detect, errors, named, hung, per_kind, pids = {}, {}, {}, set(), {}, []
    transport_used = None
    for kind in kinds:
        try:
            results = launch(_rank_mismatch, world_size, args=(kind,), transport=transport,
                             timeout=90, group_timeout=group_timeout_s)
        except (RankFailedError, LaunchTimeoutError) as exc:
            results = getattr(exc, "results", None) or [None] * world_size
        per_kind[kind] = {}
        for rank, info in enumerate(results):
            info = info or {}
            pids.append(info.get("pid"))
            transport_used = transport_used or info.get("transport")
            if "t_error" not in info:
                hung.add(rank)
                continue
            detect[rank] = max(detect.get(rank, 0.0), info["t_error"])
            errors.setdefault(rank, info["error"])
            named.setdefault(rank, _first_rank_named(info["error"], rank))
            per_kind[kind][rank] = info["error"]
    leftovers = _leftovers(None, [p for p in pids if p])
    leftovers["processes"] += [str(p) for p in _child_pids()]
    return Figures("mismatch", None, detect, errors, named, sorted(hung), 0, leftovers,
                   time.monotonic() - started,
                   {"kinds": per_kind, "transport": transport_used, "world_size": world_size,
                    "group_timeout_s": group_timeout_s})


def _rank_store_gone(workdir: str) -> dict:
    """A group whose TCPStore rank 0 hosts (as ``init_method="tcp://..."`` makes
    it); rank 0 is killed; every other rank then shuts the group down."""
    from ..bootstrap.tcpstore import TCPStore as Store
    from ..process_group import ProcessGroup

    rank, size = dist.get_rank(), dist.get_world_size()
    port = np.zeros(1, np.int64)
    host = Store("127.0.0.1", 0, size, is_master=True, timeout=timedelta(seconds=30),
                 wait_for_workers=False) if rank == 0 else None
    if host is not None:
        port[0] = host.port
    dist.broadcast(port, src=0)
    store = host or Store("127.0.0.1", int(port[0]), size, timeout=timedelta(seconds=30))
    pg = ProcessGroup(store, rank, size, ProcessGroup.Options(timeout=timedelta(seconds=30)))
    x = np.ones(4, np.float32)
    pg.allreduce(x).wait()
    dist.barrier()
    if rank == 0:
        _mark(workdir, "fault", f"{time.monotonic()} {os.getpid()}")
        os.kill(os.getpid(), signal.SIGKILL)
    while not os.path.exists(os.path.join(workdir, "fault")):
        time.sleep(0.005)
    time.sleep(0.2)  # the store's host is gone by now
    started = time.monotonic()
    pg.shutdown()
    return {"pid": os.getpid(), "shutdown_s": time.monotonic() - started,
            "transport": pg.transport_kind}


def run_store_gone(world_size: int = 3, transport: str | None = None) -> Figures:
    """How long the survivors' ``ProcessGroup.shutdown()`` (what
    ``destroy_process_group()`` does) takes once the store's host is gone;
    ``detect_s`` holds those times."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="numcoll-faults-") as workdir:
        failure = None
        try:
            results = launch(_rank_store_gone, world_size, args=(workdir,),
                             transport=transport, timeout=90, group_timeout=30)
        except (RankFailedError, LaunchTimeoutError) as exc:
            results, failure = getattr(exc, "results", None) or [None] * world_size, exc
        try:
            with open(os.path.join(workdir, "fault")) as f:
                culprit_pid = int(f.read().split()[1])
        except OSError:
            raise RuntimeError(f"store-gone scenario: rank 0 never got to its fault: "
                               f"{failure}") from failure
    survivors = range(1, world_size)
    done = {r: results[r]["shutdown_s"] for r in survivors if results[r]}
    leftovers = _leftovers(None, [culprit_pid] + [r["pid"] for r in results if r])
    leftovers["processes"] += [str(p) for p in _child_pids()]
    return Figures("store gone", 0, done, {}, {}, [r for r in survivors if r not in done], 0,
                   leftovers, time.monotonic() - started,
                   {"transport": _transport_used(results), "world_size": world_size})


SCENARIOS = ("kill", "stop", "early")
