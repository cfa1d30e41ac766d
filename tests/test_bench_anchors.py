"""numcoll-bench's ops beside its anchors: every op is the same blocking
collective in numcoll, torch and MPI; barrier, the op without data; the named
sweeps (``--sweep latency|bandwidth``).

Runs are tiny (ranks as threads, a few iterations); the comparisons with
torch and Open MPI run only where they are installed.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import numcoll as nc
from numcoll import bench
from numcoll.bench import cli, mpi, runners

from test_bench import ROOT, bench as bench_cli, table_rows

#: op -> (numcoll module function, torch.distributed function, mpi4py method)
CALLS = {
    "allreduce": ("all_reduce", "all_reduce", "Allreduce"),
    "broadcast": ("broadcast", "broadcast", "Bcast"),
    "reduce": ("reduce", "reduce", "Reduce"),
    "allgather": ("all_gather_into_tensor", "all_gather_single", "Allgather"),
    "reduce_scatter": ("reduce_scatter_tensor", "reduce_scatter_single", "Reduce_scatter_block"),
    "alltoall": ("all_to_all_single", "all_to_all_single", "Alltoall"),
    "gather": ("gather", "gather", "Gather"),
    "scatter": ("scatter", "scatter", "Scatter"),
    "barrier": ("barrier", "barrier", "Barrier"),
}


class _Recorder:
    """Any attribute is a function that records its name when called."""

    def __init__(self):
        self.called = []
        self.IN_PLACE, self.SUM = object(), object()

    def __getattr__(self, name):
        return lambda *args, **kwargs: self.called.append(name)

    def Get_rank(self):
        return 0

    def get_rank(self):  # the root: gather's and scatter's lists are built
        return 0

    def get_world_size(self):
        return 2


def test_every_op_is_the_same_collective_in_numcoll_torch_and_mpi(monkeypatch):
    assert set(CALLS) == set(bench.OPS)
    monkeypatch.setattr(nc, "get_rank", lambda: 0)
    monkeypatch.setattr(nc, "get_world_size", lambda: 2)
    for op in bench.OPS:
        plan = bench.make_plan(op, [64] if bench.moves_data(op) else [], world_size=2)
        inp, out = bench.rank_buffers(plan, plan.cases[0], 0)
        numcoll_name, torch_name, mpi_name = CALLS[op]

        called = []
        monkeypatch.setattr(nc, numcoll_name, lambda *a, name=numcoll_name, **k:
                            called.append(name))
        bench.numcoll_step(plan, inp, out)()
        dist = _Recorder()
        runners._torch_step(dist, plan, inp, out)()
        comm = _Recorder()
        mpi._mpi_step(comm, comm, op, inp, out)()
        assert (called, dist.called, comm.called) == ([numcoll_name], [torch_name],
                                                      [mpi_name]), op


@pytest.mark.timeout(60)
def test_a_forced_algorithm_goes_through_the_process_group(monkeypatch):
    """The module functions take no algorithm: with one forced, numcoll calls
    the ProcessGroup with it in the options (and the result is still right)."""
    def refuse(*args, **kwargs):
        raise AssertionError("nc.all_reduce has no algorithm to force")

    monkeypatch.setattr(nc, "all_reduce", refuse)
    plans = [bench.make_plan("allreduce", [8, 4096], world_size=2, iters=2, warmup=1,
                             algorithm="ring"),
             bench.make_plan("barrier", [], world_size=2, iters=2, warmup=1,
                             algorithm="dissemination")]
    (allreduce, barrier), _ = bench.run_plans(plans, mode="thread", progress=False)
    assert [(r["algorithm"], r["wrong"]) for r in allreduce] == [("ring", 0), ("ring", 0)]
    assert [r["algorithm"] for r in barrier] == ["dissemination"]


# -- barrier -----------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_barrier_is_one_row_of_size_0(tmp_path, capsys):
    path = tmp_path / "out.json"
    status = bench.main(["--op", "barrier", "--mode", "thread", "-n", "3", "--iters", "3",
                         "--warmup", "1", "--json", str(path), "--quiet"])
    out = capsys.readouterr()
    assert status == 0, out.err
    (cells,) = table_rows(out.out)
    # size, count, type, place, algo, time, min, max, algbw, busbw, #wrong
    assert cells[:5] == ["0", "0", "-", "-", "dissemination"]
    assert cells[8:] == ["-", "-", "-"]
    doc = json.loads(path.read_text())
    meta, (row,) = doc["metadata"], doc["rows"]
    assert (meta["op"], meta["dtype"], meta["check"], meta["placements"]) == \
        ("barrier", None, False, [None])
    assert (row["size"], row["count"], row["iters"], row["warmup"]) == (0, 0, 3, 1)
    assert row["dtype"] is row["placement"] is row["algbw_gbps"] is row["busbw_gbps"] \
        is row["wrong"] is None
    assert 0 < row["time_us_min"] <= row["time_us"] <= row["time_us_max"]


def test_barrier_plan_and_its_defaults():
    plan = bench.make_plan("barrier", [], world_size=4)
    assert (plan.placement, plan.moves_data, plan.check) == (None, False, False)
    assert [(c.nbytes, c.count, c.iters) for c in plan.cases] == [(0, 0, 200)]
    with pytest.raises(ValueError, match="barrier moves no data: give no sizes"):
        bench.make_plan("barrier", [8])
    with pytest.raises(ValueError, match="barrier has no in-place form in numcoll; it has "
                                         "no buffer"):
        bench.make_plan("barrier", [], in_place=True)
    with pytest.raises(ValueError, match="barrier moves no data: it has no bus bandwidth"):
        bench.bus_factor("barrier", 2)


@pytest.mark.parametrize("args, message", [
    (["--op", "barrier", "--sizes", "8"], "barrier moves no data: --sizes does not apply"),
    (["--op", "barrier", "-e", "4K"], "barrier moves no data: -e does not apply"),
    (["--op", "barrier", "--sweep", "latency"], "barrier moves no data: --sweep does not"),
    (["--op", "barrier", "--dtype", "float16"], "barrier moves no data: --dtype does not"),
    (["--op", "barrier", "--placement", "in-place"], "barrier has no in-place form"),
    (["--sweep", "latency", "--sizes", "8"], "--sweep latency sets the sizes: drop --sizes"),
    (["--sweep", "bandwidth", "-b", "1K"], "--sweep bandwidth sets the sizes: drop -b"),
    (["--sweep", "huge"], "invalid choice: 'huge'"),
], ids=["sizes", "max", "sweep", "dtype", "placement", "sweep-sizes", "sweep-min", "name"])
def test_options_that_would_go_unused_are_refused(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(args)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_barrier_beside_the_anchors_installed_here(tmp_path):
    """2 process ranks; torch's dist.barrier and Open MPI's comm.Barrier where
    they are installed: their times and the time ratio, no busbw."""
    anchors = [a for a, ok in (("torch", bench.torch_available()),
                               ("mpi4py", mpi.mpi_available())) if ok]
    if not anchors:
        pytest.skip("neither torch nor mpi4py with mpirun is installed")
    path = tmp_path / "out.json"
    out = bench_cli("--op", "barrier", "-n", "2", "--iters", "5", "--warmup", "1",
                    "--compare", ",".join(anchors), "--json", str(path), "--quiet",
                    timeout=170)
    assert out.returncode == 0, out.stderr
    (row,) = json.loads(path.read_text())["rows"]
    for prefix in (("torch_",) if "torch" in anchors else ()) + \
            (("mpi_",) if "mpi4py" in anchors else ()):
        assert row[prefix + "time_us"] > 0 and row[prefix + "busbw_gbps"] is None
    if "torch" in anchors:
        assert row["time_ratio"] == pytest.approx(row["time_us"] / row["torch_time_us"])
        assert row["busbw_ratio"] is None and row["torch_wrong"] is None
    if "mpi4py" in anchors:
        mpi_line = out.stdout.split("# vs mpi4py")[1].splitlines()[2].split()
        assert mpi_line[:2] == ["0", "-"] and mpi_line[5:] == ["-", "-", "-", "-"]


@pytest.mark.parametrize("args", [
    ["--paired"],
    ["--paired", "--compare", "torch"],
    ["--paired", "--compare", "mpi4py", "--mode", "thread"],
    ["--paired", "--compare", "mpi4py", "--transport", "tcp"],
], ids=["no-anchor", "torch-only", "threads", "transport"])
def test_paired_needs_mpi_and_numcolls_default_process_ranks(args, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(args)
    assert exc.value.code == 2
    assert "--paired times numcoll in MPI's processes" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_paired_times_numcoll_and_mpi_in_the_same_processes(tmp_path):
    """--paired: numcoll's rows come from MPI's processes (its group made
    there), checked as ever; MPI's rows beside them; the table says so."""
    if not mpi.mpi_available():
        pytest.skip("mpi4py with mpirun is not installed")
    path = tmp_path / "out.json"
    out = bench_cli("--op", "allgather", "-n", "2", "--sizes", "8,64K", "--iters", "8",
                    "--warmup", "1", "--compare", "mpi4py", "--paired", "--json", str(path),
                    "--quiet", timeout=170)
    assert out.returncode == 0, out.stderr
    doc = json.loads(path.read_text())
    assert doc["metadata"]["paired"] is True
    rows = doc["rows"]
    assert sorted({(r["size"], r["placement"]) for r in rows}) == \
        [(8, "in-place"), (8, "out-of-place"), (65536, "in-place"), (65536, "out-of-place")]
    from numcoll.config import Config

    single_copy = Config().single_copy_allgather_min_nbytes  # (the whole output, unmeasured)
    for row in rows:
        assert row["wrong"] == 0
        assert row["algorithm"] == ("cma" if row["size"] >= single_copy else "shared"), row
        assert row["time_us"] > 0 and row["mpi_time_us"] > 0
        assert row["mpi_time_ratio"] == pytest.approx(row["time_us"] / row["mpi_time_us"])
        assert row["iters"] == 8  # 4 rounds of 2 iterations each, per backend
    assert "paired: numcoll in the same processes" in out.stdout


