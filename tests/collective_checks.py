"""Every collective of a ProcessGroup against NumPy, on whatever ranks run it:
imported by tests/test_hier.py (thread ranks on made-up hosts) and by the
scripts tests/test_multihost.py runs in network namespaces (real hosts)."""

from __future__ import annotations

import numpy as np

import numcoll as nc

#: Families the two-level algorithms serve (chosen automatically over hosts).
TWO_LEVEL_FAMILIES = ("allreduce", "reduce", "broadcast", "allgather", "reduce_scatter",
                      "barrier")


def values(rank: int, count: int, dtype=np.float32) -> np.ndarray:
    """Rank-dependent inputs whose sums are exact in float32."""
    return ((np.arange(count) % 97) + 3 * rank + 1).astype(dtype)


def check_every_collective(pg, counts=(1, 1000, 300_001), expect: str | None = None) -> dict:
    """Run every collective on ``pg`` and compare with NumPy; return the
    algorithm each family ran (``expect``: the one the two-level families
    must have run)."""
    rank, n = pg.rank(), pg.size()
    ran: dict[str, str] = {}

    def note(family, work):
        work.wait()
        ran.setdefault(family, work.call.algorithm)

    for count in counts:
        x = values(rank, count)
        note("allreduce", pg.allreduce(x))
        np.testing.assert_array_equal(x, sum(values(r, count) for r in range(n)))
    x = values(rank, 777, np.float64)
    note("allreduce", pg.allreduce(x, nc.AllreduceOptions(reduce_op=nc.ReduceOp.AVG)))
    np.testing.assert_allclose(x, sum(values(r, 777, np.float64) for r in range(n)) / n)
    x = values(rank, 513, np.int32) * (-1) ** rank
    note("allreduce", pg.allreduce(x, nc.AllreduceOptions(reduce_op=nc.ReduceOp.MAX)))
    np.testing.assert_array_equal(x, np.max([values(r, 513, np.int32) * (-1) ** r
                                             for r in range(n)], axis=0))
    h = values(rank, 1001, np.float16)
    note("allreduce", pg.allreduce(h))
    np.testing.assert_array_equal(h, sum(values(r, 1001, np.float32) for r in range(n))
                                  .astype(np.float16))
    pair = [values(rank, 64), values(rank + 7, 64)]
    note("allreduce", pg.allreduce(pair))
    want = sum(values(r, 64) + values(r + 7, 64) for r in range(n))
    for a in pair:
        np.testing.assert_array_equal(a, want)
    parts = [values(rank, 5), values(rank, 3000, np.float32).reshape(30, 100)]
    note("allreduce", pg.allreduce_coalesced(parts))
    np.testing.assert_array_equal(parts[1], sum(values(r, 3000) for r in range(n))
                                  .reshape(30, 100))

    for root in sorted({0, n - 1, n // 2}):
        x = values(rank, 20_001)
        note("reduce", pg.reduce(x, nc.ReduceOptions(root_rank=root)))
        if rank == root:
            np.testing.assert_array_equal(x, sum(values(r, 20_001) for r in range(n)))
        else:
            np.testing.assert_array_equal(x, values(rank, 20_001))
        b = values(root, 30_003) if rank == root else np.zeros(30_003, np.float32)
        note("broadcast", pg.broadcast(b, nc.BroadcastOptions(root_rank=root)))
        np.testing.assert_array_equal(b, values(root, 30_003))

    outs = [np.empty(4099, np.float32) for _ in range(n)]
    note("allgather", pg.allgather([outs], [values(rank, 4099)]))
    for r, o in enumerate(outs):
        np.testing.assert_array_equal(o, values(r, 4099))
    out = np.empty(n * 1000, np.int64)
    note("allgather", pg.allgather_into_tensor(out, values(rank, 1000, np.int64)))
    np.testing.assert_array_equal(out, np.concatenate([values(r, 1000, np.int64)
                                                       for r in range(n)]))
    coalesced = [[np.empty(3, np.float32), np.empty(5, np.float32)] for r in range(n)]
    pg.allgather_coalesced(coalesced, [values(rank, 3), values(rank + 9, 5)]).wait()
    for r, (a, b) in enumerate(coalesced):
        np.testing.assert_array_equal(a, values(r, 3))
        np.testing.assert_array_equal(b, values(r + 9, 5))

    shares = [1000 + 3 * r for r in range(n)]  # uneven shares
    mine = np.empty(shares[rank], np.float32)
    note("reduce_scatter", pg.reduce_scatter([mine], [[values(rank * 10 + q, shares[q])
                                                       for q in range(n)]]))
    np.testing.assert_array_equal(mine, sum(values(r * 10 + rank, shares[rank])
                                            for r in range(n)))
    share = np.empty(2048, np.float32)
    note("reduce_scatter", pg.reduce_scatter_tensor(share, values(rank, 2048 * n)))
    np.testing.assert_array_equal(share, sum(values(r, 2048 * n) for r in range(n))
                                  [rank * 2048:(rank + 1) * 2048])

    root = n - 1
    gathered = [np.empty(9, np.float32) for _ in range(n)] if rank == root else []
    note("gather", pg.gather([gathered] if rank == root else [], [values(rank, 9)],
                             nc.GatherOptions(root_rank=root)))
    if rank == root:
        for r, g in enumerate(gathered):
            np.testing.assert_array_equal(g, values(r, 9))
    got = np.empty(11, np.float32)
    note("scatter", pg.scatter([got], [[values(q, 11) for q in range(n)]] if rank == 0
                               else [], nc.ScatterOptions(root_rank=0)))
    np.testing.assert_array_equal(got, values(rank, 11))
    outs = [np.empty(6, np.float32) for _ in range(n)]
    note("alltoall", pg.alltoall(outs, [values(rank * n + q, 6) for q in range(n)]))
    for q, o in enumerate(outs):
        np.testing.assert_array_equal(o, values(q * n + rank, 6))
    splits = [q + 1 for q in range(n)]  # rank r sends q + 1 rows to q
    received = np.empty((rank + 1) * n, np.float64)
    pg.alltoall_base(received, np.concatenate([np.full(q + 1, 100.0 * rank + q)
                                               for q in range(n)]),
                     [rank + 1] * n, splits).wait()
    np.testing.assert_array_equal(received, np.concatenate([np.full(rank + 1, 100.0 * q + rank)
                                                            for q in range(n)]))

    # Point to point around the ring (neighbours share a host or not), and
    # from any source.
    right, left = (rank + 1) % n, (rank - 1) % n
    if n > 1:
        inbox = np.empty(3, np.int64)
        recv = pg.recv([inbox], left, tag=5)
        pg.send([np.full(3, rank, np.int64)], right, tag=5).wait()
        recv.wait()
        assert inbox.tolist() == [left] * 3
        if rank == 0:
            senders = set()
            for _ in range(n - 1):
                box = np.empty(1, np.int64)
                work = pg.recv_anysource([box], tag=6)
                work.wait()
                assert box[0] == work.source_rank()
                senders.add(work.source_rank())
            assert senders == set(range(1, n))
        else:
            pg.send([np.array([rank], np.int64)], 0, tag=6).wait()
    note("barrier", pg.barrier())
    if expect is not None:
        # The barrier has one two-level variant.
        wrong = {f: a for f, a in ran.items() if f in TWO_LEVEL_FAMILIES
                 and a != (expect if f != "barrier" else "twolevel")}
        assert not wrong, f"expected {expect}, ran {wrong}"
    return ran
