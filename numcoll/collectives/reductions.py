"""Collectives that reduce: allreduce (+coalesced), reduce, reduce_scatter (+tensor, coalesced)."""

from __future__ import annotations

import dataclasses

import numpy as np

from ..algorithms import reduce_scatter_ring
from ..algorithms.partition import chunk_bounds
from ..arrays import as_array, as_array_list, check_same_type_and_size, check_writable
from ..buffers import HostBuffer
from ..options import AllreduceCoalescedOptions, AllreduceOptions, ReduceOptions, ReduceScatterOptions
from ..reduction import Reduction
from .checks import check_root_rank, check_root_tensor, check_same_dtype, originals
from .choice import choose, segment_count

__all__ = ["Reductions"]


class Reductions:
    """Mixin of :class:`~numcoll.ProcessGroup`: the reducing collectives."""

    def _reduction(self, op, dtype, name) -> Reduction:
        return Reduction(op, dtype, self._size, self._cfg.half_wire, name)

    def allreduce(self, arrays, opts: AllreduceOptions | None = None, *, op=None):
        """Reduce ``arrays`` across ranks; every rank gets the result in every array.

        ``arrays`` is one array or a list of same-shape, same-dtype arrays (all
        of them are reduced locally first, as in Gloo). ``op`` overrides
        ``opts.reduce_op``. The future's value is the list of arrays.
        """
        name = "allreduce"
        opts = _with_op(opts or AllreduceOptions(), op)
        outs = originals(arrays)
        arrays = as_array_list(arrays, name)
        if not arrays:
            raise ValueError(f"{name}: requires non-empty tensor list")
        check_same_type_and_size(arrays, name)
        check_writable(arrays, name)
        red = self._reduction(opts.reduce_op, arrays[0].dtype, name)
        nbytes = arrays[0].size * red.wire_dtype.itemsize
        algorithm = choose(self._cfg, name, opts.algorithm, nbytes, self._size)
        seg = segment_count(self._cfg, red.wire_dtype.itemsize)

        def run(comm, work):
            buf, in_place = red.load(arrays)
            algorithm(comm, HostBuffer(buf, red.reduce), seg)
            red.finish(buf)
            for a in arrays if not in_place else ():
                red.store(buf, a)
            return outs

        return self._enqueue(name, run, self._timeout_for(opts))

    def allreduce_coalesced(self, arrays, opts: AllreduceCoalescedOptions | None = None):
        """Allreduce a list of arrays of one dtype and any shapes as one message."""
        name = "allreduce_coalesced"
        opts = opts or AllreduceCoalescedOptions()
        outs = originals(arrays)
        arrays = as_array_list(arrays, name)
        if not arrays:
            raise ValueError(f"{name}: requires non-empty tensor list")
        check_same_dtype(arrays, name)
        check_writable(arrays, name)
        red = self._reduction(opts.reduce_op, arrays[0].dtype, name)
        total = sum(a.size for a in arrays)
        algorithm = choose(self._cfg, "allreduce", opts.algorithm,
                           total * red.wire_dtype.itemsize, self._size)
        seg = segment_count(self._cfg, red.wire_dtype.itemsize)

        def run(comm, work):
            buf = np.empty(total, red.wire_dtype)
            offsets = _pack(red, arrays, buf)
            algorithm(comm, HostBuffer(buf, red.reduce), seg)
            red.finish(buf)
            for a, (start, n) in zip(arrays, offsets):
                red.store(buf[start:start + n], a)
            return outs

        return self._enqueue(name, run, self._timeout_for(opts))

    def reduce(self, arrays, opts: ReduceOptions | None = None, *, op=None, root=None):
        """Reduce into ``arrays[opts.root_tensor]`` of rank ``opts.root_rank``.

        Other ranks' arrays are left unchanged (they reduce in a scratch copy).
        """
        name = "reduce"
        opts = _with_op(opts or ReduceOptions(), op)
        if root is not None:
            opts = dataclasses.replace(opts, root_rank=root)
        outs = originals(arrays)
        arrays = as_array_list(arrays, name)
        check_root_rank(opts.root_rank, self._size, name)
        check_root_tensor(opts.root_tensor, len(arrays), name)
        if len(arrays) != 1:
            raise ValueError(f"{name}: requires a single-element tensor list "
                             f"(got {len(arrays)})")
        arr = arrays[0]
        is_root = self._rank == opts.root_rank
        if is_root:
            check_writable(arrays, name)
        red = self._reduction(opts.reduce_op, arr.dtype, name)
        algorithm = choose(self._cfg, name, opts.algorithm, arr.size * red.wire_dtype.itemsize,
                           self._size)
        seg = segment_count(self._cfg, red.wire_dtype.itemsize)

        def run(comm, work):
            buf, in_place = red.load(arrays) if is_root else (red.to_wire(arr), False)
            algorithm(comm, HostBuffer(buf, red.reduce), opts.root_rank, seg)
            if is_root:
                red.finish(buf)
                if not in_place:
                    red.store(buf, arr)
            return outs

        return self._enqueue(name, run, self._timeout_for(opts))

    def reduce_scatter(self, output_list, input_lists, opts: ReduceScatterOptions | None = None):
        """Rank r gets the reduction over ranks of ``input_lists[0][r]`` in
        ``output_list[0]``. Shares may differ in size per rank (``input[r]``
        must match rank r's output)."""
        name = "reduce_scatter"
        opts = opts or ReduceScatterOptions()
        outs = originals(output_list)
        outputs = as_array_list(output_list, name)
        if len(outputs) != 1:
            raise ValueError(f"{name}: requires a single-element output list (got {len(outputs)})")
        if not isinstance(input_lists, (list, tuple)) or len(input_lists) != 1:
            raise ValueError(f"{name}: requires a single-element input list")
        inputs = as_array_list(input_lists[0], name, allow_single=False)
        if len(inputs) != self._size:
            raise ValueError(f"{name}: Incorrect input list size {len(inputs)}. "
                             f"Input list size should be {self._size}")
        out = outputs[0]
        check_same_dtype([out, *inputs], name)
        check_writable(outputs, name)
        if inputs[self._rank].size != out.size:
            raise ValueError(f"{name}: invalid tensor size: input {self._rank} has "
                             f"{inputs[self._rank].size} elements, the output {out.size}")
        red = self._reduction(opts.reduce_op, out.dtype, name)
        seg = segment_count(self._cfg, red.wire_dtype.itemsize)

        def run(comm, work):
            buf = np.empty(sum(a.size for a in inputs), red.wire_dtype)
            chunks = _pack(red, inputs, buf)
            reduce_scatter_ring(comm, HostBuffer(buf, red.reduce), chunks, seg)
            mine = _slice(buf, chunks[self._rank])
            red.finish(mine)
            red.store(mine, out)
            return outs

        return self._enqueue(name, run, self._timeout_for(opts))

    def reduce_scatter_tensor(self, output, input, opts: ReduceScatterOptions | None = None):
        """Rank r gets the reduction of the r-th of ``world_size`` equal slices of
        every rank's ``input`` (``input.size == output.size * world_size``)."""
        return self.reduce_scatter_tensor_coalesced([output], [input], opts,
                                                    _name="reduce_scatter_tensor")

    def reduce_scatter_tensor_coalesced(self, outputs, inputs,
                                        opts: ReduceScatterOptions | None = None, *,
                                        _name: str = "reduce_scatter_tensor_coalesced"):
        """``reduce_scatter_tensor`` for several (output, input) pairs in one
        ring: share r of every pair travels together."""
        name = _name
        opts = opts or ReduceScatterOptions()
        single = name == "reduce_scatter_tensor"
        outs = outputs if single else originals(outputs)
        outputs = as_array_list(outputs, name)
        inputs = as_array_list(inputs, name)
        if len(outputs) != len(inputs):
            raise ValueError(f"{name}: requires input/output tensor lists to have the same "
                             f"length ({len(inputs)} inputs, {len(outputs)} outputs)")
        if not outputs:
            raise ValueError(f"{name}: requires non-empty tensor list")
        for o, i in zip(outputs, inputs):
            if o.dtype != i.dtype:
                raise TypeError(f"{name}: input and output tensors must have the same type "
                                f"({i.dtype} vs {o.dtype})")
            if i.size != o.size * self._size:
                raise ValueError(
                    f"{name}: input and output tensors must have the same size times world "
                    f"size: input has {i.size} elements, output {o.size} x {self._size} ranks")
        check_same_dtype(outputs, name)
        check_writable(outputs, name)
        red = self._reduction(opts.reduce_op, outputs[0].dtype, name)
        seg = segment_count(self._cfg, red.wire_dtype.itemsize)
        share = sum(o.size for o in outputs)
        chunks = [(r * share, share) for r in range(self._size)]

        def run(comm, work):
            # Lay the buffer out share-major: [rank 0's share of every pair,
            # rank 1's share of every pair, ...], so one ring moves them all.
            if len(inputs) == 1:
                buf = red.to_wire(inputs[0])  # already share-major: a single copy
            else:
                buf = np.empty(share * self._size, red.wire_dtype)
                col = 0
                for o, i in zip(outputs, inputs):
                    buf.reshape(self._size, share)[:, col:col + o.size] = \
                        red.to_wire(i).reshape(self._size, o.size)
                    col += o.size
            view = buf.reshape(self._size, share)
            reduce_scatter_ring(comm, HostBuffer(buf, red.reduce), chunks, seg)
            mine = view[self._rank]
            red.finish(mine)
            col = 0
            for o in outputs:
                red.store(mine[col:col + o.size], o)
                col += o.size
            return [outs] if single else outs

        return self._enqueue(name, run, self._timeout_for(opts))


def _with_op(opts, op):
    return opts if op is None else dataclasses.replace(opts, reduce_op=op)


def _pack(red: Reduction, arrays, buf) -> list[tuple[int, int]]:
    """Copy ``arrays`` back to back into ``buf`` (in the wire dtype); their (start, count)."""
    offsets, start = [], 0
    for a in arrays:
        red.to_wire(a, buf[start:start + a.size])
        offsets.append((start, a.size))
        start += a.size
    return offsets


def _slice(buf, bounds):
    start, n = bounds
    return buf[start:start + n]
