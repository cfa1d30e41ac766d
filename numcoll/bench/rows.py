"""What the regression gate measures: its rows, and how each row's step is built.

A :class:`Row` is one thing timed: a collective on ranks that are processes
(the default path: numcoll's own transport and algorithm choice, called as a
user calls it, ``nc.all_reduce(x)``), a Reducer step, a kernel in this
process, or a *reference*, a workload with no numcoll code in it that tells how
fast the machine is right now (a memcpy, NumPy's add, a pure-Python loop, a
socket ping-pong between two processes). References are measured like the
others but never judged.

``rank_step(spec)`` builds a row's step inside a rank (the spec is a plain
dict, so it travels to rank processes); ``local_step(spec)`` in this process.
Both return a zero-argument callable that runs one iteration, plus whether
the ranks should line up (an untimed barrier) before each iteration.

Rows of issue 19 (persistent collectives ``nc.all_reduce_init``, shared
arrays ``nc.zeros_shared``) are in :func:`default_rows`; a numcoll without
those functions leaves them out, with the reason (:func:`missing_api`). So do
the device rows (allreduce on CUDA arrays at 2 ranks, as numcoll chooses and
staged, beside a device-to-device copy) on a machine without a CUDA GPU, or
under Numba's simulator, whose timings mean nothing.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import re
from importlib import metadata
from typing import Callable

import numpy as np

from .sweep import bus_factor, format_nbytes, make_plan, moves_data

__all__ = ["Row", "default_rows", "rank_step", "local_step", "environment", "ROOTED",
           "COLLECTIVES", "DEVICE_KINDS", "missing_api", "usable_cpus", "exchange_file_nbytes"]

#: Every collective the suite measures (numcoll-bench's ops).
COLLECTIVES = ("allreduce", "broadcast", "reduce", "allgather", "reduce_scatter", "alltoall",
               "barrier")
#: Rooted collectives: a root whose sends complete at once could run ahead of
#: its receivers, so every iteration starts from an untimed barrier.
ROOTED = frozenset({"broadcast", "reduce"})
_DTYPE = "float32"
#: The row kinds that need a CUDA GPU (skipped, saying why, without one).
DEVICE_KINDS = frozenset({"device_collective", "ref_device_copy"})


@dataclasses.dataclass(frozen=True)
class Row:
    """One timed row.

    name: unique, e.g. ``"allreduce n=2 8B"``.
    world_size: ranks (processes) it runs on; 0 for this process.
    spec: what :func:`rank_step` / :func:`local_step` build (a plain dict).
    iters: timed iterations per round.
    gated: False for references (never judged).
    info: what the row records in pytest-benchmark's ``extra_info``.
    anchor: the reference timed beside it whose slowdown, if the machine is
        slower than when the baseline was saved, is taken out of its ratio.
    """

    name: str
    world_size: int
    spec: dict
    iters: int
    gated: bool = True
    info: dict = dataclasses.field(default_factory=dict)
    anchor: str | None = None

    @property
    def id(self) -> str:
        """The name as a pytest id: ``allreduce-n2-8B``."""
        return re.sub(r"[^A-Za-z0-9_+.]+", "-",
                      self.name.replace("=", "").replace("()", "")).strip("-")


def _size_id(nbytes: int) -> str:
    return format_nbytes(nbytes).replace(" ", "")


def _collective_row(op: str, world_size: int, nbytes: int) -> Row:
    plan = make_plan(op, [nbytes] if moves_data(op) else [], world_size=world_size,
                     dtype=_DTYPE)
    case = plan.cases[0]
    # About 10-30 ms a round at 2 ranks on the 2-core machine; 4 ranks share
    # the cores, so fewer iterations.
    iters = (100 if case.nbytes <= 64 << 10 else 20 if case.nbytes <= 1 << 20 else 4)
    iters = max(2, iters // (1 if world_size <= 2 else 2))
    info = dict(op=op, world_size=world_size, ranks="processes", nbytes=case.nbytes,
                count=case.count, dtype=_DTYPE if plan.moves_data else None,
                call="module-level blocking (nc.all_reduce(x), ...)",
                sync_each_iter=op in ROOTED)
    if plan.moves_data:
        info.update(round_nbytes=case.nbytes, bus_factor=bus_factor(op, world_size))
    name = f"{op} n={world_size}" + (f" {_size_id(case.nbytes)}" if plan.moves_data else "")
    return Row(name, world_size, {"kind": "collective", "op": op, "nbytes": case.nbytes},
               iters, info=info)


def _reducer_row(world_size: int) -> Row:
    # 32 gradients of 1 to 8 KiB (120 KiB) in 24 KiB buckets: 5 buckets, each
    # an allreduce started while later gradients are still being marked. Small
    # buckets, so a step is about what each bucket costs (packing, launching,
    # the call path), which the 1 MiB collective rows do not show.
    counts = [256 << (i % 4) for i in range(32)]
    cap_mb = 24 / 1024
    spec = {"kind": "reducer", "counts": counts, "bucket_cap_mb": cap_mb}
    nbytes = 4 * sum(counts)
    return Row(f"Reducer step n={world_size} {len(counts)} grads", world_size, spec,
               20 if world_size <= 2 else 10,
               info=dict(op="Reducer step", world_size=world_size, ranks="processes",
                         nbytes=nbytes, dtype=_DTYPE, gradients=len(counts),
                         bucket_cap_mb=cap_mb, round_nbytes=nbytes,
                         bus_factor=bus_factor("allreduce", world_size)))


def missing_api(kind: str) -> str | None:
    """Why rows of ``kind`` cannot run here (None: they can)."""
    import numcoll as nc

    needs = {"persistent": "all_reduce_init", "shared_array": "zeros_shared"}.get(kind)
    if needs and not hasattr(nc, needs):
        return f"numcoll has no nc.{needs} yet (issue 19)"
    if kind in DEVICE_KINDS:
        from .device import device_problem

        why, simulated = device_problem()
        if why is None and simulated:
            why = "numba.cuda is the CUDA simulator here, whose timings mean nothing"
        if why is not None:
            return f"device row: needs a CUDA GPU ({why})"
    return None


def _device_rows(anchor_small: str) -> list[Row]:
    """Allreduce on CUDA arrays at 2 process ranks: 4 KiB and 16 MiB as numcoll
    chooses (``ipc`` on one host), and 16 MiB staged through pinned host memory
    (the ring, forced per call), beside a device-to-device copy of 16 MiB."""
    copy = f"ref: device copy {_size_id(16 << 20)}"
    rows = [Row(copy, 0, {"kind": "ref_device_copy", "nbytes": 16 << 20}, 20, gated=False,
                info=dict(reference=True, device="cuda", nbytes=16 << 20,
                          round_nbytes=16 << 20))]
    for nbytes, algorithm, iters in ((4 << 10, None, 100), (16 << 20, None, 10),
                                     (16 << 20, "ring", 4)):
        path = "staged" if algorithm else "chosen"
        rows.append(Row(
            f"device allreduce {path} n=2 {_size_id(nbytes)}", 2,
            {"kind": "device_collective", "nbytes": nbytes, "algorithm": algorithm}, iters,
            anchor=anchor_small if nbytes <= 64 << 10 else copy,
            info=dict(op="allreduce", world_size=2, ranks="processes", device="cuda",
                      nbytes=nbytes, dtype=_DTYPE, path=path, round_nbytes=nbytes,
                      bus_factor=bus_factor("allreduce", 2),
                      call=("pg.allreduce(x, AllreduceOptions(algorithm='ring')).wait()"
                            if algorithm else "nc.all_reduce(x)"))))
    return rows


def _anchor_nbytes(nbytes: int) -> int:
    """The reference size a row of ``nbytes`` is anchored to: latency-bound rows
    (up to 64 KiB) to the 8-byte handshake, others to a copy of their size."""
    return 8 if nbytes <= 64 << 10 else nbytes


def _process_reference(world_size: int, nbytes: int) -> Row:
    return Row(f"ref: {world_size} processes exchange {_size_id(nbytes)} in NumPy", world_size,
               {"kind": "ref_exchange", "nbytes": nbytes},
               (100 if nbytes <= 64 << 10 else 20 if nbytes <= 1 << 20 else 4)
               // (1 if world_size <= 2 else 2), gated=False,
               info=dict(reference=True, world_size=world_size, ranks="processes",
                         nbytes=nbytes))


def default_rows(quick: bool = True) -> list[Row]:
    """The gate's rows: every collective at 2 and 4 process ranks, 8 B and 1 MiB
    (and 16 MiB unless ``quick``), called as ``nc.all_reduce(x)``; allreduce
    through ``pg.allreduce(x).wait()`` at 8 B and 1 MiB; a Reducer step at 2 and
    4 ranks; the reduction and pack kernels; issue 19's rows; and the
    references. Each gated row names its reference (``anchor``)."""
    sizes = (8, 1 << 20) if quick else (8, 1 << 20, 16 << 20)
    mib = 1 << 20
    rows = []
    for world_size in (2, 4):
        def anchored(row: Row, nbytes: int) -> Row:
            ref = _process_reference(world_size, _anchor_nbytes(nbytes)).name
            return dataclasses.replace(row, anchor=ref)

        for op in COLLECTIVES:
            for nbytes in (sizes if moves_data(op) else (0,)):
                rows.append(anchored(_collective_row(op, world_size, nbytes), nbytes))
        rows.append(anchored(_reducer_row(world_size), 8))
        # The ProcessGroup method and its Work, as async_op=True users and the
        # Reducer call it: a queue and a worker thread that nc.all_reduce skips.
        for nbytes in sizes[:2]:
            base = anchored(_collective_row("allreduce", world_size, nbytes), nbytes)
            rows.append(dataclasses.replace(
                base, name=f"pg.allreduce().wait() n={world_size} {_size_id(nbytes)}",
                spec={**base.spec, "kind": "collective_work"},
                info={**base.info, "call": "ProcessGroup.allreduce(x).wait()"}))
        # Issue 19: a persistent allreduce started repeatedly, and nc.all_reduce
        # on an array every rank maps (see missing_api for a numcoll without them).
        for nbytes in (8, mib):
            base = anchored(_collective_row("allreduce", world_size, nbytes), nbytes)
            for kind, label in (("persistent", "all_reduce_init"),
                                ("shared_array", "zeros_shared")):
                rows.append(dataclasses.replace(
                    base, name=f"{label} n={world_size} {_size_id(nbytes)}",
                    spec={**base.spec, "kind": kind}, info={**base.info, "call": label}))
        rows += [_process_reference(world_size, _anchor_nbytes(n)) for n in sizes]
    rows += _device_rows(_process_reference(2, 8).name)
    copy, add = "ref: memcpy 1MiB", "ref: numpy add 1MiB"
    rows += [
        Row("reduce_into SUM float32 1MiB", 0,
            {"kind": "kernel", "dtype": "float32", "nbytes": mib}, 60, anchor=add,
            info=dict(op="reduce_into SUM", dtype="float32", nbytes=mib, round_nbytes=mib)),
        Row("reduce_into SUM float16 1MiB", 0,
            {"kind": "kernel", "dtype": "float16", "nbytes": mib}, 60, anchor=add,
            info=dict(op="reduce_into SUM", dtype="float16", nbytes=mib, round_nbytes=mib)),
        Row("PackPlan pack+unpack 1000 arrays", 0, {"kind": "pack", "max_count": 1024}, 20,
            anchor=copy, info=dict(op="pack+unpack", arrays=1000, dtype="float32")),
        Row(copy, 0, {"kind": "ref_copy", "nbytes": mib}, 60, gated=False,
            info=dict(reference=True, nbytes=mib, round_nbytes=mib)),
        Row(add, 0, {"kind": "ref_add", "nbytes": mib}, 60, gated=False,
            info=dict(reference=True, nbytes=mib, round_nbytes=mib)),
    ]
    return rows


def usable_cpus() -> list[int]:
    """The CPUs this process may run on (every CPU where affinity is unknown)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


