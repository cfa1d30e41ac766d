"""Run tests many times under CPU load and report every failure.

A wait that never ends under some interleaving shows up once in hundreds of
runs, and more often when the ranks fight for cores; this script makes those
runs cheap to ask for:

    python .ci/stress.py                         # every multi-process module, 20 runs each
    python .ci/stress.py --runs 200 "tests/test_hier.py::test_algorithms_can_be_forced_on_a_group_over_hosts[recursive_doubling]"
    python .ci/stress.py --load 4 --runs 50 tests/test_faults.py

Each target runs ``--runs`` times in one pytest process (every test is
parametrised once more, as pytest-repeat does), with ``--load`` busy processes
competing for the cores. Every failure is printed whole -- for a test that ran
out of time that includes what every rank was waiting for (tests/conftest.py
adds it) -- and the summary counts passes and failures per test. Exit status 1
when anything failed.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: The modules whose tests start rank processes or several transports at once.
MULTI_PROCESS_MODULES = [
    "tests/test_launch.py", "tests/test_launch_deadlines.py", "tests/test_launcher.py",
    "tests/test_hier.py", "tests/test_multihost.py", "tests/test_multihost_hier.py",
    "tests/test_shm_rendezvous.py", "tests/test_faults.py", "tests/test_persistent.py",
    "tests/test_shared_arrays.py",
]

#: A pytest plugin (this file, loaded with -p) that repeats every test.
_RUNS_ENV = "NUMCOLL_STRESS_RUNS"
_ONLY_ENV = "NUMCOLL_STRESS_ONLY"


def pytest_generate_tests(metafunc):
    runs = int(os.environ.get(_RUNS_ENV, "1"))
    if runs > 1:
        metafunc.fixturenames.append("_stress_run")
        metafunc.parametrize("_stress_run", range(runs), ids=[f"run{i}" for i in range(runs)])


def pytest_collection_modifyitems(config, items):
    """Keep only the node ids asked for (their repeats carry a ``runN`` id)."""
    wanted = set(filter(None, os.environ.get(_ONLY_ENV, "").split("\n")))
    if wanted:
        items[:] = [i for i in items if any(_unrepeated(i.nodeid) == w or
                                            _unrepeated(i.nodeid).startswith(w + "[")
                                            for w in wanted)]


def _unrepeated(nodeid: str) -> str:
    nodeid = re.sub(r"\[run\d+\]$", "", nodeid)
    return re.sub(r"-run\d+\]$", "]", re.sub(r"\[run\d+-", "[", nodeid))


def _spin(stop_at: float) -> None:
    while time.monotonic() < stop_at:
        pass


def _run_target(target: str, runs: int, extra: list[str], timeout_s: float) -> tuple[str, int]:
    env = dict(os.environ, **{_RUNS_ENV: str(runs)})
    if "::" in target:  # a node id: collect its function, keep its repeats
        env[_ONLY_ENV] = target
        target = re.sub(r"\[.*\]$", "", target)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / ".ci"), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "stress",
           "-o", "console_output_style=classic", target, *extra]
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout_s)
        return done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) \
            else (exc.stdout or "")
        return out + f"\n[stress] pytest itself ran past {timeout_s:.0f} s and was stopped", -9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("targets", nargs="*", default=MULTI_PROCESS_MODULES,
                        help="test files or node ids (default: the multi-process modules)")
    parser.add_argument("--runs", type=int, default=20, help="runs of each test (default 20)")
    parser.add_argument("--load", type=int, default=os.cpu_count() or 2,
                        help="busy processes competing for the cores (default: one per core)")
    parser.add_argument("--timeout", type=float, default=3600,
                        help="seconds for one target's pytest run (default 3600)")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER,
                        help="after --: more arguments for pytest")
    args = parser.parse_args(argv)
    extra = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
    hogs = [multiprocessing.Process(target=_spin, args=(time.monotonic() + 24 * 3600,),
                                    daemon=True) for _ in range(args.load)]
    for h in hogs:
        h.start()
    failed_total = passed_total = 0
    try:
        for target in args.targets:
            started = time.monotonic()
            out, code = _run_target(target, args.runs, extra, args.timeout)
            summary = re.findall(r"(\d+) (passed|failed|error|errors|skipped)", out)
            counts = {k.rstrip("s"): int(n) for n, k in summary}
            failed = counts.get("failed", 0) + counts.get("error", 0)
            failed_total += failed + (1 if code not in (0, 1, 5) else 0)
            passed_total += counts.get("passed", 0)
            print(f"[stress] {target}: {counts.get('passed', 0)} passed, {failed} failed, "
                  f"{counts.get('skipped', 0)} skipped in {time.monotonic() - started:.0f} s "
                  f"(load {args.load}, exit {code})", flush=True)
            if code not in (0, 5):
                print(out, flush=True)
    finally:
        for h in hogs:
            h.terminate()
        for h in hogs:
            h.join()
    print(f"{passed_total} passed, {failed_total} failed")
    return 1 if failed_total else 0


if __name__ == "__main__":
    sys.exit(main())
