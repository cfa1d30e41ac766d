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

Agree: each job launches ``agree_world`` ranks that run rounds of ``agree``
on random flags; in every round one rank still alive (chosen from a seed all
ranks share) SIGKILLs itself at a random moment 0-20 ms after the round
starts -- before, while or after it votes. Every survivor records each
round's answer; a round disagrees if two survivors' answers differ, or if
the flag is not the AND of the flags of the ranks the answer calls alive.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import threading
import time
from datetime import timedelta

import numpy as np

from .. import api as dist
from ..errors import NumcollError
from ..launcher.local import LaunchTimeoutError, RankFailedError, launch

__all__ = ["shrink_trial", "agree_job", "main"]

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
    x.fill(new.rank() + 1)
    dist.all_reduce(x)
    ready = time.monotonic()
    expected = sum(range(1, new.size() + 1))
    return {"error": error, "failed_at": failed_at, "ready": ready,
            "correct": bool(np.all(x == expected)), "size": new.size(),
            "old_ranks": new.old_ranks(), "transport": new.transport_kind,
            "killed_at": float(store.get("bench/killed_at"))}


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=20, help="shrink trials (default 20)")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--transport", default=None, help="shm (the default on one host), tcp, ...")
    p.add_argument("--agree-jobs", type=int, default=10)
    p.add_argument("--agree-world", type=int, default=6)
    ns = p.parse_args(argv)
    times, detect, failures, kind = [], [], 0, None
    for i in range(ns.kills):
        t = shrink_trial(ns.world_size, seed=i, transport=ns.transport)
        if not t["ok"]:
            failures += 1
            print(f"shrink trial {i}: FAILED {t['results']}", flush=True)
            continue
        times.append(t["recover_s"])
        detect.append(t["detect_s"])
        kind = t["transport"]
        print(f"shrink trial {i}: death -> working group {t['recover_s'] * 1e3:.0f} ms "
              f"(death -> last survivor's error {t['detect_s'] * 1e3:.0f} ms)", flush=True)
    if times:
        print(f"SHRINK {ns.world_size} ranks ({kind}), 64 MiB allreduce, {len(times)} kills "
              f"({failures} failed): death -> working group median "
              f"{statistics.median(times) * 1e3:.0f} ms, max {max(times) * 1e3:.0f} ms; "
              f"death -> error median {statistics.median(detect) * 1e3:.0f} ms", flush=True)
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
    return int(bool(failures or disagreements or bad or incomplete))


if __name__ == "__main__":
    raise SystemExit(main())
