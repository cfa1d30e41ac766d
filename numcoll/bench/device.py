"""``numcoll-bench --device cuda``: the collectives on device arrays, torch gloo on
CUDA tensors beside them, and the machine's own limits measured in the same run.

Every rank allocates its buffers on the device once per size (from the same
host buffers as the host bench, :func:`~numcoll.bench.runners.rank_buffers`,
copied over; the in-place forms keep their views), and the timing loop is the
host bench's: one blocking call per iteration, which for numcoll returns once
the result is in device memory (its stream synchronised), and for torch gloo
ends with ``torch.cuda.synchronize()``. The check runs on the host: the
rank-dependent inputs are written there, copied to the device, reduced, and
copied back to be counted.

The limits (:func:`device_limits`), per size, from the process that runs the
bench: a pinned host -> device copy, device -> pinned host, and a
device -> device copy, each the median of several, in GB/s.

Without a GPU, ``--device cuda`` stops with the reason; under Numba's CUDA
simulator (``NUMBA_ENABLE_CUDASIM=1``) it runs, for testing, with the note
that its timings mean nothing.
"""

from __future__ import annotations

import time

import numpy as np

from .check import count_wrong, prepare_check
from .runners import _time_case, rank_buffers
from .sweep import Case, Plan, format_nbytes

__all__ = ["device_problem", "device_limits", "numcoll_device_rank", "torch_device_rank",
           "run_device_plans", "format_limits"]


def device_problem() -> tuple[str | None, bool]:
    """(why the CUDA device bench cannot run here, or None; whether it is the simulator)."""
    try:
        from ..cuda import device
    except ImportError as exc:
        return f"numba.cuda cannot be imported ({exc}); pip install \"numcoll[cuda]\"", False
    if device._SIMULATED:
        return None, True
    if not device.is_available():
        return "no usable CUDA GPU here (numba.cuda.is_available() is False)", False
    return None, False


class _Mirror:
    """A rank's buffers for one case: the host pair the check reads and writes,
    and the device pair the collective runs on (views kept where the host
    input is a view of the output, or the output of the input)."""

    def __init__(self, plan: Plan, case: Case, rank: int, to_dev, view_of):
        self.inp, self.out = rank_buffers(plan, case, rank)
        self._to_dev = to_dev
        block = case.count // plan.world_size
        own = slice(rank * block, (rank + 1) * block)
        if plan.in_place and plan.op == "allgather":
            self.d_out = to_dev(self.out)
            self.d_inp = view_of(self.d_out, own)
        elif plan.in_place and plan.op == "reduce_scatter":
            self.d_inp = to_dev(self.inp)
            self.d_out = view_of(self.d_inp, own)
        else:
            self.d_inp = to_dev(self.inp)
            self.d_out = None if self.out is None else to_dev(self.out)


def _run(plan: Plan, rank: int, make_mirror, make_step, upload, download, barrier,
         ran=None) -> dict:
    """Time ``plan``'s cases on device buffers; ``ran()``, if given, says after
    each case's timing which algorithm ran it (``result["algorithms"]``)."""
    all_times, all_wrong, algorithms = [], [], []
    for case in plan.cases:
        m = make_mirror(case)
        step = make_step(m.d_inp, m.d_out)
        all_times.append(_time_case(step, case, barrier, plan.sync_each_iter))
        if ran is not None:
            algorithms.append(ran(case))
        wrong = None
        if plan.check:
            prepare_check(plan, case, rank, m.inp, m.out)
            # The whole output first: in the in-place forms the input is a view of it.
            for dev, host in ((m.d_out, m.out), (m.d_inp, m.inp)):
                if dev is not None:
                    upload(dev, host)
            barrier()
            step()
            for dev, host in ((m.d_out, m.out), (m.d_inp, m.inp)):
                if dev is not None:
                    download(dev, host)
            wrong = count_wrong(plan, case, rank, m.inp, m.out)
        all_wrong.append(wrong)
    result = {"times": all_times, "wrong": all_wrong}
    if ran is not None:
        result["algorithms"] = algorithms
    return result


def _upload(dev, host):
    from ..cuda import kernels as K

    K.to_device_async(np.ascontiguousarray(host), dev, 0)   # stream 0: done on return


def _download(dev, host):
    from ..cuda import kernels as K

    K.to_host_async(dev, host, 0)


def _wire_nbytes(plan: Plan, case: Case, cfg) -> int:
    """The bytes numcoll chooses an algorithm by (16-bit floats reduce as float32)."""
    from ..dtypes import is_half

    wide = plan.op != "broadcast" and is_half(plan.numpy_dtype) and cfg.half_wire == "float32"
    return case.count * (4 if wide else plan.numpy_dtype.itemsize)


