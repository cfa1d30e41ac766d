"""torch code ports by changing the import: real torch.distributed scripts run
on numcoll with only `import torch.distributed as dist` replaced, torch
tensors (bfloat16, requires_grad) are used in place, and the module layer's
checks keep torch's words."""

import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

import numcoll as nc

SCRIPTS = pathlib.Path(__file__).parent / "torch_scripts"
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(script: pathlib.Path, timeout: float = 100) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    return subprocess.run([sys.executable, str(script), str(_free_port())], env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(p.name for p in SCRIPTS.glob("*.py")))
def test_torch_script_runs_with_only_the_import_changed(name, tmp_path):
    pytest.importorskip("torch")
    source = (SCRIPTS / name).read_text()
    original = "import torch.distributed as dist\n"
    assert source.count(original) == 1
    ported = tmp_path / name
    ported.write_text(source.replace(original, "import numcoll as dist\n"))
    out = _run(ported)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("NUMCOLL_TEST_TORCH_ORIGINALS"),
                    reason="set NUMCOLL_TEST_TORCH_ORIGINALS=1 to check the scripts on torch too")
@pytest.mark.parametrize("name", sorted(p.name for p in SCRIPTS.glob("*.py")))
def test_torch_script_passes_on_torch_itself(name):
    pytest.importorskip("torch")
    out = _run(SCRIPTS / name)
    assert out.returncode == 0, out.stdout + out.stderr


def test_torch_tensors_are_used_in_place_bfloat16_and_requires_grad_included():
    torch = pytest.importorskip("torch")
    from numcoll.memory.arrays import as_array

    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8,
                  torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool,
                  torch.complex64, torch.complex128):
        t = torch.zeros(6, dtype=dtype, requires_grad=dtype.is_floating_point)
        a = as_array(t, "allreduce")
        assert a.__array_interface__["data"][0] == t.data_ptr(), dtype
        assert a.size == 6 and a.dtype.itemsize == t.element_size()
    strided = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)[:, 1]
    view = as_array(strided, "allreduce")
    assert view.dtype == nc.bfloat16 and view.astype(np.float32).tolist() == [1, 5, 9]

    def body():
        grad = torch.ones(3, requires_grad=True)
        half = torch.full((4,), nc.get_rank() + 0.5, dtype=torch.bfloat16)
        ptrs = grad.data_ptr(), half.data_ptr()
        nc.all_reduce(grad)
        nc.all_reduce(half)
        assert (grad.data_ptr(), half.data_ptr()) == ptrs
        return grad.detach().tolist(), half.float().tolist()

    results = nc.launch(body, 2, mode="thread", timeout=60)
    assert results == [([2.0] * 3, [2.0] * 4)] * 2


def _one_rank(fn):
    """Run fn on a world of one thread-rank (the module layer's checks)."""
    return nc.launch(fn, 1, mode="thread", timeout=30)[0]


@pytest.mark.parametrize("call", [
    lambda: nc.all_gather([np.zeros(1, np.float32)], np.zeros(1, np.float64)),
    lambda: nc.reduce_scatter(np.zeros(1, np.float32), [np.zeros(1, np.int32)]),
    lambda: nc.all_to_all([np.zeros(1, np.float32)], [np.zeros(1, np.float64)]),
    lambda: nc.all_to_all_single(np.zeros(1, np.float32), np.zeros(1, np.int64)),
    lambda: nc.all_gather_coalesced([[np.zeros(1), np.zeros(1)]],
                                    [np.zeros(1, np.float32), np.zeros(1, np.int8)]),
    lambda: nc.all_gather_coalesced([[np.zeros(1), np.zeros(1, np.int8)]], [np.zeros(1)]),
    lambda: nc.all_reduce_coalesced([np.zeros(1, np.float32), np.zeros(2, np.float64)]),
], ids=["all_gather", "reduce_scatter", "all_to_all", "all_to_all_single",
        "all_gather_coalesced_in", "all_gather_coalesced_out", "all_reduce_coalesced"])
def test_different_dtypes_use_torchs_words(call):
    def body():
        with pytest.raises(ValueError, match="tensors with different dtypes"):
            call()
        x = np.ones(2)
        nc.all_reduce(x)          # nothing was queued: the group still works
        return x.tolist()

    assert _one_rank(body) == [1.0, 1.0]


def test_all_gather_coalesced_flat_list_is_a_type_error():
    def body():
        with pytest.raises(TypeError, match="Invalid function argument.*output_tensor_lists"):
            nc.all_gather_coalesced([np.zeros(1)], [np.zeros(1)])
        with pytest.raises(TypeError, match="Invalid function argument: output_tensor_lists"):
            nc.all_gather_coalesced(np.zeros(1), [np.zeros(1)])
        return True

    assert _one_rank(body)


def test_premul_sum_as_torch_spells_it():
    def body():
        x = np.full(3, nc.get_rank() + 1.0)
        nc.all_reduce(x, op=nc._make_nccl_premul_sum(0.5))
        assert nc.ReduceOp.premul_sum(2.0).name == nc.ReduceOp.PREMUL_SUM.name == "PREMUL_SUM"
        with pytest.raises(ValueError, match="premul_sum"):
            nc.all_reduce(x, op=nc.ReduceOp.PREMUL_SUM)
        return x.tolist()

    assert nc.launch(body, 2, mode="thread", timeout=60) == [[1.5] * 3] * 2


@pytest.mark.slow
def test_under_torchrun_the_ranks_use_its_agent_store(tmp_path):
    pytest.importorskip("torch")
    script = tmp_path / "job.py"
    script.write_text(
        "import numpy as np\nimport numcoll as dist\n"
        "dist.init_process_group('gloo')\n"
        "x = np.array([dist.get_rank() + 1.0])\ndist.all_reduce(x)\n"
        # One write of a whole line: both ranks share torchrun's stdout pipe, where
        # print()'s separate writes of its parts interleaved ("sumsum 3 ...").
        "import os, sys\n"
        "line = 'sum %d %s\\n' % (int(x[0]), type(dist.get_default_group()._store).__name__)\n"
        "os.write(sys.stdout.fileno(), line.encode())\n"
        "dist.destroy_process_group()\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                          "2", "--master-port", str(_free_port()),
                          # torchrun's own logs: in the test's directory, not /tmp's
                          "--log-dir", str(tmp_path / "torchrun-logs"), str(script)], env=env,
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("sum 3") == 2, out.stdout
