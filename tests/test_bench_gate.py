"""The regression gate (issue 18): its rule (numcoll.bench.gate), its interleaved
rounds (numcoll.bench.schedule), its rows (numcoll.bench.rows), and the two
commands as docs/performance/regression-gate.md has them, passing on unchanged code and
failing, with a short table and no traceback, on an injected slowdown.

The end-to-end runs select the rows that run in this process (kernels,
references): seconds each. The rows on rank processes are timed for real in
test_a_schedule_on_rank_processes; how the whole gate holds on a busy machine
was measured by hand (docs/performance/regression-gate.md).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

from numcoll.bench import gate
from numcoll.bench.rows import Row, default_rows, environment
from numcoll.bench.schedule import QUIET_SHARE, Schedule

pytestmark = pytest.mark.timeout(120)
ROOT = pathlib.Path(__file__).resolve().parents[1]
LOCAL_ROWS = "reduce_into or ref-memcpy or ref-numpy-add or PackPlan"


def figs(best: float, noise: float = 0.0, loaded: bool = False) -> dict:
    return {"best_s": best, "median_s": best, "noise": noise, "rounds": 30,
            "quiet_rounds": 0 if loaded else 30, "loaded": loaded}


# -- the rule ----------------------------------------------------------------------------
def test_figures_count_quiet_rounds_only():
    rounds = [5.0, 1.0, 1.1, 9.0, 1.2, 1.0, 1.3, 1.1, 1.0, 1.2, 1.05]
    busy = [0.9, 0.0, 0.0, 0.9, 0.1, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    f = gate.figures(rounds, busy)
    assert f["quiet_rounds"] == 9 and not f["loaded"]
    assert f["best_s"] == 1.0 and f["median_s"] == 1.1
    # the best of the even and of the odd quiet rounds differ by 0.0: no noise
    assert f["noise"] == 0.0
    assert gate.figures([2.0, 1.0, 1.5, 1.5], None)["noise"] == pytest.approx(0.5)
    # timed again from new ranks in another state: the noise is the best launch's own
    f = gate.figures([3.0, 3.1, 2.9, 3.0, 1.0, 1.02, 1.01, 1.0], None, [0] * 4 + [1] * 4)
    assert f["best_s"] == 1.0 and f["noise"] == pytest.approx(0.0)
    # the best alone in a launch too short to judge: measured from the steady launch's edge
    assert gate.figures([3.0, 3.1, 2.9, 3.0, 1.0, 2.9, 2.9], None, [0] * 4 + [1] * 3)[
        "noise"] == pytest.approx(2.0)
    # too few quiet rounds: every round counts, and the figures say so
    f = gate.figures(rounds, [0.9] * len(rounds))
    assert f["loaded"] and f["best_s"] == 1.0 and f["quiet_rounds"] == 0
    assert QUIET_SHARE < 0.5


def test_a_row_regresses_past_its_floor_or_three_times_its_noise():
    v = gate.judge("r", figs(1.3), figs(1.0))
    assert v.regressed and v.limit == 1 + gate.FLOOR and "x1.30" in v.message()
    assert not gate.judge("r", figs(1.2), figs(1.0)).regressed
    noisy = gate.judge("r", figs(1.3), figs(1.0, noise=0.2))
    assert noisy.limit == pytest.approx(1.6) and not noisy.regressed
    assert gate.judge("r", figs(0.5), figs(1.0)).faster
    # its reference 1.5x slower than in the baseline: 1.8 / 1.5 = 1.2, not a regression
    assert not gate.judge("r", figs(1.8), figs(1.0), speed=1.5).regressed
    # a row on ranks timed while other processes held the CPUs is not judged
    busy = gate.judge("r", figs(3.0, loaded=True), figs(1.0))
    assert busy.busy and not busy.regressed
    assert not gate.judge("r", figs(3.0), figs(1.0, loaded=True)).regressed
    assert gate.judge("r", figs(3.0, loaded=True), figs(1.0), load_sensitive=False).regressed


def test_rows_are_judged_against_their_own_reference():
    rows = {r.name: r for r in [
        Row("a", 2, {}, 1, anchor="ref2"), Row("b", 0, {}, 1, anchor="ref0"),
        Row("c", 64, {}, 1), Row("ref2", 2, {}, 1, gated=False),
        Row("ref0", 0, {}, 1, gated=False)]}
    now = {"a": figs(2.0), "b": figs(2.0), "c": figs(1.4), "ref2": figs(2.0), "ref0": figs(0.5)}
    base = {n: figs(1.0) for n in now}
    verdicts = {v.name: v for v in gate.judge_all(rows, now, base)}
    assert set(verdicts) == {"a", "b", "c"}  # references are never judged
    assert verdicts["a"].speed == 2.0 and not verdicts["a"].regressed
    assert verdicts["b"].speed == 1.0 and verdicts["b"].regressed  # a faster reference helps not
    # 64 ranks on this machine: more ranks than CPUs, the wider floor
    assert verdicts["c"].limit == 1 + gate.FLOOR_OVERSUBSCRIBED and not verdicts["c"].regressed
    line = gate.summary_line(list(verdicts.values()), "base.json")
    assert line.startswith("numcoll gate: 3 rows judged against base.json: 1 regressed")


class FakeSchedule:
    """Rounds from a script: ``script[name]`` is called with the round number."""

    def __init__(self, rows, script):
        self.rows = {r.name: r for r in rows}
        self.rounds = {r.name: [] for r in rows}
        self.busy = {r.name: [] for r in rows}
        self.launch = {r.name: [] for r in rows}
        self.script, self.restarts, self.calls = script, 0, []

    def run(self, rounds, names=None, deadline=None, progress=None):
        names = list(self.rounds) if names is None else names
        self.calls.append((rounds, sorted(names)))
        for _ in range(rounds):
            for n in names:
                self.rounds[n].append(self.script[n](len(self.rounds[n]), self.restarts))
                self.busy[n].append(0.0)
                self.launch[n].append(self.restarts)
        return rounds

    def restart(self):
        self.restarts += 1


def test_a_row_slow_for_a_while_is_timed_again_from_new_ranks_and_clears():
    rows = [Row("a", 2, {}, 1, anchor="ref"), Row("b", 2, {}, 1, anchor="ref"),
            Row("ref", 2, {}, 1, gated=False)]
    script = {"a": lambda i, restarts: 1.0 if restarts else 3.0,   # slow until restarted
              "b": lambda i, restarts: 1.0, "ref": lambda i, restarts: 1.0}
    schedule = FakeSchedule(rows, script)
    now, verdicts = gate.measure(schedule, 10, {n: figs(1.0) for n in script})
    assert schedule.restarts == 1
    assert schedule.calls == [(10, ["a", "b", "ref"]), (gate.CONFIRM_ROUNDS, ["a", "ref"])]
    assert not any(v.regressed for v in verdicts) and now["a"]["best_s"] == 1.0


def test_a_real_regression_stays_after_every_confirmation():
    rows = [Row("a", 0, {}, 1), Row("b", 0, {}, 1)]
    schedule = FakeSchedule(rows, {"a": lambda i, r: 2.0, "b": lambda i, r: 1.0})
    _, verdicts = gate.measure(schedule, 10, {"a": figs(1.0), "b": figs(1.0)})
    assert [v.name for v in verdicts if v.regressed] == ["a"]
    assert schedule.restarts == 0  # rows in this process need no new ranks
    assert len(schedule.calls) == 1 + gate.CONFIRM_PASSES


def test_a_noisy_row_gets_more_rounds_even_without_a_baseline():
    rows = [Row("a", 2, {}, 1)]
    schedule = FakeSchedule(rows, {"a": lambda i, r: 1.0 if i % 2 == 0 else 2.0 - r * 0.9})
    now, verdicts = gate.measure(schedule, 10)
    assert verdicts is None and schedule.restarts >= 1
    assert now["a"]["noise"] < gate.SETTLED_NOISE


def test_the_replay_clock_gives_pytest_benchmark_the_rounds():
    clock = gate.ReplayClock()
    clock.load([0.5, 0.25])
    start = clock()
    assert clock() - start == 0.5
    start = clock()
    assert clock() - start == 0.25
    with pytest.raises(RuntimeError, match="more rounds than were loaded"):
        clock(), clock()


# -- the rows and their schedule ---------------------------------------------------------
def test_the_rows_cover_the_default_paths():
    rows = default_rows(quick=True)
    names = {r.name for r in rows}
    for n in (2, 4):
        for op in ("allreduce", "broadcast", "reduce", "allgather", "reduce_scatter",
                   "alltoall"):
            assert any(r.name.startswith(f"{op} n={n} ") and r.name.endswith("1MiB")
                       for r in rows), (op, n)
        assert f"barrier n={n}" in names and f"Reducer step n={n} 32 grads" in names
        assert f"pg.allreduce().wait() n={n} 8B" in names
        assert f"all_reduce_init n={n} 8B" in names and f"zeros_shared n={n} 1MiB" in names
    # quick: no 16 MiB host rows (the device rows keep theirs: a GPU takes it in microseconds)
    assert not any("16MiB" in n for n in names if "device" not in n)
    assert any("16MiB" in r.name for r in default_rows(quick=False))
    assert len({r.id for r in rows}) == len(rows)
    for r in rows:
        assert (r.anchor in names) if r.gated else r.anchor is None, r.name
        if r.world_size:
            assert r.info["world_size"] == r.world_size


def test_every_row_records_its_settings_and_versions(monkeypatch):
    monkeypatch.setenv("NUMCOLL_ARENA_SLOT_NBYTES", "65536")
    env = environment()
    assert env["numcoll_env"]["NUMCOLL_ARENA_SLOT_NBYTES"] == "65536"
    assert env["numcoll_config_changed"] == {"arena_slot_nbytes": 65536}
    assert {"numcoll", "python", "numpy", "numba", "pyzmq", "torch"} <= set(env["versions"])


def test_a_schedule_in_this_process_interleaves_its_rows():
    rows = [r for r in default_rows() if r.world_size == 0 and "device" not in r.name]
    with Schedule(rows, seed=1) as schedule:
        assert schedule.run(3) == 3
        assert schedule.run(2, names=[rows[0].name]) == 2
    assert [len(schedule.rounds[r.name]) for r in rows] == [5] + [3] * (len(rows) - 1)
    assert all(len(schedule.busy[n]) == len(v) for n, v in schedule.rounds.items())
    assert all(0 < v < 0.01 for vs in schedule.rounds.values() for v in vs)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_schedule_on_rank_processes():
    import tempfile

    rows = [r for r in default_rows() if r.world_size == 2
            and (r.name.startswith(("allreduce n=2 8B", "ref: 2 processes exchange 8B",
                                    "Reducer", "all_reduce_init")))]
    before = set(os.listdir(tempfile.gettempdir()))
    with Schedule(rows) as schedule:
        # rounds while other processes keep the CPUs busy do not count: more may be made
        schedule.run(2, deadline=time.monotonic() + 30)
        reducer = len(schedule.rounds["Reducer step n=2 32 grads"])
        schedule.restart()  # new ranks, the rounds kept
        schedule.run(1, names=["allreduce n=2 8B"], deadline=time.monotonic() + 30)
    assert schedule.info["allreduce n=2 8B"]["transport"] == "shm"
    assert schedule.info["allreduce n=2 8B"]["algorithm"] == "shared"
    assert len(schedule.rounds["allreduce n=2 8B"]) >= reducer + 1 >= 3
    assert schedule.launch["allreduce n=2 8B"][-1] == 1 and schedule.launch[
        "allreduce n=2 8B"][0] == 0
    assert len(schedule.rounds["Reducer step n=2 32 grads"]) == reducer
    # Issue 19's persistent allreduce: one arena step (the skip reason is gone with it).
    assert "all_reduce_init n=2 8B" not in schedule.skipped
    assert len(schedule.rounds["all_reduce_init n=2 8B"]) >= 2
    assert schedule.info["all_reduce_init n=2 8B"]["algorithm"] == "shared"
    assert not [d for d in set(os.listdir(tempfile.gettempdir())) - before
                if d.startswith("numcoll-gate-")]


def _device_rows():
    from numcoll.bench.rows import DEVICE_KINDS

    return [r for r in default_rows() if r.spec["kind"] in DEVICE_KINDS]


def test_device_rows_are_there_and_skip_saying_why_without_a_gpu(monkeypatch):
    """The device rows are in every run; where there is no GPU (here: the CUDA
    simulator, forced so the answer does not depend on the machine) the
    schedule skips them with the reason, and times the rest."""
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")
    from numcoll.bench import rows as gate_rows

    monkeypatch.setattr("numcoll.bench.device.device_problem", lambda: (None, True))
    names = {r.name for r in _device_rows()}
    assert names == {"ref: device copy 16MiB", "device allreduce chosen n=2 4KiB",
                     "device allreduce chosen n=2 16MiB", "device allreduce staged n=2 16MiB"}
    assert "simulator" in gate_rows.missing_api("device_collective")
    monkeypatch.setattr("numcoll.bench.device.device_problem",
                        lambda: ("no usable CUDA GPU here", False))
    local = [r for r in default_rows() if r.world_size == 0]
    with Schedule(local + [r for r in _device_rows() if r.world_size == 2], seed=1) as schedule:
        schedule.run(1)
    assert set(schedule.skipped) == names
    assert all(why == "device row: needs a CUDA GPU (no usable CUDA GPU here)"
               for why in schedule.skipped.values())
    assert all(len(schedule.rounds[r.name]) == 1 for r in local if r.name not in names)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_device_rows_on_a_gpu():
    """On a GPU the device rows run: ``ipc`` as chosen, the ring when staged."""
    rows = _device_rows()
    with Schedule(rows) as schedule:
        schedule.run(2, deadline=time.monotonic() + 120)
    assert not schedule.skipped
    assert schedule.info["device allreduce chosen n=2 16MiB"]["algorithm"] == "ipc"
    assert schedule.info["device allreduce staged n=2 16MiB"]["algorithm"] == "ring"
    assert all(len(schedule.rounds[r.name]) >= 2 for r in rows)


# -- the gate, as the docs run it -------------------------------------------------------------
def gate_run(storage: pathlib.Path, *args: str, plugin_dir: pathlib.Path | None = None):
    path = os.pathsep.join(str(p) for p in (ROOT, plugin_dir) if p)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "benchmarks", "--quick", "-p", "no:cacheprovider",
         "-k", LOCAL_ROWS, f"--benchmark-storage={storage}", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=150,
        env={**os.environ, "PYTHONPATH": path})


SLOW_KERNEL = '''
"""Loaded with -p: every reduction kernel call does its work twice (a 2x slower kernel)."""
import numpy as np
from numcoll.kernels import cpu

_call = cpu.ReduceKernel.__call__
_scratch = {}


def _twice(self, acc, x):
    _call(self, acc, x)
    key = (acc.dtype.str, acc.shape)
    _call(self, _scratch.setdefault(key, np.zeros_like(acc)), x)


cpu.ReduceKernel.__call__ = _twice
'''


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_gate_passes_unchanged_code_and_fails_a_slower_kernel(tmp_path):
    storage = tmp_path / "storage"
    saved = gate_run(storage, "--benchmark-autosave")
    assert saved.returncode == 0, saved.stdout[-3000:] + saved.stderr[-2000:]
    assert "saved: the baseline of the next --benchmark-compare" in saved.stdout
    run = json.loads(next(storage.glob("*/*.json")).read_text())
    rows = {b["extra_info"]["gate"]["row"]: b for b in run["benchmarks"]}
    kernel = rows["reduce_into SUM float32 1MiB"]
    figures = kernel["extra_info"]["gate"]
    # pytest-benchmark's statistics are the gate's rounds
    assert kernel["stats"]["rounds"] == len(figures["round_s"]) >= 30
    assert kernel["stats"]["min"] == pytest.approx(min(figures["round_s"]))
    # the gate's best is over the quiet rounds (every round when too few were
    # quiet): a round disturbed by other processes may be the fastest of all
    quiet = [v for v, busy in zip(figures["round_s"], figures["others_busy"])
             if busy is None or busy <= QUIET_SHARE]
    used = figures["round_s"] if figures["loaded"] else quiet
    assert figures["loaded"] == (len(quiet) < min(gate.MIN_QUIET_ROUNDS, len(figures["round_s"])))
    assert figures["best_s"] == pytest.approx(min(used))
    assert figures["anchor"] == "ref: numpy add 1MiB" and figures["noise"] >= 0
    assert {"numcoll_env", "versions", "numcoll_config_changed"} <= set(kernel["extra_info"])

    same = gate_run(storage, "--benchmark-compare")
    assert same.returncode == 0, same.stdout[-3000:]
    assert "regressed" in same.stdout and "0 regressed" in same.stdout

    plugin = tmp_path / "plugins"
    plugin.mkdir()
    (plugin / "slow_kernel.py").write_text(SLOW_KERNEL)
    slow = gate_run(storage, "--benchmark-compare", "-p", "slow_kernel", plugin_dir=plugin)
    assert slow.returncode == 1, slow.stdout[-3000:]
    failed = sorted(line.split("::")[1].split(" ")[0] for line in slow.stdout.splitlines()
                    if line.startswith("FAILED "))
    assert failed == ["test_row[reduce_into-SUM-float16-1MiB]",
                      "test_row[reduce_into-SUM-float32-1MiB]"], slow.stdout[-3000:]
    table = slow.stdout[slow.stdout.index("regressed:\n"):]
    assert table.splitlines()[1].split()[:2] == ["row", "best"]
    assert "Traceback" not in slow.stdout and "PerformanceRegression" not in slow.stdout
