"""``python -m numcoll.faults``: run the fault scenarios and print the fault table.

Every row of the fault table of the docs (``docs/guide/faults.md``) is printed here,
from the figures of :mod:`numcoll.bench.faults` (``--markdown`` prints just the table,
``--update-readme docs/guide/faults.md`` writes it between the page's markers), and
``tests/test_faults.py`` checks the page's table against what this code
prints for the same scenarios, numbers masked (:func:`masked`): detection
times, sizes and counts change from run to run, the words do not.

Without ``--verbose`` the ranks' own warnings (a stranger's refused
connection, ...) are kept off the terminal: the table says what happened.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys

import transports

from . import faults

__all__ = ["rows", "markdown", "masked", "update_readme", "main", "FAULTS", "BEGIN", "END"]

#: What ``--faults`` can name, in the table's order.
FAULTS = ("kill", "stop", "early", "mismatch", "store", "strangers", "soak")
BEGIN = "<!-- fault-table: python -m numcoll.faults --update-readme docs/guide/faults.md -->"
END = "<!-- fault-table end -->"
_HEADER = ["scenario", "survivors raise after", "what they say", "culprit named by",
           "left behind"]
_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")


def _times(values: dict[int, float]) -> str:
    return " / ".join(f"{values[r]:.2f}" for r in sorted(values)) + " s" if values else "—"


def _left(figures: faults.Figures) -> str:
    parts = [f"{kind}: {', '.join(items)}" for kind, items in figures.leftovers.items()
             if items and kind != "rss"]
    return "; ".join(parts) or "nothing (no /dev/shm entry, socket file or process)"


def _said(errors: dict[int, str]) -> str:
    """Rank-0-first messages, whole; a survivor whose message differs from the
    first one's (its own rank number aside) gets its own."""
    if not errors:
        return "—"
    first = min(errors)
    template = errors[first].replace(f"rank {first}", "rank {r}")
    text = f"`{errors[first]}`"
    for r in sorted(errors):
        if r != first and errors[r] != template.replace("rank {r}", f"rank {r}"):
            text += f"; rank {r}: `{errors[r]}`"
    return text


def _named(figures: faults.Figures) -> str:
    if figures.culprit is None or not figures.named:
        return "—"
    right = [r for r, n in sorted(figures.named.items()) if n == figures.culprit]
    if len(right) == len(figures.named):
        return f"every survivor ({len(right)})"
    wrong = ", ".join(f"rank {r} names {n}" for r, n in sorted(figures.named.items())
                      if n != figures.culprit)
    return f"ranks {', '.join(map(str, right)) or 'none'} ({wrong})"


def _fault_row(f: faults.Figures) -> list[str]:
    what = {"kill": "SIGKILLed", "stop": "SIGSTOPped", "early": "returns early"}[f.scenario]
    after = _times(f.detect_s)
    if f.scenario == "stop":
        after += f" ({f.notes['group_timeout_s']:g} s group timeout)"
    if f.hung:
        after += f"; ranks {f.hung} never raised"
    wrong = f" ({f.wrong_results} wrong results)" if f.wrong_results else ""
    return [f"rank {f.culprit} {what}{wrong}", after, _said(f.errors), _named(f), _left(f)]


def _mismatch_row(f: faults.Figures) -> list[str]:
    kinds = ", ".join(f.notes["kinds"])
    after = (f"at most {max(f.detect_s.values()):.2f} s (group timeout "
             f"{f.notes['group_timeout_s']:g} s)") if f.detect_s else "—"
    if f.hung:
        after += f"; ranks {f.hung} never raised"
    raised = len(f.detect_s)
    return [f"mismatched calls ({kinds}) on {f.notes['world_size']} ranks", after,
            _said({r: e for r, e in f.errors.items() if r == 0}),
            f"every rank raises ({raised} of {f.notes['world_size']}), naming the other call",
            _left(f)]


def _store_row(f: faults.Figures) -> list[str]:
    after = f"`ProcessGroup.shutdown()` returns in {_times(f.detect_s)}"
    if f.hung:
        after += f"; ranks {f.hung} did not return"
    return ["the store's host (rank 0, which hosts the TCPStore) SIGKILLed, the others "
            "shut their group down", after, "—", "—", _left(f)]


def _strangers_row(f: faults.Figures, alone: faults.Figures) -> list[str]:
    n = f.notes
    return [f.scenario, "never",
            f"{n['crowd_count']} of {n['crowd']} store clients served in "
            f"{n['strangers_s']:.2f} s; the collectives took {n['collectives_s']:.2f} s "
            f"({alone.notes['collectives_s']:.2f} s without strangers); "
            f"{f.wrong_results} wrong results", "—", _left(f)]


def _soak_row(f: faults.Figures) -> list[str]:
    n = f.notes
    rss = "; ".join(" → ".join(f"{b / 2**20:.0f}" for b in rank) for rank in n["rss"])
    return [f.scenario, "—",
            f"{f.wrong_results} wrong results; the async ones took {n['async_s']:.2f} s, "
            f"the sequential ones {n['sequential_s']:.2f} s", "—",
            f"{_left(f)}; RSS per rank {rss} MiB (before, after async, after sequential)"]


def rows(figures: dict[str, faults.Figures]) -> list[list[str]]:
    """The table's rows, in :data:`FAULTS` order, for the scenarios in
    ``figures`` (keyed by :data:`FAULTS` names; "strangers" needs
    "strangers_alone", the same run without strangers)."""
    out = []
    for name in FAULTS:
        f = figures.get(name)
        if f is None:
            continue
        if name in faults.SCENARIOS:
            out.append(_fault_row(f))
        elif name == "mismatch":
            out.append(_mismatch_row(f))
        elif name == "store":
            out.append(_store_row(f))
        elif name == "strangers":
            out.append(_strangers_row(f, figures["strangers_alone"]))
        else:
            out.append(_soak_row(f))
    return out


