"""Merge the ranks' flight-recorder dumps and say what went wrong, as torch's
``fr_trace`` does: which rank is missing from which collective, which ranks
are stuck waiting for whom, and where ranks ran different collectives.

Usage: ``python -m numcoll.diagnostics.fr_trace DIR`` (the ``NUMCOLL_FR_DUMP_DIR`` of a run).
"""

from __future__ import annotations

import glob
import json
import os
import sys

__all__ = ["load", "analyse", "main"]


def load(directory: str) -> dict[int, dict]:
    """The dumps in ``directory`` by rank (``numcoll_fr_rank*.json``)."""
    dumps = {}
    for path in sorted(glob.glob(os.path.join(directory, "numcoll_fr_rank*.json"))):
        with open(path) as f:
            data = json.load(f)
        rank = data.get("rank")
        if rank is None:
            rank = int(os.path.basename(path)[len("numcoll_fr_rank"):-len(".json")])
        dumps[rank] = data
    return dumps


def _by_group(dumps: dict[int, dict]):
    """{group name: {rank: {collective_seq_id: entry}}} and each group's ranks."""
    groups: dict[str, dict[int, dict[int, dict]]] = {}
    members: dict[str, list[int]] = {}
    for rank, data in dumps.items():
        config = data.get("pg_config", {})
        for e in data.get("entries", []):
            if e.get("collective_seq_id") is None:
                continue
            cfg = config.get(str(e["pg_id"]), {})
            name = cfg.get("name", str(e["pg_id"]))
            members.setdefault(name, cfg.get("ranks") or [])
            groups.setdefault(name, {}).setdefault(rank, {})[e["collective_seq_id"]] = e
    return groups, members


def analyse(dumps: dict[int, dict]) -> list[str]:
    """Findings, one line each (empty: every recorded collective completed everywhere)."""
    findings = []
    groups, members = _by_group(dumps)
    for name, per_rank in sorted(groups.items()):
        ranks = sorted(set(members.get(name) or []) | set(per_rank)) or sorted(per_rank)
        ranks = [r for r in ranks if r in dumps]
        seqs = sorted({s for entries in per_rank.values() for s in entries})
        for seq in seqs:
            entries = {r: per_rank.get(r, {}).get(seq) for r in ranks}
            present = {r: e for r, e in entries.items() if e is not None}
            if all(e["state"] == "completed" for e in entries.values() if e) and \
                    len(present) == len(ranks):
                continue
            names = {e["profiling_name"] for e in present.values()}
            what = "/".join(sorted(n.split(":", 1)[-1] for n in names))
            head = f"group {name!r} collective #{seq} ({what})"
            if len(names) > 1:
                kinds = ", ".join(f"rank {r}: {e['profiling_name'].split(':', 1)[-1]}"
                                  for r, e in sorted(present.items()))
                findings.append(f"{head}: ranks ran different collectives ({kinds})")
            missing = [r for r in ranks if entries[r] is None]
            for r in missing:
                last = max(per_rank.get(r, {}) or [0])
                findings.append(f"{head}: rank {r} never called it (its last collective "
                                f"was #{last})")
            for r, e in sorted(present.items()):
                if e["state"] == "started":
                    peer = e.get("waiting_for")
                    on = f", waiting for rank {peer}" if peer is not None else ""
                    findings.append(f"{head}: rank {r} started it and never finished{on}")
                elif e["state"] == "scheduled":
                    findings.append(f"{head}: rank {r} queued it but never started it")
                elif e["state"] == "failed":
                    findings.append(f"{head}: rank {r} failed: {e.get('error')}")
            break  # later collectives only repeat the first problem
    return findings


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    dumps = load(argv[0])
    if not dumps:
        print(f"no flight-recorder dumps (numcoll_fr_rank*.json) in {argv[0]}")
        return 1
    print(f"{len(dumps)} rank dumps: ranks {sorted(dumps)}")
    findings = analyse(dumps)
    for line in findings:
        print(line)
    if not findings:
        print("every recorded collective completed on every rank")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