# -- sweeps ------------------------------------------------------------------------------
def _plans(*args: str):
    return cli._plans(cli.build_parser().parse_args(list(args)))


def test_sweeps_choose_sizes_and_iterations():
    (latency,) = _plans("--sweep", "latency")
    assert [c.nbytes for c in latency.cases] == [8 << k for k in range(14)]  # 8 B .. 64 KiB
    assert {(c.iters, c.warmup) for c in latency.cases} == {(1000, 100)}
    (bandwidth,) = _plans("--sweep", "bandwidth")
    assert [c.nbytes for c in bandwidth.cases] == [1 << k for k in range(20, 27)]  # 1..64 MiB
    assert [c.iters for c in bandwidth.cases] == [200, 200, 200, 200, 128, 64, 32]
    # --iters and --warmup override a sweep's; --iters alone takes the default warmup
    (mine,) = _plans("--sweep", "latency", "--iters", "30")
    assert {(c.iters, c.warmup) for c in mine.cases} == {(30, 3)}
    (mine,) = _plans("--sweep", "latency", "--warmup", "7")
    assert {(c.iters, c.warmup) for c in mine.cases} == {(1000, 7)}
    # without --sweep: nccl-tests' whole range, as before
    (default,) = _plans()
    assert (default.cases[0].nbytes, default.cases[-1].nbytes, len(default.cases)) == \
        (8, 64 << 20, 24)


