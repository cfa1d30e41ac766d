"""``numcoll-bench`` / ``python -m numcoll.bench``: the command line."""

from __future__ import annotations

import argparse
import sys

import transports

from .report import compare_rows, format_table, join_anchor, ratio
from .runners import (
    DEFAULT_TIMEOUT_S,
    TorchUnavailableError,
    run_plans,
    torch_available,
    torch_version,
)
from .sweep import (
    OPS,
    PLACEMENTS,
    make_plan,
    metadata,
    parse_nbytes,
    sizes_between,
    write_json,
)

__all__ = ["main", "build_parser"]

_EPILOG = """\
size is the per-rank buffer as nccl-tests define it (allgather: the output;
reduce_scatter: the input; alltoall: the send buffer); count = size / itemsize.
algbw = size / time; busbw = algbw x 2(n-1)/n (allreduce), (n-1)/n (allgather,
reduce_scatter, alltoall), 1 (broadcast, reduce). time = median over iterations
of the slowest rank (min and max over iterations beside it). place: "out" of
place or "in" place (allgather: the input is this rank's block of the output;
reduce_scatter: the output is this rank's block of the input; allreduce,
broadcast and reduce always write into their input). #wrong: after timing a
size, inputs are filled with rank-dependent values, the collective runs once
more, and the result elements that differ from the expected ones are counted
over all ranks (0 is the only right answer; the exit status is 1 otherwise).
With --compare torch: "busbw x" = numcoll/gloo busbw (>1: numcoll faster),
"time x" = numcoll/gloo time (<1: numcoll faster).

examples:
  python -m numcoll.bench --op allreduce --world-size 4 --sizes 8,1M,64M
  python -m numcoll.bench --op broadcast --algorithm chain --compare torch --json out.json
"""


