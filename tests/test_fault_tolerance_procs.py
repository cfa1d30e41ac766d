"""Surviving a dead rank on process ranks: a rank SIGKILLs itself and the
survivors shrink and go on -- in a training loop under ``numcoll run
--keep-going``, in the middle of a large allreduce (shm and tcp), and during
``agree`` rounds. The figures (median of 20 kills, 1,000 agree rounds) are
measured by ``python -m numcoll.bench.recovery``, not here."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

from numcoll.bench import recovery
from shm_leftovers import numcoll_entries

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180),
              pytest.mark.skipif("not sys.platform.startswith('linux')")]
ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_training_carries_on_after_a_rank_is_killed():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OPENBLAS_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-m", "numcoll", "run", "--keep-going", "-n", "4", "-m",
         "numcoll.examples.elastic_training", "--kill-rank", "2", "--kill-step", "4",
         "--steps", "10"],
        env=env, capture_output=True, text=True, timeout=150, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "rank 2 (pid" in out.stderr and "killed by SIGKILL" in out.stderr, out.stderr
    done = [line for line in out.stdout.splitlines() if "done: rank" in line]
    assert len(done) == 3, out.stdout
    was = sorted(int(re.search(r"\(rank (\d+) before the shrink\)", line).group(1))
                 for line in done)
    assert was == [0, 1, 3]
    for line in done:
        assert "of 3" in line and "shrinks 1" in line and "falling True" in line, line
        # the survivors re-shard the whole batch: still full-batch training
        assert float(line.rsplit(" ", 1)[1]) < 1e-5, line
    # the error the survivors saw named the dead rank and what to do
    assert re.search(r"rank 2 is gone.*nc\.shrink_group\(\)", out.stdout), out.stdout


@pytest.mark.parametrize("transport", [None, "tcp"])
def test_survivors_of_a_kill_in_a_large_allreduce_have_a_working_group(transport):
    shm_before = numcoll_entries()
    trial = recovery.shrink_trial(4, seed=3, transport=transport, count=(8 << 20) // 4)
    assert trial["ok"], trial
    assert numcoll_entries() - shm_before == set()  # nc.launch reaps the processes
    assert trial["transport"] == (transport or "shm")
    assert trial["recover_s"] < 10.0  # generous: the figure itself is the benchmark's


def test_agree_gives_every_survivor_the_same_answer_when_ranks_die():
    job = recovery.agree_job(5, seed=7)
    assert job["complete"], job
    assert job["rounds"] == 3 and job["killed"] >= 2
    assert job["disagreements"] == 0 and job["bad_and"] == 0


def test_keep_going_reports_a_rank_that_exits_with_a_code(tmp_path):
    """A rank killed by a signal is a failure the others carried on from; a
    rank that exits with a code of its own is the run's code."""
    script = tmp_path / "ranks.py"
    script.write_text("import os, sys, time\n"
                      "if os.environ['RANK'] == '1':\n"
                      "    sys.exit(3)\n"
                      "time.sleep(0.5)\n"
                      "print('rank', os.environ['RANK'], 'finished', flush=True)\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "numcoll", "run", "--keep-going", "-n", "2",
                          str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 3, out.stdout + out.stderr
    assert "rank 1 (pid" in out.stderr and "exited with code 3" in out.stderr
    assert "rank 0 finished" in out.stdout  # it was left running
