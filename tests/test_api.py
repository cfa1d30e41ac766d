"""The torch.distributed-style module API, launch(), and the public surface."""

import ast
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import numcoll as nc

pytestmark = pytest.mark.timeout(180)
ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_all_is_complete_and_importable():
    for name in nc.__all__:
        assert hasattr(nc, name), name
    public = {n for n in dir(nc) if not n.startswith("_")}
    modules = {"algorithms", "api", "bench", "bootstrap", "call", "collectives", "comm",
               "config", "cuda", "data_parallel", "diagnostics", "dtypes", "errors",
               "examples", "kernels", "launcher", "logs", "memory", "ops", "options",
               "process_group", "testing", "torch", "work"}
    assert public - set(nc.__all__) <= modules


def _imports(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module


def test_layering_rules():
    """transports never imports numcoll and is the only importer of zmq;
    algorithms never see sockets, kernels or dtypes; kernels never see ranks."""
    for path in (ROOT / "transports").rglob("*.py"):
        mods = set(_imports(path))
        assert not any(m.split(".")[0] == "numcoll" for m in mods), path
    for path in (ROOT / "numcoll").rglob("*.py"):
        mods = set(_imports(path))
        assert not any(m.split(".")[0] == "zmq" for m in mods), path
        rel = path.relative_to(ROOT / "numcoll").parts
        tree = ast.parse(path.read_text())
        relative = {("." * n.level) + (n.module or "") for n in ast.walk(tree)
                    if isinstance(n, ast.ImportFrom) and n.level > 0}
        if rel[0] == "algorithms":
            assert not any(m.split(".")[0] in ("transports", "numba") for m in mods), path
            assert not any("kernels" in m or "dtypes" in m for m in relative), path
        if rel[0] == "kernels":
            assert "transports" not in mods, path
            assert not any(x in m for m in relative
                           for x in ("comm", "process_group", "algorithms")), path


@pytest.mark.slow
def test_import_is_fast_and_does_not_touch_cuda():
    code = ("import time, sys; t = time.perf_counter(); import numcoll; "
            "print(time.perf_counter() - t, 'numba.cuda' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out[1] == "False"
    assert float(out[0]) < 10


def test_module_api_in_threads():
    def body():
        rank, size = nc.get_rank(), nc.get_world_size()
        assert nc.is_initialized()
        x = np.array([rank + 1.0])
        nc.all_reduce(x, op=nc.ReduceOp.MAX)
        assert x[0] == size
        b = np.array([rank])
        nc.broadcast(b, src=2)
        assert b[0] == 2
        r = np.array([rank + 1])
        nc.reduce(r, dst=1)
        if rank == 1:
            assert r[0] == size * (size + 1) // 2
        lst = [np.empty(1, np.int64) for _ in range(size)]
        nc.all_gather(lst, np.array([rank]))
        assert [int(a[0]) for a in lst] == list(range(size))
        g = [np.empty(1, np.int64) for _ in range(size)] if rank == 0 else None
        nc.gather(np.array([rank * 2]), g, dst=0)
        if rank == 0:
            assert [int(a[0]) for a in g] == [0, 2, 4]
        s = np.empty(1, np.int64)
        nc.scatter(s, [np.array([10 + i]) for i in range(size)] if rank == 0 else None, src=0)
        assert s[0] == 10 + rank
        out = np.empty(2)
        nc.reduce_scatter(out, [np.full(2, float(i)) for i in range(size)])
        assert np.all(out == rank * size)
        nc.barrier()
        # point to point around the ring
        if rank == 0:
            nc.send(np.array([42]), dst=1)
            got = np.empty(1, np.int64)
            assert nc.recv(got) == size - 1 and got[0] == 42 + size - 1
        else:
            got = np.empty(1, np.int64)
            assert nc.recv(got, src=rank - 1) == rank - 1
            nc.isend(got + 1, dst=(rank + 1) % size).wait()
        w = nc.all_reduce(np.ones(3), async_op=True)
        assert isinstance(w, nc.Work) and w.wait()
        return rank

    assert nc.launch(body, 3, mode="thread", timeout=60) == [0, 1, 2]


def test_new_group_uses_global_ranks():
    def body():
        rank = nc.get_rank()
        sub = nc.new_group([1, 2])
        if rank == 0:
            assert sub is nc.GroupMember.NON_GROUP_MEMBER
            with pytest.warns(UserWarning, match="does not belong to the given group"):
                assert nc.all_reduce(np.ones(1), group=sub) is None
            return None
        x = np.array([rank * 1.0])
        nc.all_reduce(x, group=sub)
        y = np.array([rank])
        nc.broadcast(y, src=2, group=sub)
        return float(x[0]), int(y[0]), nc.get_rank(sub), nc.get_world_size(sub)

    assert nc.launch(body, 3, mode="thread", timeout=60) == [None, (3.0, 2, 0, 2),
                                                              (3.0, 2, 1, 2)]


def test_launch_names_the_failing_rank_and_joins_everyone(no_leaked_threads):
    def body():
        if nc.get_rank() == 2:
            raise ValueError("boom on purpose")
        nc.all_reduce(np.ones(1))  # the others are left waiting for rank 2

    with pytest.raises(nc.RankFailedError, match=r"rank 2 failed.*ValueError: boom") as info:
        nc.launch(body, 3, mode="thread", timeout=60)
    assert info.value.rank == 2 and isinstance(info.value.__cause__, ValueError)


@pytest.mark.slow
def test_launch_processes_with_a_lambda_and_a_crash():
    assert nc.launch(lambda k: nc.get_rank() * k, 2, args=(10,), mode="process",
                     timeout=120) == [0, 10]

    def crash():
        import os

        if nc.get_rank() == 1:
            os._exit(3)
        nc.all_reduce(np.ones(1))

    with pytest.raises(nc.RankFailedError, match="rank 1 failed.*exited with code 3"):
        nc.launch(crash, 2, mode="process", timeout=120)


def test_init_process_group_env_and_file(tmp_path, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "0")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    nc.init_process_group(init_method="env://")
    try:
        assert nc.get_rank() == 0 and nc.get_world_size() == 1
        with pytest.raises(ValueError, match="twice"):
            nc.init_process_group(init_method="env://")
    finally:
        nc.destroy_process_group()
    assert not nc.is_initialized()
    with pytest.warns(DeprecationWarning, match="pass init_method"):
        nc.init_process_group(f"file://{tmp_path}/store", rank=0, world_size=1)
    nc.all_reduce(np.ones(2))
    nc.destroy_process_group()


@pytest.mark.slow
def test_demo_runs_in_threads():
    out = subprocess.run([sys.executable, "-m", "numcoll.demo", "--world-size", "3", "--mode",
                          "thread"], capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr
    assert "every rank agreed" in out.stdout
