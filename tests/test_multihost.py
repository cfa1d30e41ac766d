"""Ranks on separate hosts: each host is a Linux network namespace of its own
(its own interfaces, routes and ports) with its own hostname (a UTS
namespace), joined by veth pairs to a bridge inside a namespace made for the
purpose (numcoll.testing.netns) — addresses 10.77.0.0/24 exist only inside
the namespaces this test makes, and are removed with them. Skipped where
namespaces cannot be made (not root, no iproute2, no unshare).

With one rank per host the group is flat (tcp): collectives, a killed rank,
a cut link. With several ranks on a host it is two-level: ``numcoll run``
here, the rest in tests/test_multihost_hier.py (which uses this module's
fixture and helpers)."""

import os
import pathlib
import sys
import textwrap
import time

import pytest

from numcoll.testing.netns import Hosts, unavailable

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
ROOT = pathlib.Path(__file__).resolve().parents[1]
TESTS = pathlib.Path(__file__).resolve().parent
PORT = 29500          # free by construction: the namespaces are new


@pytest.fixture(scope="module")
def hosts():
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    h = Hosts(3)
    try:
        yield h
    finally:
        h.remove()


def _env(**extra) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])]), **extra)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "NUMCOLL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        if name not in extra:
            env.pop(name, None)
    return env


def _finish(procs, timeout=90) -> list[tuple[int, str, str]]:
    out = []
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            o, e = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            out.append((p.returncode, o, e))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    return out


COLLECTIVES = textwrap.dedent("""
    import os, socket
    import numpy as np
    import numcoll as dist

    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    pg = dist.get_default_group()
    assert pg.transport_kind == "tcp", pg.transport_kind
    assert pg.options.host == os.environ["EXPECT_HOST"], pg.options.host
    for count in (1, 1000, 3_000_001):           # the last one: many segments
        x = np.full(count, rank + 1.0, np.float32)
        dist.all_reduce(x)
        assert x[0] == x[-1] == n * (n + 1) / 2
    out = np.empty(3 * n, np.int64)
    dist.all_gather_into_tensor(out, np.full(3, rank, np.int64))
    assert out.tolist() == [r for r in range(n) for _ in range(3)]
    b = np.arange(5.0) if rank == 1 else np.zeros(5)
    dist.broadcast(b, src=1)
    assert b.tolist() == [0, 1, 2, 3, 4]
    outs = [np.empty(2) for _ in range(n)]
    dist.all_to_all(outs, [np.full(2, 10.0 * rank + q) for q in range(n)])
    assert [o[0] for o in outs] == [10.0 * q + rank for q in range(n)]
    names = [None] * n
    dist.all_gather_object(names, socket.gethostname())
    assert names == [f"host{r}" for r in range(n)], names
    dist.barrier()
    print("ok", rank, names)
    dist.destroy_process_group()
""")


def test_collectives_across_hosts(hosts, tmp_path):
    script = tmp_path / "collectives.py"
    script.write_text(COLLECTIVES)
    n = len(hosts.names)
    procs = [hosts.popen(r, [sys.executable, str(script)],
                         _env(RANK=str(r), WORLD_SIZE=str(n), MASTER_ADDR=hosts.addrs[0],
                              MASTER_PORT=str(PORT), EXPECT_HOST=hosts.addrs[r]))
             for r in range(n)]
    results = _finish(procs)
    for r, (code, out, err) in enumerate(results):
        assert code == 0, f"rank {r}: {out}\n{err}"
        assert out.startswith(f"ok {r}")


KILL = textwrap.dedent("""
    import os, signal, sys, time
    import numpy as np
    import numcoll as dist

    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=60))
    rank = dist.get_rank()
    x = np.ones(1 << 16, np.float32)
    dist.all_reduce(x)
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        for _ in range(100):
            dist.all_reduce(x)
        print("no error")
        sys.exit(1)
    except Exception as exc:
        print(f"{time.monotonic() - start:.2f}s {type(exc).__name__}: {exc}", flush=True)
    time.sleep(3)   # rank 0 hosts the store: keep it up while the others read why
    os._exit(0)
""")


