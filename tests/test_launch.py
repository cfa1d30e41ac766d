"""nc.launch: where results come from, what dies with the launcher, what its
timeouts say, and the one clear error when ranks cannot start."""

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import numcoll as nc
from numcoll.launcher import LaunchTimeoutError

pytestmark = pytest.mark.timeout(120)
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run_script(tmp_path, source, *, stdin=False, timeout=60):
    """Run ``source`` as a script (or piped on stdin) with this checkout importable."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    if stdin:
        return subprocess.run([sys.executable, "-"], input=script.read_text(), env=env,
                              cwd=tmp_path, capture_output=True, text=True, timeout=timeout)
    return subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=timeout)


# -- results travel only over the launcher's own pipes ----------------------------------
class _Exploit:
    """Unpickling this creates ``path``: proof that a stranger's bytes ran."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (exec, (f"open({self.path!r}, 'w').close()",))


def _forge_results(marker):
    import pickle

    from numcoll import TCPStore

    # What any local process can do: reach the launch store and write every
    # key a result could be read from.
    stranger = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                        is_master=False)
    blob = pickle.dumps(_Exploit(marker))
    for r in range(nc.get_world_size()):
        stranger.set(f"launch/result/{r}", blob)
    stranger.close()
    nc.barrier()
    return ("genuine", nc.get_rank(), os.environ["RANK"], os.environ["WORLD_SIZE"])


@pytest.mark.slow
def test_results_come_from_the_ranks_not_from_the_store(tmp_path, no_leaked_threads):
    marker = tmp_path / "pwned"
    results = nc.launch(_forge_results, 2, args=(str(marker),), timeout=60)
    assert results == [("genuine", 0, "0", "2"), ("genuine", 1, "1", "2")]
    assert not marker.exists(), "the launcher unpickled bytes a stranger wrote to its store"


# -- ranks die with their launcher --------------------------------------------------------
def _alive(pid):
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # a zombie has run its last instruction


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_ranks_die_with_a_killed_launcher(tmp_path, sig):
    pids = tmp_path / "pids"
    pids.mkdir()
    script = tmp_path / "launcher.py"
    script.write_text(textwrap.dedent(f"""
        import os, time, numcoll as nc
        def rank(d):
            open(os.path.join(d, str(os.getpid())), "w").close()
            time.sleep(60)
        nc.launch(rank, 2, args=({str(pids)!r},), transport="tcp")
    """))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    launcher = subprocess.Popen([sys.executable, str(script)], env=env)
    try:
        deadline = time.monotonic() + 60
        while len(os.listdir(pids)) < 2:
            assert time.monotonic() < deadline and launcher.poll() is None, "ranks never started"
            time.sleep(0.05)
        ranks = [int(p) for p in os.listdir(pids)]
        killed = time.monotonic()
        launcher.send_signal(sig)
        launcher.wait(10)
        while any(_alive(p) for p in ranks) and time.monotonic() - killed < 2.0:
            time.sleep(0.02)
        assert not any(_alive(p) for p in ranks), f"ranks {ranks} outlived their launcher"
    finally:
        launcher.kill()
        launcher.wait()
        for p in os.listdir(pids):
            try:
                os.kill(int(p), signal.SIGKILL)
            except ProcessLookupError:
                pass


# -- the launch timeout and the group timeout are separate --------------------------------
def _late_rank(release):
    if nc.get_rank() == 1:
        release.wait(20)  # never joins the collective while the launcher waits
    else:
        try:
            nc.all_reduce(np.ones(4))
        finally:
            release.set()


def test_thread_launch_timeout_says_what_ranks_were_blocked_on(no_leaked_threads):
    # Load the reduction kernel first, so that rank 0 is surely waiting in the
    # collective (not compiling) when the deadline passes, even on a busy machine.
    nc.launch(lambda: nc.all_reduce(np.ones(4)), 2, mode="thread", timeout=60)
    release = threading.Event()
    started = time.monotonic()
    try:
        with pytest.raises(LaunchTimeoutError) as info:
            nc.launch(_late_rank, 2, args=(release,), mode="thread", timeout=1.5)
    finally:
        release.set()
    message = str(info.value)
    assert message.startswith("Timed out waiting 1500ms for launch: ranks [0, 1] still running")
    assert info.value.ranks == [0, 1]
    assert "allreduce (collective #1) waiting to recv from rank 1" in info.value.blocked[0], message
    assert "all_reduce() called from _late_rank" in info.value.blocked[0], message
    assert "_late_rank (test_launch.py" in info.value.blocked[1], message
    assert time.monotonic() - started < 1.5 + 10  # the deadline, then a bounded report


