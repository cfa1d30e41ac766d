"""Saved ``numcoll-bench`` runs: ``--save NAME`` keeps a sweep, ``--baseline NAME``
compares a new one with it, row by row.

A run is the ``--json`` document (``{"metadata": ..., "rows": [...]}``) stored as
``NAME.json`` under the storage folder (``--storage``, default
``.benchmarks/numcoll-bench``, beside pytest-benchmark's own ``.benchmarks``);
a NAME with a ``/`` or ending in ``.json`` is a path of its own.

Rows match by size and placement; the baseline must be the same collective,
world size and dtype (a comparison across them would not mean anything).
"""

from __future__ import annotations

import json
import os
import pathlib

from .report import avg_busbw, join_anchor, ratio  # avg_busbw: re-exported

__all__ = ["DEFAULT_STORAGE", "run_path", "save_run", "load_run", "check_comparable",
           "with_baseline", "avg_busbw"]

#: Where ``--save NAME`` writes unless ``--storage`` says otherwise.
DEFAULT_STORAGE = os.path.join(".benchmarks", "numcoll-bench")


def run_path(name: str, storage: str = DEFAULT_STORAGE) -> pathlib.Path:
    """The file of the run called ``name``."""
    if not name or name in (".", ".."):
        raise ValueError(f"invalid run name {name!r}")
    if "/" in name or name.endswith(".json"):
        return pathlib.Path(name)
    return pathlib.Path(storage) / f"{name}.json"


def save_run(name: str, meta: dict, rows: list[dict], storage: str = DEFAULT_STORAGE) -> str:
    """Write the run (replacing one of that name); returns its path."""
    path = run_path(name, storage)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"metadata": meta, "rows": rows}, indent=2) + "\n")
    os.replace(tmp, path)  # never half a file where a baseline is read
    return str(path)


def load_run(name: str, storage: str = DEFAULT_STORAGE) -> dict:
    """``{"metadata", "rows"}`` of a saved run; FileNotFoundError naming where it
    looked (and the runs that are there), ValueError for a file that is not one."""
    path = run_path(name, storage)
    if not path.is_file():
        there = sorted(p.stem for p in path.parent.glob("*.json")) if path.parent.is_dir() \
            else []
        raise FileNotFoundError(
            f"no saved run {name!r} ({path} does not exist; "
            + (f"saved runs there: {', '.join(there)}" if there else
               "save one with --save NAME") + ")")
    try:
        data = json.loads(path.read_text())
        rows, meta = data["rows"], data["metadata"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path} is not a numcoll-bench run ({exc})") from None
    return {"metadata": meta, "rows": rows, "path": str(path)}


def check_comparable(meta: dict, base_meta: dict, name: str) -> None:
    """ValueError unless the baseline measured the same collective, world size and dtype."""
    for key in ("op", "world_size", "dtype"):
        if meta.get(key) != base_meta.get(key):
            raise ValueError(f"baseline {name!r} measured {key} {base_meta.get(key)!r}, this "
                             f"run {meta.get(key)!r}: only runs of one collective, world size "
                             "and dtype compare")


def with_baseline(rows: list[dict], base_rows: list[dict]) -> list[dict]:
    """Copies of ``rows`` with ``base_time_us`` and ``delta_pct`` (time now against
    the baseline's, in percent: +10 is 10% slower) where the baseline has the
    same size and placement."""
    def columns(row, base):
        change = ratio(row["time_us"], base["time_us"])
        return {"base_time_us": base["time_us"],
                "delta_pct": None if change is None else (change - 1) * 100}

    return join_anchor(rows, base_rows, columns)
