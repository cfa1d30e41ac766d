"""Several ranks per host, each host a Linux network namespace (see
tests/test_multihost.py, whose fixture and helpers these tests use): the
group is two-level (the hier transport: shm within a host, tcp across; the
twolevel algorithms). Every collective at 2x2, 3x2, 2x3 and 3+1 ranks and
sub-groups, the bytes on the cable, a killed rank, a killed host leader and
a pulled cable, torchrun across hosts, and a smoke run of the cable bench.
Skipped where namespaces cannot be made."""

import glob
import json
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from test_multihost import PORT, _env, _finish, hosts  # noqa: F401 - hosts: the fixture

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _job(hosts, layout, script, port, **extra) -> list[subprocess.Popen]:
    """Rank r of ``script`` on host ``layout[r]``, with torchrun's variables."""
    n = len(layout)
    procs = []
    for r, h in enumerate(layout):
        local = [q for q in range(n) if layout[q] == h]
        procs.append(hosts.popen(h, [sys.executable, str(script)], _env(
            RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(local.index(r)),
            LOCAL_WORLD_SIZE=str(len(local)), MASTER_ADDR=hosts.addrs[0],
            MASTER_PORT=str(port), **extra)))
    return procs


def _nothing_left(hosts, procs) -> None:
    """No process on any host, no /dev/shm entry of the job's ranks."""
    deadline = time.monotonic() + 10
    while hosts.pids() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert hosts.pids() == [], "processes left on the hosts"
    pids = {p.pid for p in procs}
    left = [e for e in glob.glob("/dev/shm/*") if any(f"-{pid}-" in e for pid in pids)]
    assert not left, left


EVERY = textwrap.dedent("""
    import datetime, json, os
    import numpy as np
    import numcoll as dist
    from collective_checks import check_every_collective

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    pg = dist.get_default_group()
    assert pg.transport_kind == "hier", pg.transport_kind
    ran = check_every_collective(pg, expect="twolevel_lanes")
    if dist.get_world_size() == 6:
        # 3 hosts x 2: each group learns its own hosts (sub-groups keep the
        # default group's transport kind). Sub-groups: 2 hosts x 2 (two-level),
        # one rank per host (flat), one host (the host's arena is the group's).
        kinds = {}
        for name, members in (("2x2", [0, 1, 2, 3]), ("3x1", [0, 2, 4]), ("1x2", [4, 5])):
            sub = dist.new_group(members)
            if rank in members:
                spg = sub
                x = np.full(10_001, rank + 1.0)
                work = spg.allreduce(x)
                work.wait()
                assert x[0] == x[-1] == sum(m + 1 for m in members), (name, x[0])
                kinds[name] = [spg.transport_kind, work.call.algorithm]
            dist.barrier()
        ran["subgroups"] = kinds

    def cable(algorithm, repeats=3):
        # Bytes on this host's cable per direction per 16 MiB allreduce,
        # from its eth0 counters (rank 0's host: the others run the same).
        x = np.ones(4 << 20, np.float32)
        opts = dist.AllreduceOptions(algorithm=algorithm)
        pg.allreduce(x, opts).wait()
        pg.barrier().wait()
        stats = "/sys/class/net/eth0/statistics/"
        read = lambda: [int(open(stats + f).read()) for f in ("tx_bytes", "rx_bytes")]
        before = read()
        pg.barrier().wait()  # no rank sends before that read
        for _ in range(repeats):
            pg.allreduce(x, opts).wait()
        pg.barrier().wait()
        after = read()
        return [(a - b) / repeats / x.nbytes for a, b in zip(after, before)]

    ratios = ({a: cable(a) for a in ("twolevel_lanes", "twolevel", "ring")}
              if os.environ.get("CABLE") else {})
    print("ok", rank, json.dumps({"ran": ran, "cable": ratios}), flush=True)
    dist.destroy_process_group()
""")

LAYOUTS = {"2x2": [0, 0, 1, 1], "3x2": [0, 0, 1, 1, 2, 2], "2x3": [0, 0, 0, 1, 1, 1],
           "3+1": [0, 0, 0, 1]}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_collective_at_each_layout(hosts, tmp_path, layout):
    """Every collective against NumPy, the two-level algorithms chosen by
    themselves; at 2x2 and 2x3, the bytes on host 0's cable per direction
    per 16 MiB allreduce: at most 1.1 times the payload two-level (flat ring:
    1.5 and 1.67)."""
    script = tmp_path / "every.py"
    script.write_text(EVERY)
    measure = layout in ("2x2", "2x3")
    port = PORT + 10 + list(LAYOUTS).index(layout)
    procs = _job(hosts, LAYOUTS[layout], script, port, **({"CABLE": "1"} if measure else {}))
    results = _finish(procs, timeout=100)
    reports = {}
    for r, (code, out, err) in enumerate(results):
        assert code == 0, f"rank {r}: {out}\n{err}"
        line = next(x for x in out.splitlines() if x.startswith(f"ok {r} "))
        reports[r] = json.loads(line.split(" ", 2)[2])
    assert reports[0]["ran"]["alltoall"] == "pairwise"
    if layout == "3x2":
        assert reports[0]["ran"]["subgroups"] == {
            "2x2": ["hier", "twolevel_lanes"], "3x1": ["hier", "ring"]}, reports[0]
        assert reports[4]["ran"]["subgroups"] == {
            "3x1": ["hier", "ring"], "1x2": ["hier", "shared"]}, reports[4]
    if measure:
        flat = 2 * (len(procs) - 1) / len(procs)  # ring: each link's share crosses
        cable = reports[0]["cable"]
        for way in (0, 1):  # sent, received
            for variant in ("twolevel_lanes", "twolevel"):
                assert 0.99 < cable[variant][way] <= 1.1, (layout, way, cable)
            assert cable["ring"][way] > flat * 0.97, (layout, way, cable)
    _nothing_left(hosts, procs)