def markdown(table_rows: list[list[str]]) -> str:
    """The rows as a Markdown table (``|`` inside a cell escaped)."""
    lines = ["| " + " | ".join(_HEADER) + " |", "|" + "---|" * len(_HEADER)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |"
              for row in table_rows]
    return "\n".join(lines)


def masked(text: str) -> str:
    """``text`` with every number replaced by ``N``: what stays the same from run to run."""
    return _NUMBER.sub("N", text)


def readme_table(readme_text: str) -> str | None:
    """The table between :data:`BEGIN` and :data:`END` (None without the markers)."""
    start, end = readme_text.find(BEGIN), readme_text.find(END)
    if start < 0 or end < start:
        return None
    return readme_text[start + len(BEGIN):end].strip()


def update_readme(path: str, table: str) -> None:
    """Replace the table between the markers in the file at ``path``."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"{path}: no fault table markers ({BEGIN} ... {END})")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text[:start + len(BEGIN)] + "\n" + table + "\n" + text[end:])


def run(names, *, world_size: int, transport: str | None, group_timeout_s: float,
        progress=None) -> dict[str, faults.Figures]:
    """Run the scenarios named (see :data:`FAULTS`)."""
    progress = progress or (lambda name: None)
    figures = {}
    zmq_kind = transport if transport in ("tcp", "ipc") else "tcp"
    for name in FAULTS:
        if name not in names:
            continue
        progress(name)
        if name in faults.SCENARIOS:
            figures[name] = faults.run_scenario(name, world_size=world_size,
                                                transport=transport,
                                                group_timeout_s=group_timeout_s)
        elif name == "mismatch":
            figures[name] = faults.run_mismatches(world_size=world_size, transport=transport)
        elif name == "store":
            figures[name] = faults.run_store_gone(world_size=world_size, transport=transport)
        elif name == "strangers":
            figures["strangers_alone"] = faults.run_strangers(
                silent=0, crowd=0, transport=zmq_kind, world_size=world_size)
            figures[name] = faults.run_strangers(transport=zmq_kind, world_size=world_size)
        else:
            figures[name] = faults.soak()
    return figures


def _faults_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in FAULTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown fault {unknown[0]!r}" if unknown else "name at least one fault")
    return names


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m numcoll.faults",
        description="Inject faults into ranks that are processes and print what the "
                    "survivors see: how soon they raise, what they say, whom they name, and "
                    "what is left behind.",
        epilog="faults: kill (the last rank SIGKILLed mid 16 MiB allreduces), stop "
               "(SIGSTOPped: found by the group timeout), early (returns while the others "
               "still call), mismatch (rank 0 calls another dtype, count, op, collective or "
               "root), store (the TCPStore's host SIGKILLed, the others shut down), "
               "strangers (silent connections to the store and every endpoint, 200 store "
               "clients at once; over tcp unless --transport ipc), soak (1,000 async and "
               "10,000 sequential allreduces on 2 ranks, RSS before and after). All of them "
               "take about a minute.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--faults", type=_faults_list, default=list(FAULTS),
                   help=f"comma-separated, from {','.join(FAULTS)} (default: all)")
    p.add_argument("--world-size", "-n", type=int, default=faults.WORLD_SIZE,
                   help=f"ranks (default {faults.WORLD_SIZE}; the last is the culprit)")
    p.add_argument("--transport", choices=[k for k in transports.KINDS if k != "inproc"],
                   default=None, help="the ranks' transport (default: numcoll chooses, shm "
                                      "on Linux)")
    p.add_argument("--group-timeout", type=float, default=2.0,
                   help="collective deadline of the stop scenario, seconds (default 2)")
    p.add_argument("--markdown", action="store_true",
                   help="print only the table, in Markdown, as docs/guide/faults.md has it")
    p.add_argument("--update-readme", metavar="PATH", default=None,
                   help=f"write the table into PATH between {BEGIN!r} and {END!r}")
    p.add_argument("--verbose", "-v", action="store_true",
                   help="keep numcoll's warnings (refused strangers, ...) on stderr")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m numcoll.faults``; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.world_size < 2:
        parser.error(f"--world-size must be at least 2 (a culprit and a survivor), got "
                     f"{args.world_size}")
    if args.group_timeout <= 0:
        parser.error(f"--group-timeout must be positive, got {args.group_timeout}")
    if not args.verbose:
        # The ranks inherit the environment; this process hosts the launch's store.
        os.environ.setdefault("NUMCOLL_LOG_LEVEL", "ERROR")
        logging.getLogger("numcoll").setLevel(logging.ERROR)
    quiet = args.markdown
    figures = run(args.faults, world_size=args.world_size, transport=args.transport,
                  group_timeout_s=args.group_timeout,
                  progress=None if quiet else
                  (lambda name: print(f"numcoll faults: {name} ...", file=sys.stderr,
                                      flush=True)))
    table = markdown(rows(figures))
    print(table)
    if args.update_readme:
        update_readme(args.update_readme, table)
        print(f"numcoll faults: wrote the table into {args.update_readme}", file=sys.stderr)
    failed = [name for name, f in figures.items()
              if f.hung or f.wrong_results or any(v for k, v in f.leftovers.items())]
    if not quiet:
        for name, f in figures.items():
            for r, message in sorted(f.errors.items()):
                print(f"\n[{name}] rank {r}: {message}")
    if failed:
        print(f"numcoll faults: {', '.join(failed)}: a rank hung, a result was wrong or "
              "something was left behind (see the table)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
