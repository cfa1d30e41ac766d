"""Collectives that reduce: allreduce (+coalesced), reduce, reduce_scatter (+tensor, coalesced).

Builders (see :mod:`.context`): ``allreduce(ctx, arrays, opts, op) -> (Call, run)``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..call import Call, nbytes_of, op_fields, shapes
from ..algorithms import SHARED
from ..kernels.pack_plan import PackPlan
from ..memory.arrays import as_array_list, check_writable, memory_of, uniform_arrays
from ..memory.host import HOST, ShareBuffer
from ..memory.overlap import check_overlap, same_view, shares_memory
from ..options import AllreduceCoalescedOptions, AllreduceOptions, ReduceOptions, ReduceScatterOptions
from .checks import (check_pairs, check_root_rank, check_root_tensor, check_same_dtype,
                     originals)
from .context import GroupContext, cached, check_options
from . import shared_arrays
from .arena_step import ArenaStep
from .sparse import allreduce_sparse, check_coalesced_layouts, is_sparse_call

__all__ = ["allreduce", "allreduce_coalesced", "reduce", "reduce_scatter",
           "reduce_scatter_tensor_coalesced"]

# Read, never written: a call without options uses these instead of building one.
_ALLREDUCE_DEFAULTS = AllreduceOptions()
_REDUCE_DEFAULTS = ReduceOptions()
_COALESCED_DEFAULTS = AllreduceCoalescedOptions()
_REDUCE_SCATTER_DEFAULTS = ReduceScatterOptions()


def allreduce(ctx: GroupContext, arrays, opts: AllreduceOptions | None = None, op=None):
    """Reduce ``arrays`` across ranks; every rank gets the result in every array.

    ``arrays`` is one array or a list of same-shape, same-dtype arrays (all
    of them are reduced locally first, as in Gloo). ``op`` overrides
    ``opts.reduce_op``. The future's value is the list of arrays.
    """
    name = "allreduce"
    opts = opts or _ALLREDUCE_DEFAULTS
    reduce_op = opts.reduce_op if op is None else op
    if not _plain(arrays) and is_sparse_call(arrays):
        return allreduce_sparse(ctx, arrays, _with_op(opts, op))
    # What the caller passed, as a list: the future's value hands back the
    # caller's own objects (torch tensors stay torch tensors).
    outs = list(arrays) if isinstance(arrays, (list, tuple)) else [arrays]
    arrays, xp = uniform_arrays(outs, name)  # a list: its one-array fast path applies
    first = arrays[0]
    if ctx.shared_memory is not None and first.nbytes >= ctx.cfg.shared_arrays_min_nbytes \
            and (found := shared_arrays.allreduce(ctx, arrays, outs, reduce_op, opts)):
        return found
    # Everything below follows from these (the checks above made every array
    # alike), so a repeated call reuses it: the plan, algorithm and call
    # descriptor are most of a small call's cost.
    key = (name, first.dtype, first.shape, len(arrays), xp.is_device,
           getattr(reduce_op, "_key", None), opts.algorithm, opts.timeout)
    try:
        plan = ctx.plans.get(key)
    except TypeError:  # an unhashable option
        check_options(opts, name)
        raise
    if plan is None:
        plan = ctx.keep(key, _allreduce_plan(ctx, name, first, arrays, xp, reduce_op, opts))
    else:
        ctx.plans.move_to_end(key)
    red, algorithm, seg, call, one = plan
    planned = (xp, red, algorithm, seg, one)
    run = _allreduce_run(planned, arrays, outs)
    if len(arrays) == 1 and not xp.is_device:
        run.remake = (_allreduce_remake, planned)  # (see .context: a repeat's remake)
    return call, run


def _allreduce_run(planned, arrays, outs):
    """The run of :func:`allreduce` on ``arrays``, as its checks planned it;
    ``outs``: the future's value."""
    xp, red, algorithm, seg, one = planned
    first = arrays[0]
    if one is not None and first.flags.c_contiguous:  # one arena step: see .arena_step
        flat = first if first.ndim == 1 else first.reshape(-1)

        def run_one(comm, work):
            one.run(comm, flat)
            return outs

        return run_one
    steps = red.host_steps if xp is HOST else xp.steps(red)

    def run(comm, work):
        buf, in_place = steps.work_buffer(arrays)
        algorithm.run(comm, buf, seg)
        if red.divisor is not None:
            steps.finish(buf.array)
        if not in_place:
            for a in arrays:
                steps.store(buf.array, a)
        return outs

    return xp.wrap(run)


def _allreduce_remake(planned, tensor):
    """The run of an ``all_reduce(tensor)`` planned as ``planned`` for this very
    array (:mod:`numcoll.fast.replay`)."""
    return _allreduce_run(planned, [tensor], [tensor])


