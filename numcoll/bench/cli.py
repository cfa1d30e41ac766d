"""``numcoll-bench`` / ``python -m numcoll.bench``: the command line."""

from __future__ import annotations

import argparse
import sys

import transports

from .forms import describe
from .report import (
    compare_rows,
    format_footer,
    format_mpi_table,
    format_table,
    join_anchor,
    ratio,
)
from .runners import (
    DEFAULT_TIMEOUT_S,
    TorchUnavailableError,
    run_plans,
    torch_available,
    torch_version,
)
from .saved import DEFAULT_STORAGE, check_comparable, load_run, save_run, with_baseline
from .sweep import (
    OPS,
    PLACEMENTS,
    SWEEPS,
    Plan,
    format_nbytes,
    make_plan,
    metadata,
    moves_data,
    parse_nbytes,
    placements_text,
    sizes_between,
    write_json,
)

__all__ = ["main", "build_parser", "add_rank_arguments", "check_rank_arguments"]

_EPILOG = """\
size is the per-rank buffer as nccl-tests define it (allgather: the output;
reduce_scatter: the input; alltoall: the send buffer; gather: the root's
output; scatter: the root's input); count = size / itemsize.
algbw = size / time; busbw = algbw x 2(n-1)/n (allreduce), (n-1)/n (allgather,
reduce_scatter, alltoall, gather, scatter), 1 (broadcast, reduce). time = median over iterations
of the slowest rank (min and max over iterations beside it). place: "out" of
place or "in" place (allgather: the input is this rank's block of the output;
reduce_scatter: the output is this rank's block of the input; allreduce,
broadcast and reduce always write into their input). #wrong: after timing a
size, inputs are filled with rank-dependent values, the collective runs once
more, and the result elements that differ from the expected ones are counted
over all ranks (0 is the only right answer; the exit status is 1 otherwise).
With --compare torch: "busbw x" = numcoll/gloo busbw (>1: numcoll faster),
"time x" = numcoll/gloo time (<1: numcoll faster). The table ends as
nccl-tests' does: "# Out of bounds values" (the #wrong total) and
"# Avg bus bandwidth" (the mean busbw of every row, GB/s).

--save NAME keeps the run (as --json writes it) in --storage (default
{storage}/NAME.json; a NAME with a / or ending in .json is a path);
--baseline NAME adds the saved run's time ("base(us)") and this run's change
against it ("delta": +10.0% is 10% slower) to each row of the same size and
placement, and its Avg bus bandwidth to this one's. The baseline must be the
same op, world size and dtype. One run is one measurement: rerun before
trusting a delta of a few percent (python -m pytest benchmarks --quick
--benchmark-compare is the gate that knows the noise).

Each iteration is one blocking call, as a user makes it: numcoll's module-level
function on the default group (nc.all_reduce(x), nc.barrier(), ...) beside
torch's (dist.all_reduce(x), dist.barrier()) and mpi4py's (comm.Allreduce,
comm.Barrier). With --algorithm, numcoll calls the ProcessGroup method with the
algorithm in its options and waits on its Work (the module functions take no
algorithm).

barrier moves no data: one row, size 0, and "-" for type, place, algbw, busbw
and #wrong (nothing to check); it takes no sizes and no --sweep.

sweeps (--sweep NAME; without it: -b 8 -e 64M -f 2):
{sweeps}
--iters and --warmup override a sweep's (--iters alone: warmup iters/10, 2 to 10).

examples:
  python -m numcoll.bench --op allreduce --world-size 4 --sizes 8,1M,64M
  python -m numcoll.bench --op broadcast --algorithm chain --compare torch --json out.json
  python -m numcoll.bench --op allgather --sweep latency --compare torch,mpi4py
  python -m numcoll.bench --op barrier -n 4 --compare torch,mpi4py
  python -m numcoll.bench --op allreduce --sweep latency --persistent --compare mpi4py
  python -m numcoll.bench --op allreduce --sizes 1M,16M --shared-arrays --compare mpi4py
  python -m numcoll.bench --op alltoall --sizes 64K,1M --compare mpi4py --paired
  python -m numcoll.bench --sizes 8,1M,16M --save main     # on main
  python -m numcoll.bench --sizes 8,1M,16M --baseline main # on a branch
"""


