"""torch's own tests, run on the numcoll backend: the CPU cases of
test_c10d_gloo.py's ProcessGroupGlooTest and DistributedDataParallelTest,
test_c10d_common.py's DDP cases and test_c10d_pypg.py's DDP-over-a-Python-group
cases, with ``ProcessGroupGloo`` replaced by the group that
``init_process_group("numcoll")`` makes. Every case runs on every rank, each on
a fresh numcoll group (``dist.new_group``) so that a failure cannot leak into
the next; one JSON line reports each case's outcome.

    python ported.py RANK WORLD_SIZE PORT
"""

import json
import math
import operator
import sys
import time
import traceback
from datetime import timedelta
from functools import reduce

import torch
import torch.distributed as c10d
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
import unittest
from functools import partial

import numcoll.torch

CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


class Ctx(unittest.TestCase):
    """One case: ``self.rank``, ``self.world_size``, ``self.pg`` (a fresh numcoll group).
    ``assertEqual`` compares tensors (dense or sparse, or lists of them) as
    torch's TestCase does; torch.testing._internal itself needs test-only packages."""

    def runTest(self):  # noqa: N802 - unittest's name; the cases are run by hand
        pass

    def assertEqual(self, a, b, msg=None, atol=0.0, rtol=0.0):  # noqa: N802
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
            super().assertEqual(len(a), len(b), msg)
            for x, y in zip(a, b):
                self.assertEqual(x, y, msg, atol, rtol)
        elif isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            a, b = (t.to_dense() if isinstance(t, torch.Tensor) and t.is_sparse
                    else torch.as_tensor(t) for t in (a, b))
            torch.testing.assert_close(a, b.to(a.dtype), atol=atol, rtol=rtol, msg=msg)
        else:
            super().assertEqual(a, b, msg)


def simple_sparse_reduce_tests(rank, world_size, num_inputs=1):
    """torch.testing._internal.common_distributed's, as it is."""
    def generate(rank, world_size, sparse_dims=1, dense_dims=0):
        indices = torch.reshape(torch.arange(rank + 1), (1, rank + 1))
        shape = [world_size] + [2 for _ in range(dense_dims)]
        for _ in range(sparse_dims - 1):
            indices = torch.cat((indices, torch.zeros(1, rank + 1, dtype=torch.long)))
            shape.append(world_size)
        values = torch.ones([rank + 1] + [2 for _ in range(dense_dims)])
        return torch.sparse_coo_tensor(indices, values, shape)

    def compute_sum(fn, world_size):
        return reduce(lambda a, b: a + b, [fn(rank, world_size) for rank in range(world_size)])

    return [([fn(num_inputs * rank + i, num_inputs * world_size) for i in range(num_inputs)],
             [compute_sum(fn, num_inputs * world_size) for i in range(num_inputs)])
            for fn in [partial(generate, sparse_dims=1), partial(generate, sparse_dims=2),
                       partial(generate, sparse_dims=3), partial(generate, dense_dims=1),
                       partial(generate, dense_dims=2), partial(generate, dense_dims=3)]]


def simple_reduce_tests(rank, world_size):
    tests = [
        (c10d.ReduceOp.SUM, torch.tensor([rank + 1.0]),
         torch.tensor([float(world_size * (world_size + 1) / 2)])),
        (c10d.ReduceOp.PRODUCT, torch.tensor([rank + 1.0]),
         torch.tensor([float(math.factorial(world_size))])),
        (c10d.ReduceOp.MIN, torch.tensor([rank + 1.0]), torch.tensor([1.0])),
        (c10d.ReduceOp.MAX, torch.tensor([rank + 1.0]), torch.tensor([float(world_size)])),
        (c10d.ReduceOp.AVG, torch.tensor([rank + 1.0]),
         torch.tensor([float((world_size + 1) / 2)])),
    ]
    for i in range(4):
        tests.append((c10d.ReduceOp.BAND, torch.tensor([rank | (1 << i)], dtype=torch.int32),
                      torch.tensor([1 << i], dtype=torch.int32)))
    for i in range(1, 5):
        vin = reduce(operator.or_, [rank * i + j for j in range(i)])
        vout = reduce(operator.or_, range(world_size * i))
        tests.append((c10d.ReduceOp.BOR, torch.tensor([vin], dtype=torch.int32),
                      torch.tensor([vout], dtype=torch.int32)))
    for i in range(1, 5):
        vin = reduce(operator.xor, [rank * i + j for j in range(i)])
        vout = reduce(operator.xor, range(world_size * i))
        tests.append((c10d.ReduceOp.BXOR, torch.tensor([vin], dtype=torch.int32),
                      torch.tensor([vout], dtype=torch.int32)))
    return tests


