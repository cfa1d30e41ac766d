"""Sparse allreduce: the sum of every rank's :class:`~numcoll.SparseCOO` on every rank.

Gloo's algorithm, in one queued work: each rank coalesces its inputs, the
ranks exchange their entry counts, then every rank's (indices, values) travel
in one ring allgather with per-rank chunk sizes (no padding), and each rank
coalesces the gathered entries. The stable sort in the coalescing kernel adds
duplicates in rank order, so every rank computes the bitwise same sum.

Better than Gloo: when the gathered entries would outweigh the dense array
(``gathered bytes > Config.sparse_dense_ratio * dense bytes``, decided from the
exchanged counts, so every rank decides alike), the ranks allreduce the dense
array instead, with a mask saying which rows any rank had appended to it (one
collective), so the result has the same indices as the sparse path would give. Cost: counts,
then P-1 ring steps moving the G gathered bytes once (sparse) or 2S(P-1)/P
bytes (dense, S = dense bytes + mask).
"""

from __future__ import annotations

import numpy as np

from ..algorithms import allgather_ring
from ..memory.host import HostBuffer
from ..call import Call
from ..dtypes import dtype_name, is_half
from ..kernels.cpu import compile_op
from ..kernels.sparse import _gather_rows_kernel, _scatter_rows_kernel
from ..ops import ReduceOp
from ..memory.sparse import SparseCOO, coalesce_entries
from .choice import choose, segment_count
from .checks import originals

__all__ = ["allreduce_sparse", "check_coalesced_layouts", "is_sparse_call"]

# Each phase of the work gets its own range of message steps, so a fast peer's
# next phase can never be matched by this rank's previous one.
_PHASE_STEPS = 1 << 24


def is_sparse_call(arrays) -> bool:
    """True when ``arrays`` is, or contains, a SparseCOO (the sparse collectives apply)."""
    if isinstance(arrays, SparseCOO):
        return True
    if isinstance(arrays, (list, tuple)):
        for a in arrays:  # a loop, not any(): every allreduce asks
            if isinstance(a, SparseCOO):
                return True
    return False


def check_coalesced_layouts(arrays, name: str) -> None:
    """allreduce_coalesced takes dense arrays only (Gloo's checks and words)."""
    if not isinstance(arrays, (list, tuple)) or not arrays:
        return
    if isinstance(arrays[0], SparseCOO):
        raise ValueError(f"{name}: unsupported layout: sparse arrays (SparseCOO) cannot be "
                         "coalesced; call allreduce on each")
    for i, a in enumerate(arrays):
        if isinstance(a, SparseCOO):
            raise ValueError(f"{name}: invalid tensor layout at index {i} (a SparseCOO among "
                             "dense arrays)")


