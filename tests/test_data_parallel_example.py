"""The end-to-end example: a NumPy MLP trained on 4 ranks with nc.Reducer matches
single-process full-batch training (the DDP test test_gloo_backend_cpu_module, with tiny
buckets), prints its overlap, and its notebook runs."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from numcoll.examples import data_parallel as dp

pytestmark = pytest.mark.timeout(180)
ROOT = pathlib.Path(__file__).resolve().parents[1]
SIZES, SAMPLES, STEPS = [6, 20, 20, 12, 3], 32, 6


@pytest.mark.parametrize("view", [False, True])
def test_weights_match_single_process_full_batch(view):
    # bucket_cap_mb=0.001 as in torch's DDP test: many tiny buckets
    results = dp.train_data_parallel(4, STEPS, SIZES, SAMPLES, bucket_cap_mb=0.001,
                                     gradient_as_bucket_view=view)
    reference = dp.train_single(STEPS, SIZES, SAMPLES)
    for params, losses, stats in results:
        assert losses[-1] < losses[0]
        assert stats[-1]["buckets"] > 2
        for p, q, first in zip(params, reference, results[0][0]):
            np.testing.assert_allclose(p, q, rtol=1e-5, atol=1e-6)
            assert np.array_equal(p, first)          # identical on every rank
    # and they moved: not just the initial weights
    assert max(float(np.abs(p - q).max()) for p, q in
               zip(reference, dp.init_params(SIZES))) > 1e-3


def test_uneven_shards_are_refused():
    with pytest.raises(Exception, match="must divide evenly among 3 ranks"):
        dp.train_data_parallel(3, 1, SIZES, 32)


def test_main_prints_agreement_and_overlap(capsys):
    dp.main(["--world-size", "2", "--steps", "3", "--sizes", "6,20,3", "--samples", "16"])
    out = capsys.readouterr().out
    assert "weights identical on every rank: True" in out
    worst = float(out.split("full-batch training: ")[1].split()[0])
    assert worst < 1e-5
    assert "communication overlapped with backward:" in out


@pytest.mark.slow
def test_weights_match_with_ranks_as_processes():
    results = dp.train_data_parallel(2, 3, SIZES, SAMPLES, mode="process", bucket_cap_mb=0.001)
    reference = dp.train_single(3, SIZES, SAMPLES)
    for params, _, _ in results:
        for p, q in zip(params, reference):
            np.testing.assert_allclose(p, q, rtol=1e-5, atol=1e-6)


def test_data_parallel_notebook_executes(tmp_path_factory):
    import nbformat
    from nbclient import NotebookClient
    from test_notebooks import _kernel_name   # the suite's way of finding a kernel

    path = ROOT / "notebooks" / "data_parallel.ipynb"
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, kernel_name=_kernel_name(tmp_path_factory), timeout=150,
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    assert not errors, errors
