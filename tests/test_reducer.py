"""nc.Reducer: NumPy analogs of torch's ReducerTest (test_c10d_gloo.py) and of the DDP
comm-hook tests, plus averaging against NumPy at world sizes 1-4 and 7 (threads)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import numcoll as nc
from numcoll.data_parallel.reducer import GradBucket

pytestmark = pytest.mark.timeout(120)


def _grads(rank, shapes, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed + 100 * rank)
    return [rng.standard_normal(s).astype(dtype) for s in shapes]


# torch's ReducerModule: fc1 Linear(2, 10), fc2 Linear(10, 4), fc3 Linear(4, 4), no bias
REDUCER_SHAPES = [(10, 2), (4, 10), (4, 4)]


def _mixed_precision_grads():
    g = [np.zeros(s, np.float32) for s in REDUCER_SHAPES]
    g[0] = g[0].astype(np.float64)        # model.fc1.double()
    return g


def _dtype_buckets(grads):
    return [list(idx) for _, idx in itertools.groupby(range(len(grads)),
                                                      key=lambda i: grads[i].dtype)]


def run1(fn):
    return nc.launch(fn, 1, mode="thread")[0]


# -- ReducerTest ----------------------------------------------------------------------------
def test_single_dtype_single_bucket():
    def body():
        grads = [np.zeros(s, np.float32) for s in REDUCER_SHAPES]
        r = nc.Reducer(grads, bucket_indices=[list(range(len(grads)))])
        assert r.bucket_indices == [[0, 1, 2]]
    run1(body)


def test_multi_dtype_single_bucket():
    def body():
        grads = _mixed_precision_grads()
        with pytest.raises(TypeError, match=r"bucket 0 mixes dtypes \(0: float64, 1: float32"):
            nc.Reducer(grads, bucket_indices=[list(range(len(grads)))])
    run1(body)


def test_multi_dtype_multi_bucket():
    def body():
        grads = _mixed_precision_grads()
        r = nc.Reducer(grads, bucket_indices=_dtype_buckets(grads))
        assert r.bucket_indices == [[0], [1, 2]]
    run1(body)


@pytest.mark.parametrize("find_unused", [False, True])
def test_forward_backward_optimizer(find_unused):
    """test_forward_backward / _unused_parameters / _optimizer at world size 1: grads are
    unchanged by averaging over one rank, an SGD step uses them, repeatedly."""
    def body():
        grads = _mixed_precision_grads()
        params = [np.ones_like(g) for g in grads]
        r = nc.Reducer(grads, bucket_indices=_dtype_buckets(grads),
                       find_unused_parameters=find_unused)
        rng = np.random.default_rng(0)
        for _ in range(3):
            want = []
            for i in reversed(range(3)):
                if find_unused and i == 2:
                    continue                      # fc3 unused, as in the torch test
                r.grads[i][...] = rng.standard_normal(r.grads[i].shape)
                r.mark_ready(i)
            want = [g.copy() for g in r.grads]
            r.finalize()
            for g, w in zip(r.grads, want):
                np.testing.assert_array_equal(g, w)
            for p, g in zip(params, r.grads):
                p -= 0.1 * g
    run1(body)


# -- averaging against NumPy --------------------------------------------------------------------
SHAPES = [(3, 5), (7,), (2, 2, 2), (1,), (33,)]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("view", [False, True])
def test_average_matches_numpy(world_size, view):
    def body():
        rank = nc.get_rank()
        grads = [np.zeros(s, np.float32) for s in SHAPES]
        # tiny buckets: 64 bytes, so there are several
        r = nc.Reducer(grads, bucket_cap_mb=64 / 2**20, first_bucket_mb=32 / 2**20,
                       gradient_as_bucket_view=view)
        out = []
        for step in range(3):
            values = _grads(rank, SHAPES, seed=step)
            order = np.random.default_rng(rank + 10 * step).permutation(len(SHAPES))
            for i in order:
                r.grads[i][...] = values[i]
                r.mark_ready(int(i))
            r.finalize()
            out.append([g.copy() for g in r.grads])
            if view:
                buffers = [b.buffer for b in r._buckets]
                assert all(any(np.shares_memory(g, b) for b in buffers) for g in r.grads)
        return out

    results = nc.launch(body, world_size, mode="thread")
    for step in range(3):
        want = [np.mean([_grads(rank, SHAPES, seed=step)[i] for rank in range(world_size)],
                        axis=0) for i in range(len(SHAPES))]
        for rank in range(world_size):
            for got, w in zip(results[rank][step], want):
                np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)
            assert all(a.tobytes() == b.tobytes()
                       for a, b in zip(results[rank][step], results[0][step]))


def test_buckets_reverse_order_first_bucket_capped():
    def body():
        grads = [np.zeros(n, np.float32) for n in (100, 100, 100, 100, 100)]  # 400 B each
        r = nc.Reducer(grads, bucket_cap_mb=1000 / 2**20, first_bucket_mb=400 / 2**20)
        return r.bucket_indices
    assert run1(body) == [[4], [3, 2, 1], [0]]


def test_gradient_as_bucket_view_grads_are_views_and_survive_rebuild():
    def body():
        rank = nc.get_rank()
        grads = [np.zeros(n, np.float32) for n in (3, 4, 5)]
        r = nc.Reducer(grads, gradient_as_bucket_view=True, bucket_cap_mb=16 / 2**20,
                       first_bucket_mb=16 / 2**20)
        buffers = [b.buffer for b in r._buckets]
        assert all(any(np.shares_memory(g, b) for b in buffers) for g in r.grads)
        assert not any(np.shares_memory(g, a) for g in r.grads for a in grads)
        for i in (0, 1, 2):                   # forward order: the rebuild follows it
            r.grads[i][...] = rank + i
            r.mark_ready(i)
        r.finalize()
        assert r.bucket_indices == [[0, 1], [2]]    # 12 + 16 bytes reach 16, then 20
        buffers = [b.buffer for b in r._buckets]
        assert all(any(np.shares_memory(g, b) for b in buffers) for g in r.grads)
        return [g.tolist() for g in r.grads]

    res = nc.launch(body, 2, mode="thread")
    assert res[0] == res[1] == [[0.5] * 3, [1.5] * 4, [2.5] * 5]


def test_rebuild_follows_rank0_ready_order_on_every_rank():
    def body():
        rank = nc.get_rank()
        grads = [np.zeros(10, np.float32) for _ in range(6)]     # 40 B each
        r = nc.Reducer(grads, bucket_cap_mb=80 / 2**20, first_bucket_mb=40 / 2**20)
        initial = r.bucket_indices
        order = [2, 0, 5, 1, 4, 3] if rank == 0 else [5, 4, 3, 2, 1, 0]
        for i in order:
            r.mark_ready(i)
        r.finalize()
        rebuilt = r.bucket_indices
        for i in order:                       # the rebuilt buckets work
            r.grads[i][...] = rank
            r.mark_ready(i)
        r.finalize()
        return initial, rebuilt, r.grads[0].tolist()

    res = nc.launch(body, 3, mode="thread")
    for initial, rebuilt, g in res:
        assert initial == [[5], [4, 3], [2, 1], [0]]
        assert rebuilt == [[2], [0, 5], [1, 4], [3]]
        assert g == [1.0] * 10


def test_buckets_launch_strictly_in_index_order_as_soon_as_possible():
    def body():
        grads = [np.zeros(10, np.float32) for _ in range(4)]
        r = nc.Reducer(grads, bucket_indices=[[3], [2], [1], [0]])
        launched = []

        def hook(state, bucket):
            launched.append(bucket.index())
            return nc.hooks.allreduce_hook(state, bucket)

        r.register_comm_hook(None, hook)
        r.mark_ready(1)               # bucket 2 full, but bucket 0 is not: nothing yet
        r.mark_ready(2)
        assert launched == []
        r.mark_ready(3)               # bucket 0 full: buckets 0, 1, 2 go, in order
        assert launched == [0, 1, 2]
        r.mark_ready(0)
        assert launched == [0, 1, 2, 3]
        r.finalize()
        assert r.stats["buckets"] == 4 and 0 <= r.stats["overlap_fraction"] <= 1
    nc.launch(body, 2, mode="thread")


def test_no_sync_accumulates_and_syncs_next_step():
    def body():
        rank = nc.get_rank()
        grads = [np.zeros(4, np.float32), np.zeros(3, np.float32)]
        r = nc.Reducer(grads)
        with r.no_sync():
            for i in (1, 0):
                r.grads[i] += rank + 1.0
                r.mark_ready(i)
            r.finalize()
            assert r.grads[0].tolist() == [rank + 1.0] * 4        # no communication
        for i in (1, 0):
            r.grads[i] += 10.0 * (rank + 1)
            r.mark_ready(i)
        r.finalize()
        return r.grads[0].tolist(), r.grads[1].tolist()

    res = nc.launch(body, 2, mode="thread")
    # rank 0 has 11, rank 1 has 22: the average is 16.5
    assert res[0] == res[1] == ([16.5] * 4, [16.5] * 3)


def test_find_unused_parameters():
    def body():
        rank = nc.get_rank()
        grads = [np.full(3, 7.0, np.float32) for _ in range(4)]
        r = nc.Reducer(grads, find_unused_parameters=True, bucket_cap_mb=12 / 2**20,
                       first_bucket_mb=12 / 2**20)
        for i in (3, 2, 0):
            if i == 2 and rank == 0:
                continue                      # unused on rank 0 only: counts as zero there
            r.grads[i][...] = rank + 1.0
            r.mark_ready(i)
        # gradient 1 is unused on every rank: left as it was
        r.finalize()
        return [g.tolist() for g in r.grads]

    res = nc.launch(body, 2, mode="thread")
    assert res[0] == res[1] == [[1.5] * 3, [7.0] * 3, [1.0] * 3, [1.5] * 3]


def test_double_mark_and_unmarked_errors_name_the_index():
    def body():
        rank = nc.get_rank()
        grads = [np.zeros(2, np.float32) for _ in range(3)]
        r = nc.Reducer(grads)
        r.mark_ready(2)
        with pytest.raises(RuntimeError, match=r"Expected to mark a variable ready only once\."
                                               r" Parameter at index 2 "):
            r.mark_ready(2)
        with pytest.raises(IndexError, match="index 3 out of range for 3 gradients"):
            r.mark_ready(3)
        r.mark_ready(1)
        if rank == 0:
            r.mark_ready(0)
            r.finalize()                      # completes: rank 1 still launches its bucket
        else:
            with pytest.raises(RuntimeError, match=r"gradient\(s\) at index \[0\] were not "
                                                   "marked ready in this step"):
                r.finalize()
        # the next step works on both ranks
        for i in (2, 1, 0):
            r.grads[i][...] = rank
            r.mark_ready(i)
        r.finalize()
        return r.grads[0].tolist()

    assert nc.launch(body, 2, mode="thread") == [[0.5, 0.5]] * 2


def test_bad_arguments():
    def body():
        with pytest.raises(ValueError, match="requires non-empty tensor list"):
            nc.Reducer([])
        with pytest.raises(TypeError, match="gradient 0 has dtype int64"):
            nc.Reducer([np.zeros(3, np.int64)])
        with pytest.raises(ValueError, match="gradient 0 must be C-contiguous"):
            nc.Reducer([np.zeros((3, 3), np.float32)[:, 0]])
        with pytest.raises(ValueError, match="name every gradient exactly once"):
            nc.Reducer([np.zeros(3, np.float32)] * 2, bucket_indices=[[0]])
        with pytest.raises(ValueError, match="bucket_cap_mb must be positive"):
            nc.Reducer([np.zeros(3, np.float32)], bucket_cap_mb=0)
    run1(body)


# -- comm hooks (DDP tests of test_c10d_gloo.py / distributed_test.py) ---------------------------
def _simple_hook(state: object, bucket: GradBucket) -> nc.Future:
    fut = nc.Future()
    fut.set_result(np.ones_like(bucket.buffer()))

    def fut_then(fut):
        # Add ones to fut's result.
        t = fut.value()
        return t + t

    return fut.then(fut_then)


def test_ddp_comm_hook_future_passing_cpu():
    def body():
        grads = [np.zeros((2, 2), np.float32), np.zeros(3, np.float32)]
        r = nc.Reducer(grads)
        r.register_comm_hook(None, _simple_hook)
        for i in (1, 0):
            r.grads[i][...] = 0.25
            r.mark_ready(i)
        r.finalize()
        # without the hook the result would be 0.25
        return [g.tolist() for g in r.grads]

    for res in nc.launch(body, 2, mode="thread"):
        assert res == [[[2.0, 2.0], [2.0, 2.0]], [2.0] * 3]


def test_ddp_invalid_comm_hook_init_and_register_just_once():
    def body():
        r = nc.Reducer([np.zeros(3, np.float32)])
        with pytest.raises(TypeError, match="Communication hook must be callable."):
            r.register_comm_hook(state=None, hook=1)

        def bad_bucket(state: object, bucket: int) -> nc.Future:
            return nc.Future()

        with pytest.raises(ValueError, match="bucket annotation should be nc.GradBucket."):
            r.register_comm_hook(state=None, hook=bad_bucket)

        def bad_return(state: object, bucket: GradBucket) -> int:
            return 1

        with pytest.raises(ValueError, match="return annotation should be nc.Future"):
            r.register_comm_hook(state=None, hook=bad_return)

        def dummy_hook(state, bucket):
            fut = nc.Future()
            fut.set_result([bucket.buffer()])
            return fut

        r.register_comm_hook(None, dummy_hook)
        with pytest.raises(RuntimeError, match="register_comm_hook or register_builtin_comm_hook "
                                               "can only be called once."):
            r.register_comm_hook(None, dummy_hook)
    run1(body)


def test_ddp_invalid_comm_hook_return_type():
    def body():
        r = nc.Reducer([np.zeros(3, np.float32)])

        def comm_hook(state, bucket):
            return 1

        r.register_comm_hook(None, comm_hook)
        with pytest.raises(RuntimeError, match="callback must return a numcoll.Future object, "
                                               "but got int"):
            r.mark_ready(0)
    run1(body)


@pytest.mark.parametrize("hook, rtol", [(nc.hooks.allreduce_hook, 1e-6),
                                        (nc.hooks.fp16_compress_hook, 2e-3),
                                        (nc.hooks.bf16_compress_hook, 2e-2)])
def test_builtin_hooks_average(hook, rtol):
    shapes = [(5, 3), (8,)]

    def body():
        rank = nc.get_rank()
        r = nc.Reducer([np.zeros(s, np.float32) for s in shapes])
        r.register_comm_hook(None, hook)
        values = _grads(rank, shapes)
        for i in (1, 0):
            r.grads[i][...] = values[i]
            r.mark_ready(i)
        r.finalize()
        return r.grads

    res = nc.launch(body, 3, mode="thread")
    for i in range(len(shapes)):
        want = np.mean([_grads(rank, shapes)[i] for rank in range(3)], axis=0)
        for rank in range(3):
            assert res[rank][i].dtype == np.float32
            np.testing.assert_allclose(res[rank][i], want, rtol=rtol, atol=rtol)


def test_grad_bucket_api():
    def body():
        seen = {}

        def hook(state, bucket):
            seen["index"], seen["last"] = bucket.index(), bucket.is_last()
            seen["shapes"] = [g.shape for g in bucket.gradients()]
            assert bucket.buffer().tolist() == [1, 1, 1, 1, 2, 2, 2]   # not averaged
            bucket.set_buffer(np.arange(7, dtype=np.float64))
            with pytest.raises(ValueError, match="holds 7 elements, got 2"):
                bucket.set_buffer(np.zeros(2))
            fut = nc.Future()
            fut.set_result(bucket.buffer())
            return fut

        r = nc.Reducer([np.zeros((2, 2), np.float32), np.zeros(3, np.float32)],
                       bucket_indices=[[0, 1]])
        r.register_comm_hook(None, hook)
        r.grads[0][...] = 1
        r.grads[1][...] = 2
        r.mark_ready(0)
        r.mark_ready(1)
        r.finalize()
        assert seen == {"index": 0, "last": True, "shapes": [(2, 2), (3,)]}
        return r.grads[1].tolist()

    assert nc.launch(body, 2, mode="thread") == [[4.0, 5.0, 6.0]] * 2