def _allreduce_plan(ctx, name, first, arrays, xp, reduce_op, opts):
    red = ctx.reduction(reduce_op, first.dtype, name, xp.is_device)
    nbytes = first.size * red.wire_dtype.itemsize
    algorithm = ctx.choose(name, opts.algorithm, nbytes, device=xp.is_device)
    call = Call(name, ctx.timeout_for(opts, name), first.dtype, first.size, root=-1,
                algorithm=algorithm.name, input_sizes=shapes(arrays),
                output_sizes=shapes(arrays), nbytes=nbytes, settings=ctx.settings,
                **op_fields(reduce_op))
    one = ArenaStep.plan(ctx, algorithm.name, red, first, len(arrays))
    return red, algorithm, ctx.segment(red.wire_dtype.itemsize), call, one


def allreduce_coalesced(ctx: GroupContext, arrays, opts: AllreduceCoalescedOptions | None = None):
    """Allreduce a list of arrays of one dtype and any shapes as one message."""
    name = "allreduce_coalesced"
    opts = opts or _COALESCED_DEFAULTS
    check_coalesced_layouts(arrays, name)
    outs = originals(arrays)
    arrays = as_array_list(arrays, name)
    if not arrays:
        raise ValueError(f"{name}: requires non-empty tensor list")
    xp = memory_of(name, arrays)
    check_same_dtype(arrays, name)
    check_writable(arrays, name)
    # Each array gets the reduction of itself: one passed twice gets one result twice.
    check_overlap(name, arrays, same_result=True)
    total = sum(a.size for a in arrays)
    key = (name, arrays[0].dtype, shapes(arrays), xp.is_device,
           getattr(opts.reduce_op, "_key", None), opts.algorithm, opts.timeout)
    red, algorithm, seg, call = cached(ctx, key, opts, name, _reduction_plan, ctx, name,
                                       "allreduce", arrays, arrays, total, xp, opts)
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

    return call, xp.wrap(run)


def reduce(ctx: GroupContext, arrays, opts: ReduceOptions | None = None, op=None, root=None):
    """Reduce into ``arrays[opts.root_tensor]`` of rank ``opts.root_rank``.

    Other ranks' arrays are left unchanged (they reduce in a scratch copy).
    """
    name = "reduce"
    opts = opts or _REDUCE_DEFAULTS
    reduce_op = opts.reduce_op if op is None else op
    root_rank = opts.root_rank if root is None else root
    outs = originals(arrays)
    arrays = as_array_list(arrays, name)
    check_root_rank(root_rank, ctx.size, name)
    check_root_tensor(opts.root_tensor, len(arrays), name)
    if len(arrays) != 1:
        raise ValueError(f"{name}: requires a single-element tensor list "
                         f"(got {len(arrays)})")
    arr = arrays[0]
    xp = memory_of(name, arrays)
    is_root = ctx.rank == root_rank
    if is_root:
        check_writable(arrays, name)
    if ctx.shared_memory is not None and arr.nbytes >= ctx.cfg.shared_arrays_min_nbytes and \
            (found := shared_arrays.reduce(ctx, arrays, outs, reduce_op, root_rank, opts)):
        return found
    key = (name, arr.dtype, arr.shape, xp.is_device, root_rank,
           getattr(reduce_op, "_key", None), opts.algorithm, opts.timeout)
    red, algorithm, seg, call = cached(ctx, key, opts, name, _reduce_plan, ctx, name,
                                       arrays, xp, reduce_op, root_rank, opts)
    # A non-root rank's buffer is scratch for the trees and the ring; the
    # arena's reduce only reads it, so it can be the caller's array itself
    # (16 MiB on 2 ranks: a copy of 16 MiB less per call on that rank).
    read_only = (not is_root and algorithm.name == "shared" and not xp.is_device
                 and arr.dtype == red.wire_dtype and red.factor is None
                 and arr.flags.c_contiguous)
    planned = (xp, red, algorithm, seg, root_rank, is_root, read_only)
    run = xp.wrap(_reduce_run(planned, arrays, outs))
    if not xp.is_device:
        run.remake = (_reduce_remake, planned)  # (see .context: a repeat's remake)
    return call, run


def _reduce_run(planned, arrays, outs):
    """The run of :func:`reduce` on ``arrays`` (one), as its checks planned it;
    ``outs``: the future's value."""
    xp, red, algorithm, seg, root_rank, is_root, read_only = planned
    arr = arrays[0]

    def run(comm, work):
        steps = xp.steps(red)
        if read_only:
            buf, in_place = arr.reshape(-1), False
        else:
            buf, in_place = steps.load(arrays) if is_root else (steps.to_wire(arr), False)
        algorithm.run(comm, xp.buffer(buf, steps.reduce), root_rank, seg)
        if is_root:
            steps.finish(buf)
            if not in_place:
                steps.store(buf, arr)
        return outs

    return run


