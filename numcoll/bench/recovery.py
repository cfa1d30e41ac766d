"""Surviving a dead rank, measured: how soon the survivors have a working
group after a rank is SIGKILLed in a large allreduce, and whether ``agree``
ever gives two survivors different answers when ranks die at random moments.

::

    python -m numcoll.bench.recovery --kills 20 --agree-jobs 40

Shrink: each trial launches ``world_size`` process ranks (``nc.launch``; the
store is served by the launcher), which run 64 MiB allreduces; the last rank
SIGKILLs itself a random 0-30 ms into one. The time counted runs from just
before the kill (the system-wide monotonic clock, written by the victim) to
the moment the last survivor has a shrunk group on which one 64 MiB
allreduce came out right.

Agree (``--agree-trials``): each trial forks ``world_size`` ranks from this
process (numcoll already imported: a trial costs a group's set-up, not
interpreters' start), which make a fresh group and call ``agree`` with
random flags; one of them, at random, SIGKILLs itself a random 0-15 ms into
it -- before, while or after it votes. A trial disagrees if two survivors'
answers differ, or if the flag is not the AND of the flags of the ranks the
answer calls alive; it fails if a survivor raised or hung, or if a rank
outlives it. ``--agree-jobs`` runs the same with ranks started by
``nc.launch``, several kills per job.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import threading
import time
from datetime import timedelta

import numpy as np

from .. import api as dist
from ..bootstrap.store import PrefixStore
from ..bootstrap.tcpstore import TCPStore
from ..errors import NumcollError
from ..launcher.local import LaunchTimeoutError, RankFailedError, launch
from ..process_group import ProcessGroup

__all__ = ["shrink_trial", "netns_shrink_trial", "agree_job", "agree_trial", "restart_s",
           "main"]

BIG_COUNT = (64 << 20) // 4  # 64 MiB of float32


def _kill_later(delay_s: float, mark) -> None:
    def go():
        time.sleep(delay_s)
        mark()
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=go, name="bench-victim", daemon=True).start()


def _rank_shrink(seed: int, count: int) -> dict:
    rank, size = dist.get_rank(), dist.get_world_size()
    store = dist.get_default_group()._root_store
    x = np.empty(count, np.float32)
    for _ in range(2):  # warm: buffers, arena pages
        x.fill(1)
        dist.all_reduce(x)
    dist.barrier()
    if rank == size - 1:
        delay = random.Random(seed).uniform(0.0, 0.03)
        _kill_later(delay, lambda: store.set("bench/killed_at", repr(time.monotonic())))
    try:
        for _ in range(1000):
            x.fill(1)
            dist.all_reduce(x)
    except NumcollError as exc:
        error = f"{type(exc).__name__}: {exc}"
    else:
        return {"error": None}
    failed_at = time.monotonic()
    new = dist.shrink_group(timeout=30)
    shrunk = time.monotonic()
    x.fill(new.rank() + 1)
    dist.all_reduce(x)
    ready = time.monotonic()
    killed_at = float(store.get("bench/killed_at"))
    dist.barrier()  # every survivor has read the store (its host may be rank 0)
    expected = sum(range(1, new.size() + 1))
    return {"error": error, "failed_at": failed_at, "shrunk": shrunk, "ready": ready,
            "correct": bool(np.all(x == expected)), "size": new.size(),
            "old_ranks": new.old_ranks(), "transport": new.transport_kind,
            "killed_at": killed_at}


def shrink_trial(world_size: int = 4, seed: int = 0, transport: str | None = None,
                 count: int = BIG_COUNT) -> dict:
    """One kill: seconds from the death to the last survivor's working group."""
    try:
        results = launch(_rank_shrink, world_size, args=(seed, count), transport=transport,
                         timeout=120, group_timeout=30)
    except (RankFailedError, LaunchTimeoutError) as exc:
        results = exc.results
    survivors = [r for r in results[:world_size - 1] if r]
    ok = (len(survivors) == world_size - 1 and all(r.get("correct") for r in survivors)
          and all(r["size"] == world_size - 1 for r in survivors))
    if not ok:
        return {"ok": False, "results": results}
    killed = survivors[0]["killed_at"]
    return {"ok": True, "recover_s": max(r["ready"] for r in survivors) - killed,
            "detect_s": max(r["failed_at"] for r in survivors) - killed,
            "shrunk_s": max(r["shrunk"] for r in survivors) - killed,
            "transport": survivors[0]["transport"]}


_NETNS_RANK = """
import datetime, json, sys
import numcoll as nc
from numcoll.bench.recovery import _rank_shrink
nc.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
print("RESULT " + json.dumps(_rank_shrink(int(sys.argv[1]), int(sys.argv[2]))), flush=True)
nc.destroy_process_group()
"""


