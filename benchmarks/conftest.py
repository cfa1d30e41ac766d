"""The benchmark suites' shared machinery: the regression gate, quick mode, and
bandwidth in pytest-benchmark's tables.

The gate (``bench_gate.py``)::

    python -m pytest benchmarks --quick --benchmark-autosave   # save a baseline
    python -m pytest benchmarks --quick --benchmark-compare    # the gate

Its rows are timed together before the first of them reports, in interleaved
rounds (:mod:`numcoll.bench.schedule`), and judged against the baseline by
:mod:`numcoll.bench.gate` with the limits set there: a regressed row fails
with a one-line message, the others pass, and a short table closes the run.
pytest-benchmark's own tables and saved files hold the same rounds (each
row's timer replays them: :class:`numcoll.bench.gate.ReplayClock`).

* ``python -m pytest benchmarks`` collects the ``bench_*.py`` suites (they are
  not ``test_*.py``, so they stay out of the default test run). Without
  ``--quick`` the gate adds 16 MiB rows and rounds, and the exploration suites
  run too (thread ranks with forced algorithms, raw transports, the ring
  kernels, numcoll's kernels against NumPy's, packing against NumPy, CUDA);
  they are timed by pytest-benchmark one case after another and not judged.
* Quick mode, ``--quick`` or ``NUMCOLL_BENCH_QUICK=1``: the gate only (an
  exploration suite named on the command line runs too, with short timing).
* pytest-benchmark has no custom table columns (its issues #94 and #233 are
  open), so :func:`pytest_benchmark_group_stats` appends each case's bandwidth
  (busbw of a collective, GB/s of a kernel or transport) to its name.
* Every case records the ``NUMCOLL_*`` settings, the configuration they give,
  versions and usable CPUs in ``extra_info`` (:func:`numcoll.bench.rows.environment`).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import statistics

import pytest

from numcoll.bench import gate as gate_rules
from numcoll.bench.placement import first_two_cpus, round_trip_us
from numcoll.bench.rows import environment
from numcoll.bench.schedule import QUIET_SHARE

#: pytest-benchmark's timing of an exploration suite's cases in quick mode.
QUICK_TIMING = {"max_time": 0.02, "min_rounds": 3, "warmup": False}
#: Quiet interleaved rounds of the gate (a round of a row is 2-100 iterations),
#: and the seconds they may take at most (waiting for a busy machine to calm
#: down included), in quick mode and in full mode.
GATE_ROUNDS = {True: 30, False: 40}
GATE_BUDGET_S = {True: 25.0, False: 120.0}
#: The timer of the gate's rows: replays the rounds the schedule measured.
REPLAY = gate_rules.ReplayClock()


def pytest_addoption(parser):
    parser.addoption("--quick", action="store_true", default=False,
                     help="numcoll benchmarks: the regression gate only, 8 B and 1 MiB "
                          "(also NUMCOLL_BENCH_QUICK=1)")


def quick_mode(config=None) -> bool:
    if config is not None and config.getoption("--quick", default=False):
        return True
    return os.environ.get("NUMCOLL_BENCH_QUICK", "0") not in ("", "0")


#: pytest-benchmark's default columns, and the gate's: its figure is the best
#: round (Min), beside the median and slowest round.
_DEFAULT_COLUMNS = ["min", "max", "mean", "stddev", "median", "iqr", "outliers", "ops",
                    "rounds", "iterations"]
_GATE_COLUMNS = ["min", "median", "max", "rounds"]


def pytest_configure(config):
    # The suites choose their cases when imported, after this, from the environment.
    if quick_mode(config):
        os.environ["NUMCOLL_BENCH_QUICK"] = "1"
        if getattr(config.option, "benchmark_columns", None) == _DEFAULT_COLUMNS:
            config.option.benchmark_columns = _GATE_COLUMNS
    config.addinivalue_line("markers", "gate: a row of the regression gate (bench_gate.py)")


def pytest_ignore_collect(collection_path, config):
    """In quick mode only the gate's suite is collected (unless a file is named)."""
    if (quick_mode(config) and collection_path.name.startswith("bench_")
            and collection_path.name != "bench_gate.py"
            and collection_path.resolve() not in _named_paths(config)):
        return True
    return None


def _named_paths(config) -> set[pathlib.Path]:
    return {pathlib.Path(config.invocation_params.dir, arg.split("::")[0]).resolve()
            for arg in config.args}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("gate"):
            item.add_marker(pytest.mark.benchmark(timer=REPLAY))
        elif quick_mode(config):  # an exploration suite named on the command line
            item.add_marker(pytest.mark.benchmark(**QUICK_TIMING))


