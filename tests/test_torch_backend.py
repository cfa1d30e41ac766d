"""numcoll as a torch.distributed backend (``import numcoll.torch``).

Ranks are processes running scripts under ``tests/torch_scripts/backend/``
(torch is imported once per rank, and each script runs many cases):

- ``ported.py``: torch's own tests (test_c10d_gloo.py's ProcessGroupGlooTest
  and DistributedDataParallelTest CPU cases, test_c10d_common.py's and
  test_c10d_pypg.py's DDP cases) on the numcoll backend, at 2 and 3 ranks;
- ``ddp_parity.py``: unmodified DDP on numcoll against gloo, same data and
  steps: equal parameters (bitwise at 2 ranks, within float rounding at 3).

Skipped where torch is not installed.
"""

import json
import os
import pathlib
import socket
import subprocess
import sys
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

pytestmark = pytest.mark.timeout(300)

SCRIPTS = pathlib.Path(__file__).parent / "torch_scripts" / "backend"
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))


def run_ranks(script: str, world_size: int, *args: str, timeout: float = 240) -> list[str]:
    """Run ``script RANK WORLD_SIZE PORT *args`` as ``world_size`` processes; their stdouts."""
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, str(SCRIPTS / script), str(r), str(world_size),
                               port, *args], env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for r in range(world_size)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, f"rank {procs.index(p)} failed:\n{out}\n{err[-4000:]}"
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


def _last_json(out: str, prefix: str = "") -> dict:
    line = [ln for ln in out.splitlines() if ln.startswith(prefix)][-1]
    return json.loads(line[len(prefix):])


# -- torch's own tests, ported -----------------------------------------------------------

sys.path.insert(0, str(SCRIPTS))
from ported import CASES  # noqa: E402

sys.path.remove(str(SCRIPTS))


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def ported_outcomes(request):
    outs = run_ranks("ported.py", request.param)
    return [_last_json(out, "OUTCOMES ") for out in outs]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_ported(ported_outcomes, name):
    failures = [o[name] for o in ported_outcomes if o[name] is not None]
    assert not failures, "\n".join(failures)


# -- DDP against gloo ---------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_gives_gloos_parameters(world_size):
    results = [_last_json(out) for out in run_ranks("ddp_parity.py", world_size)]
    for res in results:
        assert res.pop("ranks_agree") is True
        for name, r in res.items():
            assert r["moved"] > 1e-3, (name, r)   # it trained
            if name == "hook_fp16":   # gloo rounds to 16 bits at each ring step, numcoll once
                assert r["max_diff"] < 1e-4, (name, r)
            elif world_size == 2:     # a + b is the same in any order: bitwise equal
                assert r["max_diff"] == 0.0, (name, r)
            else:
                assert r["max_diff"] < 1e-6, (name, r)


# -- registration, init methods, backend strings (one process, world size 1) ------------

def _in_subprocess(code: str, timeout: float = 120) -> str:
    out = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    return out.stdout


def test_init_methods_backend_strings_and_get_backend(tmp_path):
    code = f"""
import os, datetime, torch, torch.distributed as dist
import numcoll.torch
from numcoll.torch import ProcessGroupNumcoll
port = {_free_port()}
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
for kwargs in (dict(), dict(init_method="env://"),
               dict(init_method=f"tcp://127.0.0.1:{{port + 0}}", rank=0, world_size=1),
               dict(init_method="file://{tmp_path}/rdzv", rank=0, world_size=1),
               dict(store=dist.HashStore(), rank=0, world_size=1)):
    for backend in ("numcoll", "cpu:numcoll,cuda:nccl", "cpu:numcoll"):
        dist.init_process_group(backend, **kwargs)
        assert isinstance(dist.group.WORLD, ProcessGroupNumcoll), type(dist.group.WORLD)
        assert dist.get_backend() == backend, (dist.get_backend(), backend)
        t = torch.ones(3)
        dist.all_reduce(t)
        g = dist.new_group([0], backend="numcoll")
        assert dist.get_backend(g) == "numcoll"
        dist.all_reduce(t, group=g)
        dist.destroy_process_group()
print("ok")
"""
    assert _in_subprocess(code).strip().endswith("ok")


def test_pg_options_reach_numcoll():
    code = """
import datetime, torch, torch.distributed as dist
import numcoll as nc, numcoll.torch
dist.init_process_group("numcoll", store=dist.HashStore(), rank=0, world_size=1,
                        pg_options=nc.ProcessGroup.Options(threads=3),
                        timeout=datetime.timedelta(seconds=42))
pg = dist.group.WORLD.numcoll_group
assert pg.options.threads == 3 and pg.options.timeout == datetime.timedelta(seconds=42)
dist.destroy_process_group()
print("ok")
"""
    assert _in_subprocess(code).strip().endswith("ok")


def test_destroy_leaves_no_numcoll_thread():
    code = """
import threading, torch, torch.distributed as dist
import numcoll.torch
dist.init_process_group("numcoll", store=dist.HashStore(), rank=0, world_size=1)
dist.new_group([0])
dist.all_reduce(torch.ones(2))
dist.destroy_process_group()
left = [t.name for t in threading.enumerate() if t.name.startswith("numcoll-r")]
assert not left, left
print("ok")
"""
    assert _in_subprocess(code).strip().endswith("ok")


def test_the_entry_point_registers_numcoll_when_torch_is_imported(tmp_path):
    """pyproject.toml declares a ``torch.backends`` entry point; torch calls it at
    the end of ``import torch``. An installed distribution is faked with a
    dist-info holding the same entry point, so this runs without reinstalling."""
    import tomllib

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "entry-points"]["torch.backends"]
    assert declared == {"numcoll": "numcoll.torch:_autoload"}
    info = tmp_path / "numcoll_probe-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: numcoll-probe\nVersion: 0\n")
    (info / "entry_points.txt").write_text(
        "[torch.backends]\n" + "".join(f"{k} = {v}\n" for k, v in declared.items()))
    code = ("import torch, sys, torch.distributed as dist; "
            "print('NUMCOLL' in dist.Backend._plugins, 'numcoll.torch' in sys.modules)")
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.stdout.split() == ["True", "True"], run.stdout + run.stderr[-2000:]
    # numcoll.torch imported before torch: its own `import torch` calls the entry
    # point while numcoll.torch is half-imported (this raised "Failed to load the
    # backend extension: numcoll" from `import torch`).
    first = ("import warnings; warnings.simplefilter('error'); import numcoll.torch; "
             "import torch.distributed as dist; print('NUMCOLL' in dist.Backend._plugins)")
    run = subprocess.run([sys.executable, "-c", first], env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.split() == ["True"], run.stderr[-2000:]
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"   # torch's switch turns it off
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.stdout.split() == ["False", "False"], run.stdout + run.stderr[-2000:]