def netns_shrink_trial(hosts, seed: int, port: int, count: int = BIG_COUNT) -> dict:
    """:func:`shrink_trial` with one rank per host of ``hosts``
    (:class:`numcoll.testing.netns.Hosts`: network namespaces, so tcp between
    every pair); rank 0 hosts the store, the last rank is killed."""
    import subprocess
    import sys

    n = len(hosts.names)
    env = dict(os.environ, WORLD_SIZE=str(n), MASTER_ADDR=hosts.addrs[0],
               MASTER_PORT=str(port), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [
                   os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
                   os.environ.get("PYTHONPATH")])))
    procs = [hosts.popen(r, [sys.executable, "-c", _NETNS_RANK, str(seed), str(count)],
                         dict(env, RANK=str(r))) for r in range(n)]
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        line = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        results.append(json.loads(line[-1][7:]) if line else {"stderr": err[-2000:]})
    survivors = results[:n - 1]
    if not all(r.get("correct") for r in survivors):
        return {"ok": False, "results": results}
    killed = survivors[0]["killed_at"]
    return {"ok": True, "recover_s": max(r["ready"] for r in survivors) - killed,
            "detect_s": max(r["failed_at"] for r in survivors) - killed,
            "shrunk_s": max(r["shrunk"] for r in survivors) - killed,
            "transport": survivors[0]["transport"]}


def _rank_agree(seed: int, rounds: int) -> list:
    rank, size = dist.get_rank(), dist.get_world_size()
    alive = list(range(size))
    answers = []
    for rnd in range(rounds):
        rng = random.Random(seed * 1000 + rnd)
        flags = {r: rng.choice([0b111, 0b101, 0b011, 0b110, 0b111, 0b111]) for r in range(size)}
        victim = rng.choice(alive[1:]) if len(alive) > 2 else None
        delay = rng.uniform(0.0, 0.02)
        dist.barrier() if rnd == 0 else None
        if victim == rank:
            _kill_later(delay, lambda: None)
        flag, failed = dist.agree(flags[rank], timeout=30)
        answers.append((rnd, flag, failed, [flags[r] for r in range(size)]))
        alive = [r for r in range(size) if r not in failed]
        if victim == rank:
            time.sleep(1)  # the kill comes
    return answers


def agree_job(world_size: int = 6, seed: int = 0, rounds: int | None = None) -> dict:
    """One job of agree rounds with kills; how many rounds, and disagreements."""
    rounds = rounds or world_size - 2
    try:
        results = launch(_rank_agree, world_size, args=(seed, rounds), timeout=120,
                         group_timeout=30)
    except (RankFailedError, LaunchTimeoutError) as exc:
        results = exc.results
    survivors = [r for r in results if r]
    by_round: dict[int, set] = {}
    bad_and = 0
    for answers in survivors:
        for rnd, flag, failed, flags in answers:
            by_round.setdefault(rnd, set()).add((flag, tuple(failed)))
            want = -1
            for r, f in enumerate(flags):
                if r not in failed:
                    want &= f
            bad_and += int(want != flag)
    disagreements = sum(len(v) > 1 for v in by_round.values())
    return {"rounds": len(by_round), "disagreements": disagreements, "bad_and": bad_and,
            "complete": all(len(a) == rounds for a in survivors) and len(survivors) >= 2,
            "killed": world_size - len(survivors)}


def _rank_restart(count: int) -> bool:
    x = np.full(count, dist.get_rank() + 1, np.float32)
    dist.all_reduce(x)
    return bool(np.all(x == sum(range(1, dist.get_world_size() + 1))))


_GLOO_RESTART = """
import sys, time, numpy, torch, torch.distributed as dist
rank, size, port, count = map(int, sys.argv[1:])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=size)
x = torch.full((count,), float(rank + 1))
dist.all_reduce(x)
assert bool((x == sum(range(1, size + 1))).all())
dist.destroy_process_group()
"""


def restart_s(world_size: int, count: int = BIG_COUNT, gloo: bool = False) -> float:
    """The anchor: what going on costs without shrink -- start ``world_size``
    ranks again (numcoll's ``nc.launch``, or torch's gloo in fresh
    interpreters), meet, and run one allreduce of ``count`` floats (seconds)."""
    start = time.monotonic()
    if not gloo:
        assert all(launch(_rank_restart, world_size, args=(count,), timeout=120))
        return time.monotonic() - start
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", _GLOO_RESTART, str(r), str(world_size),
                               str(port), str(count)], env=env) for r in range(world_size)]
    codes = [p.wait(120) for p in procs]
    assert codes == [0] * world_size, codes
    return time.monotonic() - start