def simple_multi_input_reduce_tests(rank, world_size):
    return [
        (c10d.ReduceOp.SUM, [torch.tensor([2 * rank + 0.0]), torch.tensor([2 * rank + 1.0])],
         torch.tensor([float(world_size * (2 * world_size - 1))])),
        (c10d.ReduceOp.PRODUCT, [torch.tensor([2 * rank + 1.0]), torch.tensor([2 * rank + 2.0])],
         torch.tensor([float(math.factorial(2 * world_size))])),
        (c10d.ReduceOp.MIN, [torch.tensor([2 * rank + 1.0]), torch.tensor([2 * rank + 2.0])],
         torch.tensor([1.0])),
        (c10d.ReduceOp.MAX, [torch.tensor([2 * rank + 1.0]), torch.tensor([2 * rank + 2.0])],
         torch.tensor([2.0 * world_size])),
    ]


# -- ProcessGroupGlooTest ---------------------------------------------------------------

@case
def test_empty_tensors(self):
    xs = [torch.FloatTensor([])]
    fut = self.pg.broadcast(xs).get_future()
    fut.wait()
    output = fut.value()
    self.assertEqual(0, output[0].numel())
    self.assertEqual(xs[0], output[0])


@case
def test_broadcast_checks(self):
    t1 = torch.zeros([1], dtype=torch.float32)
    t2 = torch.zeros([1], dtype=torch.float64)
    t3 = torch.zeros([2], dtype=torch.float32)
    for root, tensor, tensors, words in ((-1, 0, [t1], "invalid root rank"),
                                         (self.world_size, 0, [t1], "invalid root rank"),
                                         (self.rank, -1, [t1], "invalid root tensor"),
                                         (self.rank, 1, [t1], "invalid root tensor"),
                                         (self.rank, 0, [], "invalid root tensor|non-empty"),
                                         (self.rank, 0, [t1, t2], "invalid tensor type"),
                                         (self.rank, 0, [t1, t3], "invalid tensor size")):
        with self.assertRaisesRegex(RuntimeError, words):
            opts = c10d.BroadcastOptions()
            opts.rootRank, opts.rootTensor = root, tensor
            self.pg.broadcast(tensors, opts)


@case
def test_broadcast_basics(self):
    def broadcast(xs, root_rank, root_tensor):
        opts = c10d.BroadcastOptions()
        opts.rootRank, opts.rootTensor = root_rank, root_tensor
        fut = self.pg.broadcast(xs, opts).get_future()
        fut.wait()
        return fut.value()

    for i in range(self.world_size):
        output = broadcast([torch.tensor([self.rank])], i, 0)
        self.assertEqual(torch.tensor([i]), output[0])
        for j in range(2):
            xs = [torch.tensor([self.rank * 2 + 0.0]), torch.tensor([self.rank * 2 + 1.0])]
            output = broadcast(xs, i, j)
            self.assertEqual(torch.tensor([i * 2 + j], dtype=torch.float32), output[0])
            self.assertEqual(torch.tensor([i * 2 + j], dtype=torch.float32), output[1])
    fut = self.pg.broadcast(torch.tensor([self.rank + 1.0]), root=0).get_future()
    fut.wait()
    self.assertEqual(torch.tensor([1.0]), fut.value()[0])


