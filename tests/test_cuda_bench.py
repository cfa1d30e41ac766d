"""``numcoll-bench --device cuda``: under Numba's CUDA simulator with tiny sizes
(its timings mean nothing; the plumbing, the check and the JSON are what is
tested), on a GPU with the tests marked ``gpu``."""

import json

from cuda_env import SIMULATED  # noqa: E402,F401 - first: chooses the simulator

import pytest  # noqa: E402

pytestmark = pytest.mark.timeout(300)


from numcoll.bench.cli import main  # noqa: E402


@pytest.fixture(autouse=True)
def tiny(monkeypatch):
    monkeypatch.setenv("NUMCOLL_CUDA_THREADS", "4")
    monkeypatch.setenv("NUMCOLL_CUDA_BLOCKS", "2")


@pytest.mark.parametrize("op", ["allreduce", "allgather", "reduce_scatter", "broadcast",
                                "reduce", "alltoall"])
def test_every_collective_on_device_arrays(op, tmp_path, capsys):
    out = tmp_path / "run.json"
    status = main(["--device", "cuda", "--op", op, "--sizes", "64,256", "-n", "2",
                   "--mode", "thread", "--iters", "2", "--warmup", "1", "--progress", "none",
                   "--dtype", "bfloat16" if op == "allreduce" else "float32",
                   "--json", str(out), "-q"])
    assert status == 0, capsys.readouterr().err
    run = json.loads(out.read_text())
    assert run["metadata"]["device"] == "cuda"
    assert [r["nbytes"] for r in run["metadata"]["device_limits"]] == [64, 256]
    assert run["rows"] and all(r["wrong"] == 0 for r in run["rows"])
    # thread ranks address each other's device memory: every collective reads it
    assert {r["algorithm"] for r in run["rows"]} == {"ipc"}


def test_what_does_not_apply_is_refused(capsys):
    assert main(["--device", "cuda", "--persistent", "--sizes", "64", "-q"]) == 2
    assert "--persistent" in capsys.readouterr().err


@pytest.mark.gpu
def test_device_bench_beside_torch_on_a_gpu(tmp_path, capsys):
    pytest.importorskip("torch")
    out = tmp_path / "run.json"
    status = main(["--device", "cuda", "--sizes", "4K,16M", "-n", "2", "--iters", "5",
                   "--compare", "torch", "--progress", "none", "--json", str(out)])
    assert status == 0, capsys.readouterr().err
    run = json.loads(out.read_text())
    assert all(r["wrong"] == 0 and r.get("torch_wrong") == 0 for r in run["rows"])
    assert {r["algorithm"] for r in run["rows"]} == {"ipc"}
