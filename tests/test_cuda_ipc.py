"""The ``ipc`` device allreduce: kernels reduce straight from the peers' device memory.

Under Numba's CUDA simulator (no IPC there) it runs between ranks that are
threads of one process, which address each other's memory directly: the
schedule, the chunking and the ordering are tested here. Between processes it
needs CUDA IPC, so those tests are marked ``gpu``.
"""


from cuda_env import SIMULATED  # noqa: E402,F401 - first: chooses the simulator

import numpy as np  # noqa: E402
import pytest  # noqa: E402

pytestmark = pytest.mark.timeout(180)


import numcoll as nc  # noqa: E402
import numcoll.cuda  # noqa: E402
from reference import OPS, assert_reduced, make_input, reduce_reference, valid  # noqa: E402

to_device, to_host = numcoll.cuda.to_device, numcoll.cuda.to_host
DTYPES = [np.float32, nc.bfloat16, np.int64, np.bool_, np.complex128]


@pytest.fixture(autouse=True)
def tiny(monkeypatch):
    monkeypatch.setenv("NUMCOLL_CUDA_THREADS", "4")
    monkeypatch.setenv("NUMCOLL_CUDA_BLOCKS", "2")


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_thread_ranks_choose_ipc_and_match_the_reference(world_size):
    """Every op and dtype, counts below and above the number of ranks (empty chunks)."""

    def body():
        rank = nc.get_rank()
        seen = set()
        for dtype in DTYPES:
            for op in OPS:
                if not valid(op, dtype):
                    continue
                for count in (0, 1, 2, 13):
                    x = to_device(make_input(dtype, count, rank, op))
                    work = nc.all_reduce(x, op=op, async_op=True)
                    work.wait()
                    seen.add(work.call.algorithm)
                    expect = reduce_reference(op, dtype, [make_input(dtype, count, r, op)
                                                          for r in range(world_size)])
                    assert_reduced(to_host(x), expect, op, dtype, f"{dtype} {op} {count}")
        return seen

    assert nc.launch(body, world_size, mode="thread", timeout=150) == [{"ipc"}] * world_size


def test_several_arrays_non_contiguous_and_native_half_wire(monkeypatch):
    monkeypatch.setenv("NUMCOLL_HALF_WIRE", "native")
    world_size, op = 3, nc.ReduceOp.SUM

    def body():
        pg, rank = nc.get_default_group(), nc.get_rank()
        xs = [to_device(make_input(nc.bfloat16, 10, rank, op, salt=k)) for k in range(2)]
        assert pg.allreduce(xs).wait()
        whole = to_device(make_input(np.float32, 24, rank, op).reshape(4, 6))
        strided = whole[:, ::2]
        work = pg.allreduce(strided)
        work.wait()
        return [to_host(x) for x in xs], to_host(whole), work.call.algorithm

    for rank, (xs, whole, algorithm) in enumerate(nc.launch(body, world_size, mode="thread",
                                                            timeout=150)):
        assert algorithm == "ipc"
        expect = reduce_reference(op, nc.bfloat16, [make_input(nc.bfloat16, 10, r, op, salt=k)
                                                   for r in range(world_size) for k in range(2)])
        for x in xs:
            assert_reduced(x, expect, op, nc.bfloat16, "bfloat16, native wire")
        inputs = [make_input(np.float32, 24, r, op).reshape(4, 6) for r in range(world_size)]
        want = inputs[rank].copy()
        want[:, ::2] = reduce_reference(op, np.float32, [a[:, ::2] for a in inputs])
        np.testing.assert_array_equal(whole, want)


def test_refused_and_switched_off(monkeypatch):
    def body():
        pg = nc.get_default_group()
        with pytest.raises(ValueError, match="'ipc' needs device arrays"):
            pg.allreduce(np.ones(4, np.float32), nc.AllreduceOptions(algorithm="ipc"))
        x = to_device(np.ones(4, np.float32))
        work = pg.allreduce(x)
        work.wait()
        return work.call.algorithm, float(to_host(x)[0])

    monkeypatch.setenv("NUMCOLL_CUDA_IPC", "off")
    got = nc.launch(body, 2, mode="thread", timeout=150)
    assert got == [("recursive_doubling", 2.0)] * 2
    monkeypatch.setenv("NUMCOLL_CUDA_IPC", "sometimes")
    with pytest.raises(ValueError, match="cuda_ipc .NUMCOLL_CUDA_IPC. must be 'auto' or 'off'"):
        nc.config.current()


def _process_body():
    import numpy as np

    import numcoll as nc
    import numcoll.cuda

    rank = nc.get_rank()
    x = numcoll.cuda.to_device(np.full(1000, rank + 1.0, np.float32))
    work = nc.all_reduce(x, async_op=True)
    work.wait()
    refused = None
    try:
        nc.get_default_group().allreduce(x, nc.AllreduceOptions(algorithm="ipc")).wait()
    except ValueError as exc:
        refused = str(exc)
    return work.call.algorithm, float(numcoll.cuda.to_host(x)[999]), refused


