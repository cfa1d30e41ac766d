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
               "examples", "fast", "kernels", "launcher", "logs", "memory", "ops", "options",
               "process_group", "recovery", "testing", "torch", "work"}
    assert public - set(nc.__all__) <= modules


def _imports(path, *, top_level_only=False):
    """Every module ``path`` imports, as absolute names (relative imports
    resolved); only the module-level ones with ``top_level_only``."""
    rel = path.relative_to(ROOT).with_suffix("")
    package = list(rel.parts[:-1]) if rel.name != "__init__" else list(rel.parts[:-1])
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                base = node.module or ""
            else:
                parts = package[:len(package) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            yield base
            yield from (f"{base}.{a.name}" for a in node.names)


#: What each layer must never import (a prefix of a module name). The layers,
#: top down: api -> process_group -> fast -> collectives -> algorithms -> comm ->
#: memory/kernels/cuda -> transports. See docs/contributing.md, "How it is built".
FORBIDDEN = {
    "transports": ("numcoll",),
    "numcoll/algorithms": ("numcoll.process_group", "numcoll.api", "numcoll.collectives",
                           "transports", "numcoll.kernels", "numcoll.dtypes", "numba",
                           "numcoll.memory", "numcoll.cuda"),
    "numcoll/kernels": ("numcoll.process_group", "numcoll.api", "numcoll.collectives",
                        "numcoll.algorithms", "numcoll.comm", "transports"),
    "numcoll/memory": ("numcoll.process_group", "numcoll.api", "numcoll.collectives",
                       "numcoll.algorithms", "numcoll.comm", "transports"),
    "numcoll/collectives": ("numcoll.process_group", "numcoll.api", "numcoll.work",
                            "numcoll.fast"),
    "numcoll/fast": ("numcoll.process_group", "numcoll.api"),
    "numcoll/comm.py": ("numcoll.process_group", "numcoll.api", "numcoll.collectives",
                        "numcoll.algorithms"),
    "numcoll/diagnostics/abort_notes.py": ("numcoll.process_group", "numcoll.api",
                                           "numcoll.collectives", "numcoll.algorithms",
                                           "numcoll.comm", "transports"),
    "numcoll/bootstrap": ("numcoll.process_group", "numcoll.api", "numcoll.collectives",
                          "numcoll.algorithms", "numcoll.launcher"),
    "numcoll/process_group.py": ("numcoll.api", "numcoll.launcher"),
}


def _layer_files():
    for where, banned in FORBIDDEN.items():
        target = ROOT / where
        for path in ([target] if target.suffix == ".py" else sorted(target.rglob("*.py"))):
            yield path, banned


def test_import_contracts():
    """Imports point down only: transports never imports numcoll; algorithms
    never import the group, the API, transports or kernels; kernels never the
    group; no layer imports one above it. Only transports import zmq."""
    for path, banned in _layer_files():
        bad = sorted({m for m in _imports(path) for b in banned
                      if m == b or m.startswith(b + ".")})
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"
    for path in (ROOT / "numcoll").rglob("*.py"):
        assert not any(m.split(".")[0] == "zmq" for m in _imports(path)), path


def test_cuda_is_imported_only_lazily():
    """No module outside numcoll/cuda imports it (or numba.cuda) at module
    level: ``import numcoll`` must not load numba.cuda."""
    for path in (ROOT / "numcoll").rglob("*.py"):
        if path.relative_to(ROOT / "numcoll").parts[0] == "cuda":
            continue
        eager = [m for m in _imports(path, top_level_only=True)
                 if m.startswith(("numcoll.cuda", "numba.cuda"))]
        assert not eager, f"{path.relative_to(ROOT)} imports {eager} at module level"


def test_layout_stays_small():
    """numcoll/ has at most 14 top-level modules and no module over ~500 lines."""
    top = sorted(p.name for p in (ROOT / "numcoll").glob("*.py"))
    assert len(top) <= 14, top
    long = {str(p.relative_to(ROOT)): n for p in list((ROOT / "numcoll").rglob("*.py")) +
            list((ROOT / "transports").rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > 520}
    assert not long, long


def test_old_import_paths_are_aliases_of_the_moved_modules():
    import importlib

    import numcoll.api
    import numcoll.diagnostics.flight_recorder

    assert importlib.import_module("numcoll.distributed") is numcoll.api
    assert importlib.import_module("numcoll.flight_recorder") is \
        numcoll.diagnostics.flight_recorder
    assert nc.flight_recorder is numcoll.diagnostics.flight_recorder
    assert numcoll.api.__spec__.name == "numcoll.api"  # the alias does not rename it
    from numcoll.distributed import all_reduce
    assert all_reduce is nc.all_reduce


@pytest.mark.slow
def test_old_module_paths_run_with_dash_m(tmp_path):
    out = subprocess.run([sys.executable, "-m", "numcoll.fr", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "flight-recorder dumps" in out.stdout, out.stderr
    out = subprocess.run([sys.executable, "-m", "numcoll.fr", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "no flight-recorder dumps" in out.stdout, out.stderr


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


def test_threads_with_worlds_of_their_own_are_counted_while_they_run():
    """The fronts skip the thread-local lookup while no thread has a world of
    its own: every rank thread of a thread launch is counted while it runs,
    and nothing once they ended, so the main thread sees no group after."""
    from numcoll.api.world import _thread_worlds

    def body():
        return _thread_worlds[0], nc.get_rank()

    got = nc.launch(body, 3, mode="thread", timeout=60)
    assert [rank for _, rank in got] == [0, 1, 2]
    assert all(count >= 1 for count, _ in got)
    assert _thread_worlds[0] == 0
    assert not nc.is_initialized()
    with pytest.raises(RuntimeError, match="Default process group has not been initialized"):
        nc.barrier()


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


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _import_graph() -> dict[str, set[str]]:
    """Module -> the numcoll/transports modules it imports (at any depth of its code,
    function-level imports included), as module names."""
    paths = sorted((ROOT / "numcoll").rglob("*.py")) + sorted((ROOT / "transports").rglob("*.py"))
    modules = {_module_name(p): p for p in paths}
    graph = {}
    for name, path in modules.items():
        edges = set()
        for imported in _imports(path):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]  # "pkg.mod.Name" -> "pkg.mod"
            if imported and imported != name and not name.startswith(imported + "."):
                edges.add(imported)
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    import sys as _sys
    limit = _sys.getrecursionlimit()
    _sys.setrecursionlimit(max(limit, 10000))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        _sys.setrecursionlimit(limit)
    return out


def test_no_two_modules_import_each_other():
    """Every folder reads top down: no import cycle between modules (a package's
    ``__init__`` importing its own modules is not one), function-level imports included."""
    cycles = _cycles(_import_graph())
    assert not cycles, f"import cycles: {cycles}"


def test_the_cycle_finder_finds_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
