"""A per-rank Gantt chart of what the collectives did, from the flight recorder.

``nc.flight_recorder.dump()`` returns ``{"version", "pg_config", "pg_status",
"entries"}``; each entry describes one collective on one rank: ``rank``,
``pg_id``, ``collective_seq_id``, ``profiling_name`` ("numcoll:all_reduce"),
``state``, ``algorithm``, ``nbytes`` (or ``input_sizes``/``input_dtypes``),
and three wall-clock stamps (``time.time_ns()``, so the ranks' records line
up): ``time_created_ns`` (the call queued it), ``time_started_ns`` (a worker
began it) and ``time_completed_ns``.

With ranks as threads one dump holds every rank's entries; with ranks as
processes each rank dumps its own and returns it from the launched function,
so ``nc.launch`` hands the list to rank 0's caller::

    dumps = nc.launch(work_then_dump, 4)            # each returns flight_recorder.dump()
    entries = timeline.entries_of(dumps)
    timeline.plot_timeline(entries)
    print(timeline.describe(timeline.analyze(entries)))

:func:`analyze` computes what the picture shows: per collective the spread of
the ranks' arrivals and which rank came last (the straggler the others waited
for), per rank the time busy, idle and the largest idle gap.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Iterable

import numpy as np

__all__ = ["entries_of", "spans", "analyze", "describe", "plot_timeline"]


def entries_of(dumps, since_ns: int | None = None) -> list[dict]:
    """Entries of one dump, of a list of dumps (one per rank, in rank order: an
    entry without ``rank`` takes its dump's index), or a list of entries.

    Each entry gets ``pg_name``, its group's name from the dump's
    ``pg_config``: ranks that are threads of one process register the same
    group under different ``pg_id``, so collectives are matched across ranks
    by (group name, ``collective_seq_id``). ``since_ns``: keep only entries
    created from then on (a recorder outlives a launch; a notebook's kernel
    keeps the records of every earlier run).
    """
    if isinstance(dumps, dict):
        dumps = [dumps]
    dumps = list(dumps)
    out = []
    if dumps and all(isinstance(d, dict) and "entries" in d for d in dumps):
        for index, dump in enumerate(dumps):
            config = dump.get("pg_config") or {}
            for e in dump["entries"]:
                e = dict(e)
                if len(dumps) > 1:
                    e.setdefault("rank", index)
                e.setdefault("pg_name", (config.get(str(e.get("pg_id"))) or {}).get("name"))
                out.append(e)
    else:
        out = [dict(e) for e in dumps]
    if since_ns is not None:
        out = [e for e in out if (e.get("time_created_ns") or 0) >= since_ns]
    return out


def _nbytes(entry: dict) -> int:
    if entry.get("nbytes") is not None:
        return int(entry["nbytes"])
    total = 0
    for shape, dtype in zip(entry.get("input_sizes") or [], entry.get("input_dtypes") or []):
        try:
            itemsize = np.dtype(dtype).itemsize
        except TypeError:  # e.g. bfloat16 without ml_dtypes registered: 2 bytes
            itemsize = 2
        total += int(np.prod(shape, dtype=np.int64)) * itemsize
    return total


def _name(entry: dict) -> str:
    return str(entry.get("profiling_name") or "?").split(":", 1)[-1]


def spans(entries: Iterable[dict]) -> list[dict]:
    """One dict per entry with times in seconds from the earliest stamp:
    ``rank, pg_id, group, seq, name, algorithm, nbytes, state, queued, started,
    completed`` (``group``: the group's name where known, else its pg_id;
    ``started``/``completed`` None while not reached), sorted by rank then
    queue time."""
    entries = [e for e in entries if e.get("time_created_ns") is not None]
    if not entries:
        return []
    t0 = min(e["time_created_ns"] for e in entries)

    def rel(ns):
        return None if ns is None else (ns - t0) / 1e9

    out = [{
        "rank": int(e.get("rank", 0)),
        "pg_id": e.get("pg_id"),
        "group": e.get("pg_name") if e.get("pg_name") is not None else e.get("pg_id"),
        "seq": e.get("collective_seq_id"),
        "name": _name(e),
        "algorithm": e.get("algorithm"),
        "nbytes": _nbytes(e),
        "state": e.get("state"),
        "queued": rel(e["time_created_ns"]),
        "started": rel(e.get("time_started_ns")),
        "completed": rel(e.get("time_completed_ns")),
    } for e in entries]
    out.sort(key=lambda s: (s["rank"], s["queued"]))
    return out


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def analyze(entries: Iterable[dict]) -> dict:
    """What the chart shows, as numbers (seconds).

    ``collectives``: per (group, seq) seen on more than one rank: ``name``,
    ``arrival_spread`` (last rank's queue time minus the first's), ``last_rank``
    (the rank that called it last), ``duration`` (first start to last finish).
    ``ranks``: per rank ``count``, ``busy`` (time with a collective running),
    ``idle`` (the rest of the run's span), ``largest_gap`` (the longest stretch
    with nothing queued or running), ``last_count`` (how many collectives it
    was the last to call) and ``max_in_flight`` (the most collectives queued or
    running at once: overlap). ``straggler``: the rank with the most ``last_count``
    (ties: the larger total lateness), None with fewer than two ranks.
    """
    rows = spans(entries)
    if not rows:
        return {"span": 0.0, "ranks": {}, "collectives": [], "straggler": None}
    end = max(max(r["queued"], r["started"] or 0.0, r["completed"] or 0.0) for r in rows)
    by_rank = defaultdict(list)
    for r in rows:
        by_rank[r["rank"]].append(r)
    groups = defaultdict(list)
    for r in rows:
        if r["seq"] is not None:  # point-to-point operations have none
            groups[(r["group"], r["seq"])].append(r)
    collectives, last_count, lateness = [], defaultdict(int), defaultdict(float)
    for (group, seq), members in sorted(groups.items(), key=lambda kv: min(
            m["queued"] for m in kv[1])):
        if len({m["rank"] for m in members}) < 2:
            continue
        last = max(members, key=lambda m: m["queued"])
        first_q = min(m["queued"] for m in members)
        starts = [m["started"] for m in members if m["started"] is not None]
        ends = [m["completed"] for m in members if m["completed"] is not None]
        spread = last["queued"] - first_q
        last_count[last["rank"]] += 1
        lateness[last["rank"]] += spread
        collectives.append({
            "group": group, "seq": seq, "name": last["name"], "algorithm": last["algorithm"],
            "nbytes": last["nbytes"], "arrival_spread": spread, "last_rank": last["rank"],
            "duration": (max(ends) - min(starts)) if starts and len(ends) == len(members)
            else None,
        })
    ranks = {}
    for rank, members in sorted(by_rank.items()):
        running = [(m["started"], m["completed"] if m["completed"] is not None else end)
                   for m in members if m["started"] is not None]
        occupied = sorted((m["queued"], m["completed"] if m["completed"] is not None else end)
                          for m in members)
        gap, reach = 0.0, 0.0
        for a, b in occupied:
            gap = max(gap, a - reach)
            reach = max(reach, b)
        gap = max(gap, end - reach)
        busy = _union_length(running)
        ranks[rank] = {"count": len(members), "busy": busy, "idle": end - busy,
                       "largest_gap": gap, "last_count": last_count.get(rank, 0),
                       "max_in_flight": max(_slots(members, end)) + 1}
    straggler = None
    if len(ranks) > 1 and last_count:
        straggler = max(last_count, key=lambda r: (last_count[r], lateness[r]))
    return {"span": end, "ranks": ranks, "collectives": collectives, "straggler": straggler}


def describe(analysis: dict) -> str:
    """A few sentences on :func:`analyze`'s numbers (for a notebook's conclusion)."""
    ranks, colls = analysis["ranks"], analysis["collectives"]
    if not ranks:
        return "No flight-recorder entries: nothing ran (or the recorder is off)."
    lines = [f"{sum(r['count'] for r in ranks.values())} records on {len(ranks)} rank(s) "
             f"over {analysis['span'] * 1e3:.1f} ms."]
    for rank, r in ranks.items():
        lines.append(f"rank {rank}: {r['count']} collectives, busy {r['busy'] * 1e3:.1f} ms "
                     f"({100 * r['busy'] / analysis['span']:.0f}% of the run), largest idle gap "
                     f"{r['largest_gap'] * 1e3:.1f} ms, up to {r['max_in_flight']} in flight "
                     f"at once, last to arrive {r['last_count']} times.")
    if colls:
        worst = max(colls, key=lambda c: c["arrival_spread"])
        lines.append(f"Largest arrival spread: {worst['name']} #{worst['seq']} "
                     f"({worst['nbytes']} B), rank {worst['last_rank']} came "
                     f"{worst['arrival_spread'] * 1e3:.2f} ms after the first.")
    if analysis["straggler"] is not None:
        s = analysis["straggler"]
        waited = sum(c["arrival_spread"] for c in colls if c["last_rank"] == s)
        lines.append(f"Straggler: rank {s}, the last to call {ranks[s]['last_count']} of "
                     f"{len(colls)} collectives; the first rank to call them waited "
                     f"{waited * 1e3:.1f} ms in all for it.")
    return "\n".join(lines)


def _format_nbytes(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes} B"


def _slots(members: list[dict], end: float) -> list[int]:
    """A sub-lane per entry so that collectives in flight together on one
    rank sit one above the other instead of hiding each other."""
    free_at: list[float] = []
    slots = []
    for m in members:  # sorted by queue time
        stop = m["completed"] if m["completed"] is not None else end
        for k, t in enumerate(free_at):
            if t <= m["queued"]:
                free_at[k] = stop
                slots.append(k)
                break
        else:
            free_at.append(stop)
            slots.append(len(free_at) - 1)
    return slots


def plot_timeline(entries: Iterable[dict], ax=None, *, title: str | None = None,
                  label_min_fraction: float = 0.1):
    """Draw ``entries`` as a Gantt chart, one lane per rank (rank 0 on top).

    Each collective is a pale bar from queued to started (waiting for a
    worker) and a solid bar, coloured by collective, from started to
    completed; failed ones are edged red, unfinished ones run to the end,
    hatched. Bars wide enough (``label_min_fraction`` of the span) are
    labelled with algorithm and bytes. Collectives in flight together on
    one rank stack within its lane. Returns the matplotlib Axes.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = spans(entries)
    if ax is None:
        _, ax = plt.subplots(figsize=(12, 1 + 0.8 * max(1, len({r["rank"] for r in rows}))))
    if not rows:
        ax.set_title(title or "no flight-recorder entries")
        return ax
    end = max(max(r["queued"], r["started"] or 0.0, r["completed"] or 0.0) for r in rows)
    end = end if end > 0 else 1e-6
    names = sorted({r["name"] for r in rows})
    cmap = plt.get_cmap("tab10")
    colour = {n: cmap(i % 10) for i, n in enumerate(names)}
    ranks = sorted({r["rank"] for r in rows})
    lane = {rank: i for i, rank in enumerate(ranks)}
    for rank in ranks:
        members = [r for r in rows if r["rank"] == rank]
        slots = _slots(members, end)
        depth = max(slots) + 1
        height = 0.8 / depth
        for m, slot in zip(members, slots):
            y = lane[rank] - 0.4 + slot * height
            failed = m["state"] == "failed"
            edge = "red" if failed else "none"
            begin = m["started"] if m["started"] is not None else end
            ax.broken_barh([(m["queued"] * 1e3, (begin - m["queued"]) * 1e3)],
                           (y, height * 0.9), facecolors=colour[m["name"]], alpha=0.25,
                           edgecolors=edge, label="_queued")
            if m["started"] is None:
                continue
            stop = m["completed"] if m["completed"] is not None else end
            ax.broken_barh([(m["started"] * 1e3, (stop - m["started"]) * 1e3)],
                           (y, height * 0.9), facecolors=colour[m["name"]], edgecolors=edge,
                           linewidth=1.5 if failed else 0,
                           hatch=None if m["completed"] is not None else "//",
                           label="_running")
            if (stop - m["started"]) >= label_min_fraction * end:
                text = " ".join(x for x in (m["algorithm"], _format_nbytes(m["nbytes"])) if x)
                ax.text((m["started"] + stop) / 2 * 1e3, y + height * 0.45, text,
                        ha="center", va="center", fontsize=7, clip_on=True)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.set_ylim(len(ranks) - 0.5, -0.5)  # rank 0 on top
    ax.set_xlim(0, end * 1e3 * 1.01)
    ax.set_xlabel("time since the first call (ms)")
    handles = [Patch(facecolor=colour[n], label=n) for n in names]
    handles.append(Patch(facecolor="grey", alpha=0.25, label="queued (waiting for a worker)"))
    if any(r["state"] == "failed" for r in rows):
        handles.append(Patch(facecolor="white", edgecolor="red", label="failed"))
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(True, axis="x", alpha=0.3)
    if title:
        ax.set_title(title)
    return ax
