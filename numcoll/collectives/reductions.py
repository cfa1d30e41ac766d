"""Collectives that reduce: allreduce (+coalesced), reduce, reduce_scatter (+tensor, coalesced)."""

from __future__ import annotations

import dataclasses

from ..memory.arrays import as_array_list, check_same_type_and_size, check_writable
from ..call import Call, nbytes_of, op_fields, shapes
from ..algorithms import SHARED
from ..memory.buffers import ShareBuffer
from ..kernels.pack_plan import PackPlan
from ..options import AllreduceCoalescedOptions, AllreduceOptions, ReduceOptions, ReduceScatterOptions
from ..memory.reduction import Reduction
from .checks import (check_pairs, check_root_rank, check_root_tensor, check_same_dtype,
                     originals)
from .choice import choose, segment_count
from ..memory.host import memory_of
from .sparse import allreduce_sparse, check_coalesced_layouts, is_sparse_call

__all__ = ["Reductions"]

# Read, never written: a call without options uses these instead of building one.
_ALLREDUCE_DEFAULTS = AllreduceOptions()
_REDUCE_DEFAULTS = ReduceOptions()
# Call plans a group keeps (see Reductions._call_plan): one per shape, dtype and op in use.
_CALL_PLANS_KEPT = 256


class Reductions:
    """Mixin of :class:`~numcoll.ProcessGroup`: the reducing collectives."""

    def _call_plan(self, key: tuple):
        """What an earlier call with the same ``key`` worked out (None if none):
        a :class:`Reduction`, the algorithm, the segment size and the
        :class:`Call`. A key holding an unhashable option finds nothing; the
        checks then say what is wrong with it."""
        try:
            return self._call_plans.get(key)
        except TypeError:
            return None

    def _keep_call_plan(self, key: tuple, plan: tuple) -> tuple:
        plans = self._call_plans
        if len(plans) >= _CALL_PLANS_KEPT:  # many shapes: start again, not grow forever
            plans.clear()
        plans[key] = plan
        return plan

    def _reduction(self, op, dtype, name, xp) -> Reduction:
        # A plan per (op, dtype, memory) and group: building one (checks and a
        # compiled-kernel lookup) is a sizeable part of a small call's cost.
        key = (op, dtype, xp.is_device)
        red = self._reduction_plans.get(key)
        if red is None:
            red = self._reduction_plans[key] = Reduction(op, dtype, self._size, self._cfg.half_wire, name,
                                         device=xp.is_device)
        return red

    def allreduce(self, arrays, opts: AllreduceOptions | None = None, *, op=None):
        """Reduce ``arrays`` across ranks; every rank gets the result in every array.

        ``arrays`` is one array or a list of same-shape, same-dtype arrays (all
        of them are reduced locally first, as in Gloo). ``op`` overrides
        ``opts.reduce_op``. The future's value is the list of arrays.
        """
        name = "allreduce"
        opts = opts or _ALLREDUCE_DEFAULTS
        reduce_op = opts.reduce_op if op is None else op
        if is_sparse_call(arrays):
            return allreduce_sparse(self, arrays, _with_op(opts, op))
        outs = originals(arrays)
        arrays = as_array_list(arrays, name)
        if not arrays:
            raise ValueError(f"{name}: requires non-empty tensor list")
        xp = memory_of(name, arrays)
        check_same_type_and_size(arrays, name)
        check_writable(arrays, name)
        first = arrays[0]
        # Everything below follows from these (the checks above made every
        # array alike), so a repeated call reuses it: the plan, algorithm and
        # call descriptor are most of a small call's cost.
        key = (name, first.dtype, first.shape, len(arrays), xp.is_device, reduce_op,
               opts.algorithm, opts.timeout, self._timeout_s)
        plan = self._call_plan(key)
        if plan is None:
            red = self._reduction(reduce_op, first.dtype, name, xp)
            nbytes = first.size * red.wire_dtype.itemsize
            algorithm = choose(self._cfg, name, opts.algorithm, nbytes, self._size)
            call = Call(name, self._timeout_for(opts, name), first.dtype, first.size,
                        root=-1, algorithm=algorithm.name, input_sizes=shapes(arrays),
                        output_sizes=shapes(arrays), nbytes=nbytes, op=reduce_op.name,
                        custom_op=reduce_op.is_custom)
            plan = self._keep_call_plan(key, (red, algorithm,
                                              segment_count(self._cfg, red.wire_dtype.itemsize),
                                              call))
        red, algorithm, seg, call = plan

        def run(comm, work):
            steps = xp.steps(red)
            buf, in_place = steps.load(arrays)
            algorithm.run(comm, xp.buffer(buf, steps.reduce), seg)
            steps.finish(buf)
            for a in arrays if not in_place else ():
                steps.store(buf, a)
            return outs

        return self._enqueue(call, xp.wrap(run))

    def allreduce_coalesced(self, arrays, opts: AllreduceCoalescedOptions | None = None):
        """Allreduce a list of arrays of one dtype and any shapes as one message."""
        name = "allreduce_coalesced"
        opts = opts or AllreduceCoalescedOptions()
        check_coalesced_layouts(arrays, name)
        outs = originals(arrays)
        arrays = as_array_list(arrays, name)
        if not arrays:
            raise ValueError(f"{name}: requires non-empty tensor list")
        xp = memory_of(name, arrays)
        check_same_dtype(arrays, name)
        check_writable(arrays, name)
        red = self._reduction(opts.reduce_op, arrays[0].dtype, name, xp)
        total = sum(a.size for a in arrays)
        algorithm = choose(self._cfg, "allreduce", opts.algorithm,
                           total * red.wire_dtype.itemsize, self._size)
        seg = segment_count(self._cfg, red.wire_dtype.itemsize)
        call = Call(name, self._timeout_for(opts, name), arrays[0].dtype, total,
                    algorithm=algorithm.name, input_sizes=shapes(arrays),
                    output_sizes=shapes(arrays), nbytes=nbytes_of(arrays),
                    **op_fields(opts.reduce_op))
        # Host arrays that travel as they are: one Numba call packs them all,
        # one unpacks (16-bit floats widen and premul_sum scales: per array).
        plan = (PackPlan(arrays, name) if not xp.is_device and not red.widen
                and red.factor is None and all(a.flags.c_contiguous for a in arrays) else None)

        def run(comm, work):
            steps = xp.steps(red)
            if plan is not None:
                buf = plan.pack()
                algorithm.run(comm, xp.buffer(buf, steps.reduce), seg)
                steps.finish(buf)
                plan.unpack(buf)
                return outs
            buf = xp.empty(total, red.wire_dtype)
            offsets = _pack(steps, arrays, buf)
            algorithm.run(comm, xp.buffer(buf, steps.reduce), seg)
            steps.finish(buf)
            for a, (start, n) in zip(arrays, offsets):
                steps.store(buf[start:start + n], a)
            return outs

        return self._enqueue(call, xp.wrap(run))

    def reduce(self, arrays, opts: ReduceOptions | None = None, *, op=None, root=None):
        """Reduce into ``arrays[opts.root_tensor]`` of rank ``opts.root_rank``.

        Other ranks' arrays are left unchanged (they reduce in a scratch copy).
        """
        name = "reduce"
        opts = opts or _REDUCE_DEFAULTS
        reduce_op = opts.reduce_op if op is None else op
        root_rank = opts.root_rank if root is None else root
        outs = originals(arrays)
        arrays = as_array_list(arrays, name)
        check_root_rank(root_rank, self._size, name)
        check_root_tensor(opts.root_tensor, len(arrays), name)
        if len(arrays) != 1:
            raise ValueError(f"{name}: requires a single-element tensor list "
                             f"(got {len(arrays)})")
        arr = arrays[0]
        xp = memory_of(name, arrays)
        is_root = self._rank == root_rank
        if is_root:
            check_writable(arrays, name)
        red = self._reduction(reduce_op, arr.dtype, name, xp)
        algorithm = choose(self._cfg, name, opts.algorithm, arr.size * red.wire_dtype.itemsize,
                           self._size)
        seg = segment_count(self._cfg, red.wire_dtype.itemsize)
        call = Call(name, self._timeout_for(opts, name), arr.dtype, arr.size,
                    root=root_rank, algorithm=algorithm.name, input_sizes=shapes(arrays),
                    output_sizes=shapes(arrays) if is_root else (), nbytes=nbytes_of(arrays),
                    **op_fields(reduce_op))

        def run(comm, work):
            steps = xp.steps(red)
            buf, in_place = steps.load(arrays) if is_root else (steps.to_wire(arr), False)
            algorithm.run(comm, xp.buffer(buf, steps.reduce), root_rank, seg)
            if is_root:
                steps.finish(buf)
                if not in_place:
                    steps.store(buf, arr)
            return outs

        return self._enqueue(call, xp.wrap(run))

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
        xp = memory_of(name, outputs, inputs)
        check_same_dtype([out, *inputs], name)
        check_writable(outputs, name)
        if inputs[self._rank].size != out.size:
            raise ValueError(f"{name}: invalid tensor size: input {self._rank} has "
                             f"{inputs[self._rank].size} elements, the output {out.size}")
        red = self._reduction(opts.reduce_op, out.dtype, name, xp)
        seg = segment_count(self._cfg, red.wire_dtype.itemsize)
        total = sum(a.size for a in inputs)
        algorithm = choose(self._cfg, "reduce_scatter", opts.algorithm,
                           total * red.wire_dtype.itemsize, self._size)
        call = Call(name, self._timeout_for(opts, name), out.dtype, total,
                    algorithm=algorithm.name, input_sizes=shapes(inputs),
                    output_sizes=shapes(outputs), nbytes=nbytes_of(inputs),
                    **op_fields(opts.reduce_op))

        def run(comm, work):
            steps = xp.steps(red)
            buf = xp.empty(total, red.wire_dtype)
            chunks = _pack(steps, inputs, buf)
            algorithm.run(comm, xp.buffer(buf, steps.reduce), chunks, seg)
            mine = _slice(buf, chunks[self._rank])
            steps.finish(mine)
            steps.store(mine, out)
            return outs

        return self._enqueue(call, xp.wrap(run))

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
        check_pairs(outputs, inputs, self._size, name, gathered="input")
        xp = memory_of(name, outputs, inputs)
        check_same_dtype(outputs, name)
        check_writable(outputs, name)
        red = self._reduction(opts.reduce_op, outputs[0].dtype, name, xp)
        seg = segment_count(self._cfg, red.wire_dtype.itemsize)
        share = sum(o.size for o in outputs)
        chunks = [(r * share, share) for r in range(self._size)]
        algorithm = choose(self._cfg, "reduce_scatter", opts.algorithm,
                           share * self._size * red.wire_dtype.itemsize, self._size)
        call = Call(name, self._timeout_for(opts, name), outputs[0].dtype, share * self._size,
                    algorithm=algorithm.name, input_sizes=shapes(inputs),
                    output_sizes=shapes(outputs), nbytes=nbytes_of(inputs),
                    **op_fields(opts.reduce_op))

        # One host pair that travels as it is, on the shared arena: the
        # algorithm reads the input where it lies and writes only this rank's
        # share, straight into the output (no copy of the whole input).
        in_place_share = (algorithm.name in SHARED and len(inputs) == 1 and not xp.is_device
                          and not red.widen and red.factor is None
                          and inputs[0].flags.c_contiguous and outputs[0].flags.c_contiguous)

        def run(comm, work):
            steps = xp.steps(red)
            if in_place_share:
                whole, own = inputs[0].reshape(-1), outputs[0].reshape(-1)
                mine = whole[self._rank * share:(self._rank + 1) * share]
                if not xp.overlaps(own, mine):  # else the output is that share already
                    xp.assign(own, mine)
                algorithm.run(comm, ShareBuffer(whole, own, self._rank * share, steps.reduce),
                              chunks, seg)
                steps.finish(own)
                return [outs]
            # Lay the buffer out share-major: [rank 0's share of every pair,
            # rank 1's share of every pair, ...], so one ring moves them all.
            if len(inputs) == 1:
                buf = steps.to_wire(inputs[0])  # already share-major: a single copy
            else:
                buf = xp.empty(share * self._size, red.wire_dtype)
                col = 0
                for o, i in zip(outputs, inputs):
                    xp.assign(buf.reshape(self._size, share)[:, col:col + o.size],
                              steps.to_wire(i).reshape(self._size, o.size))
                    col += o.size
            algorithm.run(comm, xp.buffer(buf, steps.reduce), chunks, seg)
            mine = buf[self._rank * share:(self._rank + 1) * share]
            steps.finish(mine)
            col = 0
            for o in outputs:
                steps.store(mine[col:col + o.size], o)
                col += o.size
            return [outs] if single else outs

        return self._enqueue(call, xp.wrap(run))


def _with_op(opts, op):
    return opts if op is None else dataclasses.replace(opts, reduce_op=op)


def _pack(steps, arrays, buf) -> list[tuple[int, int]]:
    """Copy ``arrays`` back to back into ``buf`` (in the wire dtype); their (start, count)."""
    offsets, start = [], 0
    for a in arrays:
        steps.to_wire(a, buf[start:start + a.size])
        offsets.append((start, a.size))
        start += a.size
    return offsets


def _slice(buf, bounds):
    start, n = bounds
    return buf[start:start + n]
