"""The benchmark tooling works end to end: ``numcoll-bench`` (thread and
process ranks, table and JSON), the pytest-benchmark suites (run once each,
tiny, with timing off) and the notebooks (executed headless).

Everything runs in subprocesses or a kernel: importing ``numcoll.bench``
here would add ``bench`` to this process's ``numcoll`` namespace.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
ROW_FIELDS = {"backend", "op", "algorithm", "world_size", "size", "count", "dtype", "iters",
              "warmup", "time_us", "time_us_min", "time_us_max", "algbw_gbps", "busbw_gbps"}
META_FIELDS = {"op", "world_size", "mode", "transport", "transport_used", "dtype",
               "numcoll_version", "torch_version", "host_cpu_count", "timing"}
TABLE_HEADER = ["size(B)", "count", "type", "algo", "time(us)", "algbw(GB/s)", "busbw(GB/s)"]


def bench(*args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "numcoll.bench", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **env})


def table_rows(stdout: str) -> list[list[str]]:
    """The data lines of the printed table, split into cells (header checked)."""
    lines = [ln for ln in stdout.splitlines() if ln.strip() and not ln.startswith("#")]
    assert lines[0].split()[:len(TABLE_HEADER)] == TABLE_HEADER, stdout
    return [ln.split() for ln in lines[1:]]


def check_rows(rows: list[dict], *, op: str, sizes: list[int], counts: list[int],
               factor: float) -> None:
    assert [r["size"] for r in rows] == sizes
    assert [r["count"] for r in rows] == counts
    for r in rows:
        assert ROW_FIELDS <= set(r), sorted(ROW_FIELDS - set(r))
        assert r["op"] == op and r["dtype"] == "float32" and r["backend"] == "numcoll"
        assert r["iters"] == 3 and r["warmup"] == 1
        assert 0 < r["time_us_min"] <= r["time_us"] <= r["time_us_max"]
        assert r["algbw_gbps"] == pytest.approx(r["size"] / r["time_us"] / 1e3)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * factor)


# -- numcoll-bench -----------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(90)
def test_cli_thread_mode_json_to_stdout():
    out = bench("--op", "allreduce", "--world-size", "2", "--mode", "thread",
                "--sizes", "8,4K", "--iters", "3", "--warmup", "1", "--json", "-")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)  # with --json -, stdout is only the JSON document
    meta = doc["metadata"]
    assert META_FIELDS <= set(meta), sorted(META_FIELDS - set(meta))
    assert (meta["world_size"], meta["mode"], meta["transport_used"]) == (2, "thread", "inproc")
    assert meta["host_cpu_count"] >= 1
    check_rows(doc["rows"], op="allreduce", sizes=[8, 4096], counts=[2, 1024], factor=1.0)
    assert {r["algorithm"] for r in doc["rows"]} <= {"ring", "recursive_doubling"}
    assert "[numcoll allreduce] 8 B (1/2)" in out.stderr
    assert "[numcoll allreduce] 4 KiB (2/2)" in out.stderr


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_cli_process_mode_table_and_json_file(tmp_path):
    path = tmp_path / "out.json"
    out = bench("--op", "allgather", "--world-size", "2", "--sizes", "8,4K", "--iters", "3",
                "--warmup", "1", "--json", str(path), "--quiet")
    assert out.returncode == 0, out.stderr
    assert "[numcoll" not in out.stderr  # --quiet: no progress lines
    cells = table_rows(out.stdout)
    assert [(int(c[0]), int(c[1]), c[2], c[3]) for c in cells] == [
        (8, 2, "float32", "ring"), (4096, 1024, "float32", "ring")]
    doc = json.loads(path.read_text())
    assert doc["metadata"]["mode"] == "process"
    assert doc["metadata"]["transport_used"] in ("ipc", "tcp")
    # allgather: size is the output (n x input); busbw = algbw x (n-1)/n
    check_rows(doc["rows"], op="allgather", sizes=[8, 4096], counts=[2, 1024], factor=0.5)
    for c, r in zip(cells, doc["rows"]):
        assert float(c[4]) == pytest.approx(r["time_us"], abs=0.06)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, message", [
    (["--op", "gather"], "invalid choice: 'gather'"),
    (["--min-bytes", "1M", "--max-bytes", "8"], "max size (8 B) is smaller than min size"),
    (["--world-size", "0"], "--world-size must be at least 1"),
    (["--sizes", "8,12Q"], "invalid size '12Q'"),
    (["--op", "allgather", "--algorithm", "tree"], "unknown allgather algorithm 'tree'; choose one of ring"),
    (["--algorithm", "tree"], "unknown allreduce algorithm 'tree'"),
], ids=["op", "max-lt-min", "world-size", "size", "algorithm-op", "algorithm-name"])
@pytest.mark.slow
def test_cli_rejects_bad_arguments(args, message):
    out = bench(*args)
    assert out.returncode == 2
    assert message in out.stderr, out.stderr


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_cli_compare_torch_without_torch_says_so():
    # sys.modules["torch"] = None makes torch unimportable for this process.
    code = ("import sys; sys.modules['torch'] = None; from numcoll.bench import main; "
            "sys.exit(main(['--compare', 'torch', '--sizes', '8', '--iters', '1']))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2
    assert "--compare torch needs PyTorch" in out.stderr


# -- benchmark suites --------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_benchmark_suites_run_once_tiny():
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "benchmarks", "-q", "--benchmark-disable",
         "-p", "no:cacheprovider"],
        cwd=ROOT, capture_output=True, text=True, timeout=230,
        env={**os.environ, "NUMCOLL_BENCH_MAX_NBYTES": "4096"})
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "failed" not in out.stdout


# -- notebooks ---------------------------------------------------------------------------
def _kernel_name(tmp_path_factory) -> str:
    """"python3" if it runs this interpreter; otherwise a private kernelspec for
    ``sys.executable`` under a temporary JUPYTER_PATH (nothing installed for the user)."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        argv0 = KernelSpecManager().get_kernel_spec("python3").argv[0]
    except NoSuchKernel:
        argv0 = None
    # jupyter_client runs a bare "python"/"python3"/"python3.X" as sys.executable.
    bare = {"python", f"python{sys.version_info[0]}", "python%d.%d" % sys.version_info[:2]}
    if argv0 is not None and (argv0 in bare or shutil.which(argv0) and
                              os.path.realpath(shutil.which(argv0)) ==
                              os.path.realpath(sys.executable)):
        return "python3"
    from ipykernel.kernelspec import install

    prefix = tmp_path_factory.mktemp("jupyter")
    install(prefix=str(prefix), kernel_name="numcoll-test-python3")
    data = prefix / "share" / "jupyter"
    os.environ["JUPYTER_PATH"] = os.pathsep.join(
        p for p in (str(data), os.environ.get("JUPYTER_PATH")) if p)
    return "numcoll-test-python3"


@pytest.fixture(scope="module")
def kernel_name(tmp_path_factory):
    saved = os.environ.get("JUPYTER_PATH")
    yield _kernel_name(tmp_path_factory)
    if saved is None:
        os.environ.pop("JUPYTER_PATH", None)
    else:
        os.environ["JUPYTER_PATH"] = saved


def test_there_are_notebooks_and_they_are_saved_without_outputs():
    import nbformat

    assert NOTEBOOKS, "notebooks/*.ipynb: none found"
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, \
                    f"{path.name}: clear the outputs before saving"


@pytest.mark.slow
@pytest.mark.timeout(330)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes(path, kernel_name, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("NUMCOLL_NOTEBOOK_MAX_NBYTES", "65536")
    nb = nbformat.read(path, as_version=4)
    # A failing cell raises CellExecutionError naming the cell and the error.
    NotebookClient(nb, kernel_name=kernel_name, timeout=300,
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    assert not errors, errors
