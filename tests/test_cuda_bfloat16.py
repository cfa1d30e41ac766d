"""bfloat16 (and every other dtype the host path takes) on the device path.

Runs under Numba's CUDA simulator unless ``NUMBA_ENABLE_CUDASIM=0`` is set (then
on the GPU); the tests marked ``gpu`` need a real GPU (and, for torch, a CUDA
build of torch) and skip elsewhere with the reason.
"""


from cuda_env import SIMULATED  # noqa: E402,F401 - first: chooses the simulator

import numpy as np  # noqa: E402
import pytest  # noqa: E402

pytestmark = pytest.mark.timeout(180)

from numba import cuda as _numba_cuda  # noqa: E402

_numba_to_device = _numba_cuda.to_device
del _numba_cuda

import numcoll as nc  # noqa: E402
import numcoll.cuda  # noqa: E402
from numcoll.dtypes import SUPPORTED_DTYPES, dtype_name  # noqa: E402
from reference import assert_reduced, make_input, reduce_reference  # noqa: E402

to_device, to_host = numcoll.cuda.to_device, numcoll.cuda.to_host


@pytest.fixture(autouse=True)
def tiny(monkeypatch):
    monkeypatch.setenv("NUMCOLL_CUDA_THREADS", "4")
    monkeypatch.setenv("NUMCOLL_CUDA_BLOCKS", "2")
    monkeypatch.setenv("NUMCOLL_SEGMENT_NBYTES", "64")


def _op_for(dtype):
    return nc.ReduceOp.MAX if np.dtype(dtype).kind == "b" else nc.ReduceOp.SUM


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=dtype_name)
def test_copies_take_every_dtype(dtype):
    values = make_input(dtype, 12, 1, None).reshape(3, 4)
    d = to_device(values[:, ::2])                       # not contiguous on the host
    assert d.dtype == values.dtype and d.shape == (3, 2)
    back = to_host(d)
    assert back.dtype == values.dtype
    np.testing.assert_array_equal(back.view(np.uint8), np.ascontiguousarray(
        values[:, ::2]).view(np.uint8))


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_host_dtype_reduces_on_the_device_as_on_the_host(world_size):
    """The device path takes every dtype the host path takes, and gives the
    same bits (16-bit floats: reduced in float32, rounded once, on both)."""

    def body():
        rank = nc.get_rank()
        got = {}
        for dtype in SUPPORTED_DTYPES:
            op = _op_for(dtype)
            on_host = make_input(dtype, 13, rank, op)
            d = to_device(on_host)
            nc.all_reduce(on_host, op=op)
            nc.all_reduce(d, op=op)
            got[dtype_name(dtype)] = (to_host(d), on_host)
        return got

    for got in nc.launch(body, world_size, mode="thread", timeout=150):
        assert len(got) == len(SUPPORTED_DTYPES)
        for name, (device, host) in got.items():
            assert device.dtype == host.dtype, name
            np.testing.assert_array_equal(device.view(np.uint8), host.view(np.uint8), name)
            dtype = host.dtype
            expect = reduce_reference(_op_for(dtype), dtype,
                                      [make_input(dtype, 13, r, _op_for(dtype))
                                       for r in range(world_size)])
            assert_reduced(device, expect, _op_for(dtype), dtype, name)


def test_bfloat16_is_reduced_in_float32_and_rounded_once():
    """1 + 2**-8 + 2**-8: rounding to bfloat16 after each addition gives 1.0
    (each 2**-8 is half a unit in the last place: a tie, to even); adding in
    float32 and rounding once gives 1 + 2**-7 exactly."""

    def body():
        rank = nc.get_rank()
        x = to_device(np.full(5, 1.0 if rank == 0 else 2.0 ** -8, nc.bfloat16))
        nc.all_reduce(x, op=nc.ReduceOp.SUM)
        return to_host(x)

    for x in nc.launch(body, 3, mode="thread", timeout=150):
        np.testing.assert_array_equal(x.astype(np.float32), np.full(5, 1 + 2.0 ** -7))


@pytest.mark.gpu
def test_numba_refuses_bfloat16_copies_and_numcoll_does_not():
    """Why numcoll copies bfloat16 as its bits: Numba's copies go through the
    buffer protocol, which has no format for it (on a GPU; the simulator's
    copies are NumPy's and take it)."""
    values = np.arange(8).astype(nc.bfloat16)
    with pytest.raises((ValueError, TypeError), match="dtype 'E'|buffer"):
        _numba_to_device(values)
    np.testing.assert_array_equal(to_host(to_device(values)), values)


@pytest.mark.gpu
def test_torch_bfloat16_cuda_tensors_in_place():
    """Real torch bfloat16 CUDA tensors (torch exports no __cuda_array_interface__
    for them) are reduced in their own memory, as gloo would reduce them in
    float32 and round once."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA build of torch")
    world_size = 2

    def body():
        rank = nc.get_rank()
        t = torch.full((1000,), 1.0 if rank == 0 else 2.0 ** -8, dtype=torch.bfloat16,
                       device="cuda")
        ptr = t.data_ptr()
        nc.all_reduce(t)
        torch.cuda.synchronize()
        assert t.data_ptr() == ptr
        return t.float().cpu().numpy()

    for x in nc.launch(body, world_size, mode="thread", timeout=150):
        np.testing.assert_array_equal(x, np.full(1000, 1 + 2.0 ** -8, np.float32)
                                      .astype(nc.bfloat16).astype(np.float32))