def _reduce_remake(planned, tensor):
    """The run of a ``reduce(tensor)`` planned as ``planned`` for this very
    array (:mod:`numcoll.fast.replay`)."""
    return _reduce_run(planned, [tensor], [tensor])


def _reduce_plan(ctx, name, arrays, xp, reduce_op, root_rank, opts):
    arr = arrays[0]
    red = ctx.reduction(reduce_op, arr.dtype, name, xp.is_device)
    algorithm = ctx.choose(name, opts.algorithm, arr.size * red.wire_dtype.itemsize,
                           device=xp.is_device)
    is_root = ctx.rank == root_rank
    call = Call(name, ctx.timeout_for(opts, name), arr.dtype, arr.size,
                root=root_rank, algorithm=algorithm.name, input_sizes=shapes(arrays),
                output_sizes=shapes(arrays) if is_root else (), nbytes=nbytes_of(arrays),
                **op_fields(reduce_op), settings=ctx.settings)
    return red, algorithm, ctx.segment(red.wire_dtype.itemsize), call


def reduce_scatter(ctx: GroupContext, output_list, input_lists,
                   opts: ReduceScatterOptions | None = None):
    """Rank r gets the reduction over ranks of ``input_lists[0][r]`` in
    ``output_list[0]``. Shares may differ in size per rank (``input[r]``
    must match rank r's output)."""
    name = "reduce_scatter"
    opts = opts or _REDUCE_SCATTER_DEFAULTS
    size, rank = ctx.size, ctx.rank
    outs = originals(output_list)
    outputs = as_array_list(output_list, name)
    if len(outputs) != 1:
        raise ValueError(f"{name}: requires a single-element output list (got {len(outputs)})")
    if not isinstance(input_lists, (list, tuple)) or len(input_lists) != 1:
        raise ValueError(f"{name}: requires a single-element input list")
    inputs = as_array_list(input_lists[0], name, allow_single=False)
    if len(inputs) != size:
        raise ValueError(f"{name}: Incorrect input list size {len(inputs)}. "
                         f"Input list size should be {size}")
    out = outputs[0]
    xp = memory_of(name, outputs, inputs)
    check_same_dtype([out, *inputs], name)
    check_writable(outputs, name)
    if inputs[rank].size != out.size:
        raise ValueError(f"{name}: invalid tensor size: input {rank} has "
                         f"{inputs[rank].size} elements, the output {out.size}")
    total = sum(a.size for a in inputs)
    key = (name, out.dtype, shapes(inputs), shapes(outputs), xp.is_device,
           getattr(opts.reduce_op, "_key", None), opts.algorithm, opts.timeout)
    red, algorithm, seg, call = cached(ctx, key, opts, name, _reduction_plan, ctx, name,
                                       "reduce_scatter", inputs, outputs, total, xp, opts)

    def run(comm, work):
        steps = xp.steps(red)
        buf = xp.empty(total, red.wire_dtype)
        chunks = _pack(steps, inputs, buf)
        algorithm.run(comm, xp.buffer(buf, steps.reduce), chunks, seg)
        mine = _slice(buf, chunks[rank])
        steps.finish(mine)
        steps.store(mine, out)
        return outs

    return call, xp.wrap(run)


def _reduction_plan(ctx, name, collective, inputs, outputs, total, xp, opts):
    """The reduction, algorithm (``collective``'s), segment and call of a
    coalesced allreduce or of the reduce_scatter family; ``total`` is the
    elements of a rank's whole input."""
    red = ctx.reduction(opts.reduce_op, outputs[0].dtype, name, xp.is_device)
    algorithm = ctx.choose(collective, opts.algorithm, total * red.wire_dtype.itemsize,
                           device=xp.is_device)
    call = Call(name, ctx.timeout_for(opts, name), outputs[0].dtype, total,
                algorithm=algorithm.name, input_sizes=shapes(inputs),
                output_sizes=shapes(outputs), nbytes=nbytes_of(inputs),
                **op_fields(opts.reduce_op), settings=ctx.settings)
    return red, algorithm, ctx.segment(red.wire_dtype.itemsize), call


