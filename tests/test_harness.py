"""The test harness itself: what a test that runs out of time reports, and
.ci/stress.py's repeats."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"

_HANG = '''
import threading
from datetime import timedelta
import numpy as np
import pytest
import numcoll as nc

def on_both(fn, *args):
    threads = [threading.Thread(target=fn, args=(r, *args)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)

def pair(name, timeout_s=None):
    store, pgs = nc.HashStore(), [None, None]
    def make(r):
        options = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
        pgs[r] = nc.ProcessGroup(store, r, 2, nc.ProcessGroup.Options(
            transport="inproc", group_name=name, **options))
    on_both(make)
    return pgs

@pytest.mark.timeout(5)
def test_rank_one_never_calls():
    pgs = pair("stuck")
    try:
        pgs[0].allreduce(np.ones(4)).wait()  # rank 1 never calls it
    finally:
        for pg in pgs:
            pg.shutdown()

@pytest.mark.timeout(30)
def test_rank_one_stops_calling():
    pgs = pair("late", timeout_s=1)
    try:
        on_both(lambda r: pgs[r].allreduce(np.ones(4)).wait())
        pgs[0].allreduce(np.ones(4)).wait()  # rank 1 does not call the second one
    finally:
        for pg in pgs:
            pg.shutdown()

def test_repeated(_stress_run=None):
    pass
'''


def _pytest(tmp_path, *args, env=None):
    (tmp_path / "test_hang.py").write_text(_HANG)
    env = dict(os.environ, **(env or {}))
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(ROOT / ".ci"), str(ROOT)])
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-p",
                           "no:cacheprovider", "--rootdir", str(tmp_path), *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90)


def test_a_test_out_of_time_says_what_every_rank_waited_for(tmp_path):
    done = _pytest(tmp_path, "test_hang.py::test_rank_one_never_calls")
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-3000:]
    assert "numcoll: what every rank was waiting for" in out, out[-3000:]
    assert "rank 0 of group 'stuck/0': allreduce (collective #1) waiting to recv from rank 1" \
        in out, out[-3000:]


def test_a_collective_timeout_lists_every_call_of_the_test_per_rank(tmp_path):
    done = _pytest(tmp_path, "test_hang.py::test_rank_one_stops_calling")
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-3000:]
    assert "numcoll: every collective this test ran, per rank" in out, out[-3000:]
    # The first call completed on both ranks; the second failed on rank 0.
    for rank in (0, 1):
        assert f"rank {rank} of group 'late/0': allreduce (collective #1) completed" in out, \
            out[-3000:]
    assert "rank 0 of group 'late/0': allreduce (collective #2) failed" in out, out[-3000:]
    assert "collective #2" not in out.split("rank 1 of group 'late/0'", 1)[1].split("\n")[0]


def test_the_stress_plugin_repeats_a_test_and_keeps_only_what_was_asked(tmp_path):
    done = _pytest(tmp_path, "-p", "stress", "-q", "test_hang.py::test_repeated",
                   env={"NUMCOLL_STRESS_RUNS": "7",
                        "NUMCOLL_STRESS_ONLY": "test_hang.py::test_repeated"})
    assert "7 passed" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