def _size(text: str) -> int:
    try:
        return parse_nbytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _sizes(text: str) -> list[int]:
    items = [s for s in text.split(",") if s.strip()]
    if not items:
        raise argparse.ArgumentTypeError("--sizes needs at least one size, e.g. 8,1M,64M")
    return [_size(s) for s in items]


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="numcoll-bench", description="nccl-tests-style sweeps of numcoll collectives "
        "on local ranks, optionally beside torch.distributed's gloo backend.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", choices=OPS, default="allreduce", help="collective (default allreduce)")
    p.add_argument("--world-size", "-n", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--mode", choices=("process", "thread"), default="process",
                   help="ranks as processes (default) or threads of one process")
    p.add_argument("--transport", choices=transports.KINDS, default=None,
                   help="numcoll transport (default: numcoll chooses; shm for local processes "
                        "on Linux, ipc elsewhere, inproc for threads)")
    p.add_argument("--dtype", default="float32", help="element type (default float32)")
    p.add_argument("--min-bytes", "-b", type=_size, default=8, help="smallest size (default 8)")
    p.add_argument("--max-bytes", "-e", type=_size, default=64 << 20,
                   help="largest size (default 64M)")
    p.add_argument("--factor", "-f", type=float, default=2.0,
                   help="size multiplier between steps (default 2)")
    p.add_argument("--sizes", type=_sizes, default=None,
                   help="explicit comma-separated sizes, e.g. 8,1M,16M,64M (overrides -b/-e/-f)")
    p.add_argument("--iters", type=int, default=None,
                   help="timed iterations per size (default: 200 for small sizes, down to 5 "
                        "for large ones: about 2 GiB of buffer per size)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed iterations per size (default: iters/10, 2 to 10)")
    p.add_argument("--algorithm", default=None,
                   help="force a numcoll algorithm (allreduce: ring, recursive_doubling; "
                        "broadcast: binomial, chain; reduce: binomial, ring)")
    p.add_argument("--sync-each-iter", action="store_true",
                   help="untimed barrier before every timed iteration (default: once per size, "
                        "as nccl-tests; then a broadcast/reduce root whose sends complete "
                        "eagerly can run ahead, which flatters their small-size times)")
    p.add_argument("--placement", choices=("both", "out-of-place", "in-place"), default="both",
                   help="out-of-place and/or in-place forms (default both, where the op has "
                        "both: allgather, reduce_scatter)")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                   help="count wrong result elements after each size (the #wrong column; "
                        "default on)")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="write metadata and every row as JSON to PATH ('-' for stdout, "
                        "which then replaces the table)")
    p.add_argument("--compare", type=_anchors, default=(),
                   help="comma-separated anchors run on the same sizes in the same "
                        "invocation: torch (torch.distributed, backend gloo), mpi4py (Open "
                        "MPI via mpirun); e.g. --compare torch,mpi4py")
    p.add_argument("--timeout", type=_positive_float, default=DEFAULT_TIMEOUT_S,
                   help=f"deadline of each sweep in seconds (default {DEFAULT_TIMEOUT_S:.0f})")
    p.add_argument("--progress", choices=("auto", "bar", "lines", "none"), default="auto",
                   help="progress on stderr: a bar on a terminal, one line per size "
                        "otherwise (default auto)")
    p.add_argument("--quiet", "-q", action="store_true",
                   help="no progress and no notes on stderr (same as --progress none)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``numcoll-bench``; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.world_size < 1:
        parser.error(f"--world-size must be at least 1, got {args.world_size}")
    if args.mode == "process" and args.transport == "inproc":
        parser.error("--transport inproc needs --mode thread (ranks in one process)")
    if args.iters is not None and args.iters < 1:
        parser.error(f"--iters must be at least 1, got {args.iters}")
    if args.warmup is not None and args.warmup < 0:
        parser.error(f"--warmup must be at least 0, got {args.warmup}")
    try:
        sizes = args.sizes or sizes_between(args.min_bytes, args.max_bytes, args.factor)
        placements = [p for p in PLACEMENTS[args.op] if args.placement in ("both", p)]
        if not placements:
            raise ValueError(f"{args.op} has no {args.placement} form in numcoll; it is "
                             f"{' or '.join(PLACEMENTS[args.op])}")
        plans = [make_plan(args.op, sizes, world_size=args.world_size, dtype=args.dtype,
                           iters=args.iters, warmup=args.warmup, algorithm=args.algorithm,
                           in_place=(p == "in-place"), sync_each_iter=args.sync_each_iter,
                           check=args.check)
                 for p in placements]
    except ValueError as exc:
        parser.error(str(exc))
    progress = "none" if args.quiet else args.progress
    plan = plans[0]
    if "torch" in args.compare:
        if not torch_available():
            print("numcoll-bench: error: --compare torch needs PyTorch, which is not importable "
                  "in this environment (pip install torch)", file=sys.stderr)
            return 2
        if args.mode == "thread" and not args.quiet:
            print("numcoll-bench: note: torch gloo ranks always run as processes",
                  file=sys.stderr)

    if plan.op in ("broadcast", "reduce") and not plan.sync_each_iter and not args.quiet:
        print("numcoll-bench: note: without --sync-each-iter the root may run ahead of its "
              "receivers between iterations, which understates small-size latency",
              file=sys.stderr)
    per_plan, info = run_plans(plans, backend="numcoll", mode=args.mode,
                               transport=args.transport, timeout_s=args.timeout,
                               progress=progress)
    torch_per_plan, status = None, 0
    if "torch" in args.compare:
        try:
            torch_per_plan, _ = run_plans(plans, backend="torch", timeout_s=args.timeout,
                                          progress=progress)
        except TorchUnavailableError as exc:
            print(f"numcoll-bench: error: {exc}", file=sys.stderr)
            status = 2
        except Exception as exc:  # noqa: BLE001 - keep numcoll's results, report torch's failure
            print(f"numcoll-bench: error: the torch gloo run failed: {exc}", file=sys.stderr)
            status = 1
    rows = _by_size([r for rows in per_plan for r in rows])
    torch_rows = None if torch_per_plan is None else [r for rs in torch_per_plan for r in rs]
    rows = compare_rows(rows, torch_rows)
    mpi_rows = None
    if "mpi4py" in args.compare:
        from .mpi import run_plan_mpi

        try:
            mpi_rows = [r for p in plans for r in run_plan_mpi(p, timeout_s=args.timeout)[0]]
        except Exception as exc:  # noqa: BLE001 - keep the other results, report MPI's failure
            print(f"numcoll-bench: error: the mpi4py run failed: {exc}", file=sys.stderr)
            status = status or 1
        else:
            rows = _with_mpi(rows, mpi_rows)
    meta = metadata(plan, mode=args.mode, transport=args.transport,
                    transport_used=info.get("transport"), compare=",".join(args.compare) or None,
                    torch_version=torch_version())
    meta["placements"] = [p.placement for p in plans]

    if args.json != "-":
        title = (f"# numcoll {plan.op}: world_size={plan.world_size} mode={args.mode} "
                 f"transport={info.get('transport')} dtype={plan.dtype}"
                 + (f" algorithm={plan.algorithm}" if plan.algorithm else "")
                 + (f"  vs torch {meta['torch_version']} gloo (processes, 1 thread/rank)"
                    if torch_rows is not None else ""))
        print(format_table(rows, title=title), flush=True)
        if mpi_rows is not None:
            print(_mpi_table(rows), flush=True)
    if args.json is not None:
        write_json(args.json, meta, rows)
    wrong = sum((r["wrong"] or 0) + (r.get("torch_wrong") or 0) + (r.get("mpi_wrong") or 0)
                for r in rows)
    if wrong:
        print(f"numcoll-bench: error: {wrong} wrong result elements (see #wrong)",
              file=sys.stderr)
        status = status or 1
    return status


def _anchors(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in ("torch", "mpi4py")]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown anchor {unknown[0]!r}; choose from torch, "
                                         "mpi4py")
    return names


