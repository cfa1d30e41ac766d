"""The regression gate's rule: when is a row slower than its baseline?

Each row is timed in many interleaved rounds (:mod:`numcoll.bench.schedule`);
its figures (:func:`figures`, from the quiet rounds only) are

* ``best_s``: the best round (a round is the median of its iterations). Load
  from other processes only ever adds time, so the best round is the one
  least disturbed, and it moves little from run to run;
* ``noise``: how much the best itself wobbles within the run: the rounds are
  split into two interleaved halves and ``noise = |best(even) - best(odd)| /
  best``. It is stored with the baseline (``extra_info["gate"]``) so a later
  run knows each row's own noise floor.

A row is judged (:func:`judge`) by ``ratio = best_now / best_baseline /
speed``, where ``speed`` is how much slower the row's *reference* (its
``anchor``: a workload with no numcoll code timed in the same rounds, for a
row on N ranks N processes exchanging as many bytes through shared memory in
NumPy) is than in the baseline, never below 1: a machine that got slower does
not make a row look regressed, and a faster one does not hide anything. The
row regressed when ``ratio`` exceeds ``1 + max(floor, NOISE_FACTOR * noise)``,
``noise`` being the larger of the row's noise now and in the baseline, the
floor :data:`FLOOR` (:data:`FLOOR_OVERSUBSCRIBED` for more ranks than CPUs).
Rows on ranks with too few quiet rounds, now or in the baseline, are not
judged (:attr:`Verdict.busy`).

A row that looks regressed, or whose noise is above :data:`SETTLED_NOISE`,
is timed again from new rank processes (:data:`CONFIRM_ROUNDS` more rounds,
interleaved with its reference, up to :data:`CONFIRM_PASSES` times): its best
can only come down, so a row slowed by a burst of load or by where its
processes ran recovers, and a real regression stays.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import statistics
import time
from typing import Iterable

__all__ = ["FLOOR", "FLOOR_OVERSUBSCRIBED", "NOISE_FACTOR", "SETTLED_NOISE", "CONFIRM_ROUNDS",
           "CONFIRM_PASSES", "MIN_QUIET_ROUNDS", "figures", "anchor_speed", "judge",
           "judge_all", "measure", "Verdict", "format_verdicts", "summary_line", "ReplayClock",
           "load_run", "saved_runs"]

#: A row must be at least this much slower (relative) to be flagged, however
#: steady it is: on the 2-core development VM the best round of an unchanged
#: row moved by up to 18% between back-to-back runs.
FLOOR = 0.25
#: The same for rows with more ranks than CPUs (4 ranks on 2 cores): the ranks
#: take turns on the cores, and their best round moved by up to 70% between
#: launches.
FLOOR_OVERSUBSCRIBED = 0.5
#: The limit is at least this many times the row's own noise.
NOISE_FACTOR = 3.0
#: A row whose noise is above this, or (against a baseline) that looks
#: regressed, is timed again from new rank processes: CONFIRM_ROUNDS more
#: rounds, at most CONFIRM_PASSES times.
SETTLED_NOISE = 0.25
CONFIRM_ROUNDS = 20
CONFIRM_PASSES = 2
#: Rows need this many quiet rounds (see numcoll.bench.schedule.QUIET_SHARE);
#: rows on ranks that have fewer are not judged (the machine was busy).
MIN_QUIET_ROUNDS = 8


def figures(round_s: Iterable[float], busy: Iterable[float | None] | None = None,
            launches: Iterable[int] | None = None) -> dict:
    """A row's figures from its rounds (seconds per iteration, one per round),
    the share of the CPUs other processes used in each (``busy``; None:
    unknown) and which rank processes timed each (``launches``: a row timed
    again after :meth:`~numcoll.bench.schedule.Schedule.restart`).

    Only quiet rounds count (see :data:`~numcoll.bench.schedule.QUIET_SHARE`);
    with fewer than :data:`MIN_QUIET_ROUNDS` of them, every round does and the
    figures are marked ``loaded``. The best is over every launch. With several
    launches the noise is taken where the row was steadiest: the launch (of 4
    rounds or more) whose best plus its own noise is lowest, that upper edge
    measured from the overall best. New processes may sit in another state
    (two ranks sharing a core) for all their rounds; what the limit needs is how
    repeatable the best is where it was found, not how far apart the states
    are."""
    from .schedule import QUIET_SHARE

    rounds = [float(v) for v in round_s]
    if not rounds:
        raise ValueError("figures: no rounds")
    busy = list(busy) if busy is not None else [None] * len(rounds)
    launches = list(launches) if launches is not None else [0] * len(rounds)
    quiet = [(v, g) for v, b, g in zip(rounds, busy, launches)
             if b is None or b <= QUIET_SHARE]
    loaded = len(quiet) < min(MIN_QUIET_ROUNDS, len(rounds))
    used = list(zip(rounds, launches)) if loaded else quiet
    best = min(v for v, _ in used)
    noise = _halves([v for v, _ in used], best)
    by_launch = {}
    for v, g in used:
        by_launch.setdefault(g, []).append(v)
    if len(by_launch) > 1:
        # the launch with the lowest upper edge (its best, plus its own noise)
        edges = [(min(vs) * (1 + _halves(vs, min(vs))), vs)
                 for vs in by_launch.values() if len(vs) >= 4]
        if edges:
            edge, vs = min(edges, key=lambda e: e[0])
            noise = max(edge / best - 1, 0.0)
    return {"best_s": best, "median_s": statistics.median(v for v, _ in used),
            "noise": noise, "rounds": len(rounds), "quiet_rounds": len(quiet),
            "loaded": loaded}


def _halves(values: list[float], best: float) -> float:
    """``|best(even) - best(odd)| / best`` over ``values`` in their order."""
    even, odd = values[0::2], values[1::2]
    return abs(min(even) - min(odd)) / best if odd and best > 0 else 0.0


def anchor_speed(now: dict, base: dict) -> float:
    """How much slower a row's reference is than in the baseline: its best-time
    ratio, at least 1 (a faster machine never makes a row look slower)."""
    return max(1.0, now["best_s"] / base["best_s"]) if base["best_s"] > 0 else 1.0


@dataclasses.dataclass(frozen=True)
class Verdict:
    """How one row compares with its baseline. ``ratio``: best now / best in the
    baseline, divided by ``speed`` (its reference's slowdown, see
    :func:`anchor_speed`); ``limit``: the ratio above which it regressed."""

    name: str
    now_s: float
    base_s: float
    ratio: float
    limit: float
    noise: float
    speed: float = 1.0
    #: Not judged: the row runs on ranks and had too few quiet rounds, now or
    #: in the baseline (other processes kept the CPUs busy).
    busy: bool = False
    #: The baseline's figures were among those too busy to judge by.
    busy_baseline: bool = False

    @property
    def regressed(self) -> bool:
        return not self.busy and self.ratio > self.limit

    @property
    def faster(self) -> bool:
        return not self.busy and self.ratio < 1 / self.limit

    def as_dict(self) -> dict:
        return {"baseline_best_s": self.base_s, "ratio": self.ratio, "limit": self.limit,
                "noise_used": self.noise, "reference_slowdown": self.speed,
                "not_judged_busy": self.busy, "regressed": self.regressed}

    def message(self) -> str:
        slower = f", its reference x{self.speed:.2f} slower" if self.speed > 1.005 else ""
        return (f"{self.name}: best {_us(self.now_s)} against {_us(self.base_s)} in the "
                f"baseline{slower}: x{self.ratio:.2f}, limit x{self.limit:.2f} (noise "
                f"{self.noise:.0%})")


def judge(name: str, now: dict, base: dict, speed: float = 1.0,
          floor: float = FLOOR, load_sensitive: bool = True) -> Verdict:
    """The verdict on one row (see the module docstring)."""
    noise = max(now["noise"], base["noise"])
    limit = 1.0 + max(floor, NOISE_FACTOR * noise)
    ratio = now["best_s"] / base["best_s"] / speed if base["best_s"] > 0 else 1.0
    busy = load_sensitive and bool(now.get("loaded") or base.get("loaded"))
    return Verdict(name, now["best_s"], base["best_s"], ratio, limit, noise, speed, busy,
                   load_sensitive and bool(base.get("loaded")))


def judge_all(rows: dict, now: dict[str, dict], base: dict[str, dict]) -> list[Verdict]:
    """Verdicts on the gated rows (``rows``: name -> :class:`~numcoll.bench.rows.Row`)
    that both runs have, each against its anchor's slowdown."""
    from .rows import usable_cpus

    cpus = len(usable_cpus())
    verdicts = []
    for name, row in rows.items():
        if not row.gated or name not in now or name not in base:
            continue
        anchor = row.anchor
        speed = (anchor_speed(now[anchor], base[anchor])
                 if anchor in now and anchor in base else 1.0)
        floor = FLOOR_OVERSUBSCRIBED if row.world_size > cpus else FLOOR
        # Kernels in this process hold up under load (within 6% beside a busy
        # process); rows on ranks do not.
        verdicts.append(judge(name, now[name], base[name], speed, floor,
                              load_sensitive=bool(row.world_size)))
    return verdicts


