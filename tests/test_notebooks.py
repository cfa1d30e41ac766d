"""The notebooks run headless at small sizes (as a user's "Run all" would, in a
fresh kernel), show progress, save their figures, and print conclusions that
match the numbers they measured.

``NUMCOLL_NOTEBOOK_MAX_NBYTES`` and ``NUMCOLL_NOTEBOOK_ITERS`` keep them small;
``NUMCOLL_NOTEBOOK_FIGURES`` sends their PNGs (and the rows behind them) to a
temporary folder instead of ``notebooks/figures``.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
#: What a CI-sized run of one notebook may take here (2 shared cores); all of
#: them together are meant to stay under a minute on an idle machine.
NOTEBOOK_BUDGET_S = 75


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


def execute(path: pathlib.Path, kernel_name: str, figures: pathlib.Path, monkeypatch):
    """Run every cell of ``path`` in a fresh kernel; return the executed notebook."""
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("NUMCOLL_NOTEBOOK_MAX_NBYTES", "65536")
    monkeypatch.setenv("NUMCOLL_NOTEBOOK_ITERS", "20")
    monkeypatch.setenv("NUMCOLL_NOTEBOOK_FIGURES", str(figures))
    nb = nbformat.read(path, as_version=4)
    started = time.monotonic()
    # A failing cell raises CellExecutionError naming the cell and the error.
    NotebookClient(nb, kernel_name=kernel_name, timeout=300,
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    elapsed = time.monotonic() - started
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    assert not errors, errors
    assert elapsed < NOTEBOOK_BUDGET_S, f"{path.name} took {elapsed:.0f} s at CI size"
    return nb


def text_of(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


def cell_with(nb, fragment: str):
    cells = [c for c in nb.cells if c.cell_type == "code" and fragment in c.source]
    assert len(cells) == 1, fragment
    return cells[0]


def assert_png(path: pathlib.Path) -> None:
    assert path.is_file(), path
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5000, path


@pytest.mark.slow
@pytest.mark.timeout(330)
def test_performance_notebook(kernel_name, tmp_path, monkeypatch):
    from numcoll import bench
    from numcoll.bench import findings

    nb = execute(ROOT / "notebooks" / "performance.ipynb", kernel_name, tmp_path, monkeypatch)
    # progress while the ranks run: a widget where ipywidgets is, else a text bar
    sweep = cell_with(nb, "bench.run_plans(list(plans.values())")
    widgets = [o for o in sweep.outputs if "application/vnd.jupyter.widget-view+json"
               in o.get("data", {})]
    assert widgets or "100%" in "".join(o.get("text", "") for o in sweep.outputs
                                         if o.get("name") == "stderr"), sweep.outputs
    for name in ("busbw.png", "per_rank.png"):
        assert_png(tmp_path / name)
    saved = json.loads((tmp_path / "performance.json").read_text())
    results, world_size = saved["results"], saved["world_size"]
    rows = [r for series in (results, saved["torch_results"]) for rs in series.values()
            for r in rs]
    assert rows and all(r["wrong"] == 0 for r in rows)
    assert max(r["size"] for r in rows) == 65536
    for r in rows:
        assert r["time_us_min"] <= r["time_us_p10"] <= r["time_us"] <= r["time_us_p90"] \
            <= r["time_us_max"]
        assert len(r["rank_time_us"]) == world_size
    # the conclusions are the ones these rows give, and the notebook printed them
    ring, rd = results["allreduce ring"], results["allreduce recursive_doubling"]
    conclusions = saved["conclusions"]
    assert conclusions[0] == findings.faster_sentence("The ring allreduce", ring,
                                                      "recursive doubling", rd, world_size)
    auto_plan = bench.make_plan("allreduce", [r["size"] for r in ring], world_size=world_size)
    auto = {c.nbytes: bench.algorithm_name(auto_plan, c) for c in auto_plan.cases}
    choice = findings.algorithm_choice(auto, {"ring": ring, "recursive_doubling": rd})
    assert f"at {len(choice['agree'])} of {len(choice['sizes'])} sizes" in conclusions[1]
    printed = text_of(cell_with(nb, "conclusions = ["))
    assert printed.splitlines() == [f"* {c}" for c in conclusions]
    if saved["torch_results"]:
        gloo = findings.faster_sentence("numcoll's allreduce ring", ring, "gloo allreduce",
                                        saved["torch_results"]["gloo allreduce"], world_size)
        assert gloo in conclusions


@pytest.mark.slow
@pytest.mark.timeout(330)
def test_timeline_notebook(kernel_name, tmp_path, monkeypatch):
    nb = execute(ROOT / "notebooks" / "timeline.ipynb", kernel_name, tmp_path, monkeypatch)
    assert text_of(nb.cells[1]).strip() == "flight recorder on: True"
    threads = text_of(cell_with(nb, 'run("thread")'))
    processes = text_of(cell_with(nb, 'run("process")'))
    for text in (threads, processes):
        # 4 ranks x (3 steps x 3 allreduces + the closing barrier)
        assert text.startswith("40 records on 4 rank(s)"), text
    # rank 2 sleeps twice as long before each bucket: the records must say so
    assert "Straggler: rank 2," in threads, threads
    assert_png(tmp_path / "timeline.png")
    findings = text_of(cell_with(nb, "findings = ["))
    assert len(findings.splitlines()) == 3, findings


def test_the_extras_install_what_notebooks_and_benchmarks_use():
    import re
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]

    def names(extra):
        return {re.split(r"[<>=!~\[ ]", req, maxsplit=1)[0].lower() for req in extras[extra]}

    assert {"jupyter", "nbconvert", "nbclient", "nbformat", "ipykernel", "matplotlib",
            "tqdm"} <= names("notebook")
    assert {"pytest-benchmark", "tqdm"} <= names("bench")
    # what this suite runs: the notebooks, the progress bar, the benchmark suites
    assert {"nbclient", "nbformat", "ipykernel", "matplotlib", "tqdm",
            "pytest-benchmark"} <= names("test")
