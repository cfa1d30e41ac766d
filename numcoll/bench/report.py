"""How sweep rows are shown: the nccl-tests-like table, and numcoll beside gloo."""

from __future__ import annotations

__all__ = ["avg_busbw", "compare_rows", "join_anchor", "ratio", "format_table", "format_footer",
           "format_mpi_table"]


def compare_rows(rows: list[dict], torch_rows: list[dict] | None) -> list[dict]:
    """Add ``torch_*`` columns and the numcoll/torch ratios to ``rows`` (matched
    by size and placement).

    ``busbw_ratio`` > 1 and ``time_ratio`` < 1 mean numcoll is faster.
    """
    if torch_rows is None:
        return rows
    return join_anchor(rows, torch_rows, lambda row, t: dict(
        torch_time_us=t["time_us"], torch_time_us_min=t["time_us_min"],
        torch_time_us_max=t["time_us_max"], torch_algbw_gbps=t["algbw_gbps"],
        torch_busbw_gbps=t["busbw_gbps"], torch_wrong=t.get("wrong"),
        busbw_ratio=ratio(row["busbw_gbps"], t["busbw_gbps"]),
        time_ratio=ratio(row["time_us"], t["time_us"])))


def join_anchor(rows: list[dict], anchor_rows: list[dict], columns) -> list[dict]:
    """Copies of ``rows`` with ``columns(row, anchor_row)`` added where an anchor's
    row has the same size and placement (gloo, MPI: one matching rule)."""
    by_key = {(r["size"], r.get("placement")): r for r in anchor_rows}
    out = []
    for row in rows:
        row = dict(row)
        anchor = by_key.get((row["size"], row.get("placement")))
        if anchor is not None:
            row.update(columns(row, anchor))
        out.append(row)
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


_PLACE = {"in-place": "in", "out-of-place": "out"}
_COLUMNS = [  # (key, header, format)
    ("size", "size(B)", "{:>12d}"),
    ("count", "count", "{:>12d}"),
    ("dtype", "type", "{:>8s}"),
    ("placement", "place", "{:>5s}"),
    ("algorithm", "algo", "{:>18s}"),
    ("time_us", "time(us)", "{:>11.1f}"),
    ("time_us_min", "min(us)", "{:>11.1f}"),
    ("time_us_max", "max(us)", "{:>11.1f}"),
    ("algbw_gbps", "algbw(GB/s)", "{:>11.3f}"),
    ("busbw_gbps", "busbw(GB/s)", "{:>11.3f}"),
    ("wrong", "#wrong", "{:>7d}"),
]
_BASELINE_COLUMNS = [
    ("base_time_us", "base(us)", "{:>11.1f}"),
    ("delta_pct", "delta", "{:>+7.1f}%"),
]
_TORCH_COLUMNS = [
    ("torch_time_us", "gloo(us)", "{:>11.1f}"),
    ("torch_busbw_gbps", "gloo busbw", "{:>11.3f}"),
    ("torch_wrong", "gloo#wrong", "{:>10d}"),
    ("busbw_ratio", "busbw x", "{:>8.2f}"),
    ("time_ratio", "time x", "{:>8.2f}"),
]