def measure(schedule, rounds: int, base: dict[str, dict] | None = None, *,
            budget_s: float = 25.0, confirm_budget_s: float = 8.0,
            progress=None) -> tuple[dict[str, dict], list[Verdict] | None]:
    """Time every row of ``schedule`` (a started :class:`~numcoll.bench.schedule.Schedule`)
    for ``rounds`` quiet rounds (or ``budget_s``); then time again, from new rank
    processes, the rows whose noise is above :data:`SETTLED_NOISE` and, against a
    baseline (row name -> figures), those that look regressed (see the module
    docstring). Returns (figures per row, verdicts or None)."""
    rows = schedule.rows
    schedule.run(rounds, deadline=time.monotonic() + budget_s, progress=progress)
    for attempt in range(CONFIRM_PASSES + 1):
        now = {n: figures(v, schedule.busy[n], schedule.launch[n])
               for n, v in schedule.rounds.items()}
        verdicts = None if base is None else judge_all(rows, now, base)
        if attempt == CONFIRM_PASSES:
            break
        again = {n for n, f in now.items()
                 if rows[n].gated and f["noise"] > SETTLED_NOISE and not f["loaded"]}
        again |= {v.name for v in verdicts or () if v.regressed}
        if not again:
            break
        anchors = {rows[n].anchor for n in again} - {None}
        if any(rows[n].world_size for n in again):
            schedule.restart()
        schedule.run(CONFIRM_ROUNDS, names=sorted(again | anchors),
                     deadline=time.monotonic() + confirm_budget_s)
    return now, verdicts