def _forked_rank(port: int, trial: int, rank: int, size: int, transport: str | None,
                 flag: int, kill_after_s: float | None, out_fd: int) -> None:
    """A forked rank of :func:`agree_trial` (never returns)."""
    code = 1
    try:
        store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
        pg = ProcessGroup(PrefixStore(f"trial{trial}", store), rank, size,
                          ProcessGroup.Options(transport=transport,
                                               timeout=timedelta(seconds=30)))
        if kill_after_s is not None:
            _kill_later(kill_after_s, lambda: None)
        value, failed = pg.agree(flag, timeout=30)
        answer = [rank, value, failed]
        pg.shutdown()
        store.close()
        code = 0
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        answer = [rank, None, f"{type(exc).__name__}: {exc}"]
    os.write(out_fd, (json.dumps(answer) + "\n").encode())
    os._exit(code)


def agree_trial(store: TCPStore, trial: int, size: int = 4, transport: str | None = "shm",
                seed: int = 0) -> dict:
    """One agreement of ``size`` forked ranks, one killed at a random moment."""
    rng = random.Random(seed * 100_003 + trial)
    flags = [rng.choice([0b111, 0b101, 0b011, 0b110, 0b111]) for _ in range(size)]
    victim, delay = rng.randrange(size), rng.uniform(0.0, 0.015)
    read_fd, write_fd = os.pipe()
    pids = []
    for r in range(size):
        pid = os.fork()
        if pid == 0:
            os.close(read_fd)
            _forked_rank(store.port, trial, r, size, transport, flags[r],
                         delay if r == victim else None, write_fd)
        pids.append(pid)
    os.close(write_fd)
    with os.fdopen(read_fd) as pipe:
        lines = pipe.read().splitlines()  # until every rank has exited or closed it
    deadline, statuses = time.monotonic() + 30, {}
    while len(statuses) < size and time.monotonic() < deadline:
        for pid in pids:
            if pid not in statuses:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    statuses[pid] = status
        time.sleep(0.005)
    for pid in pids:  # nothing outlives a trial
        if pid not in statuses:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    answers = [json.loads(line) for line in lines]
    survivors = {a[0]: a for a in answers}
    errors = [a[2] for a in answers if a[1] is None]
    decided = {(a[1], tuple(a[2])) for a in answers if a[1] is not None}
    bad_and = 0
    for flag, failed in decided:
        want = -1
        for r in range(size):
            if r not in failed:
                want &= flags[r]
        bad_and += int(want != flag)
    return {"survivors": sorted(survivors), "victim": victim, "errors": errors,
            "disagree": len(decided) > 1, "bad_and": bad_and,
            "hung": len(statuses) < size,
            "victim_counted": bool(decided) and victim in next(iter(decided))[1]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=20, help="shrink trials (default 20)")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--transport", default=None, help="shm (the default on one host), tcp, ...")
    p.add_argument("--netns-kills", type=int, default=0,
                   help="shrink trials with one rank per network namespace (tcp; root)")
    p.add_argument("--restarts", type=int, default=0,
                   help="the anchor: restart world_size - 1 ranks (numcoll, then gloo) this "
                        "many times")
    p.add_argument("--agree-trials", type=int, default=0,
                   help="agree trials on forked ranks (each with one random kill)")
    p.add_argument("--agree-jobs", type=int, default=0)
    p.add_argument("--agree-world", type=int, default=6)
    ns = p.parse_args(argv)
    times, detect, shrunk, failures, kind = [], [], [], 0, None
    for i in range(ns.kills):
        t = shrink_trial(ns.world_size, seed=i, transport=ns.transport)
        if not t["ok"]:
            failures += 1
            print(f"shrink trial {i}: FAILED {t['results']}", flush=True)
            continue
        times.append(t["recover_s"])
        detect.append(t["detect_s"])
        shrunk.append(t["shrunk_s"])
        kind = t["transport"]
        print(f"shrink trial {i}: death -> working group {t['recover_s'] * 1e3:.0f} ms "
              f"(death -> last survivor's error {t['detect_s'] * 1e3:.0f} ms)", flush=True)
    if times:
        print(f"SHRINK {ns.world_size} ranks ({kind}), 64 MiB allreduce, {len(times)} kills "
              f"({failures} failed): death -> working group median "
              f"{statistics.median(times) * 1e3:.0f} ms, max {max(times) * 1e3:.0f} ms; "
              f"death -> error median {statistics.median(detect) * 1e3:.0f} ms; death -> "
              f"shrink returned median {statistics.median(shrunk) * 1e3:.0f} ms", flush=True)
    if ns.netns_kills:
        _netns_trials(ns)
    for gloo in (False, True):
        if ns.restarts:
            runs = [restart_s(ns.world_size - 1, gloo=gloo) for _ in range(ns.restarts)]
            print(f"RESTART (the anchor) {ns.world_size - 1} ranks, "
                  f"{'torch gloo, fresh interpreters' if gloo else 'numcoll, nc.launch'}: "
                  f"start, meet, one 64 MiB allreduce: median "
                  f"{statistics.median(runs) * 1e3:.0f} ms of {ns.restarts}", flush=True)
    trial_failures = _agree_trials(ns) if ns.agree_trials else 0
    rounds = disagreements = bad = incomplete = killed = 0
    for j in range(ns.agree_jobs):
        a = agree_job(ns.agree_world, seed=j)
        rounds += a["rounds"]
        disagreements += a["disagreements"]
        bad += a["bad_and"]
        incomplete += int(not a["complete"])
        killed += a["killed"]
        print(f"agree job {j}: {a}", flush=True)
    if ns.agree_jobs:
        print(f"AGREE {ns.agree_jobs} jobs of {ns.agree_world} ranks: {rounds} rounds, "
              f"{killed} ranks killed at random moments, {disagreements} disagreements, "
              f"{bad} wrong ANDs, {incomplete} jobs incomplete", flush=True)
    return int(bool(failures or disagreements or bad or incomplete or trial_failures))