@case
def test_broadcast_stress(self):
    inputs = [torch.tensor([i * self.world_size + self.rank]) for i in range(300)]
    works = [self.pg.broadcast(inputs[i], root=(i % self.world_size)) for i in range(300)]
    for i, work in enumerate(works):
        work.wait()
        self.assertEqual(torch.tensor([(i * self.world_size) + (i % self.world_size)]),
                         inputs[i])


@case
def test_allreduce_checks(self):
    t1 = torch.zeros([1], dtype=torch.float32)
    t2 = torch.zeros([1], dtype=torch.float64)
    t3 = torch.zeros([2], dtype=torch.float32)
    with self.assertRaisesRegex(RuntimeError, "requires non-empty tensor list"):
        self.pg.allreduce([], c10d.AllreduceOptions())
    with self.assertRaisesRegex(RuntimeError, "invalid tensor type"):
        self.pg.allreduce([t1, t2], c10d.AllreduceOptions())
    with self.assertRaisesRegex(RuntimeError, "invalid tensor size"):
        self.pg.allreduce([t1, t3], c10d.AllreduceOptions())


@case
def test_allreduce_basics(self):
    for op, input, expected in simple_reduce_tests(self.rank, self.world_size):
        opts = c10d.AllreduceOptions()
        opts.reduceOp = op
        fut = self.pg.allreduce([input.clone()], opts).get_future()
        fut.wait()
        self.assertEqual(expected, fut.value()[0])
    for op, inputs, output in simple_multi_input_reduce_tests(self.rank, self.world_size):
        opts = c10d.AllreduceOptions()
        opts.reduceOp = op
        fut = self.pg.allreduce([t.clone() for t in inputs], opts).get_future()
        fut.wait()
        for tensor in fut.value():
            self.assertEqual(output, tensor)
    fut = self.pg.allreduce(torch.tensor([self.rank + 1.0])).get_future()
    fut.wait()
    self.assertEqual(torch.tensor([float(self.world_size * (self.world_size + 1) / 2)]),
                     fut.value()[0])


