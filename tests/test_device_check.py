"""``.ci/device-check``, the one script a session with a GPU runs: here in its
``--dry`` mode (Numba's CUDA simulator, tiny sizes), which runs every stage as
on the GPU. What is checked is the plumbing the GPU run depends on: each stage
under its own limit, a failed or timed-out stage not stopping the next, and at
most the 8 files the device machine brings back."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / ".ci" / "device-check"

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                 reason="needs bash and coreutils' timeout")]


def _dry(tmp_path, **env):
    out = tmp_path / "out"
    run_env = {**os.environ, "OUT": str(out), "DEVICE_CHECK_PYTHON": sys.executable, **env}
    run_env.pop("NUMBA_ENABLE_CUDASIM", None)
    done = subprocess.run(["bash", str(SCRIPT), "--dry"], cwd=ROOT, env=run_env,
                          capture_output=True, text=True, timeout=200)
    return done, out


def _stages(out) -> dict:
    text = (out / "summary.txt").read_text()
    return dict(re.findall(r"^(\w+): (passed|FAILED[^;]*|TIMED OUT[^;]*) in", text, re.M))


def test_every_stage_runs_and_what_comes_back_fits_the_device_tool(tmp_path):
    done, out = _dry(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert _stages(out) == {s: "passed" for s in ("env", "tests", "gpu", "bench", "staged")}
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and all(re.fullmatch(r"[A-Za-z0-9._-]+", f) for f in files), files
    assert {"bench.json", "bench-staged.json", "summary.txt", "env.txt"} <= set(files)
    assert '"device": "cuda"' in (out / "bench.json").read_text()


def test_a_failed_or_timed_out_stage_does_not_stop_the_next(tmp_path):
    done, out = _dry(tmp_path, DEVICE_CHECK_TESTS="tests/no_such_test_module.py",
                     DEVICE_CHECK_GPU_S="0.001")
    assert done.returncode == 1
    stages = _stages(out)
    assert stages["tests"].startswith("FAILED")
    assert stages["gpu"].startswith("TIMED OUT")
    assert stages["bench"] == stages["staged"] == "passed"
    assert "some stage did not pass" in (out / "summary.txt").read_text()


def test_it_refuses_what_it_does_not_know():
    done = subprocess.run(["bash", str(SCRIPT), "--gpu-please"], cwd=ROOT, capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 2 and "usage" in done.stderr