def allreduce_sparse(ctx, arrays, opts):
    """The allreduce builder (see :mod:`.context`) for SparseCOO inputs."""
    name = "allreduce"
    outs = originals(arrays)
    inputs = outs
    if not inputs:
        raise ValueError(f"{name}: requires non-empty tensor list")
    for i, a in enumerate(inputs):
        if not isinstance(a, SparseCOO):
            raise ValueError(f"{name}: invalid tensor layout at index {i} (expected a "
                             f"SparseCOO like index 0, got a dense {type(a).__name__})"
                             if i else
                             f"{name}: invalid tensor layout at index 0 (dense among sparse)")
    first = inputs[0]
    for i, a in enumerate(inputs[1:], 1):
        if a.dtype != first.dtype:
            raise TypeError(f"{name}: invalid tensor type at index {i} (expected "
                            f"{dtype_name(first.dtype)}, got {dtype_name(a.dtype)})")
        if a.shape != first.shape or a.sparse_dim != first.sparse_dim:
            raise ValueError(f"{name}: invalid tensor size at index {i} (expected shape "
                             f"{first.shape} with {first.sparse_dim} sparse dims, got "
                             f"{a.shape} with {a.sparse_dim})")
        if a.on_device != first.on_device:
            raise TypeError(f"{name}: cannot mix host (NumPy) and device (CUDA) arrays in "
                            "one call")
    if opts.reduce_op != ReduceOp.SUM:
        raise ValueError(f"{name}: unsupported reduction operation {opts.reduce_op!r} "
                         "(allreduce of sparse tensors only works with ReduceOp.SUM)")
    cfg, size = ctx.cfg, ctx.size
    shape, sparse_dims = first.shape, first.sparse_dim
    sparse_shape = shape[:sparse_dims]
    dtype = first.dtype

    def run(comm, work):
        if len(inputs) == 1:
            indices, values = _host(first.indices), _host(first.values)
        else:
            indices = np.concatenate([_host(a.indices) for a in inputs], axis=1)
            values = np.concatenate([_host(a.values) for a in inputs], axis=0)
        indices, values = coalesce_entries(indices, values, sparse_shape)
        counts = np.zeros(size, np.int64)
        counts[comm.rank] = indices.shape[1]
        allgather_ring(_Phase(comm, 0), HostBuffer(counts), [(r, 1) for r in range(size)], 1)
        row_nbytes = values[0:1].nbytes if values.shape[0] else \
            int(np.prod(shape[sparse_dims:], dtype=np.int64)) * dtype.itemsize
        entry_nbytes = 8 * sparse_dims + row_nbytes
        # what the dense path moves: values and the row mask, in its wire dtype
        dense_nbytes = (int(np.prod(shape, dtype=np.int64)) +
                        int(np.prod(sparse_shape, dtype=np.int64))) * _dense_wire(dtype).itemsize
        if int(counts.sum()) * entry_nbytes > cfg.sparse_dense_ratio * dense_nbytes:
            result = _dense_sum(comm, cfg, indices, values, shape, sparse_dims)
        else:
            result = _gathered_sum(comm, cfg, indices, values, counts, entry_nbytes, shape)
        for i, a in enumerate(inputs):
            a._assign(result if i == 0 and not a.on_device else _like(a, result))
        return outs

    dense_count = int(np.prod(shape, dtype=np.int64))
    call = Call("sparse_allreduce", ctx.timeout_for(opts, name), dtype, dense_count,
                op="SUM", algorithm="allgather_coalesce",
                input_sizes=tuple(tuple(a.shape) for a in inputs),
                output_sizes=tuple(tuple(a.shape) for a in inputs),
                nbytes=sum(int(a.values.nbytes) + int(a.indices.nbytes) for a in inputs),
                settings=ctx.settings)
    return call, run


def _gathered_sum(comm, cfg, indices, values, counts, entry_nbytes, shape) -> SparseCOO:
    """Allgather every rank's entries (chunk r = rank r's indices then values), coalesce."""
    sparse_dims = indices.shape[0]
    starts = np.concatenate([[0], np.cumsum(counts * entry_nbytes)]).tolist()
    buf = np.empty(starts[-1], np.uint8)
    mine = buf[starts[comm.rank]:starts[comm.rank + 1]]
    n = indices.shape[1]
    mine[:8 * sparse_dims * n] = indices.view(np.uint8).reshape(-1)
    mine[8 * sparse_dims * n:] = np.ascontiguousarray(values).view(np.uint8).reshape(-1)
    chunks = [(starts[r], starts[r + 1] - starts[r]) for r in range(comm.size)]
    allgather_ring(_Phase(comm, 1), HostBuffer(buf), chunks, segment_count(cfg, 1))
    all_indices, all_values = [], []
    for r, k in enumerate(counts.tolist()):
        chunk = buf[starts[r]:starts[r + 1]]
        all_indices.append(chunk[:8 * sparse_dims * k].view(np.int64).reshape(sparse_dims, k))
        all_values.append(chunk[8 * sparse_dims * k:].view(values.dtype)
                          .reshape((k,) + tuple(shape[sparse_dims:])))
    out_indices, out_values = coalesce_entries(np.concatenate(all_indices, axis=1),
                                               np.concatenate(all_values, axis=0),
                                               shape[:sparse_dims])
    return SparseCOO._trusted(out_indices, out_values, shape, True)