def _netns_trials(ns) -> None:
    from ..testing.netns import Hosts, unavailable

    reason = unavailable()
    if reason:
        print(f"SHRINK over network namespaces: skipped ({reason})", flush=True)
        return
    times, detect, shrunk, failed = [], [], [], 0
    with Hosts(ns.world_size) as hosts:
        for i in range(ns.netns_kills):
            t = netns_shrink_trial(hosts, i, 29600 + i)
            if not t["ok"]:
                failed += 1
                print(f"netns shrink trial {i}: FAILED {t['results']}", flush=True)
                continue
            times.append(t["recover_s"])
            detect.append(t["detect_s"])
            shrunk.append(t["shrunk_s"])
            print(f"netns shrink trial {i}: death -> working group {t['recover_s'] * 1e3:.0f} "
                  f"ms (-> last error {t['detect_s'] * 1e3:.0f} ms)", flush=True)
    if times:
        print(f"SHRINK {ns.world_size} ranks on {ns.world_size} network namespaces (tcp), "
              f"64 MiB allreduce, {len(times)} kills ({failed} failed): death -> working "
              f"group median {statistics.median(times) * 1e3:.0f} ms, max "
              f"{max(times) * 1e3:.0f} ms; death -> error median "
              f"{statistics.median(detect) * 1e3:.0f} ms; death -> shrink returned median "
              f"{statistics.median(shrunk) * 1e3:.0f} ms", flush=True)


def _warm(transport: str) -> None:
    """Make a group of two thread ranks here once, so that what the forked
    ranks run (the transport's compiled kernels) is compiled before they fork."""
    from ..bootstrap.store import HashStore

    store, made = HashStore(), [None, None]

    def rank(r):
        made[r] = ProcessGroup(store, r, 2, ProcessGroup.Options(transport=transport))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for pg in made:
        if pg is not None:
            pg.shutdown()


def _agree_trials(ns) -> int:
    _warm(ns.transport or "shm")
    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60))
    disagree = bad = errors = hung = counted = 0
    start = time.monotonic()
    try:
        for i in range(ns.agree_trials):
            t = agree_trial(store, i, ns.world_size, ns.transport or "shm")
            disagree += t["disagree"]
            bad += t["bad_and"]
            errors += bool(t["errors"])
            hung += t["hung"]
            counted += t["victim_counted"]
            if t["errors"] or t["disagree"] or t["bad_and"] or t["hung"]:
                print(f"agree trial {i}: {t}", flush=True)
            if (i + 1) % 100 == 0:
                print(f"agree trials: {i + 1} done, {disagree} disagreements", flush=True)
    finally:
        store.close()
    print(f"AGREE {ns.agree_trials} trials of {ns.world_size} forked ranks "
          f"({ns.transport or 'shm'}), one SIGKILLed at a random moment in each: "
          f"{disagree} disagreements, {bad} wrong ANDs, {errors} trials where a survivor "
          f"raised, {hung} hung; the victim was counted failed in {counted} "
          f"({time.monotonic() - start:.0f} s)", flush=True)
    return disagree + bad + errors + hung


if __name__ == "__main__":
    raise SystemExit(main())