def _with_mpi(rows: list[dict], mpi_rows: list[dict]) -> list[dict]:
    """``mpi_*`` columns and numcoll/MPI ratios, matched by size and placement."""
    return join_anchor(rows, mpi_rows, lambda row, m: dict(
        mpi_time_us=m["time_us"], mpi_busbw_gbps=m["busbw_gbps"], mpi_wrong=m.get("wrong"),
        mpi_time_ratio=ratio(row["time_us"], m["time_us"]),
        mpi_busbw_ratio=ratio(row["busbw_gbps"], m["busbw_gbps"])))


def _mpi_table(rows: list[dict]) -> str:
    """The same sizes against mpi4py: time and busbw, and numcoll's ratios."""
    lines = ["# vs mpi4py (Open MPI, mpirun)",
             f"{'size(B)':>12} {'place':>5} {'time(us)':>10} {'mpi(us)':>10} {'time x':>8} "
             f"{'busbw':>8} {'mpi':>8} {'busbw x':>8} {'#wrong':>6}"]
    for r in rows:
        if "mpi_time_us" not in r:
            continue
        lines.append(
            f"{r['size']:>12d} {r.get('placement', '')[:5]:>5} {r['time_us']:>10.1f} "
            f"{r['mpi_time_us']:>10.1f} {_fmt(r['mpi_time_ratio']):>8} "
            f"{r['busbw_gbps']:>8.3f} {r['mpi_busbw_gbps']:>8.3f} "
            f"{_fmt(r['mpi_busbw_ratio']):>8} {r.get('mpi_wrong') or 0:>6}")
    return "\n".join(lines)


def _fmt(ratio) -> str:
    return "-" if ratio is None else f"{ratio:.2f}"


def _by_size(rows: list[dict]) -> list[dict]:
    """Rows of several placements interleaved by size (out-of-place first), as
    nccl-tests puts both forms of a size on one line."""
    order = {"out-of-place": 0, "in-place": 1}
    return sorted(rows, key=lambda r: (r["size"], order.get(r["placement"], 2)))
