"""numcoll-bench --persistent and --shared-arrays (numcoll.bench.forms): the
plans, the buffers, every op checked right in both forms, and the command
line with and without the MPI anchor."""

import json
import subprocess
import sys

import numpy as np
import pytest

import numcoll as nc
from numcoll import bench
from numcoll.bench import forms

pytestmark = pytest.mark.timeout(180)
SHM = pytest.mark.skipif("not __import__('transports').shm_available()")


def test_plans_carry_the_forms():
    plan = bench.make_plan("allgather", [4096], persistent=True, shared_arrays=True,
                           in_place=True)
    assert plan.persistent and plan.shared_arrays
    assert plan.label == "allgather in-place (persistent, shared arrays)"
    assert forms.describe(plan) == "persistent, shared arrays"
    assert forms.describe(bench.make_plan("allreduce", [8])) == ""
    assert bench.make_plan("barrier", [], persistent=True).persistent
    with pytest.raises(ValueError, match="no arrays to share"):
        bench.make_plan("barrier", [], shared_arrays=True)


@pytest.mark.parametrize("op", bench.OPS)
@pytest.mark.parametrize("form", ["persistent", "shared_arrays", "both"])
def test_every_op_checks_out_right_in_every_form(op, form):
    if form != "persistent" and op == "barrier":
        pytest.skip("a barrier has no arrays to share")
    flags = dict(persistent=form in ("persistent", "both"),
                 shared_arrays=form in ("shared_arrays", "both"))
    if op in ("gather", "scatter"):
        with pytest.raises(ValueError, match=f"{op} has no"):
            bench.make_plan(op, [8], world_size=3, **flags)
        return
    flags = dict(persistent=form in ("persistent", "both"),
                 shared_arrays=form in ("shared_arrays", "both"))
    plans = [bench.make_plan(op, [] if op == "barrier" else [8, 3 << 20], world_size=3,
                             iters=2, warmup=1, in_place=placement == "in-place", **flags)
             for placement in bench.PLACEMENTS[op]]
    rows, info = bench.run_plans(plans, mode="thread", transport="shm", progress=False)
    for plan_rows in rows:
        for row in plan_rows:
            assert row["wrong"] in (0, None), row
    if flags["shared_arrays"]:  # the large size (1 MiB a rank) reads the peers' arrays in place
        assert [plan_rows[-1]["algorithm"] for plan_rows in rows] == ["shared_arrays"] * len(rows)


@SHM
def test_shared_buffers_are_shared_and_keep_the_in_place_forms():
    def body():
        r = nc.get_rank()
        memory = nc.get_default_group().context.shared_memory
        plan = bench.make_plan("allgather", [1 << 16], world_size=2, in_place=True,
                               shared_arrays=True)
        inp, out = forms.numcoll_buffers(plan, plan.cases[0], r)
        block = plan.cases[0].count // 2
        gathered = np.shares_memory(inp, out[r * block:(r + 1) * block])
        plan = bench.make_plan("reduce_scatter", [1 << 16], world_size=2, in_place=True,
                               shared_arrays=True)
        inp2, out2 = forms.numcoll_buffers(plan, plan.cases[0], r)
        return gathered, np.shares_memory(out2, inp2), len(memory)

    assert nc.launch(body, 2, mode="thread", transport="shm", timeout=60) == [(True, True, 2)] * 2


def _bench(*args):
    return subprocess.run([sys.executable, "-m", "numcoll.bench", *args], capture_output=True,
                          text=True, timeout=170)


@pytest.mark.slow
@SHM
def test_cli_persistent_and_shared_arrays_in_json():
    out = _bench("--op", "allreduce", "-n", "2", "--sizes", "8,1M", "--iters", "5",
                 "--warmup", "1", "--persistent", "--shared-arrays", "--json", "-")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert [(r["size"], r["algorithm"], r["wrong"]) for r in doc["rows"]] == [
        (8, "shared", 0), (1 << 20, "shared_arrays", 0)]


@pytest.mark.slow
@pytest.mark.skipif("not __import__('numcoll.bench.mpi', fromlist=['x']).mpi_available()")
def test_cli_persistent_beside_mpi_says_what_mpi_ran():
    out = _bench("--op", "allreduce", "-n", "2", "--sizes", "8", "--iters", "5", "--warmup", "1",
                 "--persistent", "--compare", "mpi4py")
    assert out.returncode == 0, out.stderr
    assert "form=persistent" in out.stdout and "vs mpi4py" in out.stdout
    # The MPI standard's version, asked in a process of its own: importing
    # mpi4py.MPI here would initialise MPI in the test process, whose runtime
    # leaves a helper process behind (the leak checks of later tests see it).
    version = subprocess.run(
        [sys.executable, "-c", "import mpi4py; mpi4py.rc.initialize = False; "
         "from mpi4py import MPI; print(*MPI.Get_version())"],
        capture_output=True, text=True, timeout=60, check=True).stdout.split()
    if tuple(map(int, version)) < (4, 0):
        assert "this MPI has no persistent collectives" in out.stderr
