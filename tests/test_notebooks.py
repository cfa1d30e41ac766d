"""The notebooks run headless at small sizes (as a user's "Run all" would, in a
fresh kernel), show progress that ends complete, draw every chart inline, print
conclusions that match the numbers they measured, and change no file of the
checkout.

``NUMCOLL_NOTEBOOK_MAX_NBYTES`` and ``NUMCOLL_NOTEBOOK_ITERS`` keep them small;
``NUMCOLL_NOTEBOOK_FIGURES`` (only when set) has them write their PNGs (and the
rows behind them) to a folder: a temporary one here, ``notebooks/figures``
when the docs' figures are remade. ``history.ipynb`` reads the gate's saved
runs from ``NUMCOLL_HISTORY_STORAGE``: runs this test saves.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
#: What docs/performance/notebooks.md lists; a notebook added without it fails here.
NAMES = {"performance", "timeline", "data_parallel", "history"}
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

    assert {p.stem for p in NOTEBOOKS} == NAMES
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, \
                    f"{path.name}: clear the outputs before saving"


def _checkout_state() -> dict[str, str]:
    """Every file under notebooks/ (and the docs' figures) with a hash of its
    bytes: a notebook that writes into the checkout changes this."""
    state = {}
    for path in sorted((ROOT / "notebooks").rglob("*")):
        if path.is_file() and ".ipynb_checkpoints" not in path.parts:
            state[str(path.relative_to(ROOT))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return state


def execute(path: pathlib.Path, kernel_name: str, figures: pathlib.Path | None, monkeypatch):
    """Run every cell of ``path`` in a fresh kernel; return the executed notebook.
    ``figures``: where it may write its PNGs (None: nowhere, as by default)."""
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("NUMCOLL_NOTEBOOK_MAX_NBYTES", "65536")
    monkeypatch.setenv("NUMCOLL_NOTEBOOK_ITERS", "20")
    # The kernel runs in notebooks/: the numcoll under test is this checkout's.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    if figures is None:
        monkeypatch.delenv("NUMCOLL_NOTEBOOK_FIGURES", raising=False)
    else:
        monkeypatch.setenv("NUMCOLL_NOTEBOOK_FIGURES", str(figures))
    nb = nbformat.read(path, as_version=4)
    before = _checkout_state()
    started = time.monotonic()
    # A failing cell raises CellExecutionError naming the cell and the error.
    NotebookClient(nb, kernel_name=kernel_name, timeout=300,
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    elapsed = time.monotonic() - started
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    assert not errors, errors
    assert _checkout_state() == before, f"running {path.name} changed files in notebooks/"
    assert elapsed < NOTEBOOK_BUDGET_S, f"{path.name} took {elapsed:.0f} s at CI size"
    for cell in nb.cells:  # every chart is drawn in the notebook, not only saved
        if cell.cell_type == "code" and "plt.show()" in cell.source \
                and "nothing to plot" not in text_of(cell):
            assert images(cell), f"{path.name}: no inline chart from:\n{cell.source[:200]}"
    return nb


def images(cell) -> list[str]:
    return [o["data"]["image/png"] for o in cell.outputs
            if o.output_type == "display_data" and "image/png" in o.get("data", {})]


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
    import numpy as np

    from numcoll import bench
    from numcoll.bench import findings

    nb = execute(ROOT / "notebooks" / "performance.ipynb", kernel_name, tmp_path, monkeypatch)
    # progress while the ranks run, ending complete in the saved output
    sweep = cell_with(nb, "bench.run_plans(list(plans.values())")
    progress = "".join(o.get("text", "") for o in sweep.outputs if o.get("name") == "stderr")
    # what a saved notebook shows: each line's last state (a text bar redraws after "\r")
    states = [line.split("\r")[-1] for line in progress.split("\n") if "sizes" in line]
    assert states and "100%" in states[-1], progress[-300:]
    for name in ("busbw.png", "per_rank.png"):
        assert_png(tmp_path / name)
    saved = json.loads((tmp_path / "performance.json").read_text())
    results, world_size = saved["results"], saved["world_size"]
    anchors, notes = saved["anchors"], saved["anchor_notes"]
    rows = [r for series in [results, *anchors.values()] for rs in series.values() for r in rs
            if r.get("wrong") is not None]
    assert rows and all(r["wrong"] == 0 for r in rows)
    assert max(r["size"] for r in rows) == 65536
    for r in rows:
        assert r["time_us_min"] <= r["time_us_p10"] <= r["time_us"] <= r["time_us_p90"] \
            <= r["time_us_max"]
        assert len(r["rank_time_us"]) == world_size
    # numcoll's own choice was measured (not only forced alternatives) ...
    auto = results["allreduce (auto)"]
    chosen = {r["size"]: r["algorithm"] for r in auto}
    alternatives = {label.split()[1]: rs for label, rs in results.items()
                    if label.startswith("allreduce ") and "(auto)" not in label}
    assert set(chosen.values()) <= set(alternatives), (chosen, list(alternatives))
    # ... and the conclusions are the ones these rows give, printed as computed
    conclusions = saved["conclusions"]
    choice = findings.algorithm_choice(chosen, alternatives)
    assert choice["sizes"] and not choice["unmeasured"]
    assert conclusions[0] == findings.choice_sentence("allreduce", choice)
    same = [a["time_us"] / f["time_us"] for a in auto for f in alternatives[a["algorithm"]]
            if f["size"] == a["size"]]
    assert conclusions[1].startswith(f"nc.all_reduce(x) took {np.median(same):.2f}x the time")
    printed = text_of(cell_with(nb, "conclusions = ["))
    assert printed.splitlines() == [f"* {c}" for c in conclusions]
    for name in ("gloo", "MPI"):
        if anchors[name]:
            label = "allreduce (auto)"
            assert findings.faster_sentence(f"numcoll's {label}", auto, f"{name} allreduce",
                                            anchors[name][label], world_size) in conclusions
        else:
            assert f"numcoll against {name}: nothing to compare ({notes[name]})." \
                in conclusions
    if bench.torch_available() and not notes.get("gloo"):
        assert anchors["gloo"], "torch is installed: gloo must have been measured"
    # the prose states no transport: the run prints the one it used
    assert f"numcoll over {saved['transport']}:" in text_of(sweep)
    # the device section: on a GPU both paths measured right, elsewhere the reason and nothing
    device = text_of(cell_with(nb, "device_problem()"))
    saved_device = tmp_path / "performance-device.json"
    if device.startswith("device section skipped (nothing to plot): "):
        assert not saved_device.exists()
        assert "GPU" in device or "simulator" in device, device
    else:
        measured = json.loads(saved_device.read_text())["results"]
        assert all(r["wrong"] == 0 for rows in measured.values() for r in rows)
        assert {r["algorithm"] for r in measured["device allreduce (auto)"]} == {"ipc"}
        assert {r["algorithm"] for r in measured["device allreduce staged (ring)"]} == {"ring"}


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


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_data_parallel_notebook_draws_its_chart(kernel_name, monkeypatch):
    nb = execute(ROOT / "notebooks" / "data_parallel.ipynb", kernel_name, None, monkeypatch)
    chart = cell_with(nb, "overlapped fraction")
    assert images(chart) and "buckets; mean overlap" in text_of(chart)


#: Gate rows that run in the test process only (no rank processes): quick to save.
LOCAL_ROWS = "reduce_into or ref-memcpy or ref-numpy-add or PackPlan"


def _save_gate_run(storage: pathlib.Path, *extra: str) -> None:
    subprocess.run([sys.executable, "-m", "pytest", str(ROOT / "benchmarks"), "--quick", "-q",
                    "-p", "no:cacheprovider", "-k", LOCAL_ROWS, "--benchmark-autosave",
                    f"--benchmark-storage={storage}", *extra],
                   cwd=ROOT, check=True, capture_output=True, timeout=120,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.slow
@pytest.mark.timeout(330)
def test_history_notebook(kernel_name, tmp_path, monkeypatch):
    storage = tmp_path / "storage"
    _save_gate_run(storage)
    _save_gate_run(storage)
    _save_gate_run(storage, "--benchmark-compare")  # judged against the second
    monkeypatch.setenv("NUMCOLL_HISTORY_STORAGE", str(storage))
    nb = execute(ROOT / "notebooks" / "history.ipynb", kernel_name, None, monkeypatch)
    listing = text_of(cell_with(nb, "gate.saved_runs(STORAGE)"))
    assert listing.startswith(f"3 saved runs with gate rows under {storage}"), listing
    assert images(cell_with(nb, "fill_between"))
    summary = text_of(cell_with(nb, "summary = []"))
    assert "reduce_into SUM float32 1MiB" in summary and "ref: memcpy 1MiB" in summary
    assert "* 3 runs, " in summary
    assert "* The gate flagged " in summary and "rows in the latest run" in summary


def test_the_extras_install_what_notebooks_and_benchmarks_use():
    import re
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]

    def names(extra):
        return {re.split(r"[<>=!~\[ ]", req, maxsplit=1)[0].lower() for req in extras[extra]}

    assert {"jupyter", "nbconvert", "nbclient", "nbformat", "ipykernel", "matplotlib",
            "tqdm"} <= names("notebook")
    assert {"pytest-benchmark", "pytest-timeout", "tqdm", "matplotlib"} <= names("bench")
    # what this suite runs: the notebooks, the progress bar, the benchmark suites
    assert {"nbclient", "nbformat", "ipykernel", "matplotlib", "tqdm",
            "pytest-benchmark"} <= names("test")