@case
def test_allreduce_stress(self):
    inputs = [torch.tensor([i + self.rank]) for i in range(300)]
    works = [self.pg.allreduce(inputs[i]) for i in range(300)]
    for i, work in enumerate(works):
        work.wait()
        self.assertEqual(torch.tensor([i * self.world_size + self.world_size *
                                       (self.world_size - 1) // 2]), work.result()[0])


@case
def test_allreduce_coalesced_checks(self):
    t1, t2 = torch.zeros(1, dtype=torch.float32), torch.zeros(1, dtype=torch.float64)
    with self.assertRaisesRegex(RuntimeError, "requires non-empty tensor list"):
        self.pg.allreduce_coalesced([], c10d.AllreduceCoalescedOptions())
    with self.assertRaisesRegex(RuntimeError, "tensors .* same type|invalid tensor type"):
        self.pg.allreduce_coalesced([t1, t2], c10d.AllreduceCoalescedOptions())


@case
def test_allreduce_coalesced_basics(self):
    r, n = self.rank, self.world_size
    opts = c10d.AllreduceCoalescedOptions()
    opts.reduceOp = c10d.ReduceOp.SUM
    xs = [torch.tensor([r + 1.0]), torch.tensor([(r + 1.0) ** 2])]
    fut = self.pg.allreduce_coalesced(xs, opts).get_future()
    fut.wait()
    self.assertEqual(fut.value(), [torch.tensor([float(n * (n + 1) / 2)]),
                                   torch.tensor([float(n * (n + 1) * (2 * n + 1) / 6)])])


@case
def test_sparse_allreduce_basics(self):
    for num_inputs in (1, 2):
        for inputs, outputs in simple_sparse_reduce_tests(self.rank, self.world_size,
                                                         num_inputs=num_inputs):
            work = self.pg.allreduce(inputs)
            work.wait()
            result = work.result()
            for i, output in enumerate(outputs):
                self.assertEqual(output, result[i])
                self.assertEqual(output, inputs[i])   # in place, as gloo


@case
def test_sparse_allreduce_checks(self):
    t1, t2 = torch.zeros([1]), torch.sparse_coo_tensor([[0]], [1], size=(2,))
    t3 = torch.sparse_coo_tensor([[0]], [1], size=(4,))
    with self.assertRaisesRegex(RuntimeError, "requires non-empty tensor list"):
        self.pg.allreduce([], c10d.AllreduceOptions())
    with self.assertRaisesRegex(RuntimeError, "invalid tensor layout"):
        self.pg.allreduce([t1, t2], c10d.AllreduceOptions())
    with self.assertRaisesRegex(RuntimeError, "invalid tensor size"):
        self.pg.allreduce([t2, t3], c10d.AllreduceOptions())
    for op in (c10d.ReduceOp.PRODUCT, c10d.ReduceOp.MIN, c10d.ReduceOp.MAX):
        opts = c10d.AllreduceOptions()
        opts.reduceOp = op
        with self.assertRaisesRegex(RuntimeError, "unsupported reduction operation"):
            self.pg.allreduce([t3], opts)


@case
def test_scatter_checks(self):
    t1 = torch.zeros([1], dtype=torch.float32)
    with self.assertRaisesRegex(RuntimeError, "invalid root rank"):
        opts = c10d.ScatterOptions()
        opts.rootRank = -1
        self.pg.scatter([t1], [], opts)
    with self.assertRaisesRegex(RuntimeError, "invalid root rank"):
        opts = c10d.ScatterOptions()
        opts.rootRank = self.world_size
        self.pg.scatter([t1], [], opts)
    with self.assertRaisesRegex(RuntimeError, "requires a single-element output tensor list"):
        opts = c10d.ScatterOptions()
        opts.rootRank = 0
        self.pg.scatter([], [], opts)


@case
def test_scatter_basics(self):
    inputs = [torch.tensor([i]) for i in range(self.world_size)]
    for root in range(self.world_size):
        outputs = [torch.tensor([-1])]
        opts = c10d.ScatterOptions()
        opts.rootRank = root
        self.pg.scatter(outputs, [inputs] if root == self.rank else [], opts).wait()
        self.assertEqual(torch.tensor([self.rank]), outputs[0])


@case
def test_gather_checks(self):
    t1 = torch.zeros([1], dtype=torch.float32)
    with self.assertRaisesRegex(RuntimeError, "invalid root rank"):
        opts = c10d.GatherOptions()
        opts.rootRank = -1
        self.pg.gather([], [t1], opts)
    with self.assertRaisesRegex(RuntimeError, "requires a single-element input tensor list"):
        opts = c10d.GatherOptions()
        opts.rootRank = 0
        self.pg.gather([], [], opts)


@case
def test_gather_basics(self):
    for root in range(self.world_size):
        outputs = [torch.tensor([-1]) for _ in range(self.world_size)]
        opts = c10d.GatherOptions()
        opts.rootRank = root
        self.pg.gather([outputs] if root == self.rank else [], [torch.tensor([self.rank])],
                       opts).wait()
        if root == self.rank:
            self.assertEqual([torch.tensor([i]) for i in range(self.world_size)], outputs)


@case
def test_allgather_checks(self):
    t1 = torch.zeros([1], dtype=torch.float32)
    t2 = torch.zeros([1], dtype=torch.float64)
    with self.assertRaisesRegex(RuntimeError, "requires non-empty input tensor list"):
        self.pg.allgather([], [])
    with self.assertRaisesRegex(RuntimeError, "requires input/output tensor lists to have "
                                              "the same length"):
        self.pg.allgather([], [t1])
    with self.assertRaisesRegex(RuntimeError, "invalid output tensor list"):
        self.pg.allgather([[t1] * (self.world_size - 1)], [t1])
    with self.assertRaisesRegex(RuntimeError, "invalid tensor type"):
        self.pg.allgather([[t1, t1] * self.world_size, [t1, t1] * self.world_size],
                          [t1, t2])


@case
def test_allgather_basics(self):
    for n in (1, 2, 3):
        inp = [torch.tensor([n * self.rank + i]) for i in range(n)]
        out = [[torch.tensor([-1]) for _ in range(n * self.world_size)] for _ in range(n)]
        expected = [[torch.tensor([i]) for i in range(n * self.world_size)] for _ in range(n)]
        fut = self.pg.allgather(out, inp).get_future()
        fut.wait()
        self.assertEqual(expected, fut.value())
        self.assertEqual(expected, out)


@case
def test_allgather_coalesced_basics(self):
    inputs = [torch.full((2,), self.rank * 10.0 + i) for i in range(3)]
    outputs = [[torch.zeros(2) for _ in range(3)] for _ in range(self.world_size)]
    self.pg.allgather_coalesced(outputs, inputs).wait()
    for r in range(self.world_size):
        for i in range(3):
            self.assertEqual(outputs[r][i], torch.full((2,), r * 10.0 + i))


@case
def test_allgather_into_tensor(self):
    out = torch.zeros(self.world_size * 3)
    self.pg._allgather_base(out, torch.full((3,), float(self.rank))).wait()
    self.assertEqual(out, torch.arange(self.world_size).repeat_interleave(3).float())
    dist.all_gather_into_tensor(out, torch.full((3,), self.rank + 1.0), group=self.pg)
    self.assertEqual(out, (torch.arange(self.world_size) + 1).repeat_interleave(3).float())


@case
def test_reduce_checks(self):
    t1 = torch.zeros([1], dtype=torch.float32)
    for root, tensor, tensors, words in ((-1, 0, [t1], "invalid root rank"),
                                         (self.world_size, 0, [t1], "invalid root rank"),
                                         (self.rank, 1, [t1], "invalid root tensor"),
                                         (self.rank, 0, [t1, t1], "requires a single-element")):
        opts = c10d.ReduceOptions()
        opts.rootRank, opts.rootTensor = root, tensor
        with self.assertRaisesRegex(RuntimeError, words):
            self.pg.reduce(tensors, opts)


@case
def test_reduce_basics(self):
    for op, input, output in simple_reduce_tests(self.rank, self.world_size):
        for root in range(self.world_size):
            opts = c10d.ReduceOptions()
            opts.reduceOp, opts.rootRank = op, root
            tmp = input.clone()
            fut = self.pg.reduce([tmp], opts).get_future()
            fut.wait()
            if root == self.rank:
                self.assertEqual(output, fut.value()[0])


@case
def test_reduce_scatter_tensor(self):
    n = self.world_size
    inp = torch.arange(n * 2, dtype=torch.float32) + self.rank
    out = torch.zeros(2)
    self.pg._reduce_scatter_base(out, inp).wait()
    base = torch.arange(n * 2, dtype=torch.float32)[self.rank * 2:self.rank * 2 + 2]
    self.assertEqual(out, base * n + sum(range(n)))
    dist.reduce_scatter_tensor(out, inp, op=dist.ReduceOp.MAX, group=self.pg)
    self.assertEqual(out, base + n - 1)


@case
def test_reduce_scatter_list(self):
    n = self.world_size
    inputs = [torch.full((2,), float(self.rank * n + i)) for i in range(n)]
    out = torch.zeros(2)
    dist.reduce_scatter(out, inputs, group=self.pg)
    self.assertEqual(out, torch.full((2,), float(sum(r * n + self.rank for r in range(n)))))


@case
def test_alltoall(self):
    n = self.world_size
    inputs = [torch.full((2,), float(self.rank * 100 + i)) for i in range(n)]
    outputs = [torch.zeros(2) for _ in range(n)]
    dist.all_to_all(outputs, inputs, group=self.pg)
    self.assertEqual(outputs, [torch.full((2,), float(r * 100 + self.rank)) for r in range(n)])


@case
def test_alltoall_base_with_splits(self):
    n = self.world_size
    # rank r sends j + 1 elements to rank j
    in_splits = [j + 1 for j in range(n)]
    out_splits = [self.rank + 1] * n
    inp = torch.cat([torch.full((j + 1,), float(self.rank * 10 + j)) for j in range(n)])
    out = torch.zeros(sum(out_splits))
    dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.pg)
    self.assertEqual(out, torch.cat([torch.full((self.rank + 1,), float(r * 10 + self.rank))
                                     for r in range(n)]))


@case
def test_send_recv_all_to_all(self):
    inputs = [torch.tensor([self.rank]) for _ in range(self.world_size)]
    outputs = [torch.tensor([-1]) for _ in range(self.world_size)]
    recv_work = [self.pg.recv([outputs[i]], i, 0) for i in range(self.world_size)
                 if i != self.rank]
    send_work = [self.pg.send([inputs[i]], i, 0) for i in range(self.world_size)
                 if i != self.rank]
    for work in recv_work + send_work:
        work.wait()
        self.assertTrue(work.is_completed())
    for i in range(self.world_size):
        if i != self.rank:
            self.assertEqual(torch.tensor([i]), outputs[i])


@case
def test_recv_anysource(self):
    if self.rank == 0:
        got = {}
        for _ in range(self.world_size - 1):
            t = torch.zeros(1)
            src = dist.recv(t, group=self.pg)
            got[src] = t.item()
        self.assertEqual(got, {r: float(r) for r in range(1, self.world_size)})
    else:
        dist.send(torch.tensor([float(self.rank)]), 0, group=self.pg)


@case
def test_batch_isend_irecv(self):
    peer_send, peer_recv = (self.rank + 1) % self.world_size, (self.rank - 1) % self.world_size
    out = torch.zeros(3)
    ops = [dist.P2POp(dist.isend, torch.full((3,), float(self.rank)), peer_send, self.pg),
           dist.P2POp(dist.irecv, out, peer_recv, self.pg)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    self.assertEqual(out, torch.full((3,), float(peer_recv)))


@case
def test_barrier_implies_wait(self):
    tensors = [torch.full((32,), float(i)) for i in range(20)]
    for t in tensors:
        self.pg.allreduce(t)
    self.pg.barrier().wait()
    for i, t in enumerate(tensors):
        self.assertEqual(torch.full((32,), float(i * self.world_size)), t)


@case
def test_reduce_op_premul_sum_and_avg(self):
    t = torch.full((4,), self.rank + 1.0)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5), group=self.pg)
    self.assertEqual(t, torch.full((4,), 0.5 * sum(range(1, self.world_size + 1))))
    t = torch.full((4,), self.rank + 1.0, dtype=torch.bfloat16, requires_grad=True)
    dist.all_reduce(t, op=dist.ReduceOp.AVG, group=self.pg)
    self.assertEqual(t.float(), torch.full((4,), (self.world_size + 1) / 2))


@case
def test_tensors_are_used_in_place(self):
    t = torch.arange(8, dtype=torch.float32)
    ptr = t.data_ptr()
    view = t[::2]   # non-contiguous: numcoll copies in and out, the caller's memory is updated
    dist.all_reduce(view, group=self.pg)
    self.assertEqual(t.data_ptr(), ptr)
    self.assertEqual(t[::2], torch.arange(0, 8, 2).float() * self.world_size)
    self.assertEqual(t[1::2], torch.arange(1, 8, 2).float())


@case
def test_monitored_barrier_names_the_missing_rank(self):
    if self.world_size < 2:
        return
    if self.rank == self.world_size - 1:   # this rank does not come
        return
    if self.rank == 0:
        with self.assertRaisesRegex(RuntimeError, f"[Rr]ank {self.world_size - 1}"):
            numcoll.torch.monitored_barrier(self.pg, timeout=timedelta(seconds=1))
    else:
        try:   # released or told of the failure; either way it ends
            numcoll.torch.monitored_barrier(self.pg, timeout=timedelta(seconds=3))
        except RuntimeError:
            pass


@case
def test_timeout_is_a_dist_backend_error(self):
    if self.rank == 1:   # never joins this collective (and stays until the others time out)
        time.sleep(1.5)
        return
    opts = c10d.AllreduceOptions()
    opts.timeout = timedelta(milliseconds=300)
    work = self.pg.allreduce([torch.ones(1)], opts)
    try:
        work.wait()
    except dist.DistBackendError as exc:
        self.assertIsInstance(exc, TimeoutError)
        self.assertIn("Timed out waiting 300ms", str(exc))
        self.assertEqual(exc.peer, 1 if self.rank == 0 else exc.peer)
        self.assertRaises(dist.DistBackendError, work.get_future().wait)
    else:
        raise AssertionError("no timeout")


# -- DistributedDataParallelTest (test_c10d_gloo.py) and test_c10d_common.py ------------

class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(2, 10, bias=False)
        self.fc2 = nn.Linear(10, 50, bias=False)
        self.fc3 = nn.Linear(50, 4, bias=False)

    def forward(self, x):
        return F.softmax(self.fc3(F.relu(self.fc2(F.relu(self.fc1(x))))), dim=1)


def _ddp_matches_local(self, **ddp_kwargs):
    """test_c10d_common's _test_ddp_with_process_group: DDP over the group matches
    a single-process model trained on every rank's inputs."""
    torch.manual_seed(42)
    model = _Net()
    local = _Net()
    local.load_state_dict(model.state_dict())
    ddp = DistributedDataParallel(model, process_group=self.pg, bucket_cap_mb=0.001,
                                  **ddp_kwargs)
    n, batch = self.world_size, 4
    for step in range(3):
        torch.manual_seed(step)
        x = torch.randn(n * batch, 2)
        y = torch.randn(n * batch, 4)
        F.mse_loss(local(x), y).backward()
        F.mse_loss(ddp(x[self.rank * batch:(self.rank + 1) * batch]),
                   y[self.rank * batch:(self.rank + 1) * batch]).backward()
        for p_local, p_ddp in zip(local.parameters(), ddp.parameters()):
            self.assertEqual(p_local.grad, p_ddp.grad, atol=1e-6, rtol=1e-5)
            with torch.no_grad():
                p_local -= 0.1 * p_local.grad
                p_ddp -= 0.1 * p_ddp.grad
            p_local.grad = None
            p_ddp.grad = None


@case
def test_ddp_with_process_group(self):
    _ddp_matches_local(self)


@case
def test_ddp_with_process_group_grad_views(self):
    _ddp_matches_local(self, gradient_as_bucket_view=True)


@case
def test_ddp_invoke_work_object(self):
    torch.manual_seed(123)
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    wrapped = model
    x = torch.rand(2)
    ddp = DistributedDataParallel(model, process_group=self.pg)
    ddp(x).sum().backward()
    ddp_grad = wrapped[0].bias.grad.clone()
    wrapped.zero_grad()
    wrapped(x).sum().backward()
    self.assertEqual(wrapped[0].bias.grad, ddp_grad)   # the same input on every rank


@case
def test_ddp_no_init_sync(self):
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    DistributedDataParallel(model, process_group=self.pg, init_sync=False)


@case
def test_ddp_comm_hook_future_passing_cpu(self):
    """A hook returning a future of the allreduced bucket divided by the world size."""
    torch.manual_seed(0)
    model = _Net()
    ddp = DistributedDataParallel(model, process_group=self.pg)

    def allreduce_hook(state, bucket):
        tensors = [bucket.buffer() / self.world_size]
        return self.pg.allreduce(tensors).get_future().then(lambda fut: fut.value()[0])

    ddp.register_comm_hook(None, allreduce_hook)
    x = torch.full((4, 2), float(self.rank))
    ddp(x).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    probe = torch.cat([g.flatten() for g in grads])
    gathered = [torch.empty_like(probe) for _ in range(self.world_size)]
    dist.all_gather(gathered, probe, group=self.pg)
    for g in gathered:
        self.assertEqual(g, gathered[0])


@case
def test_ddp_comm_hook_register_just_once(self):
    ddp = DistributedDataParallel(_Net(), process_group=self.pg)

    def dummy_hook(state, bucket):
        fut = torch.futures.Future()
        fut.set_result([bucket.buffer()])
        return fut

    ddp.register_comm_hook(None, dummy_hook)
    with self.assertRaisesRegex(RuntimeError, "register_comm_hook or register_builtin_comm_hook "
                                              "can only be called once."):
        ddp.register_comm_hook(None, dummy_hook)


@case
def test_ignored_output_with_unused_parameters(self):
    class IgnoredOutputWithUnusedParameters(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(2, 10, bias=False)
            self.fc2 = nn.Linear(10, 4, bias=False)
            self.fc3 = nn.Linear(4, 4, bias=False)
            self.relu = nn.ReLU()

        def forward(self, x):
            return F.softmax(self.fc2(self.relu(self.fc1(x))), dim=1)

    model = DistributedDataParallel(IgnoredOutputWithUnusedParameters().float(),
                                    process_group=self.pg, find_unused_parameters=True)
    batch_size = 4
    criterion = nn.CrossEntropyLoss()
    x = torch.rand([batch_size, 2], dtype=torch.float)
    target = torch.LongTensor([torch.randint(0, 4, (1,)).item() for _ in range(batch_size)])
    for i in range(4):
        output = model(x)
        loss = criterion(output, target)
        if i % 2 == 0:   # every other output ignored: the reducer must cope
            loss.backward()


@case
def test_sparse_gradients(self):
    """test_c10d_gloo's test_sparse_gradients: DDP over an EmbeddingBag with
    sparse gradients, whose buckets go through the sparse allreduce."""
    class SparseGradientModule(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.EmbeddingBag(10, 10, sparse=True)

        def forward(self, x):
            return F.softmax(self.embedding(x), dim=1)

    torch.manual_seed(1337)
    vanilla = SparseGradientModule()
    ddp = DistributedDataParallel(SparseGradientModule(), process_group=self.pg)
    ddp.module.load_state_dict(vanilla.state_dict())
    batch = 4
    torch.manual_seed(0)
    inputs = torch.randint(0, 10, [self.world_size * batch, 5])
    targets = torch.randint(0, 10, [self.world_size * batch])
    F.nll_loss(vanilla(inputs), targets).backward()
    mine = slice(self.rank * batch, (self.rank + 1) * batch)
    F.nll_loss(ddp(inputs[mine]), targets[mine]).backward()
    g_vanilla = vanilla.embedding.weight.grad.to_dense()
    g_ddp = ddp.module.embedding.weight.grad.to_dense()
    self.assertEqual(g_vanilla, g_ddp, atol=1e-6, rtol=1e-5)


def main():
    rank, world_size, port = map(int, sys.argv[1:4])
    dist.init_process_group("numcoll", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=30))
    outcomes = {}
    for name, fn in CASES.items():
        ctx = Ctx()
        ctx.rank, ctx.world_size = rank, world_size
        ctx.pg = dist.new_group(backend="numcoll")
        try:
            fn(ctx)
            outcomes[name] = None
        except BaseException:  # noqa: BLE001 - reported, the next case runs
            outcomes[name] = f"rank {rank}: {traceback.format_exc()}"
        dist.destroy_process_group(ctx.pg)
    print("OUTCOMES " + json.dumps(outcomes), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