@pytest.mark.timeout(60)
def test_latency_sweep_runs_and_says_so(tmp_path, capsys):
    path = tmp_path / "out.json"
    status = bench.main(["--sweep", "latency", "--op", "reduce_scatter", "--mode", "thread",
                         "--iters", "1", "--warmup", "0", "--json", str(path), "--quiet"])
    out = capsys.readouterr()
    assert status == 0, out.err
    assert "sweep=latency" in out.out.splitlines()[0]
    doc = json.loads(path.read_text())
    assert doc["metadata"]["sweep"] == "latency"
    rows = doc["rows"]
    assert sorted({r["size"] for r in rows}) == [8 << k for k in range(14)]
    assert {r["placement"] for r in rows} == {"out-of-place", "in-place"}
    assert all(r["wrong"] == 0 for r in rows)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_help_describes_the_sweeps_from_their_table():
    out = bench_cli("--help")
    assert out.returncode == 0
    for name, sweep in bench.SWEEPS.items():
        line = next(ln for ln in out.stdout.splitlines() if ln.startswith(f"  {name} "))
        assert bench.format_nbytes(sweep.min_nbytes) in line
        assert bench.format_nbytes(sweep.max_nbytes) in line


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_mpi_command_line_takes_no_sizes_for_barrier():
    out = subprocess.run([sys.executable, "-m", "numcoll.bench.mpi", "--op", "barrier",
                          "--sizes", "8"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2
    assert "barrier moves no data: --sizes does not apply" in out.stderr


def test_rank_buffers_of_a_barrier_are_empty():
    plan = bench.make_plan("barrier", [])
    inp, out = bench.rank_buffers(plan, plan.cases[0], 0)
    assert isinstance(inp, np.ndarray) and inp.size == 0 and out is None


# -- where the CPUs are --------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_round_trip_between_two_cpus_is_measured_or_none():
    """A cache line's round trip between the first two CPUs: a few hundred
    nanoseconds at most on any machine numcoll runs on; None (not a hang)
    where a thread cannot have its CPU."""
    from numcoll.bench import placement

    cpus = placement.first_two_cpus()
    if cpus is None:
        pytest.skip("fewer than two CPUs")
    us = placement.round_trip_us(trips=2000)
    assert us is not None and 0 < us < 50
    assert placement.round_trip_us((cpus[0], 1 << 20), trips=2000) is None