#: -b, -e, -f without --sweep or --sizes (nccl-tests' whole range).
_DEFAULT_SIZES = (8, 64 << 20, 2.0)


def _describe_sweeps() -> str:
    lines = []
    for name, sweep in SWEEPS.items():
        iters = ("iterations as by default" if sweep.iters is None else
                 f"{sweep.iters} iterations (warmup {sweep.warmup}) per size")
        lines.append(f"  {name:<10} {format_nbytes(sweep.min_nbytes)} .. "
                     f"{format_nbytes(sweep.max_nbytes)}, factor {sweep.factor:g}, {iters}")
    return "\n".join(lines)


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


def add_rank_arguments(p: argparse.ArgumentParser, world_size: int) -> None:
    """``--world-size/-n``, ``--mode`` and ``--transport``: how the local ranks run
    (numcoll-bench and the demo alike; :func:`check_rank_arguments` after parsing)."""
    p.add_argument("--world-size", "-n", type=int, default=world_size,
                   help=f"ranks (default {world_size})")
    p.add_argument("--mode", choices=("process", "thread"), default="process",
                   help="ranks as processes (default) or threads of one process")
    p.add_argument("--transport", choices=transports.KINDS, default=None,
                   help="numcoll transport (default: numcoll chooses; shm for local processes "
                        "on Linux, ipc elsewhere, inproc for threads)")