def format_table(rows: list[dict], *, title: str | None = None) -> str:
    """The rows as an nccl-tests-like text table (torch columns when present).

    time = median over iterations of the slowest rank, min/max beside it;
    ``place`` is ``in`` or ``out`` (of place); ``#wrong`` counts the wrong
    result elements over all ranks ("-": not checked). With a baseline
    (:func:`numcoll.bench.saved.with_baseline`): its time and ``delta``, this
    run's time against it (+10.0%: 10% slower). ``busbw x`` = numcoll
    busbw / gloo busbw (> 1: numcoll faster); ``time x`` = numcoll time / gloo
    time (< 1: numcoll faster).
    """
    columns = list(_COLUMNS)
    if any("base_time_us" in r for r in rows):
        columns += _BASELINE_COLUMNS
    if any("torch_time_us" in r for r in rows):
        columns += _TORCH_COLUMNS
    widths = [max(len(header), len(fmt.format(0 if "d}" in fmt else
                                              ("" if "s}" in fmt else 0.0))))
              for _, header, fmt in columns]
    lines = [] if title is None else [title]
    lines.append(" ".join(h.rjust(w) for (_, h, _), w in zip(columns, widths)))
    for row in rows:
        cells = []
        for (key, _, fmt), w in zip(columns, widths):
            value = row.get(key)
            if key == "placement" and value is not None:
                value = _PLACE.get(value, value)
            cells.append("-".rjust(w) if value is None else fmt.format(value).rjust(w))
        lines.append(" ".join(cells))
    return "\n".join(lines)


def avg_busbw(rows: list[dict], key: str = "busbw_gbps") -> float | None:
    """nccl-tests' "Avg bus bandwidth": the mean busbw over every row (every size
    and placement) that has one; None when none has (a barrier)."""
    values = [r[key] for r in rows if r.get(key) is not None]
    return sum(values) / len(values) if values else None


def format_footer(rows: list[dict], *, baseline: tuple[str, list[dict]] | None = None) -> str:
    """nccl-tests' closing lines: ``# Out of bounds values : 0 OK`` (the wrong
    elements over every row) and ``# Avg bus bandwidth    : 4.52531`` (the mean
    busbw over every row, in GB/s), with the baseline's beside it when given
    as (name, rows)."""
    wrong = sum(r.get("wrong") or 0 for r in rows)
    lines = [f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}"]
    avg = avg_busbw(rows)
    text = "-" if avg is None else f"{avg:g}"
    if baseline is not None:
        name, base_rows = baseline
        keys = {(r["size"], r.get("placement")) for r in rows if "base_time_us" in r}
        common = [r for r in rows if (r["size"], r.get("placement")) in keys]
        now = avg_busbw(common)
        base = avg_busbw([r for r in base_rows if (r["size"], r.get("placement")) in keys])
        if base and now is not None:
            scope = "" if len(common) == len(rows) else f" over the {len(common)} rows both have"
            text += (f"  (baseline {name}{scope}: {base:g}"
                     + (f" against {now:g}" if scope else "") + f", {(now / base - 1) * 100:+.1f}%)")
    lines += [f"# Avg bus bandwidth    : {text}", "#"]
    return "\n".join(lines)


def format_mpi_table(rows: list[dict], paired: bool = False) -> str:
    """The rows that have ``mpi_*`` columns, against mpi4py: time and busbw, and
    numcoll's ratios ("-": none, as for a barrier's busbw; MPI's results are
    not checked, so its #wrong is "-"). ``paired``: both were timed in the
    same processes (``--paired``), which the title says."""
    lines = ["# vs mpi4py (Open MPI, mpirun" + ("; paired: numcoll in the same processes, "
                                               "rounds alternated)" if paired else ")"),
             f"{'size(B)':>12} {'place':>5} {'time(us)':>10} {'mpi(us)':>10} {'time x':>8} "
             f"{'busbw':>8} {'mpi':>8} {'busbw x':>8} {'#wrong':>6}"]
    for r in rows:
        if "mpi_time_us" not in r:
            continue
        lines.append(
            f"{r['size']:>12d} {_PLACE.get(r.get('placement'), '-'):>5} {r['time_us']:>10.1f} "
            f"{r['mpi_time_us']:>10.1f} {_fmt(r['mpi_time_ratio']):>8} "
            f"{_fmt(r['busbw_gbps'], 3):>8} {_fmt(r['mpi_busbw_gbps'], 3):>8} "
            f"{_fmt(r['mpi_busbw_ratio']):>8} {_fmt(r.get('mpi_wrong'), 0):>6}")
    return "\n".join(lines)


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