def numcoll_device_rank(plans: list[Plan]) -> list[dict]:
    """Each plan on this rank's default numcoll group, on Numba device arrays
    (inside :func:`numcoll.launch`); the host bench's result dicts, with the
    algorithm that ran each case, as the flight recorder saw it run (``ipc``,
    or what the ranks fell back to when they could not open each other's
    memory, e.g. ``ring (staged: ipc unavailable)``)."""
    import numcoll as nc

    from ..cuda.copies import to_device
    from .runners import numcoll_step
    from .steps import last_algorithm

    pg = nc.get_default_group()
    rank, ctx = pg.rank(), pg.context
    results = []
    for plan in plans:
        def ran(case, plan=plan):
            # (the recorder off: what the group chooses, which may not be what ran)
            return last_algorithm(rank) or ctx.choose(
                plan.op, plan.algorithm, _wire_nbytes(plan, case, ctx.cfg), device=True).name

        result = _run(plan, rank,
                      lambda case, plan=plan: _Mirror(plan, case, rank, to_device,
                                                      lambda a, s: a[s]),
                      lambda inp, out, plan=plan: numcoll_step(plan, inp, out),
                      _upload, _download, nc.barrier, ran)
        results.append({**result, "transport": pg.transport_kind})
    return results


def torch_device_rank(plans: list[Plan], timeout_s: float) -> list[dict]:
    """Each plan on torch.distributed gloo with CUDA tensors (inside
    :func:`numcoll.launch`, processes); the host bench's result dicts."""
    from datetime import timedelta

    import numcoll as nc

    from .runners import TorchUnavailableError, _torch_init, _torch_step, _torch_tensor

    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:
        raise TorchUnavailableError(f"torch cannot be imported: {exc}") from exc
    if not torch.cuda.is_available():
        raise TorchUnavailableError("--device cuda --compare torch needs a CUDA build of "
                                    "torch and a GPU (torch.cuda.is_available() is False)")
    torch.set_num_threads(1)
    store = _torch_init(dist, timedelta(seconds=timeout_s))
    rank = dist.get_rank()

    def download(dev, host):
        got = dev.cpu()
        if got.dtype == torch.bfloat16:
            got = got.view(torch.int16)
        host[...] = got.numpy().view(host.dtype)

    results = []
    try:
        for plan in plans:
            def upload(dev, host, plan=plan):
                dev.copy_(_torch_tensor(torch, np.ascontiguousarray(host), plan.dtype))

            def make_step(inp, out, plan=plan):
                run = _torch_step(dist, plan, inp, out)

                def step():
                    run()
                    torch.cuda.synchronize()
                return step

            def mirror(case, plan=plan):
                return _Mirror(plan, case, rank,
                               lambda a: _torch_tensor(torch, a, plan.dtype).cuda(),
                               lambda t, s: t.view(-1)[s])

            result = _run(plan, rank, mirror, make_step, upload, download, dist.barrier)
            results.append({**result, "transport": "gloo-tcp",
                            "torch_version": torch.__version__})
    finally:
        dist.destroy_process_group()
        nc.barrier()
        del store
    return results


def run_device_plans(plans: list[Plan], *, backend: str = "numcoll", mode: str = "process",
                     transport: str | None = None,
                     timeout_s: float = 900.0) -> tuple[list[list[dict]], dict]:
    """:func:`numcoll.bench.runners.run_plans` on device arrays (torch: CUDA tensors)."""
    from ..launcher.local import launch
    from .sweep import summarize

    world_size = plans[0].world_size
    if backend == "numcoll":
        per_rank = launch(numcoll_device_rank, world_size, args=(plans,), mode=mode,
                          transport=transport, timeout=timeout_s)
    else:
        per_rank = launch(torch_device_rank, world_size, args=(plans, timeout_s),
                          mode="process", timeout=timeout_s)
    rows = [summarize(plan, [r[i]["times"] for r in per_rank], backend=backend,
                      rank_wrong=[r[i]["wrong"] for r in per_rank],
                      algorithms=per_rank[0][i].get("algorithms"))
            for i, plan in enumerate(plans)]
    info = {k: v for k, v in per_rank[0][0].items() if k not in ("times", "wrong", "algorithms")}
    return rows, info


def device_limits(sizes: list[int], repeats: int = 5) -> list[dict]:
    """Per size in bytes: pinned host -> device, device -> pinned host and
    device -> device copy bandwidth (GB/s, medians of ``repeats``), measured here."""
    from ..cuda import kernels as K
    from ..cuda.device import cuda

    rows = []
    stream = cuda.stream()
    for nbytes in sizes:
        host = K.pinned_empty(nbytes)
        host[...] = 1
        a, b = cuda.device_array(nbytes, np.uint8), cuda.device_array(nbytes, np.uint8)

        def timed(fn):
            fn()
            stream.synchronize()
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                fn()
                stream.synchronize()
                times.append(time.perf_counter() - start)
            return nbytes / float(np.median(times)) / 1e9

        rows.append({
            "nbytes": nbytes,
            "h2d_pinned_gbps": timed(lambda: K.to_device_async(host, a, stream)),
            "d2h_pinned_gbps": timed(lambda: K.to_host_async(a, host, stream)),
            "d2d_gbps": timed(lambda: b.copy_to_device(a, stream=stream)),
        })
    return rows


def format_limits(rows: list[dict]) -> str:
    """The limits as a small table."""
    lines = ["# this machine's limits (GB/s): pinned host->device, device->pinned host, "
             "device->device",
             f"{'size':>10} {'h2d pinned':>11} {'d2h pinned':>11} {'d2d':>9}"]
    for r in rows:
        lines.append(f"{format_nbytes(r['nbytes']):>10} {r['h2d_pinned_gbps']:>11.2f} "
                     f"{r['d2h_pinned_gbps']:>11.2f} {r['d2d_gbps']:>9.2f}")
    return "\n".join(lines)
