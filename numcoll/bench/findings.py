"""Sentences computed from sweep rows, so a notebook's conclusions say what
*this* run measured instead of prose written on another machine.

Every function takes rows as :func:`~numcoll.bench.sweep.summarize` returns
them (one per size, ascending) and compares at the sizes both series have.
"""

from __future__ import annotations

from collections import Counter

from .sweep import format_nbytes

__all__ = ["faster_from", "faster_sentence", "algorithm_choice", "choice_sentence",
           "noisy_sizes", "waited_for", "peak"]


def _by_size(rows: list[dict]) -> dict[int, dict]:
    return {r["size"]: r for r in rows}


def faster_from(rows: list[dict], other: list[dict]) -> dict:
    """Where ``rows`` is faster than ``other`` (shorter median time, the same as
    higher busbw at one size).

    Returns ``{"sizes": common sizes, "better": sizes where rows is faster,
    "from_size": the smallest size from which rows is faster at every larger
    size too (None: not at the largest)}``.
    """
    mine, theirs = _by_size(rows), _by_size(other)
    sizes = sorted(set(mine) & set(theirs))
    better = [s for s in sizes if mine[s]["time_us"] < theirs[s]["time_us"]]
    from_size = None
    for s in reversed(sizes):
        if s not in better:
            break
        from_size = s
    return {"sizes": sizes, "better": better, "from_size": from_size}


def faster_sentence(label: str, rows: list[dict], other_label: str, other: list[dict],
                    world_size: int) -> str:
    """``"A beats B from 64 KiB up at 2 ranks (faster at 7 of 10 sizes)."``, or at
    every size, or at no size, or only below some size."""
    f = faster_from(rows, other)
    n, k = len(f["sizes"]), len(f["better"])
    tally = f"faster at {k} of {n} sizes"
    if n == 0:
        return f"{label} and {other_label} have no size in common."
    if k == n:
        return f"{label} beats {other_label} at every size measured at {world_size} ranks."
    if k == 0:
        return f"{label} is slower than {other_label} at every size measured at {world_size} ranks."
    if f["from_size"] is not None:
        return (f"{label} beats {other_label} from {format_nbytes(f['from_size'])} up at "
                f"{world_size} ranks ({tally}).")
    return (f"{label} beats {other_label} only below {format_nbytes(f['sizes'][-1])} at "
            f"{world_size} ranks ({tally}, not at the largest).")


def algorithm_choice(auto_algorithms: dict[int, str],
                     candidates: dict[str, list[dict]]) -> dict:
    """Whether numcoll's automatic choice picks the algorithm that measured
    fastest: ``auto_algorithms[size]`` is the algorithm numcoll chose (or would
    choose), ``candidates[algorithm]`` the rows measured with it.

    Only sizes where the chosen algorithm *and* at least one other were
    measured are judged; the others are listed in ``unmeasured``, never
    counted as agreeing. Returns ``{"sizes": judged sizes, "agree": sizes where
    the choice was the fastest, "disagree": [(size, chosen, fastest, chosen time
    / fastest time)], "unmeasured": [(size, chosen)]}``.
    """
    by_alg = {alg: _by_size(rows) for alg, rows in candidates.items()}
    sizes, agree, disagree, unmeasured = [], [], [], []
    for s in sorted(auto_algorithms):
        chosen = auto_algorithms[s]
        measured = [a for a in by_alg if s in by_alg[a]]
        if chosen not in measured or len(measured) < 2:
            unmeasured.append((s, chosen))
            continue
        sizes.append(s)
        fastest = min(measured, key=lambda a: by_alg[a][s]["time_us"])
        if chosen == fastest:
            agree.append(s)
        else:
            disagree.append((s, chosen, fastest,
                             by_alg[chosen][s]["time_us"] / by_alg[fastest][s]["time_us"]))
    return {"sizes": sizes, "agree": agree, "disagree": disagree, "unmeasured": unmeasured}


def choice_sentence(op: str, choice: dict, tolerance: float = 0.1) -> str:
    """What :func:`algorithm_choice` found, as a sentence: where the automatic
    choice was the fastest, where it was slower and by how much (within
    ``tolerance``: "within noise"), and that nothing could be judged when no
    alternative was measured."""
    n = len(choice["sizes"])
    if n == 0:
        return (f"numcoll's {op} choice: nothing to compare (no size has the chosen "
                "algorithm and another one measured).")
    close = [d for d in choice["disagree"] if d[3] <= 1 + tolerance]
    text = (f"numcoll's automatic {op} choice was the fastest measured at "
            f"{len(choice['agree'])} of {n} sizes")
    if close:
        text += f" and within {tolerance:.0%} of it at {len(close)} more"
    far = [d for d in choice["disagree"] if d[3] > 1 + tolerance]
    if far:
        text += "; slower at " + ", ".join(
            f"{format_nbytes(s)} ({c} took {100 * (r - 1):.0f}% longer than {f})"
            for s, c, f, r in far)
    if choice["unmeasured"]:
        text += f"; {len(choice['unmeasured'])} sizes not judged (no alternative measured)"
    return text + "."


def noisy_sizes(rows: list[dict], ratio: float = 2.0) -> list[int]:
    """Sizes whose slowest iteration took more than ``ratio`` x the median."""
    return [r["size"] for r in rows if r["time_us_max"] > ratio * r["time_us"]]


def waited_for(rows: list[dict]) -> Counter:
    """How often each rank had the shortest own median time: in a collective
    the rank that arrives last waits least, so that is the rank the others
    waited for (a consistent winner is a straggler)."""
    return Counter(min(range(len(r["rank_time_us"])), key=r["rank_time_us"].__getitem__)
                   for r in rows if r.get("rank_time_us"))


def peak(rows: list[dict]) -> dict:
    """The row with the highest busbw."""
    return max(rows, key=lambda r: r["busbw_gbps"] or 0.0)