def test_thread_group_timeout_is_the_collectives_deadline(no_leaked_threads):
    release = threading.Event()
    try:
        with pytest.raises(nc.RankFailedError) as info:
            nc.launch(_late_rank, 2, args=(release,), mode="thread", timeout=30,
                      group_timeout=0.5)
    finally:
        release.set()
    cause = info.value.__cause__
    assert isinstance(cause, nc.CollectiveTimeoutError), cause
    assert str(cause).startswith("Timed out waiting 500ms for allreduce (collective #1) on rank 0")
    assert "rank 1" in str(cause) and "launch" not in str(cause)


def _sleepy_rank(seconds):
    nc.all_reduce(np.ones(4))  # started, connected, kernel loaded
    if nc.get_rank() == 1:
        time.sleep(seconds)
    nc.all_reduce(np.ones(4))


@pytest.mark.slow
def test_process_launch_timeout_says_what_ranks_were_blocked_on():
    started = time.monotonic()
    with pytest.raises(LaunchTimeoutError) as info:
        nc.launch(_sleepy_rank, 2, args=(30,), timeout=8.0, transport="tcp")
    elapsed = time.monotonic() - started
    message = str(info.value)
    assert info.value.ranks == [0, 1]
    assert "allreduce (collective #2) waiting to recv from rank 1" in info.value.blocked[0], message
    assert "_sleepy_rank (test_launch.py" in info.value.blocked[1], message
    assert elapsed < 8.0 + 10  # the deadline, then a bounded report (ranks sleep 30 s)


# -- ranks that cannot start: one clear error, or none at all -----------------------------
_WORKS = """
    import numcoll as nc
    def rank():
        nc.barrier()
        return nc.get_rank() * 10
    print("result", nc.launch(rank, 2))
"""


@pytest.mark.slow
@pytest.mark.parametrize("stdin", [False, True], ids=["no-main-guard", "stdin"])
def test_scripts_without_a_main_guard_and_on_stdin_just_work(tmp_path, stdin):
    run = _run_script(tmp_path, _WORKS, stdin=stdin)
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("result [0, 10]") == 1, run.stdout  # ranks did not re-run it
    assert "Traceback" not in run.stderr


@pytest.mark.slow
def test_an_unpicklable_function_is_one_clear_error(tmp_path):
    run = _run_script(tmp_path, """
        import threading, numcoll as nc
        lock = threading.Lock()
        def rank():
            with lock:
                return nc.get_rank()
        nc.launch(rank, 2)
    """)
    assert run.returncode == 1
    assert run.stderr.count("Traceback") == 1, run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("TypeError: launch(mode='process'): cannot send 'rank'")
    assert "cannot pickle '_thread.lock' object" in last and "mode='thread'" in last


@pytest.mark.slow
def test_a_module_the_ranks_cannot_import_is_one_clear_error(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "hidden_mod.py").write_text("def rank():\n    return 1\n")
    run = _run_script(tmp_path, """
        import sys, numcoll as nc
        sys.path.append("elsewhere"); import hidden_mod; sys.path.remove("elsewhere")
        nc.launch(hidden_mod.rank, 2)
    """)
    assert run.returncode == 1
    assert run.stderr.count("Traceback") == 1, run.stderr
    assert len(run.stderr.splitlines()) < 30, run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("numcoll.LaunchError: launch: the ranks could not load the "
                           "function: ModuleNotFoundError: No module named 'hidden_mod'")
    assert "must be importable by the ranks" in last


def test_launch_arguments_are_checked_at_the_call():
    with pytest.raises(ValueError, match="world_size"):
        nc.launch(print, True)
    with pytest.raises(TypeError, match="callable"):
        nc.launch("fn", 2)
    with pytest.raises(ValueError, match="timeout must be positive"):
        nc.launch(print, 2, timeout=-1)
    with pytest.raises(TypeError, match="group_timeout"):
        nc.launch(print, 2, group_timeout="1s")


def _stalls(_):
    if nc.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    nc.all_reduce(np.ones(4))


@pytest.mark.slow
def test_a_stalled_rank_is_named_not_the_rank_that_timed_out_waiting_for_it():
    with pytest.raises(nc.RankFailedError) as info:
        nc.launch(_stalls, 2, args=(None,), timeout=60, group_timeout=1.0, transport="tcp")
    assert info.value.rank == 1, info.value
    # named first, and the precise timeout that found it leads the message
    assert str(info.value).startswith("rank 1 stalled (ranks [0] failed too): "
                                      "CollectiveTimeoutError: Timed out waiting 1000ms for "
                                      "allreduce (collective #1) on rank 0"), info.value
    assert "\n  rank 1: stopped: still running 3.0s after rank 0 failed; no answer" \
        in str(info.value), info.value
    assert "Timed out waiting 1000ms for allreduce" in info.value.failures[0]
