"""What the suites share: collection of ``bench_*.py``, the quick mode, and
bandwidth in pytest-benchmark's tables.

* ``python -m pytest benchmarks`` collects the ``bench_*.py`` suites (they are
  not ``test_*.py``, so they stay out of the default test run).
* Quick mode, ``--quick`` or ``NUMCOLL_BENCH_QUICK=1``: fewer cases (each
  suite keeps a small and a large size, the inproc and ipc transports, two
  ranks) and short timing (``max_time`` 20 ms, 3 rounds at least, no warmup),
  so every suite finishes in seconds: CI-style regression tracking, e.g.
  ``pytest benchmarks --quick --benchmark-autosave`` on main, then
  ``pytest benchmarks --quick --benchmark-compare --benchmark-compare-fail=median:25%``.
* pytest-benchmark has no custom table columns (its issues #94 and #233 are
  open), so :func:`pytest_benchmark_group_stats` appends each case's bandwidth
  (busbw of a collective, GB/s of a kernel or transport) to its name, in the
  run's table and in ``--benchmark-compare`` tables alike. ``pytest-benchmark compare`` reads the
  ``conftest.py`` of the directory it runs in, so run it from here to get the
  same names: ``cd benchmarks && pytest-benchmark --storage ../.benchmarks compare``.
"""

import os

import pytest

#: pytest-benchmark options of every case in quick mode.
QUICK_TIMING = {"max_time": 0.02, "min_rounds": 3, "warmup": False}


def pytest_addoption(parser):
    parser.addoption("--quick", action="store_true", default=False,
                     help="numcoll benchmarks: few cases, short timing (also "
                          "NUMCOLL_BENCH_QUICK=1)")


def quick_mode(config=None) -> bool:
    if config is not None and config.getoption("--quick", default=False):
        return True
    return os.environ.get("NUMCOLL_BENCH_QUICK", "0") not in ("", "0")


def pytest_configure(config):
    # The suites choose their cases when imported, after this, from the environment.
    if quick_mode(config):
        os.environ["NUMCOLL_BENCH_QUICK"] = "1"


def pytest_collection_modifyitems(config, items):
    if quick_mode(config):
        for item in items:
            item.add_marker(pytest.mark.benchmark(**QUICK_TIMING))


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