@pytest.mark.slow
@pytest.mark.skipif(not SIMULATED, reason="on a GPU, process ranks do use IPC: see below")
def test_process_ranks_under_the_simulator_stage_instead():
    """Processes cannot address each other's memory without CUDA IPC, which the
    simulator lacks: the automatic choice stages, and forcing ``ipc`` says why."""
    got = nc.launch(_process_body, 2, mode="process", transport="tcp", timeout=150)
    for algorithm, value, refused in got:
        assert algorithm == "recursive_doubling" and value == 3.0
        assert "the CUDA simulator has no IPC" in refused


def _ipc_body(count):
    import numpy as np

    import numcoll as nc
    import numcoll.cuda
    from numcoll.cuda import ipc

    rank = nc.get_rank()
    out = {}
    for dtype in (np.float32, nc.bfloat16):
        x = numcoll.cuda.to_device(np.full(count, rank + 1.0, dtype))
        for _ in range(3):                  # the peers' allocations are opened once
            work = nc.all_reduce(x, async_op=True)
            work.wait()
        out[np.dtype(dtype).name] = (work.call.algorithm,
                                     numcoll.cuda.to_host(x).astype(np.float32))
    return out, len(ipc.PEERS._opened)


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [2, 3])
def test_process_ranks_on_a_gpu_use_cuda_ipc(world_size):
    """Ranks as processes on one GPU (or peer GPUs): ``ipc`` is chosen, and
    the result is every rank's sum (x 27: three calls of 1 + 2 (+ 3))."""
    count = 4 << 20
    got = nc.launch(_ipc_body, world_size, mode="process", args=(count,), timeout=150)
    total = sum(range(1, world_size + 1)) * world_size ** 2
    for out, opened in got:
        for name, (algorithm, values) in out.items():
            assert algorithm == "ipc", name
            np.testing.assert_array_equal(values, np.full(count, total, np.float32), name)
        assert opened >= world_size - 1


def test_a_peer_that_cannot_be_reached_sends_every_rank_to_the_staged_ring(monkeypatch):
    """If some rank cannot open some peer's memory, the ranks agree and all
    stage through host memory instead: the result is the same."""
    from numcoll.cuda import ipc

    real_view = ipc.PEERS.view

    def view(data, dtype, op, peer):
        if peer == 0:
            raise nc.NumcollError(f"{op}: rank 0's device memory cannot be opened here: test")
        return real_view(data, dtype, op, peer)

    monkeypatch.setattr(ipc.PEERS, "view", view)

    def body():
        rank = nc.get_rank()
        x = to_device(make_input(np.float32, 11, rank, nc.ReduceOp.SUM))
        work = nc.all_reduce(x, async_op=True)
        work.wait()
        return work.call.algorithm, to_host(x)

    expect = reduce_reference(nc.ReduceOp.SUM, np.float32,
                              [make_input(np.float32, 11, r, nc.ReduceOp.SUM) for r in range(3)])
    for algorithm, x in nc.launch(body, 3, mode="thread", timeout=150):
        assert algorithm == "ipc"
        assert_reduced(x, expect, nc.ReduceOp.SUM, np.float32, "fallback")


@pytest.mark.parametrize("world_size", [2, 3])
def test_broadcast_from_every_root_reads_the_root_directly(world_size):
    def body():
        pg, rank = nc.get_default_group(), nc.get_rank()
        got = []
        for root in range(world_size):
            for dtype in (np.float32, nc.bfloat16, np.complex128):
                x = to_device(make_input(dtype, 13, rank, None))
                work = pg.broadcast(x, nc.BroadcastOptions(root_rank=root))
                work.wait()
                np.testing.assert_array_equal(to_host(x), make_input(dtype, 13, root, None))
                got.append(work.call.algorithm)
        return set(got)

    assert nc.launch(body, world_size, mode="thread", timeout=150) == [{"ipc"}] * world_size


@pytest.mark.parametrize("world_size", [2, 3])
def test_allgather_and_reduce_scatter_read_the_peers_directly(world_size):
    op = nc.ReduceOp.SUM

    def body():
        pg, rank = nc.get_default_group(), nc.get_rank()
        algorithms = set()
        for dtype in (np.float32, nc.bfloat16, np.int32):
            mine = make_input(dtype, 5, rank, None)
            out = to_device(np.zeros(5 * world_size, dtype))
            work = pg.allgather_into_tensor(out, to_device(mine))
            work.wait()
            algorithms.add(work.call.algorithm)
            np.testing.assert_array_equal(
                to_host(out), np.concatenate([make_input(dtype, 5, r, None)
                                              for r in range(world_size)]))
            whole = make_input(dtype, 4 * world_size, rank, op)
            part = to_device(np.zeros(4, dtype))
            work = pg.reduce_scatter_tensor(part, to_device(whole))
            work.wait()
            algorithms.add(work.call.algorithm)
            expect = reduce_reference(op, dtype, [make_input(dtype, 4 * world_size, r, op)
                                                  for r in range(world_size)])
            assert_reduced(to_host(part), expect[4 * rank:4 * rank + 4], op, dtype,
                           f"reduce_scatter {dtype}")
        return algorithms

    assert nc.launch(body, world_size, mode="thread", timeout=150) == [{"ipc"}] * world_size
