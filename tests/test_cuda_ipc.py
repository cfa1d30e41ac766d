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
        ran = nc.flight_recorder.dump(rank)["entries"][-1]["algorithm"]
        return work.call.algorithm, ran, to_host(x)

    expect = reduce_reference(nc.ReduceOp.SUM, np.float32,
                              [make_input(np.float32, 11, r, nc.ReduceOp.SUM) for r in range(3)])
    for algorithm, ran, x in nc.launch(body, 3, mode="thread", timeout=150):
        assert algorithm == "ipc"
        # what ran, in the flight recorder (and the device bench's column)
        assert ran == "ring (staged: ipc unavailable)"
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


# -- reduce, gather, scatter, alltoall over the peers' device memory -------------------
def _rooted_and_exchange(world_size, dtype, root):
    """One of each of reduce, gather, scatter, alltoall and alltoall_base (uneven
    splits) on device arrays; their results on the host and the algorithms chosen."""
    pg, rank = nc.get_default_group(), nc.get_rank()
    op, got, algorithms = nc.ReduceOp.SUM, {}, set()

    def wait(work):
        work.wait()
        algorithms.add(work.call.algorithm)

    x = to_device(make_input(dtype, 7, rank, op))
    wait(pg.reduce(x, nc.ReduceOptions(reduce_op=op, root_rank=root)))
    got["reduce"] = to_host(x)
    mine = to_device(make_input(dtype, 3, rank, None, salt=1))
    outs = [to_device(np.zeros(3, dtype)) for _ in range(world_size)] if rank == root else []
    wait(pg.gather([outs] if outs else [], [mine], nc.GatherOptions(root_rank=root)))
    got["gather"] = [to_host(o) for o in outs]
    ins = [to_device(make_input(dtype, 3, q, None, salt=2)) for q in range(world_size)]
    out = to_device(np.zeros(3, dtype))
    wait(pg.scatter([out], [ins] if rank == root else [], nc.ScatterOptions(root_rank=root)))
    got["scatter"] = to_host(out)
    ins = [to_device(make_input(dtype, 2, rank * world_size + q, None)) for q in range(world_size)]
    outs = [to_device(np.zeros(2, dtype)) for _ in range(world_size)]
    wait(pg.alltoall(outs, ins))
    got["alltoall"] = [to_host(o) for o in outs]
    # alltoall_base: rank r sends rank q (r + q) % 3 rows of 2 (some none)
    send_rows = [(rank + q) % 3 for q in range(world_size)]
    recv_rows = [(q + rank) % 3 for q in range(world_size)]
    inp = to_device(make_input(dtype, 2 * sum(send_rows), rank, None, salt=3).reshape(-1, 2))
    out = to_device(np.zeros((sum(recv_rows), 2), dtype))
    wait(pg.alltoall_base(out, inp, recv_rows, send_rows))
    got["alltoall_base"] = to_host(out)
    return got, algorithms


def _expected(world_size, dtype, root, rank):
    op = nc.ReduceOp.SUM
    want = {"gather": [make_input(dtype, 3, q, None, salt=1) for q in range(world_size)]
            if rank == root else [],
            "scatter": make_input(dtype, 3, rank, None, salt=2),
            "alltoall": [make_input(dtype, 2, q * world_size + rank, None)
                         for q in range(world_size)]}
    reduced = reduce_reference(op, dtype, [make_input(dtype, 7, r, op) for r in range(world_size)])
    want["reduce"] = reduced if rank == root else make_input(dtype, 7, rank, op)
    blocks = []
    for q in range(world_size):
        rows = [(q + p) % 3 for p in range(world_size)]
        start = 2 * sum(rows[:rank])
        sent = make_input(dtype, 2 * sum(rows), q, None, salt=3)
        blocks.append(sent[start:start + 2 * rows[rank]])
    want["alltoall_base"] = np.concatenate(blocks).reshape(-1, 2)
    return want


@pytest.mark.parametrize("world_size", [2, 3])
def test_reduce_gather_scatter_alltoall_read_the_peers_directly(world_size):
    """Thread ranks address each other's device memory: each of these
    collectives takes ``ipc`` (the flight recorder and ``work.call`` say so) and
    matches NumPy, from every root, for a float, bfloat16 and an integer dtype."""

    def body():
        rank, out = nc.get_rank(), []
        # the recorder is the process's: leave out what earlier tests recorded
        before = {e["record_id"] for e in nc.flight_recorder.dump(rank)["entries"]}
        for root in range(world_size):
            for dtype in (np.float32, nc.bfloat16, np.int64):
                got, algorithms = _rooted_and_exchange(world_size, dtype, root)
                out.append((root, dtype, got, algorithms))
        names = ("numcoll:reduce", "numcoll:gather", "numcoll:scatter", "numcoll:all_to_all",
                 "numcoll:all_to_all_single")
        recorded = {e["algorithm"] for e in nc.flight_recorder.dump(rank)["entries"]
                    if e["record_id"] not in before and e["profiling_name"] in names}
        return out, recorded

    for rank, (results, recorded) in enumerate(nc.launch(body, world_size, mode="thread",
                                                          timeout=150)):
        assert recorded == ({"ipc"} if nc.flight_recorder.enabled() else set())
        for root, dtype, got, algorithms in results:
            assert algorithms == {"ipc"}, (root, dtype)
            want = _expected(world_size, dtype, root, rank)
            for name in want:
                np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]),
                                              f"{name} root {root} {dtype} rank {rank}")


