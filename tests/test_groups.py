"""Groups, rank translation, object collectives, batched p2p and the module
layer's argument checks (issue 9's argument holes), with ranks as threads."""

import warnings
from datetime import timedelta

import numpy as np
import pytest

import numcoll as nc

pytestmark = pytest.mark.timeout(120)


def _run(fn, n=4):
    return nc.launch(fn, n, mode="thread", timeout=60)


def test_object_collectives():
    class Point:            # defined here: travels with cloudpickle
        def __init__(self, x):
            self.x = x

    def body():
        r, n = nc.get_rank(), nc.get_world_size()
        objs = [None] * n
        nc.all_gather_object(objs, {"rank": r, "p": Point(r), "f": lambda: r * 2})
        assert [o["rank"] for o in objs] == list(range(n))
        assert [o["p"].x for o in objs] == list(range(n)) and objs[3]["f"]() == 6
        lst = [None, None] if r else [("a", 0), np.arange(3)]
        nc.broadcast_object_list(lst, src=0)
        assert lst[0] == ("a", 0) and lst[1].tolist() == [0, 1, 2]
        gathered = [None] * n if r == 1 else None
        nc.gather_object("x" * (r * 100), gathered, dst=1)   # different sizes
        if r == 1:
            assert [len(g) for g in gathered] == [0, 100, 200, 300]
        out = [None]
        nc.scatter_object_list(out, [f"s{i}" for i in range(n)] if r == 2 else None, src=2)
        assert out == [f"s{r}"]
        if r == 0:
            nc.send_object_list([1, "two"], dst=3)
        if r == 3:
            got = [None, None]
            assert nc.recv_object_list(got) == 0 and got == [1, "two"]
        if r != 0:   # refused before anything is sent, so rank 0 need not take part
            with pytest.raises(ValueError, match="must NOT be specified on non-destination"):
                nc.gather_object(1, [None] * n, dst=0)
        nc.barrier()
        return True

    assert _run(body) == [True] * 4