class ReplayClock:
    """A pytest-benchmark timer (``@pytest.mark.benchmark(timer=clock)``) for
    rows timed elsewhere: after :meth:`load`, a benchmark that calls it twice
    per round (start, end) sees each loaded duration in turn, so
    pytest-benchmark's statistics and saved data are exactly those rounds."""

    def __init__(self):
        self._durations: list[float] = []
        self._now = 0.0
        self._starting = True

    def load(self, durations: Iterable[float]) -> None:
        self._durations = [float(d) for d in durations][::-1]
        self._starting = True

    def __call__(self) -> float:
        if not self._starting:
            if not self._durations:
                raise RuntimeError("ReplayClock: more rounds than were loaded")
            self._now += self._durations.pop()
        self._starting = not self._starting
        return self._now

    def __repr__(self) -> str:
        return "numcoll.bench.gate.ReplayClock (rounds timed by numcoll.bench.schedule)"


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} us" if seconds < 1e-2 else f"{seconds * 1e3:.2f} ms"


def format_verdicts(verdicts: list[Verdict]) -> str:
    """A short table: one line per verdict."""
    width = max([len(v.name) for v in verdicts] + [3])
    lines = [f"{'row':<{width}} {'best now':>11} {'baseline':>11} {'ratio':>7} "
             f"{'limit':>7} {'noise':>6}"]
    for v in verdicts:
        lines.append(f"{v.name:<{width}} {_us(v.now_s):>11} {_us(v.base_s):>11} "
                     f"x{v.ratio:>6.2f} x{v.limit:>6.2f} {v.noise:>6.1%}")
    return "\n".join(lines)


def summary_line(verdicts: list[Verdict], baseline: str) -> str:
    """``numcoll gate: 31 rows against BASELINE: 0 regressed, 2 faster; ...``."""
    judged = [v for v in verdicts if not v.busy]
    regressed = sum(v.regressed for v in judged)
    faster = sum(v.faster for v in judged)
    limits = sorted(v.limit for v in judged) or [0.0]
    slowed = sum(v.speed > 1.1 for v in judged)
    busy = len(verdicts) - len(judged)
    in_base = sum(v.busy_baseline for v in verdicts)
    return (f"numcoll gate: {len(judged)} rows judged against {baseline}: {regressed} "
            f"regressed, {faster} faster; limits x{limits[0]:.2f} to x{limits[-1]:.2f} "
            f"(median x{limits[len(limits) // 2]:.2f}); {slowed} judged beside a reference "
            "more than 10% slower than in the baseline"
            + (f"; {busy} rows NOT judged: too few quiet rounds (other processes kept the "
               f"CPUs busy), {in_base} of them in the baseline" if busy else "")
            + ("; save the baseline again on a quieter machine" if in_base else ""))


# -- saved runs --------------------------------------------------------------------------
def load_run(path: str | pathlib.Path) -> dict:
    """One saved pytest-benchmark run: ``{"path", "datetime", "commit", "machine",
    "rows": {row name: extra_info["gate"] with "stats" (pytest-benchmark's)}}``;
    rows without gate figures (the exploration suites) are left out."""
    path = pathlib.Path(path)
    data = json.loads(path.read_text())
    rows = {}
    for bench in data.get("benchmarks", []):
        gate = (bench.get("extra_info") or {}).get("gate")
        if gate and "best_s" in gate:
            rows[gate["row"]] = {**gate, "fullname": bench["fullname"],
                                 "group": bench.get("group")}
    commit = data.get("commit_info") or {}
    return {"path": str(path), "datetime": data.get("datetime"),
            "commit": commit.get("id"), "dirty": commit.get("dirty"),
            "machine": (data.get("machine_info") or {}).get("node"), "rows": rows}


def saved_runs(storage: str | pathlib.Path = ".benchmarks") -> list[dict]:
    """Every run saved under ``storage`` (pytest-benchmark's ``--benchmark-storage``,
    one folder per machine), oldest first, as :func:`load_run` reads them."""
    paths = sorted(pathlib.Path(storage).glob("*/*.json"))
    runs = [load_run(p) for p in paths]
    return sorted((r for r in runs if r["rows"]), key=lambda r: (r["datetime"] or "", r["path"]))