def test_a_killed_rank_is_named_promptly_across_hosts(hosts, tmp_path):
    script = tmp_path / "kill.py"
    script.write_text(KILL)
    n = len(hosts.names)
    procs = [hosts.popen(r, [sys.executable, str(script)],
                         _env(RANK=str(r), WORLD_SIZE=str(n), MASTER_ADDR=hosts.addrs[0],
                              MASTER_PORT=str(PORT + 1)))
             for r in range(n)]
    results = _finish(procs)
    assert results[2][0] == -9
    for r in (0, 1):
        code, out, err = results[r]
        assert code == 0, f"rank {r}: {out}\n{err}"
        seconds = float(out.split("s ", 1)[0])
        assert seconds < 10, out          # the group timeout is 60 s
        assert "rank 2" in out, out


LAUNCHED = textwrap.dedent("""
    import os, socket
    import numpy as np
    import numcoll as dist

    dist.init_process_group("gloo")
    pg = dist.get_default_group()
    x = np.array([float(dist.get_rank())])
    work = pg.allreduce(x)
    work.wait()
    names = [None] * dist.get_world_size()
    dist.all_gather_object(names, socket.gethostname())
    print("sum", int(x[0]), os.environ["GROUP_RANK"], pg.transport_kind, work.call.algorithm,
          names)
    dist.destroy_process_group()
""")


def test_the_launcher_across_hosts(hosts, tmp_path):
    """``numcoll run`` on each of 2 hosts, 2 ranks each: the group is
    two-level by itself (the hier transport, the two-level allreduce)."""
    script = tmp_path / "launched.py"
    script.write_text(LAUNCHED)
    procs = [hosts.popen(node, [sys.executable, "-m", "numcoll", "run", "--nnodes", "2",
                                "--node-rank", str(node), "--master-addr", hosts.addrs[0],
                                "--master-port", str(PORT + 2), "-n", "2", str(script)],
                         _env())
             for node in (0, 1)]
    results = _finish(procs)
    expected_names = str(["host0", "host0", "host1", "host1"])
    for node, (code, out, err) in enumerate(results):
        assert code == 0, f"node {node}: {out}\n{err}"
        lines = sorted(line for line in out.splitlines() if "sum" in line)
        assert lines == [f"[rank{r}]: sum 6 {node} hier twolevel_lanes {expected_names}"
                         for r in (2 * node, 2 * node + 1)], out


CUT = textwrap.dedent("""
    import datetime, os, sys, time
    import numpy as np
    import numcoll as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))
    rank = dist.get_rank()
    x = np.ones(1 << 16, np.float32)
    dist.all_reduce(x)
    open(os.environ["READY"] + str(rank), "w").close()
    start = None
    try:
        for _ in range(100000):
            if start is None and os.path.exists(os.environ["CUT"]):
                start = time.monotonic()
            dist.all_reduce(x)
        print("no error")
        sys.exit(1)
    except Exception as exc:
        took = time.monotonic() - (start or time.monotonic())
        print(f"{took:.2f}s {type(exc).__name__} peer={getattr(exc, 'peer', None)}: {exc}",
              flush=True)
    time.sleep(3)   # rank 0 hosts the store: keep it up while the others read why
    os._exit(0)
""")


def test_a_cut_link_is_named_by_every_survivor(hosts, tmp_path):
    """The cable of host 2 is pulled mid-allreduce (its veth goes down: no RST,
    nothing closes): the survivors' group timeout (3 s) fires, and each names
    rank 2 -- rank 0 directly, rank 1 through rank 0's note -- within a few
    seconds."""
    script = tmp_path / "cut.py"
    script.write_text(CUT)
    ready, cut = tmp_path / "ready", tmp_path / "cut"
    n = len(hosts.names)
    procs = [hosts.popen(r, [sys.executable, str(script)],
                         _env(RANK=str(r), WORLD_SIZE=str(n), MASTER_ADDR=hosts.addrs[0],
                              MASTER_PORT=str(PORT + 3), READY=str(ready), CUT=str(cut)))
             for r in range(n)]
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"ready{r}").exists() for r in range(n)):
            assert time.monotonic() < deadline, "the ranks never got going"
            assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
            time.sleep(0.05)
        time.sleep(0.2)
        hosts.cut(2)
        cut.touch()
        results = _finish(procs)
    finally:
        hosts.mend(2)
    for r in (0, 1):
        code, out, err = results[r]
        assert code == 0, f"rank {r}: {out}\n{err}"
        seconds = float(out.split("s ", 1)[0])
        assert seconds < 8, out           # 3 s timeout + following the notes
        assert "peer=2" in out, out