FAULT = textwrap.dedent("""
    import datetime, os, signal, sys, time
    import numpy as np
    import numcoll as dist

    timeout = datetime.timedelta(seconds=float(os.environ["TIMEOUT_S"]))
    # Start-up under a generous deadline, the group's own after: four ranks
    # importing numcoll beside a loaded test run took more than 3 s to meet.
    dist.init_process_group("gloo", timeout=max(timeout, datetime.timedelta(seconds=60)))
    rank = dist.get_rank()
    x = np.ones(1 << 20, np.float32)
    dist.all_reduce(x)
    dist.get_default_group().set_timeout(timeout)
    dist.all_reduce(x)
    open(os.environ["READY"] + str(rank), "w").close()
    victim = int(os.environ.get("VICTIM", -1))
    try:
        for i in range(100000):
            if rank == victim and i == 20:
                with open(os.environ["EVENT"], "w") as f:   # when it happened
                    f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            dist.all_reduce(x)
        print("no error")
        sys.exit(1)
    except Exception as exc:
        print(f"{time.time()!r} {type(exc).__name__} peer={getattr(exc, 'peer', None)}: {exc}",
              flush=True)
    time.sleep(3)   # rank 0 hosts the store: keep it up while the others read why
    os._exit(0)
""")


def _fault_job(hosts, tmp_path, port, timeout_s, **extra):
    script = tmp_path / "fault.py"
    script.write_text(FAULT)
    ready, event = tmp_path / "ready", tmp_path / "event"
    layout = LAYOUTS["2x2"]
    procs = _job(hosts, layout, script, port, READY=str(ready), EVENT=str(event),
                 TIMEOUT_S=str(timeout_s), **extra)
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"ready{r}").exists() for r in range(len(layout))):
        assert time.monotonic() < deadline, "the ranks never got going"
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.05)
    return procs, event


def _named(out: str, since: float) -> tuple[float, int]:
    """Seconds from ``since`` (wall clock) to a rank's error, and the rank it names."""
    when, rest = out.split(" ", 1)
    return float(when) - since, int(rest.split("peer=", 1)[1].split(":", 1)[0])


@pytest.mark.parametrize("victim", [3, 2], ids=["rank", "host-leader"])
def test_a_killed_rank_or_host_leader_is_named_by_every_survivor(hosts, tmp_path, victim):
    """2 hosts x 2 ranks; rank 3, or rank 2 (host 1's leader, the rank that
    exchanges with host 0), is SIGKILLed in the middle of allreduces: every
    survivor -- its host-mate, both ranks of the other host -- names it
    within a second or two of a 60 s group timeout."""
    procs, event = _fault_job(hosts, tmp_path, PORT + 20 + victim, 60, VICTIM=str(victim))
    results = _finish(procs)
    assert results[victim][0] == -signal.SIGKILL
    killed_at = float(event.read_text())
    for r, (code, out, err) in enumerate(results):
        if r == victim:
            continue
        assert code == 0, f"rank {r}: {out}\n{err}"
        seconds, peer = _named(out, killed_at)
        assert seconds < 5 and peer == victim, (r, seconds, out)
        assert f"rank {victim}" in out, (r, out)
    _nothing_left(hosts, procs)