# -- steps -------------------------------------------------------------------------------
def rank_step(spec: dict) -> tuple[Callable[[], object], bool]:
    """``(step, sync_each_iter)`` for a row measured on this rank's default group."""
    import numcoll as nc

    from .runners import numcoll_issue, numcoll_step, rank_buffers

    kind, rank, world_size = spec["kind"], nc.get_rank(), nc.get_world_size()
    if kind == "collective":
        op = spec["op"]
        plan = make_plan(op, [spec["nbytes"]] if moves_data(op) else [],
                         world_size=world_size, dtype=_DTYPE)
        return numcoll_step(plan, *rank_buffers(plan, plan.cases[0], rank)), op in ROOTED
    if kind == "collective_work":
        plan = make_plan(spec["op"], [spec["nbytes"]], world_size=world_size, dtype=_DTYPE)
        issue = numcoll_issue(nc.get_default_group(), plan,
                              *rank_buffers(plan, plan.cases[0], rank))
        return (lambda: issue().wait()), False
    if kind == "reducer":
        grads = [np.zeros(c, np.float32) for c in spec["counts"]]
        reducer = nc.Reducer(grads, bucket_cap_mb=spec["bucket_cap_mb"],
                             first_bucket_mb=spec["bucket_cap_mb"])
        order = range(len(grads) - 1, -1, -1)  # a backward pass: last layer first

        def step():
            for i in order:
                reducer.mark_ready(i)
            reducer.finalize()
        return step, False
    if kind == "ref_exchange":
        return _exchange(spec["path"], spec["nbytes"], rank, world_size), False
    if kind == "persistent":
        x = np.zeros(spec["nbytes"] // 4, np.float32)
        request = nc.all_reduce_init(x)
        return (lambda: request.start().wait()), False
    if kind == "shared_array":
        x = nc.zeros_shared((spec["nbytes"] // 4,), np.float32)
        return (lambda: nc.all_reduce(x)), False
    if kind == "device_collective":
        from ..cuda import to_device

        x = to_device(np.zeros(spec["nbytes"] // 4, np.float32))
        if spec["algorithm"] is None:
            return (lambda: nc.all_reduce(x)), False
        pg, opts = nc.get_default_group(), nc.AllreduceOptions(algorithm=spec["algorithm"])
        return (lambda: pg.allreduce(x, opts).wait()), False
    raise ValueError(f"rank_step: unknown row kind {kind!r}")


def _exchange(path: str, nbytes: int, rank: int, world_size: int) -> Callable[[], None]:
    """A reference with no numcoll code that moves memory between its ranks as an
    arena collective does, in NumPy: each rank copies ``nbytes`` into its slot of
    a file every rank maps, they meet, each sums every slot into a buffer of its
    own, and they meet again (so no slot is overwritten while read). Meeting is
    a counter per rank (one cache line each) that the others poll, spinning
    briefly and then yielding the CPU as numcoll's arena waits (no spin when
    there are more ranks than CPUs). Load that keeps the ranks from running
    together, from running side by side, or that takes the caches and memory
    bandwidth, slows it as it slows a collective of that size."""
    count = max(1, nbytes // 4)
    slot = _slot_nbytes(nbytes) // 4  # float32 per slot
    shared = np.memmap(path, dtype=np.int64, mode="r+")
    flags = shared[:world_size * 8]
    slots = shared[world_size * 8:].view(np.float32)[:world_size * slot].reshape(
        world_size, slot)[:, :count]
    src, acc = np.zeros(count, np.float32), np.empty(count, np.float32)
    spins = 0 if world_size > len(usable_cpus()) else 32
    epoch = [int(flags[rank * 8])]

    def meet():
        epoch[0] += 1
        target = epoch[0]
        flags[rank * 8] = target
        for peer in range(world_size):
            polls = 0
            while flags[peer * 8] < target:
                polls += 1
                if polls > spins:
                    os.sched_yield()

    def step():
        np.copyto(slots[rank], src)
        meet()
        np.copyto(acc, slots[0])
        for peer in range(1, world_size):
            np.add(acc, slots[peer], out=acc)
        meet()
    return step


def _slot_nbytes(nbytes: int) -> int:
    """A rank's slot in :func:`_exchange`'s file: whole float32s, whole cache lines."""
    return -(-max(1, nbytes // 4) * 4 // 64) * 64


def exchange_file_nbytes(world_size: int, nbytes: int) -> int:
    """The size of the file :func:`_exchange` maps (counters, then one slot per rank)."""
    return 64 * world_size + _slot_nbytes(nbytes) * world_size


def local_step(spec: dict) -> Callable[[], object]:
    """A row's step in this process (kernels and references)."""
    kind = spec["kind"]
    if kind == "kernel":
        from ..kernels.cpu import compile_op
        from ..ops import ReduceOp

        dtype = np.dtype(spec["dtype"])
        count = spec["nbytes"] // dtype.itemsize
        acc, x = np.zeros(count, dtype), np.zeros(count, dtype)
        kernel = compile_op(ReduceOp.SUM, dtype)
        return lambda: kernel(acc, x)
    if kind == "pack":
        from ..kernels.pack_plan import PackPlan

        rng = np.random.default_rng(0)
        arrays = [np.zeros(int(k), np.float32)
                  for k in rng.integers(1, spec["max_count"] + 1, 1000)]
        plan = PackPlan(arrays)
        buf = plan.empty()

        def step():
            plan.pack(buf)
            plan.unpack(buf)
        return step
    if kind == "ref_copy":
        src, dst = np.ones(spec["nbytes"], np.uint8), np.empty(spec["nbytes"], np.uint8)
        return lambda: np.copyto(dst, src)
    if kind == "ref_device_copy":
        from ..cuda.device import cuda

        src, dst = (cuda.device_array(spec["nbytes"], np.uint8) for _ in range(2))
        synchronize = cuda.synchronize

        def step():
            dst.copy_to_device(src)
            synchronize()       # a device-to-device copy may return before it is done
        return step
    if kind == "ref_add":
        a, b = np.zeros(spec["nbytes"] // 4, np.float32), np.zeros(spec["nbytes"] // 4,
                                                                    np.float32)
        return lambda: np.add(a, b, out=a)
    raise ValueError(f"local_step: unknown row kind {kind!r}")


# -- what a row records ------------------------------------------------------------------
def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def environment() -> dict:
    """What every row records beside its own fields: the ``NUMCOLL_*`` settings
    in the environment, the configuration they give (the fields that differ
    from the defaults), versions, and how loaded the machine was."""
    from .. import __version__
    from ..config import Config, current

    cfg, defaults = current(), Config()
    changed = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(Config)
               if getattr(cfg, f.name) != getattr(defaults, f.name)}
    return {
        "numcoll_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("NUMCOLL_")},
        "numcoll_config_changed": changed,
        "versions": {"numcoll": __version__, "python": platform.python_version(),
                     "numpy": np.__version__, "numba": _version("numba"),
                     "pyzmq": _version("pyzmq"), "torch": _version("torch")},
        "cpus_usable": len(usable_cpus()),
    }