def test_switched_off_the_same_collectives_stage_and_agree(monkeypatch):
    """NUMCOLL_CUDA_IPC=off: the host algorithms, staged, give the same results;
    forcing ``ipc`` on host arrays is refused at the call."""
    monkeypatch.setenv("NUMCOLL_CUDA_IPC", "off")
    world_size, dtype = 3, np.float32

    def body():
        pg = nc.get_default_group()
        for name, call in (("reduce", lambda: pg.reduce(np.ones(4, np.float32),
                                                        nc.ReduceOptions(algorithm="ipc"))),
                           ("alltoall", lambda: pg.alltoall_base(
                               np.zeros(3, np.float32), np.ones(3, np.float32),
                               opts=nc.AllToAllOptions(algorithm="ipc")))):
            with pytest.raises(ValueError, match="'ipc' needs device arrays"):
                call()
        return _rooted_and_exchange(world_size, dtype, 1)

    for rank, (got, algorithms) in enumerate(nc.launch(body, world_size, mode="thread",
                                                       timeout=150)):
        assert "ipc" not in algorithms and algorithms
        want = _expected(world_size, dtype, 1, rank)
        for name in want:
            np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]), name)


def _moves_body(count):
    import numpy as np

    import numcoll as nc
    import numcoll.cuda

    pg, rank, size = nc.get_default_group(), nc.get_rank(), nc.get_world_size()
    x = numcoll.cuda.to_device(np.full(count, rank + 1.0, np.float32))
    algorithms = []
    work = pg.reduce(x, nc.ReduceOptions(root_rank=0))
    work.wait()
    algorithms.append(work.call.algorithm)
    inp = numcoll.cuda.to_device(np.repeat(np.arange(size, dtype=np.float32) + 10 * rank,
                                           count // size))
    out = numcoll.cuda.to_device(np.zeros(count // size * size, np.float32))
    work = pg.alltoall_base(out, inp)
    work.wait()
    algorithms.append(work.call.algorithm)
    root = size - 1
    mine = numcoll.cuda.to_device(np.full(count, 100.0 + rank, np.float32))
    slots = [numcoll.cuda.to_device(np.zeros(count, np.float32)) for _ in range(size)]
    work = pg.gather([slots] if rank == root else [], [mine], nc.GatherOptions(root_rank=root))
    work.wait()
    algorithms.append(work.call.algorithm)
    part = numcoll.cuda.to_device(np.zeros(count, np.float32))
    parts = [numcoll.cuda.to_device(np.full(count, 200.0 + q, np.float32)) for q in range(size)]
    work = pg.scatter([part], [parts] if rank == root else [], nc.ScatterOptions(root_rank=root))
    work.wait()
    algorithms.append(work.call.algorithm)
    gathered = [float(numcoll.cuda.to_host(s)[-1]) for s in slots] if rank == root else []
    return (algorithms, float(numcoll.cuda.to_host(x)[-1]), numcoll.cuda.to_host(out),
            gathered, float(numcoll.cuda.to_host(part)[-1]))


@pytest.mark.gpu
@pytest.mark.parametrize("size", [2, 3])
def test_process_ranks_on_a_gpu_reduce_gather_scatter_alltoall_through_cuda_ipc(size):
    """Ranks as processes on one GPU: reduce, alltoall_base, gather and scatter
    take ``ipc`` (CUDA IPC handles, opened once per allocation) and are right
    at 4 Mi elements."""
    count = 4 << 20 if size == 2 else 3 << 20
    got = nc.launch(_moves_body, size, mode="process", args=(count,), timeout=150)
    for rank, (algorithms, last, out, gathered, part) in enumerate(got):
        assert algorithms == ["ipc"] * 4
        if rank == 0:
            assert last == sum(range(1, size + 1))
        want = np.repeat(np.arange(size, dtype=np.float32) * 10 + rank, count // size)
        np.testing.assert_array_equal(out, want)
        if rank == size - 1:
            assert gathered == [100.0 + q for q in range(size)]
        assert part == 200.0 + rank


def test_persistent_and_coalesced_forms_read_the_peers_too():
    """A persistent request made once on device arrays, started twice, and the
    coalesced forms: the same ``ipc`` algorithms (their builders are the ordinary ones)."""
    world_size = 3

    def body():
        rank, out = nc.get_rank(), {}
        x = to_device(np.full(5, rank + 1.0, np.float32))
        req = nc.reduce_init(x, dst=1)
        for _ in range(2):
            work = req.start()
            work.wait()
        out["reduce_init"] = (work.call.algorithm, to_host(x)[0])
        o = to_device(np.zeros(world_size * 2, np.float32))
        i = to_device(np.full(world_size * 2, float(rank), np.float32))
        req = nc.all_to_all_single_init(o, i)
        work = req.start()
        work.wait()
        out["all_to_all_single_init"] = (work.call.algorithm, to_host(o).tolist())
        ys = [to_device(np.full(n, rank + 1, np.int32)) for n in (3, 4)]
        work = nc.get_default_group().allreduce_coalesced(ys)
        work.wait()
        out["allreduce_coalesced"] = (work.call.algorithm, [int(to_host(y)[-1]) for y in ys])
        return out

    total = sum(range(1, world_size + 1))
    for rank, out in enumerate(nc.launch(body, world_size, mode="thread", timeout=150)):
        assert {a for a, _ in out.values()} == {"ipc"}, out
        # rank 1's x is reduced twice over: the second start adds the others again
        assert out["reduce_init"][1] == (total + total - 2 if rank == 1 else rank + 1.0)
        assert out["all_to_all_single_init"][1] == [float(q) for q in range(world_size)
                                                    for _ in range(2)]
        assert out["allreduce_coalesced"][1] == [total, total]
