"""`numcoll run` / `python -m numcoll run`: torchrun's environment, output
prefixed by rank, the first failure's exit code, every rank stopped on a
failure, on Ctrl-C and when the launcher itself is killed."""

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))


def _script(tmp_path, body: str) -> pathlib.Path:
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(body))
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purpose (its parent has not reaped it yet).
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def _pids(tmp_path) -> list[int]:
    # A rank may be between creating its file and writing its pid: skip empty ones.
    return [int(text) for text in (p.read_text() for p in tmp_path.glob("pid*")) if text]


def _gone(pids, within_s=10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def test_help():
    out = subprocess.run([sys.executable, "-m", "numcoll"], capture_output=True, text=True,
                         env=_env(), timeout=60)
    assert out.returncode == 0 and "numcoll run -n 4 train.py" in out.stdout
    out = subprocess.run([sys.executable, "-m", "numcoll", "run", "--help"],
                         capture_output=True, text=True, env=_env(), timeout=60)
    assert out.returncode == 0 and "--nproc-per-node" in out.stdout


def test_ranks_get_torchruns_environment_and_prefixed_output(tmp_path):
    script = _script(tmp_path, """
        import os, sys
        import numpy as np
        import numcoll as dist
        dist.init_process_group("gloo")
        x = np.array([float(dist.get_rank() + 1)])
        dist.all_reduce(x)
        keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "MASTER_ADDR")
        print("env", *(os.environ[k] for k in keys), int(x[0]), sys.argv[1:])
        print("to stderr", file=sys.stderr)
        dist.destroy_process_group()
    """)
    out = subprocess.run([sys.executable, "-m", "numcoll", "run", "-n", "3", "--", str(script),
                          "--flag", "v"], capture_output=True, text=True, env=_env(),
                         timeout=100)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = sorted(line for line in out.stdout.splitlines() if "env" in line)
    assert lines == [f"[rank{r}]: env {r} {r} 3 3 0 127.0.0.1 6 ['--flag', 'v']"
                     for r in range(3)], out.stdout
    errors = out.stderr.splitlines()
    assert all(f"[rank{r}]: to stderr" in errors for r in range(3)), out.stderr


def test_first_failure_sets_the_exit_code_and_stops_the_others(tmp_path):
    script = _script(tmp_path, """
        import os, sys, time
        rank = int(os.environ["RANK"])
        open(os.path.join(sys.argv[1], f"pid{rank}"), "w").write(str(os.getpid()))
        if rank == 1:
            time.sleep(0.5)
            sys.exit(7)
        time.sleep(60)
    """)
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "numcoll", "run", "-n", "3", "--grace", "2",
                          str(script), str(tmp_path)], capture_output=True, text=True,
                         env=_env(), timeout=100)
    assert out.returncode == 7, out.stderr
    assert "rank 1" in out.stderr and "exited with code 7" in out.stderr
    assert time.monotonic() - start < 30
    assert len(_pids(tmp_path)) == 3 and _gone(_pids(tmp_path))


def _start_sleepers(tmp_path, n=2):
    script = _script(tmp_path, """
        import os, sys, time, subprocess
        rank = int(os.environ["RANK"])
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open(os.path.join(sys.argv[1], f"pid{rank}"), "w").write(str(os.getpid()))
        open(os.path.join(sys.argv[1], f"pid{rank}child"), "w").write(str(child.pid))
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-m", "numcoll", "run", "-n", str(n), "--grace",
                             "1", str(script), str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=_env())
    deadline = time.monotonic() + 60
    while len(_pids(tmp_path)) < 2 * n and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(_pids(tmp_path)) == 2 * n
    return proc


def test_ctrl_c_stops_every_rank_and_their_children(tmp_path):
    proc = _start_sleepers(tmp_path)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGINT, err
    assert b"got SIGINT" in err
    assert _gone(_pids(tmp_path))


def test_ranks_die_with_a_killed_launcher(tmp_path):
    proc = _start_sleepers(tmp_path)
    proc.kill()
    proc.wait(timeout=30)
    ranks = [int(p.read_text()) for p in tmp_path.glob("pid?")]
    try:
        assert _gone(ranks)
    finally:
        # A rank's own children are not reached once the launcher is SIGKILLed
        # (they are when it stops them itself): end them here.
        for p in tmp_path.glob("pid?child"):
            try:
                os.kill(int(p.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