_RESULT = pytest.StashKey["GateRun"]()


def _baseline(config) -> tuple[str | None, dict[str, dict]]:
    """(file name, row name -> figures) of the run ``--benchmark-compare`` loaded."""
    session = getattr(config, "_benchmarksession", None)
    mapping = getattr(session, "compared_mapping", None) or {}
    for path, benches in mapping.items():
        rows = {}
        for bench in benches.values():
            figures = (bench.get("extra_info") or {}).get("gate")
            if figures and "best_s" in figures:
                rows[figures["row"]] = figures
        return os.path.basename(str(path)), rows
    return None, {}


class GateRun:
    """The gate's rows, timed and (against a baseline) judged; ``report`` hands
    one row to pytest-benchmark and fails it if it regressed."""

    def __init__(self, config, rows):
        from numcoll.bench.schedule import Schedule

        self.comparing = bool(config.getoption("benchmark_compare", None))
        self.saving = bool(config.getoption("benchmark_autosave", None)
                           or config.getoption("benchmark_save", None))
        self.baseline_name, base = _baseline(config)
        self.rows = {row.name: row for row in rows}
        rounds = GATE_ROUNDS[quick_mode(config)]
        _say(config, f"numcoll gate: timing {len(rows)} rows in {rounds} interleaved rounds, "
             f"load average {_load()}")
        self.load = {"before": os.getloadavg()}
        # How far apart the first two CPUs are (numcoll.bench.placement): on a VM
        # a 2-rank row's figure moves with it, by up to 4.5x.
        self.round_trip_us = {"before": round_trip_us()}
        with Schedule(rows) as schedule:
            self.figures, verdicts = gate_rules.measure(
                schedule, rounds, base if self.comparing else None,
                budget_s=GATE_BUDGET_S[quick_mode(config)])
            self.rounds, self.info, self.skipped = (schedule.rounds, schedule.info,
                                                    schedule.skipped)
            self.busy, self.waited_s = schedule.busy, schedule.waited_s
            self.launch = schedule.launch
        self.load["after"] = os.getloadavg()
        self.round_trip_us["after"] = round_trip_us()
        self.verdicts = {v.name: v for v in verdicts or []}
        self.unjudged = [n for n, r in self.rows.items() if r.gated and self.comparing
                         and n in self.figures and n not in self.verdicts]
        self.environment = environment()

    def report(self, benchmark, row) -> None:
        if row.name in self.skipped:
            pytest.skip(self.skipped[row.name])
        benchmark.group = _group(row)
        verdict = self.verdicts.get(row.name)
        benchmark.extra_info.update(row.info)
        benchmark.extra_info.update(self.info.get(row.name, {}))
        benchmark.extra_info["gate"] = {
            "row": row.name, **self.figures[row.name], "iters": row.iters,
            "round_s": self.rounds[row.name], "others_busy": self.busy[row.name],
            "launch": self.launch[row.name],
            "gated": row.gated, "anchor": row.anchor, "load_avg": self.load,
            "cpu_round_trip_us": self.round_trip_us,
            **({"verdict": verdict.as_dict()} if verdict else {})}
        REPLAY.load(self.rounds[row.name])
        benchmark.pedantic(lambda: None, rounds=len(self.rounds[row.name]))
        if verdict is not None and verdict.regressed:
            pytest.fail("regressed: " + verdict.message(), pytrace=False)

    def _load_line(self) -> str:
        shares = next(iter(self.busy.values()), [])
        known = [b for b in shares if b is not None]
        quiet = sum(b <= QUIET_SHARE for b in known)
        busy = (f"{quiet} of {len(shares)} rounds quiet (other processes used at most "
                f"{QUIET_SHARE:.0%} of the CPUs; median {statistics.median(known):.0%}), "
                f"waited {self.waited_s:.0f} s for quiet; " if known else "")
        trips = self.round_trip_us
        placed = ("" if None in trips.values() else
                  f"; a cache line between CPUs {' and '.join(map(str, first_two_cpus()))}: "
                  f"{trips['before']:.3f} us before, {trips['after']:.3f} after")
        return (f"  {busy}load average {self.load['before'][0]:.1f} before, "
                f"{self.load['after'][0]:.1f} after{placed}")

    def summary(self) -> list[str]:
        loaded = [n for n, f in self.figures.items() if f["loaded"] and self.rows[n].world_size]
        warning = ([f"  WARNING: {len(loaded)} rows on ranks had fewer than "
                    f"{gate_rules.MIN_QUIET_ROUNDS} quiet rounds (other processes kept the "
                    "CPUs busy): "
                    + ("a compare against this baseline cannot judge them; save it again "
                       "when the machine is quieter" if self.saving else "not judged")]
                   if loaded else [])
        if not self.comparing:
            what = ("saved: the baseline of the next --benchmark-compare" if self.saving else
                    "not saved and not compared (--benchmark-autosave saves a baseline)")
            return [f"numcoll gate: {len(self.figures)} rows timed, {what}", self._load_line(),
                    *warning]
        if not self.verdicts:
            return [f"numcoll gate: the baseline {self.baseline_name or '(none found)'} has "
                    "no gate figures for these rows: nothing judged. Save a baseline with "
                    "python -m pytest benchmarks --quick --benchmark-autosave"]
        verdicts = list(self.verdicts.values())
        lines = [gate_rules.summary_line(verdicts, self.baseline_name), self._load_line()]
        flagged = [v for v in verdicts if v.regressed]
        if flagged:
            lines += ["regressed:", gate_rules.format_verdicts(flagged)]
        if self.unjudged:
            lines.append(f"not in the baseline (not judged): {', '.join(self.unjudged)}")
        return lines


