"""What a benchmark sweep measures and how it is reported, nccl-tests style.

A sweep is a :class:`Plan`: one collective, one dtype, one world size and a
list of :class:`Case` (one per message size). ``size`` is the nccl-tests
size: the bytes of the per-rank buffer (allreduce, broadcast, reduce: the
buffer; allgather: the *output*, n x input; reduce_scatter: the *input*,
n x output; alltoall: the per-rank send buffer; gather: the root's output,
n x input; scatter: the root's input, n x output). ``count = size / itemsize``.
A barrier moves no data: its plan has one case of size 0, no placement, no
bandwidth and nothing for ``#wrong`` to check.

Bandwidths follow nccl-tests' PERFORMANCE.md: ``algbw = size / time`` and
``busbw = algbw * factor`` with factor ``2(n-1)/n`` for allreduce,
``(n-1)/n`` for allgather, reduce_scatter, alltoall, gather and scatter, and 1 for broadcast
and reduce, so that busbw is comparable to the link bandwidth whatever n.

:data:`SWEEPS` holds the named size ranges of ``numcoll-bench --sweep``: a
latency sweep (8 B to 64 KiB, many iterations) and a bandwidth sweep (1 MiB
to 64 MiB).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
import sys
import time
from typing import Iterable, Sequence

import numpy as np

__all__ = [
    "OPS",
    "PLACEMENTS",
    "SWEEPS",
    "Sweep",
    "Case",
    "Plan",
    "bus_factor",
    "parse_nbytes",
    "format_nbytes",
    "sizes_between",
    "placements_text",
    "moves_data",
    "make_plan",
    "algorithm_name",
    "summarize",
    "metadata",
    "write_json",
]

#: The collectives the benchmark knows.
OPS = ("allreduce", "allgather", "reduce_scatter", "broadcast", "reduce", "alltoall",
       "gather", "scatter", "barrier")
#: Collectives without a buffer: one case of size 0, no placement, no busbw,
#: no #wrong.
_NO_DATA_OPS = frozenset({"barrier"})
#: Collectives whose buffer is split into world_size equal blocks: their size
#: is rounded down to a multiple of world_size elements (as nccl-tests does).
_SPLIT_OPS = frozenset({"allgather", "reduce_scatter", "alltoall", "gather", "scatter"})
#: Collectives numcoll has no persistent form or shared-array path for.
_LIST_OPS = frozenset({"gather", "scatter"})
#: The placements each collective has (in numcoll and torch alike): allreduce,
#: broadcast and reduce write into their input; alltoall_base does not take
#: aliased buffers; barrier has no buffer, so its one plan has placement None.
PLACEMENTS = {
    "allreduce": ("in-place",), "broadcast": ("in-place",), "reduce": ("in-place",),
    "allgather": ("out-of-place", "in-place"), "reduce_scatter": ("out-of-place", "in-place"),
    "alltoall": ("out-of-place",), "gather": ("out-of-place",), "scatter": ("out-of-place",),
    "barrier": (None,),
}

#: Default iteration policy: about this many bytes of buffer per size (so the
#: large sizes run few iterations), clamped to [MIN_ITERS, MAX_ITERS].
ITER_BUDGET_NBYTES = 2 << 30
MIN_ITERS, MAX_ITERS = 5, 200
MIN_WARMUP, MAX_WARMUP = 2, 10

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMG]?)(?:I?B)?\s*$", re.IGNORECASE)


def bus_factor(op: str, world_size: int) -> float:
    """busbw / algbw for ``op`` on ``world_size`` ranks (nccl-tests' factors)."""
    n = world_size
    if op == "allreduce":
        return 2 * (n - 1) / n
    if op in _SPLIT_OPS:
        return (n - 1) / n
    if op in ("broadcast", "reduce"):
        return 1.0
    if op in _NO_DATA_OPS:
        raise ValueError(f"{op} moves no data: it has no bus bandwidth")
    raise ValueError(f"unknown op {op!r}; choose one of {', '.join(OPS)}")


def parse_nbytes(text: str | int) -> int:
    """``"64M"`` -> 67108864. Suffixes K, M, G are powers of 1024 (optionally
    followed by B or iB); a bare number is bytes."""
    if isinstance(text, int):
        nbytes = text
    else:
        match = _SIZE_RE.match(str(text))
        if not match:
            raise ValueError(f"invalid size {text!r}: expected bytes such as 8, 4K, 16M or 1G")
        nbytes = int(match.group(1)) * _UNITS[match.group(2).upper()]
    if nbytes < 1:
        raise ValueError(f"invalid size {text!r}: must be at least 1 byte")
    return nbytes


def format_nbytes(nbytes: int) -> str:
    """Short human form: ``4 KiB``, ``64 MiB``, ``12 B``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def sizes_between(min_nbytes: int, max_nbytes: int, factor: float = 2) -> list[int]:
    """``min, min*factor, ...`` up to and including ``max`` (nccl-tests' -b/-e/-f)."""
    if min_nbytes < 1:
        raise ValueError(f"min size must be at least 1 byte, got {min_nbytes}")
    if max_nbytes < min_nbytes:
        raise ValueError(f"max size ({max_nbytes} B) is smaller than min size ({min_nbytes} B)")
    if factor <= 1:
        raise ValueError(f"factor must be greater than 1, got {factor}")
    sizes, nbytes = [], float(min_nbytes)
    while round(nbytes) <= max_nbytes:
        if not sizes or round(nbytes) != sizes[-1]:
            sizes.append(int(round(nbytes)))
        nbytes *= factor
    return sizes


@dataclasses.dataclass(frozen=True)
class Sweep:
    """A named size range: ``min_nbytes`` to ``max_nbytes`` by ``factor``, and
    the iterations per size (None: :func:`make_plan`'s default)."""

    min_nbytes: int
    max_nbytes: int
    factor: float
    iters: int | None = None
    warmup: int | None = None

    @property
    def sizes(self) -> list[int]:
        """The sizes in bytes, as :func:`sizes_between` lists them."""
        return sizes_between(self.min_nbytes, self.max_nbytes, self.factor)


#: ``numcoll-bench --sweep NAME``. Latency: small messages, where one
#: iteration takes tens of microseconds and a scheduler hiccup is an outlier,
#: so many iterations (and a longer warmup) for a steady median. Bandwidth:
#: the default iteration policy (200 at 1 MiB down to 32 at 64 MiB).
SWEEPS = {
    "latency": Sweep(8, 64 << 10, 2, iters=1000, warmup=100),
    "bandwidth": Sweep(1 << 20, 64 << 20, 2),
}


@dataclasses.dataclass(frozen=True)
class Case:
    """One message size of a sweep.

    nbytes, count: the nccl-tests size and element count (see the module
    docstring); iters, warmup: timed and untimed iterations.
    """

    nbytes: int
    count: int
    iters: int
    warmup: int


@dataclasses.dataclass(frozen=True)
class Plan:
    """A sweep: ``op`` on ``world_size`` ranks over ``cases``.

    algorithm: forced numcoll algorithm (None: numcoll chooses per size).
    in_place: the result overwrites the input (allgather: each rank's input is
        its block of the output; reduce_scatter: the output is this rank's
        block of the input, as in nccl-tests). allreduce, broadcast and reduce
        are always in place (numcoll's and torch's calls write into the input);
        alltoall never is; a barrier has no buffer (``placement`` None).
    sync_each_iter: an untimed barrier before every timed iteration (by default
        the ranks meet once per size, as in nccl-tests; then a broadcast root
        whose sends complete eagerly can run ahead of its receivers).
    check: after timing each size, run it once more on rank-dependent inputs
        and count the wrong elements (the ``#wrong`` column).
    persistent, shared_arrays: numcoll's other forms (``--persistent``: a
        request made once per size, ``start(); wait()`` per iteration;
        ``--shared-arrays``: buffers from ``nc.empty_shared``): see
        :mod:`numcoll.bench.forms`.
    """

    op: str
    dtype: str
    world_size: int
    cases: tuple[Case, ...]
    algorithm: str | None = None
    in_place: bool = False
    sync_each_iter: bool = False
    check: bool = True
    persistent: bool = False
    shared_arrays: bool = False

    @property
    def numpy_dtype(self) -> np.dtype:
        from ..dtypes import bfloat16

        return bfloat16 if self.dtype == "bfloat16" else np.dtype(self.dtype)

    @property
    def placement(self) -> str | None:
        """"in-place", "out-of-place", or None (barrier: no buffer)."""
        return _placement(self.op, self.in_place)

    @property
    def moves_data(self) -> bool:
        """False for barrier: no size, no bandwidth, nothing to check."""
        return moves_data(self.op)

    @property
    def label(self) -> str:
        """``allreduce``, ``allgather in-place``, ``allreduce ring`` (forced): what a
        progress bar calls it."""
        both = self.op in PLACEMENTS and len(PLACEMENTS[self.op]) > 1
        label = f"{self.op} {self.placement}" if both else self.op
        label += f" {self.algorithm}" if self.algorithm else ""
        forms = [w for w, on in (("persistent", self.persistent),
                                 ("shared arrays", self.shared_arrays)) if on]
        return f"{label} ({', '.join(forms)})" if forms else label


def moves_data(op: str) -> bool:
    """Whether ``op`` has a buffer (every op but barrier): sizes, busbw, #wrong."""
    return op not in _NO_DATA_OPS


def _placement(op: str, in_place: bool) -> str | None:
    if op in _NO_DATA_OPS:
        return None
    return "in-place" if in_place else "out-of-place"


def placements_text(op: str) -> str:
    """``"it is out-of-place or in-place"``: the forms ``op`` has, for error messages."""
    forms = [p for p in PLACEMENTS[op] if p is not None]
    return f"it is {' or '.join(forms)}" if forms else "it has no buffer"


def _default_iters(nbytes: int) -> int:
    return int(min(MAX_ITERS, max(MIN_ITERS, ITER_BUDGET_NBYTES // max(1, nbytes))))


def _default_warmup(iters: int) -> int:
    return int(min(MAX_WARMUP, max(MIN_WARMUP, iters // 10)))


def make_plan(op: str, sizes: Iterable[int], *, world_size: int = 2, dtype: str = "float32",
              iters: int | None = None, warmup: int | None = None,
              algorithm: str | None = None, in_place: bool | None = None,
              sync_each_iter: bool = False, check: bool = True, persistent: bool = False,
              shared_arrays: bool = False) -> Plan:
    """Validate the arguments and build a :class:`Plan`.

    Sizes are rounded down to whole elements (to a multiple of ``world_size``
    elements for allgather, reduce_scatter and alltoall; at least one element
    per rank); sizes that round to the same value are measured once.
    ``iters``/``warmup`` None: fewer iterations for larger sizes
    (about 2 GiB of buffer per size, 5 to 200 iterations). ``in_place`` None:
    the op's first placement in :data:`PLACEMENTS`.

    A barrier moves no data: ``sizes`` must be empty, the plan has one case of
    size 0 (200 iterations by default) and ``check`` is off (nothing to check).
    ``persistent``, ``shared_arrays``: see :class:`Plan`.
    """
    from ..dtypes import SUPPORTED_DTYPES, dtype_name

    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; choose one of {', '.join(OPS)}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world size must be a positive integer, got {world_size!r}")
    names = {dtype_name(d): d for d in SUPPORTED_DTYPES}
    if dtype not in names:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {', '.join(names)}")
    if iters is not None and iters < 1:
        raise ValueError(f"iters must be at least 1, got {iters}")
    if warmup is not None and warmup < 0:
        raise ValueError(f"warmup must be at least 0, got {warmup}")
    if algorithm is not None:
        _check_algorithm(op, algorithm)
    if in_place is None:
        in_place = PLACEMENTS[op][0] == "in-place"
    placement = "in-place" if in_place else _placement(op, False)
    if placement not in PLACEMENTS[op]:
        raise ValueError(f"{op} has no {placement} form in numcoll; {placements_text(op)}")
    sizes = list(sizes)
    if op in _LIST_OPS and (persistent or shared_arrays):
        raise ValueError(f"{op} has no {'persistent' if persistent else 'shared-array'} form "
                         "in numcoll")
    if op in _NO_DATA_OPS:
        if sizes:
            raise ValueError(f"{op} moves no data: give no sizes (its one case is size 0)")
        if shared_arrays:
            raise ValueError(f"{op} moves no data: it has no arrays to share")
        n_iters = iters if iters is not None else MAX_ITERS
        n_warmup = warmup if warmup is not None else _default_warmup(n_iters)
        return Plan(op, dtype, world_size, (Case(0, 0, n_iters, n_warmup),), algorithm, False,
                    sync_each_iter, check=False, persistent=persistent)
    itemsize = names[dtype].itemsize
    per = world_size if op in _SPLIT_OPS else 1
    cases, seen = [], set()
    for requested in sizes:
        count = max(1, int(requested) // (itemsize * per)) * per
        if count in seen:
            continue
        seen.add(count)
        nbytes = count * itemsize
        n_iters = iters if iters is not None else _default_iters(nbytes)
        n_warmup = warmup if warmup is not None else _default_warmup(n_iters)
        cases.append(Case(nbytes, count, n_iters, n_warmup))
    if not cases:
        raise ValueError("no sizes to measure")
    return Plan(op, dtype, world_size, tuple(cases), algorithm, bool(in_place), sync_each_iter,
                check, persistent, shared_arrays)


def _check_algorithm(op: str, algorithm: str) -> None:
    from ..algorithms import CHOICES

    if algorithm not in CHOICES[op]:
        raise ValueError(f"unknown {op} algorithm {algorithm!r}; choose one of "
                         f"{', '.join(sorted(CHOICES[op]))}")


def algorithm_name(plan: Plan, case: Case, cfg=None, context=None) -> str:
    """The numcoll algorithm that runs ``case`` (forced, or chosen by size) on a
    group configured as ``cfg`` (default: the current configuration, as a group
    whose ranks share memory would have it), or on the group whose
    :class:`~numcoll.collectives.context.GroupContext` is ``context`` (which
    also knows what its transport offers, e.g. single-copy reads)."""
    from ..collectives.choice import choose
    from ..config import current
    from ..dtypes import is_half

    cfg = context.cfg if context is not None else cfg if cfg is not None else current()
    # Reductions of 16-bit floats travel as float32 unless half_wire="native".
    wire = 4 if plan.op != "broadcast" and is_half(plan.numpy_dtype) and \
        cfg.half_wire == "float32" else plan.numpy_dtype.itemsize
    # (gather and scatter choose by a rank's block, as the collectives do;
    # the others by the case's whole count)
    count = case.count // plan.world_size if plan.op in ("gather", "scatter") else case.count
    # (the bench's alltoall is all_to_all_single: chosen as its ranks may send unevenly)
    uneven = plan.op == "alltoall"
    if context is not None:
        return context.choose(plan.op, plan.algorithm, count * wire, uneven=uneven).name
    return choose(cfg, plan.op, plan.algorithm, count * wire, plan.world_size,
                  uneven=uneven).name


def summarize(plan: Plan, rank_times: Sequence[Sequence[np.ndarray]], *,
              backend: str = "numcoll",
              rank_wrong: Sequence[Sequence[int | None]] | None = None,
              algorithms: Sequence[str] | None = None) -> list[dict]:
    """One row per case from every rank's per-iteration times (seconds).

    ``rank_times[r][i]`` holds rank r's iteration times for case i. The time
    of an iteration is the slowest rank's; a case's ``time_us`` is the median
    over its iterations, with ``time_us_min``/``_max`` and the 10th/90th
    percentiles (``time_us_p10``/``_p90``) beside it. ``rank_time_us`` keeps each
    rank's own median (a rank that arrives late waits least, so the *shortest*
    one is the rank the others waited for). ``rank_wrong[r][i]``: rank r's wrong
    elements in case i (None: not checked); ``wrong`` is their sum. A barrier's
    row has size 0 and None for dtype, placement, algbw, busbw and wrong.
    ``algorithms[i]``: the algorithm that ran case i, as the ranks reported it
    (default: :func:`algorithm_name`).
    """
    if len(rank_times) != plan.world_size:
        raise ValueError(f"expected times from {plan.world_size} ranks, got {len(rank_times)}")
    factor = bus_factor(plan.op, plan.world_size) if plan.moves_data else None
    rows = []
    for i, case in enumerate(plan.cases):
        per_rank = np.stack([np.asarray(t[i], dtype=np.float64) for t in rank_times])
        per_iter = per_rank.max(axis=0)
        median_s = float(np.median(per_iter))
        p10_s, p90_s = (float(v) for v in np.percentile(per_iter, [10, 90]))
        algbw = case.nbytes / median_s / 1e9 if median_s > 0 and plan.moves_data else None
        wrong = None
        if rank_wrong is not None and all(w[i] is not None for w in rank_wrong):
            wrong = int(sum(w[i] for w in rank_wrong))
        rows.append({
            "backend": backend,
            "op": plan.op,
            "placement": plan.placement,
            "algorithm": ((algorithms[i] if algorithms is not None
                           else algorithm_name(plan, case)) if backend == "numcoll" else "gloo"),
            "world_size": plan.world_size,
            "size": case.nbytes,
            "count": case.count,
            "dtype": plan.dtype if plan.moves_data else None,
            "iters": case.iters,
            "warmup": case.warmup,
            "time_us": median_s * 1e6,
            "time_us_min": float(per_iter.min()) * 1e6,
            "time_us_p10": p10_s * 1e6,
            "time_us_p90": p90_s * 1e6,
            "time_us_max": float(per_iter.max()) * 1e6,
            "rank_time_us": [float(v) * 1e6 for v in np.median(per_rank, axis=1)],
            "algbw_gbps": algbw,
            "busbw_gbps": None if algbw is None else algbw * factor,
            "wrong": wrong,
        })
    return rows


def metadata(plan: Plan, *, mode: str, transport: str | None, transport_used: str | None,
             compare: str | None = None, torch_version: str | None = None,
             sweep: str | None = None) -> dict:
    """What a reader of the results needs to reproduce or weigh them
    (``sweep``: the :data:`SWEEPS` name the sizes came from, if any)."""
    from .. import __version__

    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    meta = {
        "op": plan.op,
        "world_size": plan.world_size,
        "mode": mode,
        "transport": transport,
        "transport_used": transport_used,
        "dtype": plan.dtype if plan.moves_data else None,
        "sweep": sweep,
        "algorithm": plan.algorithm,
        "sync_each_iter": plan.sync_each_iter,
        "check": plan.check,
        "numcoll_version": __version__,
        "torch_version": torch_version,
        "compare": compare,
        "python": platform.python_version(),
        "numpy_version": np.__version__,
        "platform": platform.platform(),
        "host_cpu_count": os.cpu_count(),
        "host_cpus_usable": affinity,
        # how busy the machine was when the run began (1, 5, 15 min), for readers of the JSON
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "timing": ("per iteration: one complete collective, time.perf_counter; iteration time "
                   "= max over ranks; reported time = median over iterations (min, p10, p90, "
                   "max kept)"),
        "numcoll_call": ("ProcessGroup method with the algorithm in its options, then "
                         "Work.wait()" if plan.algorithm else
                         "module-level blocking function on the default group "
                         "(nc.all_reduce(x), as torch's dist.all_reduce(x))"),
        "wrong": ("after timing, one more run on rank-dependent inputs; wrong = elements that "
                  "differ from the NumPy-computed result, summed over ranks"),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": sys.argv,
    }
    if compare and "torch" in compare.split(","):
        meta["torch_backend"] = "gloo"
        meta["torch_mode"] = "process"
        meta["torch_num_threads"] = 1
        meta["torch_transport"] = "tcp (gloo, loopback)"
    return meta


def write_json(path: str, meta: dict, rows: list[dict]) -> None:
    """Write ``{"metadata": ..., "rows": [...]}`` to ``path`` ("-": stdout)."""
    text = json.dumps({"metadata": meta, "rows": rows}, indent=2)
    if path == "-":
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    else:
        with open(path, "w") as f:
            f.write(text + "\n")