def test_groups_and_rank_translation():
    def body():
        r = nc.get_rank()
        assert nc.get_backend() == "gloo" and nc.is_available()
        assert nc.GroupMember.WORLD is nc.get_default_group() is nc.group.WORLD
        assert nc.get_process_group_ranks(nc.group.WORLD) == [0, 1, 2, 3]
        sub, subs = nc.new_subgroups(2)
        # torch's shape: one entry per subgroup, the others NON_GROUP_MEMBER here.
        assert len(subs) == 2 and subs[r // 2] is sub
        assert subs[1 - r // 2] is nc.GroupMember.NON_GROUP_MEMBER
        assert nc.get_process_group_ranks(sub) == [r - r % 2, r - r % 2 + 1]
        assert nc.get_group_rank(sub, r) == r % 2
        assert nc.get_global_rank(sub, r % 2) == r
        with pytest.raises(ValueError, match="is not part of group"):
            nc.get_group_rank(sub, (r + 2) % 4)
        x = np.array([r])
        nc.all_reduce(x, group=sub)
        assert x[0] == 2 * (r - r % 2) + 1
        backwards = nc.new_group([3, 1], sort_ranks=False)
        if r in (1, 3):
            assert nc.get_process_group_ranks(backwards) == [3, 1]
            b = np.array([r])
            nc.broadcast(b, src=1, group=backwards)          # src is a global rank
            assert b[0] == 1 and nc.get_rank(backwards) == (0 if r == 3 else 1)
        else:
            assert backwards is nc.GroupMember.NON_GROUP_MEMBER
            assert nc.get_rank(backwards) == -1
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                assert nc.all_reduce(x, group=backwards) is None
            assert "does not belong to the given group" in str(caught[0].message)
            assert caught[0].filename == __file__  # the caller's line, not numcoll's
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                assert nc.monitored_barrier(group=backwards) is None  # (no fast path)
            assert caught[0].filename == __file__
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                assert nc.barrier(group=backwards) is None
            assert str(caught[0].message).startswith("Running barrier on global rank")
            assert caught[0].filename == __file__
        local = nc.new_group([0, 2], use_local_synchronization=True) if r in (0, 2) else None
        if local is not None:
            y = np.ones(1)
            nc.all_reduce(y, group=local)
            assert y[0] == 2
        split = nc.split_group(split_ranks=[[0, 2], [1]])
        if r == 3:
            assert split is None
        else:
            assert nc.get_process_group_ranks(split) == ([0, 2] if r != 1 else [1])
        with nc.ProcessGroup(nc.HashStore(), 0, 1) as stranger:
            with pytest.raises(ValueError, match="not registered"):
                nc.get_process_group_ranks(stranger)
        with pytest.raises(TypeError, match="unexpected keyword"):
            nc.new_group([0, 1], bogus=True)
        before = nc.get_default_group().sequence_number()
        nc.barrier()
        return before, nc.get_default_group().sequence_number()

    seqs = _run(body)
    assert len(set(seqs)) == 1 and seqs[0][1] == seqs[0][0] + 1


def test_batch_isend_irecv_ring_with_more_receives_than_workers():
    def body():
        r, n = nc.get_rank(), nc.get_world_size()
        ops, outs = [], []
        for k in range(4):               # 4 receives queued first, 2 worker threads
            outs.append(np.zeros(2))
            ops.append(nc.P2POp(nc.irecv, outs[-1], (r - 1) % n, tag=k))
        for k in range(4):
            ops.append(nc.P2POp(nc.isend, np.full(2, 10.0 * r + k), (r + 1) % n, tag=k))
        works = nc.batch_isend_irecv(ops)
        for w in works:
            w.wait()
        assert [o[0] for o in outs] == [10.0 * ((r - 1) % n) + k for k in range(4)]
        with pytest.raises(ValueError, match="Invalid ``op``"):
            nc.P2POp(nc.all_reduce, outs[0], 0)
        with pytest.raises(ValueError, match="Invalid ``p2p_op_list``"):
            nc.batch_isend_irecv([])
        return True

    assert _run(body, 3) == [True] * 3


@pytest.mark.parametrize("call, error, words", [
    (lambda x: nc.barrier(timeout=timedelta(seconds=-1)), ValueError, "timeout must be positive"),
    (lambda x: nc.barrier(timeout=5), TypeError, "timedelta"),
    (lambda x: nc.broadcast(x, src=1.0), TypeError, "src must be an int"),
    (lambda x: nc.broadcast(x, src=True), TypeError, "src must be an int"),
    (lambda x: nc.reduce(x, dst=True), TypeError, "dst must be an int"),
    (lambda x: nc.all_reduce(x, group="junk"), TypeError, "group must be a ProcessGroup"),
    (lambda x: nc.isend(x, 1, tag=1.5), TypeError, "tag must be an int"),
    (lambda x: nc.isend(x, 1, tag="x"), TypeError, "tag must be an int"),
    (lambda x: nc.irecv(x, 1, tag=None), TypeError, "tag must be an int"),
    (lambda x: nc.new_group([0, True]), TypeError, "rank must be an int"),
    (lambda x: nc.new_group([0, 1], timeout=timedelta(0)), ValueError, "positive"),
    (lambda x: nc.broadcast(x), ValueError, "Must specify global_rank or group_rank"),
    (lambda x: nc.broadcast(x, src=0, group_src=0), ValueError, "Can't specify both"),
    (lambda x: nc.all_reduce(x, op=nc.ReduceOp.PREMUL_SUM), ValueError, "needs a factor"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_argument_holes_are_errors_at_the_call(call, error, words):
    def body():
        x = np.ones(2)
        with pytest.raises(error, match=words):
            call(x)
        nc.all_reduce(x)            # nothing was queued or poisoned
        return x.tolist()

    assert _run(body, 2) == [[2.0, 2.0]] * 2


def test_init_process_group_checks_keep_torchs_words(tmp_path):
    with pytest.raises(ValueError, match="Cannot specify both init_method and store"):
        nc.init_process_group("gloo", init_method="env://", store=nc.HashStore())
    with pytest.raises(ValueError, match="world_size must be positive if using store"):
        nc.init_process_group("gloo", store=nc.HashStore(), rank=0)
    with pytest.raises(ValueError, match="unsupported backend 'nccl'"):
        nc.init_process_group("nccl", store=nc.HashStore(), rank=0, world_size=1)
    with pytest.raises(TypeError, match="rank must be an int"):
        nc.init_process_group("gloo", store=nc.HashStore(), rank=0.0, world_size=1)
    nc.init_process_group("gloo", f"file://{tmp_path}/s", timedelta(seconds=30), 1, 0)
    try:
        assert nc.get_backend() == "gloo" and nc.get_world_size() == 1
        with pytest.raises(ValueError, match="twice"):
            nc.init_process_group("gloo", store=nc.HashStore(), rank=0, world_size=1)
    finally:
        nc.destroy_process_group()
    nc.init_process_group(backend="numcoll", store=nc.HashStore(), rank=0, world_size=1)
    try:
        assert nc.get_backend() == "numcoll"
    finally:
        nc.destroy_process_group()


def test_numpy_integer_ranks_and_tags_are_ints():
    def body():
        r = nc.get_rank()
        x = np.array([float(r)])
        nc.broadcast(x, src=np.int64(1))
        if r == 0:
            nc.send(np.ones(1), dst=np.int32(1), tag=np.int64(3))
        else:
            assert nc.recv(np.zeros(1), src=np.int64(0), tag=np.int16(3)) == 0
        return x[0]

    assert _run(body, 2) == [1.0, 1.0]


def test_split_group_takes_ranks_of_the_parent():
    def body():
        r = nc.get_rank()
        parent = nc.new_group([1, 2, 3])
        if parent is nc.GroupMember.NON_GROUP_MEMBER:
            with pytest.raises(ValueError, match="not registered"):
                nc.split_group(parent, [[0], [1, 2]])
            return None
        child = nc.split_group(parent, [[1, 2]])      # parent ranks 1, 2: global 2, 3
        if r == 1:
            assert child is None
            return None
        assert nc.get_process_group_ranks(child) == [2, 3]
        x = np.array([r])
        nc.all_reduce(x, group=child)
        return int(x[0])

    assert _run(body) == [None, None, 5, 5]


def test_gather_single_and_set_timeout():
    def body():
        r = nc.get_rank()
        out = np.zeros((3, 2)) if r == 1 else None
        nc.gather_single(np.full(2, float(r)), out, dst=1)
        with pytest.raises(ValueError, match="must hold world size"):
            if r == 1:
                nc.gather_into_tensor(np.ones(2), np.zeros(5), dst=1)
            else:
                raise ValueError("must hold world size")
        nc.set_timeout(timedelta(seconds=42))
        assert nc.get_default_group().options.timeout == timedelta(seconds=42)
        with pytest.raises(ValueError, match="positive"):
            nc.set_timeout(timedelta(0))
        return None if out is None else out.tolist()

    assert _run(body, 3)[1] == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]
