"""numcoll.torch.shrink_group: DDP on numcoll's torch backend loses a rank
(SIGKILL, under ``numcoll run --keep-going``), the survivors shrink the group,
rebuild DDP on it and keep training."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240),
              pytest.mark.skipif("not sys.platform.startswith('linux')")]
ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ddp_is_rebuilt_on_the_shrunk_group_and_training_goes_on():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-m", "numcoll", "run", "--keep-going", "-n", "3", "-m",
         "numcoll.examples.elastic_ddp", "--kill-rank", "2", "--kill-step", "3"],
        env=env, capture_output=True, text=True, timeout=220, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    done = [line for line in out.stdout.splitlines() if "done: rank" in line]
    assert len(done) == 2, out.stdout[-3000:]
    before = r"\(rank (\d+) before the shrink\)"
    assert sorted(int(re.search(before, d).group(1)) for d in done) == [0, 1]
    for line in done:
        assert "of 2" in line and "shrinks 1" in line and "falling True" in line, line


def test_shrink_group_refuses_a_group_of_another_backend():
    import numcoll.torch

    with pytest.raises(TypeError, match="must be a numcoll group"):
        numcoll.torch.shrink_group(object())