def reduce_scatter_tensor_coalesced(ctx: GroupContext, outputs, inputs,
                                    opts: ReduceScatterOptions | None = None, *,
                                    name: str = "reduce_scatter_tensor_coalesced"):
    """Rank r gets the reduction of the r-th of ``world_size`` equal slices of
    every rank's input, for several (output, input) pairs in one ring: share r
    of every pair travels together. With ``name="reduce_scatter_tensor"``,
    ``outputs``/``inputs`` are single arrays (``reduce_scatter_tensor``)."""
    opts = opts or _REDUCE_SCATTER_DEFAULTS
    size, rank = ctx.size, ctx.rank
    single = name == "reduce_scatter_tensor"
    outs = outputs if single else originals(outputs)
    outputs = as_array_list(outputs, name)
    inputs = as_array_list(inputs, name)
    check_pairs(outputs, inputs, size, name, gathered="input")
    xp = memory_of(name, outputs, inputs)
    check_same_dtype(outputs, name)
    check_writable(outputs, name)
    share = sum(o.size for o in outputs)
    chunks = [(r * share, share) for r in range(size)]
    # torch's in-place form: the output is exactly this rank's share of the input.
    own_share = (len(inputs) == 1 and shares_memory(inputs[0], outputs[0])
                 and xp.contiguous(inputs[0]) and xp.contiguous(outputs[0])
                 and same_view(outputs[0].reshape(-1),
                               inputs[0].reshape(-1)[rank * share:(rank + 1) * share]))
    # Any other overlap: the copying path below reads the input before writing.
    aliased = check_overlap(name, outputs, inputs,
                            in_place=[(inputs[0], outputs[0])] if own_share else ())
    if single and ctx.shared_memory is not None and \
            inputs[0].nbytes >= ctx.cfg.shared_arrays_min_nbytes and \
            (found := shared_arrays.reduce_scatter_tensor(ctx, outputs[0], inputs[0], [outs],
                                                          opts.reduce_op, aliased, opts)):
        return found
    key = (name, outputs[0].dtype, shapes(inputs), shapes(outputs), xp.is_device,
           getattr(opts.reduce_op, "_key", None), opts.algorithm, opts.timeout)
    red, algorithm, seg, call = cached(ctx, key, opts, name, _reduction_plan, ctx, name,
                                       "reduce_scatter", inputs, outputs, share * size, xp, opts)

    # One host pair that travels as it is, on the shared arena: the
    # algorithm reads the input where it lies and writes only this rank's
    # share, straight into the output (no copy of the whole input) -- so
    # not when the output overlaps the input elsewhere than that share.
    in_place_share = (algorithm.name in SHARED and len(inputs) == 1 and not xp.is_device
                      and not aliased
                      and not red.widen and red.factor is None
                      and inputs[0].flags.c_contiguous and outputs[0].flags.c_contiguous)
    planned = (xp, red, algorithm, seg, chunks, rank, size, share, single, in_place_share,
               own_share)
    run = xp.wrap(_reduce_scatter_run(planned, outputs, inputs, outs))
    if single and not xp.is_device:
        run.remake = (_reduce_scatter_remake, planned)  # (see .context: a repeat's remake)
    return call, run


def _reduce_scatter_run(planned, outputs, inputs, outs):
    """The run of :func:`reduce_scatter_tensor_coalesced`, as its checks planned
    it; ``outs``: what the caller passed as outputs."""
    xp, red, algorithm, seg, chunks, rank, size, share, single, in_place_share, own_share = \
        planned

    def run(comm, work):
        steps = xp.steps(red)
        if in_place_share:
            whole, own = inputs[0].reshape(-1), outputs[0].reshape(-1)
            if not own_share:
                xp.assign(own, whole[rank * share:(rank + 1) * share])
            algorithm.run(comm, ShareBuffer(whole, own, rank * share, steps.reduce),
                          chunks, seg)
            steps.finish(own)
            return [outs]
        # Lay the buffer out share-major: [rank 0's share of every pair,
        # rank 1's share of every pair, ...], so one ring moves them all.
        if len(inputs) == 1:
            buf = steps.to_wire(inputs[0])  # already share-major: a single copy
        else:
            buf = xp.empty(share * size, red.wire_dtype)
            col = 0
            for o, i in zip(outputs, inputs):
                xp.assign(buf.reshape(size, share)[:, col:col + o.size],
                          steps.to_wire(i).reshape(size, o.size))
                col += o.size
        algorithm.run(comm, xp.buffer(buf, steps.reduce), chunks, seg)
        mine = buf[rank * share:(rank + 1) * share]
        steps.finish(mine)
        col = 0
        for o in outputs:
            steps.store(mine[col:col + o.size], o)
            col += o.size
        return [outs] if single else outs

    return run


def _reduce_scatter_remake(planned, output, input):
    """The run of a ``reduce_scatter_tensor(output, input)`` planned as
    ``planned`` for these very arrays (:mod:`numcoll.fast.replay`)."""
    return _reduce_scatter_run(planned, [output], [input], output)


def _plain(arrays) -> bool:
    """One NumPy array, or a list of them (the common case): nothing sparse."""
    if arrays.__class__ is np.ndarray:
        return True
    if arrays.__class__ is not list:
        return False
    for a in arrays:
        if a.__class__ is not np.ndarray:
            return False
    return True


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