def check_rank_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit through ``parser.error`` on ranks that cannot run as asked."""
    if args.world_size < 1:
        parser.error(f"--world-size must be at least 1, got {args.world_size}")
    if args.mode == "process" and args.transport == "inproc":
        parser.error("--transport inproc needs --mode thread (ranks in one process)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="numcoll-bench", description="nccl-tests-style sweeps of numcoll collectives "
        "on local ranks, optionally beside torch.distributed's gloo backend.",
        epilog=_EPILOG.format(sweeps=_describe_sweeps(), storage=DEFAULT_STORAGE),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", choices=OPS, default="allreduce", help="collective (default allreduce)")
    add_rank_arguments(p, world_size=2)
    p.add_argument("--dtype", default=None, help="element type (default float32)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the arrays live: cpu (NumPy, default) or cuda (Numba device "
                        "arrays; torch gloo on CUDA tensors with --compare torch; the "
                        "machine's pinned and device copy limits measured in the same run)")
    p.add_argument("--sweep", choices=tuple(SWEEPS), default=None,
                   help="a named size range, with iterations to suit it (see below; "
                        "excludes --sizes, -b, -e, -f)")
    p.add_argument("--min-bytes", "-b", type=_size, default=None,
                   help=f"smallest size (default {_DEFAULT_SIZES[0]})")
    p.add_argument("--max-bytes", "-e", type=_size, default=None,
                   help=f"largest size (default {format_nbytes(_DEFAULT_SIZES[1])})")
    p.add_argument("--factor", "-f", type=float, default=None,
                   help=f"size multiplier between steps (default {_DEFAULT_SIZES[2]:g})")
    p.add_argument("--sizes", type=_sizes, default=None,
                   help="explicit comma-separated sizes, e.g. 8,1M,16M,64M (overrides -b/-e/-f)")
    p.add_argument("--iters", type=int, default=None,
                   help="timed iterations per size (default: 200 for small sizes, down to 5 "
                        "for large ones: about 2 GiB of buffer per size)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed iterations per size (default: iters/10, 2 to 10)")
    p.add_argument("--algorithm", default=None,
                   help="force a numcoll algorithm (allreduce: ring, recursive_doubling; "
                        "broadcast: binomial, chain; reduce: binomial, ring); numcoll then "
                        "runs through ProcessGroup + Work.wait() (see below)")
    p.add_argument("--sync-each-iter", action="store_true",
                   help="untimed barrier before every timed iteration (default: once per size, "
                        "as nccl-tests; then a broadcast/reduce root whose sends complete "
                        "eagerly can run ahead, which flatters their small-size times)")
    p.add_argument("--placement", choices=("both", "out-of-place", "in-place"), default="both",
                   help="out-of-place and/or in-place forms (default both, where the op has "
                        "both: allgather, reduce_scatter)")
    p.add_argument("--persistent", action="store_true",
                   help="time numcoll's persistent collectives: a request made once per size "
                        "(nc.all_reduce_init ...), start() + wait() per iteration; MPI's "
                        "MPI-4 persistent collectives where its library has them (else its "
                        "blocking call, as torch's)")
    p.add_argument("--shared-arrays", action="store_true",
                   help="numcoll's buffers from nc.empty_shared, so its collectives read "
                        "the other ranks' arrays in place (the anchors' stay ordinary arrays)")
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
    p.add_argument("--paired", action="store_true",
                   help="with --compare mpi4py: numcoll runs inside MPI's processes, each "
                        "size's iterations in rounds alternating with MPI's, so both are "
                        "timed on the same machine state (on a shared VM, where two cores "
                        "are from one launch to the next, two launches can time two "
                        "different machines)")
    p.add_argument("--save", metavar="NAME", default=None,
                   help="keep this run as NAME (in --storage) for a later --baseline NAME")
    p.add_argument("--baseline", metavar="NAME", default=None,
                   help="compare with the run saved as NAME: its time and a delta column "
                        "per row, its Avg bus bandwidth beside this one's")
    p.add_argument("--storage", metavar="DIR", default=DEFAULT_STORAGE,
                   help=f"where --save and --baseline keep runs (default {DEFAULT_STORAGE})")
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
    check_rank_arguments(parser, args)
    if args.iters is not None and args.iters < 1:
        parser.error(f"--iters must be at least 1, got {args.iters}")
    if args.warmup is not None and args.warmup < 0:
        parser.error(f"--warmup must be at least 0, got {args.warmup}")
    if args.paired and ("mpi4py" not in args.compare or args.mode != "process"
                        or args.transport is not None or args.device != "cpu"):
        parser.error("--paired times numcoll in MPI's processes: it needs --compare mpi4py "
                     "and numcoll's default transport, process ranks and the CPU")
    try:
        plans = _plans(args)
    except ValueError as exc:
        parser.error(str(exc))
    progress = "none" if args.quiet else args.progress
    plan = plans[0]
    run = run_plans
    if args.device == "cuda":
        run, why = _device_runner(args)
        if why is not None:
            print(f"numcoll-bench: error: {why}", file=sys.stderr)
            return 2
    baseline = None
    if args.baseline is not None:  # read (and checked) before minutes of measuring
        try:
            baseline = load_run(args.baseline, args.storage)
            check_comparable({"op": plan.op, "world_size": plan.world_size,
                              "dtype": plan.dtype if plan.moves_data else None},
                             baseline["metadata"], args.baseline)
        except (OSError, ValueError) as exc:
            print(f"numcoll-bench: error: --baseline: {exc}", file=sys.stderr)
            return 2
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
    from .placement import first_two_cpus, round_trip_us

    trip_before = round_trip_us()
    paired = None
    if args.paired:
        from .mpi import run_plans_paired

        try:
            paired = run_plans_paired(plans, timeout_s=args.timeout)
        except Exception as exc:  # noqa: BLE001 - both backends ran there: nothing to show
            print(f"numcoll-bench: error: the paired run failed: {exc}", file=sys.stderr)
            return 1
        per_plan, info = [run[0] for run in paired], paired[0][1]
    else:
        per_plan, info = run(plans, backend="numcoll", mode=args.mode,
                             transport=args.transport, timeout_s=args.timeout,
                             progress=progress)
    torch_per_plan, status = None, 0
    if "torch" in args.compare:
        try:
            torch_per_plan, _ = run(plans, backend="torch", timeout_s=args.timeout,
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
            mpi_runs = [run[2:] for run in paired] if paired is not None else \
                [run_plan_mpi(p, timeout_s=args.timeout) for p in plans]
        except Exception as exc:  # noqa: BLE001 - keep the other results, report MPI's failure
            print(f"numcoll-bench: error: the mpi4py run failed: {exc}", file=sys.stderr)
            status = status or 1
        else:
            mpi_rows = [r for rows_, _ in mpi_runs for r in rows_]
            rows = _with_mpi(rows, mpi_rows)
            if args.persistent and not mpi_runs[0][1].get("mpi_persistent") and not args.quiet:
                print("numcoll-bench: note: this MPI has no persistent collectives (MPI-4): "
                      "its rows time the blocking call", file=sys.stderr)
    meta = metadata(plan, mode=args.mode, transport=args.transport,
                    transport_used=info.get("transport"), compare=",".join(args.compare) or None,
                    torch_version=torch_version(), sweep=args.sweep)
    meta["placements"] = [p.placement for p in plans]
    meta["paired"] = args.paired
    trips = [trip_before, round_trip_us()]
    meta["cpu_round_trip_us"] = {"cpus": first_two_cpus(), "before": trips[0],
                                 "after": trips[1]}
    limits = None
    if args.device == "cuda":
        from .device import device_limits

        meta["device"] = "cuda"
        limits = meta["device_limits"] = device_limits([c.nbytes for c in plan.cases
                                                        if c.nbytes])
    if baseline is not None:
        rows = with_baseline(rows, baseline["rows"])
        meta["baseline"] = {"name": args.baseline, "path": baseline["path"],
                            "started_at": baseline["metadata"].get("started_at")}

    if args.json != "-":
        title = (f"# numcoll {plan.op}: world_size={plan.world_size} mode={args.mode} "
                 f"transport={info.get('transport')}"
                 + (f" dtype={plan.dtype}" if plan.moves_data else "")
                 + (f" sweep={args.sweep}" if args.sweep else "")
                 + (f" algorithm={plan.algorithm}" if plan.algorithm else "")
                 + (f" form={describe(plan)}" if describe(plan) else "")
                 + (f" baseline={args.baseline}" if baseline is not None else "")
                 + (f"  vs torch {meta['torch_version']} gloo (processes, 1 thread/rank)"
                    if torch_rows is not None else ""))
        print(format_table(rows, title=title), flush=True)
        print(format_footer(rows, baseline=None if baseline is None else
                            (args.baseline, baseline["rows"])), flush=True)
        if None not in trips:
            print(f"# CPUs {' and '.join(map(str, first_two_cpus()))}: a cache line's round "
                  f"trip {trips[0]:.3f} us before the run, {trips[1]:.3f} after (on a VM: "
                  "where the hypervisor put them; see numcoll.bench.placement)", flush=True)
        if mpi_rows is not None:
            print(format_mpi_table(rows, paired=args.paired), flush=True)
        if limits is not None:
            from .device import format_limits

            print(format_limits(limits), flush=True)
    if args.json is not None:
        write_json(args.json, meta, rows)
    if args.save is not None:
        try:
            path = save_run(args.save, meta, rows, args.storage)
        except (OSError, ValueError) as exc:
            print(f"numcoll-bench: error: --save: {exc}", file=sys.stderr)
            status = status or 2
        else:
            if not args.quiet:
                print(f"numcoll-bench: saved as {args.save!r} ({path})", file=sys.stderr)
    wrong = sum((r["wrong"] or 0) + (r.get("torch_wrong") or 0) + (r.get("mpi_wrong") or 0)
                for r in rows)
    if wrong:
        print(f"numcoll-bench: error: {wrong} wrong result elements (see #wrong)",
              file=sys.stderr)
        status = status or 1
    return status


def _device_runner(args: argparse.Namespace):
    """(the runner of ``--device cuda``, None), or (None, why it cannot run here)."""
    from .device import device_problem, run_device_plans

    if args.persistent or args.shared_arrays or "mpi4py" in args.compare:
        return None, ("--device cuda runs the blocking calls, beside torch only: "
                      "--persistent, --shared-arrays and --compare mpi4py do not apply")
    why, simulated = device_problem()
    if why is not None:
        return None, f"--device cuda needs a CUDA GPU: {why}"
    if "torch" in args.compare:
        import torch

        if not torch.cuda.is_available():
            return None, ("--device cuda --compare torch needs a CUDA build of torch and a "
                          "GPU (torch.cuda.is_available() is False)")
    if simulated and not args.quiet:
        print("numcoll-bench: note: NUMBA_ENABLE_CUDASIM=1: the CUDA simulator runs the "
              "device code on the CPU; its timings mean nothing (use tiny sizes)",
              file=sys.stderr)

    def run(plans, *, backend, timeout_s, progress, mode="process", transport=None):
        return run_device_plans(plans, backend=backend, mode=mode, transport=transport,
                                timeout_s=timeout_s)

    return run, None


def _plans(args: argparse.Namespace) -> list[Plan]:
    """One plan per placement asked for; ValueError on arguments that do not fit
    together (an option the op would not use included)."""
    if not moves_data(args.op) and args.dtype is not None:
        raise ValueError(f"{args.op} moves no data: --dtype does not apply")
    sizes, iters, warmup = _sweep_sizes(args)
    if args.placement != "both" and args.placement not in PLACEMENTS[args.op]:
        raise ValueError(f"{args.op} has no {args.placement} form in numcoll; "
                         f"{placements_text(args.op)}")
    return [make_plan(args.op, sizes, world_size=args.world_size, dtype=args.dtype or "float32",
                      iters=iters, warmup=warmup, algorithm=args.algorithm,
                      in_place=(p == "in-place"), sync_each_iter=args.sync_each_iter,
                      check=args.check, persistent=args.persistent,
                      shared_arrays=args.shared_arrays)
            for p in PLACEMENTS[args.op] if args.placement in ("both", p)]


def _sweep_sizes(args: argparse.Namespace) -> tuple[list[int], int | None, int | None]:
    """(sizes, iters, warmup) from --sweep, --sizes or -b/-e/-f; ValueError on a
    combination that would leave one of them unused."""
    explicit = [flag for flag, value in (("--sizes", args.sizes), ("-b", args.min_bytes),
                                         ("-e", args.max_bytes), ("-f", args.factor))
                if value is not None]
    if not moves_data(args.op):
        if explicit or args.sweep:
            raise ValueError(f"{args.op} moves no data: {(explicit or ['--sweep'])[0]} does "
                             "not apply (its one row is size 0)")
        return [], args.iters, args.warmup
    if args.sweep is not None:
        if explicit:
            raise ValueError(f"--sweep {args.sweep} sets the sizes: drop {explicit[0]}, or "
                             "drop --sweep")
        sweep = SWEEPS[args.sweep]
        if args.iters is not None:  # the sweep's warmup goes with its own iterations
            return sweep.sizes, args.iters, args.warmup
        return sweep.sizes, sweep.iters, args.warmup if args.warmup is not None else sweep.warmup
    if args.sizes:
        return args.sizes, args.iters, args.warmup
    low, high, factor = (d if v is None else v for v, d in
                         zip((args.min_bytes, args.max_bytes, args.factor), _DEFAULT_SIZES))
    return sizes_between(low, high, factor), args.iters, args.warmup


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


def _by_size(rows: list[dict]) -> list[dict]:
    """Rows of several placements interleaved by size (out-of-place first), as
    nccl-tests puts both forms of a size on one line."""
    order = {"out-of-place": 0, "in-place": 1}
    return sorted(rows, key=lambda r: (r["size"], order.get(r["placement"], 2)))