@pytest.mark.parametrize("algorithm", ["twolevel", "twolevel_lanes"])
def test_a_pulled_cable_is_named_by_every_survivor(hosts, tmp_path, algorithm):
    """2 hosts x 2 ranks; host 1's cable is pulled mid-allreduce (no reset,
    nothing closes). Within the 3 s group timeout and the notes that follow
    it: host 0's ranks (the store's side) name a rank of host 1.

    With one leader per host (``twolevel``), host 1's leader names a rank of
    host 0; its other rank, which cannot reach the store to read why its
    leader stopped, names its leader. With every rank carrying a share
    (``twolevel_lanes``, the default), either rank of host 1 may be the one
    on the cable when it is pulled and the other the one waiting for it in
    the host's arena: each names a rank of host 0 or its host-mate, and at
    least one of them names a rank of host 0."""
    port = PORT + 30 + ["twolevel", "twolevel_lanes"].index(algorithm)
    procs, _ = _fault_job(hosts, tmp_path, port, 3,
                          NUMCOLL_ALGORITHM=f"allreduce:{algorithm}")
    try:
        time.sleep(0.3)
        cut_at = time.time()
        hosts.cut(1)
        results = _finish(procs)
    finally:
        hosts.mend(1)
    if algorithm == "twolevel":
        expected = {0: {2, 3}, 1: {2, 3}, 2: {0, 1}, 3: {0, 1, 2}}
    else:
        expected = {0: {2, 3}, 1: {2, 3}, 2: {0, 1, 3}, 3: {0, 1, 2}}
    named = {}
    for r, (code, out, err) in enumerate(results):
        assert code == 0, f"rank {r}: {out}\n{err}"
        seconds, named[r] = _named(out, cut_at)
        assert seconds < 3 + 4 and named[r] in expected[r], (r, seconds, out)
    assert {named[2], named[3]} & {0, 1}, ("host 1 named no rank of host 0", named)
    _nothing_left(hosts, procs)


LAUNCHED_HIER = textwrap.dedent("""
    import os, socket
    import numpy as np
    import numcoll as dist

    dist.init_process_group("gloo")
    pg = dist.get_default_group()
    x = np.full(1 << 20, float(dist.get_rank()), np.float32)
    work = pg.allreduce(x)
    work.wait()
    names = [None] * dist.get_world_size()
    dist.all_gather_object(names, socket.gethostname())
    # torch.distributed with numcoll's backend, in the same job: its group
    # learns the hosts too.
    import torch
    import torch.distributed as tdist
    import numcoll.torch

    tdist.init_process_group("numcoll")
    t = torch.full((1 << 20,), float(tdist.get_rank()))
    tdist.all_reduce(t)
    inner = tdist.group.WORLD._pg   # the numcoll ProcessGroup under torch's
    line = "sum %d %d %s %s %s %s %s\\n" % (
        int(x[0]), int(t[0]), pg.transport_kind, work.call.algorithm, inner.transport_kind,
        os.environ["LOCAL_RANK"], names)
    os.write(1, line.encode())   # one write: the ranks share the launcher's pipe
    tdist.destroy_process_group()
    dist.destroy_process_group()
""")


def test_torchrun_across_hosts(hosts, tmp_path):
    """The same job under torchrun on each of 2 hosts (2 ranks each): its
    agent's store, the hier transport, the two-level allreduce; and
    torch.distributed with numcoll's backend in the same job, over hier too."""
    pytest.importorskip("torch")
    script = tmp_path / "launched.py"
    script.write_text(LAUNCHED_HIER)
    procs = [hosts.popen(node, [sys.executable, "-m", "torch.distributed.run", "--nnodes",
                                "2", "--node-rank", str(node), "--nproc-per-node", "2",
                                "--master-addr", hosts.addrs[0], "--master-port",
                                str(PORT + 40),
                                # torchrun's own logs: in the test's directory
                                "--log-dir", str(tmp_path / f"torchrun-logs-{node}"),
                                str(script)], _env())
             for node in (0, 1)]
    results = _finish(procs, timeout=110)
    names = str(["host0", "host0", "host1", "host1"])
    for node, (code, out, err) in enumerate(results):
        assert code == 0, f"node {node}: {out}\n{err}"
        lines = sorted(line for line in out.splitlines() if line.startswith("sum"))
        assert lines == [f"sum 6 6 hier twolevel_lanes hier {local} {names}"
                         for local in (0, 1)], out
    _nothing_left(hosts, procs)


def test_the_cable_bench_measures_bytes_and_limits_the_cable(hosts):
    """``python -m numcoll.bench.cable`` at 2x2 with a 1 MiB allreduce (one
    iteration, no gloo: a smoke run of what the cable table of docs/guide/many-hosts.md comes
    from): the counters give two-level 1x the payload each way, the flat
    ring 1.5x, and the token bucket on the cable holds (``hosts``: only for
    its skip)."""
    from numcoll.bench.cable import _layout, measure

    assert _layout("2x3") == [0, 0, 0, 1, 1, 1] and _layout("3+1") == [0, 0, 0, 1]
    found = measure([0, 0, 1, 1], nbytes=1 << 20, iterations=2,
                    methods=("twolevel_lanes", "ring"), rate="200mbit", port=PORT + 50)
    assert found["transport"] == "hier"
    for method, ratio in (("twolevel_lanes", 1.0), ("ring", 1.5)):
        row = found[method]
        assert ratio * 0.99 < row["tx"] < ratio * 1.1 and ratio * 0.99 < row["rx"] < \
            ratio * 1.1, (method, row)
        # 200 Mbit/s: at least the bytes' time on the cable, less what the
        # bucket lets through at once (its 512 KiB burst).
        floor_ms = (ratio * (1 << 20) - (512 << 10)) * 8 / 200e6 * 1e3
        assert row["min_ms"] >= floor_ms, (method, row, floor_ms)