def _dense_sum(comm, cfg, indices, values, shape, sparse_dims) -> SparseCOO:
    """Allreduce the dense sum with a row mask appended (one collective); the rows
    any rank had form the result."""
    dtype = values.dtype
    wire = _dense_wire(dtype)
    rows = int(np.prod(shape[:sparse_dims], dtype=np.int64))
    row_count = int(np.prod(shape[sparse_dims:], dtype=np.int64))
    # [dense values | mask]: the mask is 1 where this rank has a row; summed (or or-ed
    # for bool) it is the number of ranks that had it, exact in any dtype for P ranks.
    flat = np.zeros(rows * (row_count + 1), wire)
    dense = flat[:rows * row_count].reshape(rows, row_count)
    mask = flat[rows * row_count:]
    keys = np.ravel_multi_index(tuple(indices), tuple(shape[:sparse_dims])).astype(np.int64)
    rows_in = np.ascontiguousarray(values).reshape(len(keys), row_count)
    _scatter_rows_kernel(dense, mask, keys, rows_in.astype(wire, copy=False))
    op = ReduceOp.BOR if dtype == np.bool_ else ReduceOp.SUM
    # Over the rings, as the rest of this call: its arena turn is not taken.
    algorithm = choose(cfg, "allreduce", None, flat.nbytes, comm.size, shared=False)
    algorithm.run(_Phase(comm, 2), HostBuffer(flat, compile_op(op, wire)),
                  segment_count(cfg, wire.itemsize))
    out_keys = np.flatnonzero(mask)
    out_indices = np.array(np.unravel_index(out_keys, tuple(shape[:sparse_dims])),
                           dtype=np.int64).reshape(sparse_dims, -1)
    out_values = _gather_rows_kernel(dense, out_keys).reshape((-1,) + tuple(shape[sparse_dims:]))
    if dtype == np.bool_:
        out_values = out_values != 0
    return SparseCOO._trusted(out_indices, out_values.astype(dtype, copy=False), shape, True)


def _dense_wire(dtype: np.dtype) -> np.dtype:
    """The dtype the dense path reduces in: float32 for 16-bit floats (rounded once
    at the end), uint8 for bool (or-ed), the values' own otherwise."""
    if is_half(dtype):
        return np.dtype(np.float32)
    return np.dtype(np.uint8) if dtype == np.bool_ else dtype


def _like(a: SparseCOO, result: SparseCOO) -> SparseCOO:
    """``result`` for input ``a``: its own copy, in device memory if ``a`` was there."""
    if a.on_device:
        from numba import cuda  # lazy: only device inputs load numba.cuda

        return SparseCOO._trusted(cuda.to_device(result.indices),
                                  cuda.to_device(result.values), result.shape, True)
    return result.copy()


def _host(a) -> np.ndarray:
    return a.copy_to_host() if hasattr(a, "copy_to_host") else np.asarray(a)


class _Phase:
    """``comm`` with its message steps moved to a range of their own."""

    def __init__(self, comm, phase: int):
        self._comm, self._offset = comm, phase * _PHASE_STEPS
        self.rank, self.size = comm.rank, comm.size

    def isend(self, peer, step, buf):
        return self._comm.isend(peer, self._offset + step, buf)

    def irecv(self, peer, step, buf=None):
        return self._comm.irecv(peer, self._offset + step, buf)

    def sendrecv(self, send_peer, recv_peer, step, send_buf, recv_buf=None):
        return self._comm.sendrecv(send_peer, recv_peer, self._offset + step, send_buf,
                                   recv_buf)

    def wait(self, pending):
        return self._comm.wait(pending)

    def wait_all(self, pendings):
        return self._comm.wait_all(pendings)