def _say(config, line: str) -> None:
    """A line on the terminal while a fixture runs (its output is captured)."""
    terminal = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if terminal is None:
        return
    with capture.global_and_fixture_disabled() if capture else _nothing():
        terminal.ensure_newline()
        terminal.write_line(line)


@contextlib.contextmanager
def _nothing():
    yield


def _load() -> str:
    return "/".join(f"{v:.1f}" for v in os.getloadavg())


def _group(row) -> str:
    if not row.gated:
        return "gate: machine references (not judged)"
    if row.world_size:
        return f"gate: {row.world_size} process ranks, default transport and algorithms"
    return "gate: kernels in this process"


@pytest.fixture(scope="session")
def gate(request):
    """The gate's rows, timed once for the whole session (see :class:`GateRun`)."""
    # The items left after every selection (-k, -m, deselection): only their rows run.
    rows = [item.callspec.params["row"] for item in request.session.items
            if item.get_closest_marker("gate")]
    run = GateRun(request.config, rows)
    request.config.stash[_RESULT] = run
    return run


@pytest.fixture(autouse=True)
def _record_environment(request):
    """Every case records the settings and versions it ran with."""
    yield
    bench = request.node.funcargs.get("benchmark") if hasattr(request.node, "funcargs") \
        else None
    if bench is not None:
        for key, value in environment().items():
            bench.extra_info.setdefault(key, value)


@pytest.hookimpl(trylast=True)  # after pytest-benchmark's tables: the verdict comes last
def pytest_terminal_summary(terminalreporter):
    run = terminalreporter.config.stash.get(_RESULT, None)
    if run is not None:
        terminalreporter.section("numcoll regression gate", sep="-")
        for line in run.summary():
            terminalreporter.write_line(line)


def pytest_collect_file(file_path, parent):
    # Files named on the command line are collected by pytest itself.
    if (file_path.suffix == ".py" and file_path.name.startswith("bench_")
            and not parent.session.isinitpath(file_path)):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


def bandwidth_label(bench: dict) -> str | None:
    """`` busbw 1.23 GB/s`` (collectives) or `` 4.56 GB/s`` (kernels, transports),
    from the bench's own median: in ``--benchmark-compare`` tables
    pytest-benchmark gives a saved run's row the stats of that run but the
    ``extra_info`` of the current one, so stored bandwidths would be wrong there.
    ``extra_info["round_nbytes"]`` is the bytes one round counts for bandwidth
    (``bus_factor``: the nccl-tests busbw factor of a collective)."""
    info, median_s = bench.get("extra_info") or {}, bench.get("median")
    if "round_nbytes" in info and median_s:
        gbps = info["round_nbytes"] / median_s / 1e9
        if "bus_factor" in info:
            return f" busbw {gbps * info['bus_factor']:.3g} GB/s"
        return f" {gbps:.3g} GB/s"
    return None


def pytest_benchmark_group_stats(config, benchmarks, group_by):
    """pytest-benchmark's grouping, then each case's bandwidth added to its name."""
    from pytest_benchmark.plugin import pytest_benchmark_group_stats as default

    groups = default(config=config, benchmarks=benchmarks, group_by=group_by)
    for _, members in groups:
        for bench in members:
            label = bandwidth_label(bench)
            if label and not bench["name"].endswith(label):
                bench["name"] += label
    return groups
