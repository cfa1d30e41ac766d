"""Collectives that move data without reducing it: broadcast, allgather
(+coalesced, +into_tensor), gather, scatter (alltoall: :mod:`.exchange`).

Builders (see :mod:`.context`): ``broadcast(ctx, arrays, opts, root) -> (Call, run)``.
"""

from __future__ import annotations

from ..call import Call, nbytes_of, shapes
from ..memory.arrays import (as_array_list, check_same_type_and_size, check_writable,
                             is_device_array, memory_of, uniform_arrays)
from ..memory.overlap import check_overlap, same_view, shares_memory
from ..options import AllgatherOptions, BroadcastOptions, GatherOptions, ScatterOptions
from .checks import (check_pairs, check_root_rank, check_root_tensor, check_same_dtype,
                     originals, root_list)
from . import shared_arrays
from .context import GroupContext, cached

__all__ = ["broadcast", "allgather", "allgather_coalesced", "allgather_into_tensor_coalesced",
           "gather", "scatter"]

# Read, never written: a call without options uses these instead of building one.
_BROADCAST_DEFAULTS = BroadcastOptions()
_ALLGATHER_DEFAULTS = AllgatherOptions()
_GATHER_DEFAULTS = GatherOptions()
_SCATTER_DEFAULTS = ScatterOptions()

# -- broadcast -----------------------------------------------------------------
def broadcast(ctx: GroupContext, arrays, opts: BroadcastOptions | None = None, root=None):
    """Copy ``arrays[opts.root_tensor]`` of rank ``opts.root_rank`` into every
    array on every rank. ``root`` overrides ``opts.root_rank``."""
    name = "broadcast"
    opts = opts or _BROADCAST_DEFAULTS
    root_rank = opts.root_rank if root is None else root
    outs = list(arrays) if isinstance(arrays, (list, tuple)) else [arrays]
    check_root_rank(root_rank, ctx.size, name)
    arrays, xp = uniform_arrays(arrays, name, nonempty=False)
    check_root_tensor(opts.root_tensor, len(arrays), name)
    src = arrays[opts.root_tensor]
    is_root = ctx.rank == root_rank
    if ctx.shared_memory is not None and src.nbytes >= ctx.cfg.shared_arrays_min_nbytes and \
            (found := shared_arrays.broadcast(ctx, arrays, outs, root_rank, opts)):
        return found
    key = (name, src.dtype, src.shape, len(arrays), xp.is_device, root_rank,
           opts.algorithm, opts.timeout)
    algorithm, seg, call = cached(ctx, key, opts, name, _broadcast_plan, ctx, name, arrays,
                                  root_rank, opts)
    plan = (xp, algorithm, seg, root_rank, is_root, opts.root_tensor)
    run = xp.wrap(_broadcast_run(plan, arrays, outs))
    if len(arrays) == 1 and not xp.is_device:
        run.remake = (_broadcast_remake, plan)  # (see .context: a repeat's remake)
    return call, run


def _broadcast_run(plan, arrays, outs):
    """The run of :func:`broadcast` into ``arrays``, as its checks planned it;
    ``outs``: the future's value."""
    xp, algorithm, seg, root_rank, is_root, root_tensor = plan
    src = arrays[root_tensor]

    def run(comm, work):
        flat = xp.flat(src, copy_in=is_root)
        algorithm.run(comm, xp.buffer(flat), root_rank, seg)
        for i, a in enumerate(arrays):
            if i != root_tensor or not xp.contiguous(src):
                xp.write(a, flat)
        return outs

    return run


def _broadcast_remake(plan, tensor):
    """The run of a ``broadcast(tensor)`` planned as ``plan`` for this very
    array (:mod:`numcoll.fast.replay`)."""
    return _broadcast_run(plan, [tensor], [tensor])


def _broadcast_plan(ctx, name, arrays, root_rank, opts):
    src = arrays[opts.root_tensor]
    nbytes = src.size * src.dtype.itemsize
    algorithm = ctx.choose(name, opts.algorithm, nbytes, device=is_device_array(src))
    call = Call(name, ctx.timeout_for(opts, name), src.dtype, src.size, root=root_rank,
                algorithm=algorithm.name, input_sizes=shapes(arrays),
                output_sizes=shapes(arrays), nbytes=nbytes, settings=ctx.settings)
    return algorithm, ctx.segment(src.dtype.itemsize), call


# -- allgather family ----------------------------------------------------------------
def allgather(ctx: GroupContext, output_lists, input_list,
              opts: AllgatherOptions | None = None):
    """Every rank's inputs, in rank order, into every output list.

    With n inputs per rank, each of the n output lists holds n * world_size
    arrays: rank 0's n inputs, then rank 1's, ... The future's value is the
    output list for n == 1, the list of output lists otherwise.
    """
    name = "allgather"
    opts = opts or _ALLGATHER_DEFAULTS
    size, rank = ctx.size, ctx.rank
    inputs = as_array_list(input_list, name)
    if not inputs:
        raise ValueError(f"{name}: requires non-empty input tensor list")
    if not isinstance(output_lists, (list, tuple)) or len(output_lists) != len(inputs):
        got = len(output_lists) if isinstance(output_lists, (list, tuple)) else "not a list"
        raise ValueError(f"{name}: requires input/output tensor lists to have the same "
                         f"length ({len(inputs)} inputs, {got} output lists)")
    expected = len(inputs) * size
    outputs = []
    for i, lst in enumerate(output_lists):
        if not isinstance(lst, (list, tuple)) or len(lst) != expected:
            got = len(lst) if isinstance(lst, (list, tuple)) else type(lst).__name__
            raise ValueError(f"{name}: invalid output tensor list at index {i} (expected "
                             f"length {expected}, got {got})")
        outputs.append(as_array_list(lst, name, allow_single=False))
    xp = memory_of(name, inputs, *outputs)
    check_same_type_and_size(inputs, name)
    for lst in outputs:
        check_same_type_and_size(lst, name, like=inputs[0])
        check_writable(lst, name)
    value = [list(lst) for lst in output_lists]
    value = value[0] if len(value) == 1 else value
    per_rank = sum(a.size for a in inputs)
    chunks = [(r * per_rank, per_rank) for r in range(size)]
    flat_outputs = [a for lst in outputs for a in lst]
    # Inputs are packed into a buffer before anything is written: only
    # outputs that overlap each other are wrong.
    check_overlap(name, flat_outputs)
    algorithm, seg, call = _gathered_plan(ctx, name, opts, inputs, flat_outputs, per_rank)

    def run(comm, work):
        buf = xp.empty(per_rank * size, inputs[0].dtype)
        xp.pack(inputs, buf[rank * per_rank:])
        algorithm.run(comm, xp.buffer(buf), chunks, seg)
        gathered = _unpack_like(buf, [inputs[0]] * expected)
        for lst in outputs:
            for a, g in zip(lst, gathered):
                xp.assign(a, g)
        return value

    return call, xp.wrap(run)


def allgather_coalesced(ctx: GroupContext, output_lists, input_list,
                        opts: AllgatherOptions | None = None):
    """``output_lists[r][j]`` receives rank r's ``input_list[j]``; inputs may
    differ in shape (one dtype). One ring moves them all."""
    name = "allgather_coalesced"
    opts = opts or _ALLGATHER_DEFAULTS
    size, rank = ctx.size, ctx.rank
    inputs = as_array_list(input_list, name)
    if not inputs:
        raise ValueError(f"{name}: requires non-empty input tensor list")
    if not isinstance(output_lists, (list, tuple)) or len(output_lists) != size:
        got = len(output_lists) if isinstance(output_lists, (list, tuple)) else "not a list"
        raise ValueError(f"{name}: output lists should be equal to world size "
                         f"({size}), got {got}")
    converted = [as_array_list(lst, name, allow_single=False) for lst in output_lists]
    xp = memory_of(name, inputs, *converted)
    check_same_dtype(inputs, name)
    outputs = []
    for r, lst in enumerate(converted):
        if len(lst) != len(inputs):
            raise ValueError(f"{name}: invalid output size at index {r} (expected "
                             f"length {len(inputs)}, got {len(lst)})")
        for j, (o, i) in enumerate(zip(lst, inputs)):
            if o.dtype != i.dtype:
                raise TypeError(f"{name}: invalid tensor type at index {j} of output "
                                f"list {r}: expected {i.dtype}, got {o.dtype}")
            if o.size != i.size:
                raise ValueError(f"{name}: invalid size of output tensor at index {j} of "
                                 f"output list {r}: expected {i.size} elements, got "
                                 f"{o.size}")
        check_writable(lst, name)
        outputs.append(lst)
    value = [list(lst) for lst in output_lists]
    per_rank = sum(a.size for a in inputs)
    chunks = [(r * per_rank, per_rank) for r in range(size)]
    flat_outputs = [a for lst in outputs for a in lst]
    check_overlap(name, flat_outputs)  # inputs are packed before anything is written
    algorithm, seg, call = _gathered_plan(ctx, name, opts, inputs, flat_outputs, per_rank)

    def run(comm, work):
        buf = xp.empty(per_rank * size, inputs[0].dtype)
        xp.pack(inputs, buf[rank * per_rank:])
        algorithm.run(comm, xp.buffer(buf), chunks, seg)
        for r, lst in enumerate(outputs):
            for a, g in zip(lst, _unpack_like(buf[r * per_rank:], lst)):
                xp.assign(a, g)
        return value

    return call, xp.wrap(run)


def allgather_into_tensor_coalesced(ctx: GroupContext, outputs, inputs, opts=None, *,
                                    name: str = "allgather_into_tensor_coalesced"):
    """``outputs[i]`` (``world_size`` times ``inputs[i]``'s size) gets every
    rank's ``inputs[i]`` back to back, in rank order, for several pairs in one
    ring. With ``name="allgather_into_tensor"``: one pair, given as arrays."""
    opts = opts or _ALLGATHER_DEFAULTS
    size, rank = ctx.size, ctx.rank
    outs = originals(outputs)
    outputs = as_array_list(outputs, name)
    inputs = as_array_list(inputs, name)
    check_pairs(outputs, inputs, size, name, gathered="output")
    xp = memory_of(name, outputs, inputs)
    check_same_dtype(inputs, name)
    check_writable(outputs, name)
    direct = len(outputs) == 1 and xp.contiguous(outputs[0])
    per_rank = sum(a.size for a in inputs)
    # torch's in-place form: the input is exactly this rank's chunk of the output.
    own_chunk = (direct and shares_memory(inputs[0], outputs[0]) and xp.contiguous(inputs[0])
                 and same_view(inputs[0].reshape(-1),
                               outputs[0].reshape(-1)[rank * per_rank:(rank + 1) * per_rank]))
    aliased = check_overlap(name, outputs, inputs,
                            in_place=[(inputs[0], outputs[0])] if own_chunk else ())
    if name == "allgather_into_tensor" and ctx.shared_memory is not None and \
            inputs[0].nbytes >= ctx.cfg.shared_arrays_min_nbytes and \
            (found := shared_arrays.allgather_into_tensor(ctx, outputs[0], inputs[0], outs,
                                                          aliased, opts)):
        return found
    chunks = [(r * per_rank, per_rank) for r in range(size)]
    algorithm, seg, call = _gathered_plan(ctx, name, opts, inputs, outputs, per_rank)
    plan = (xp, algorithm, seg, chunks, rank, size, per_rank, direct, own_chunk, aliased)
    run = xp.wrap(_gathered_run(plan, outputs, inputs, outs))
    if name == "allgather_into_tensor" and not xp.is_device:
        run.remake = (_gathered_remake, plan)  # (see .context: a repeat's remake)
    return call, run


def _gathered_run(plan, outputs, inputs, outs):
    """The run of :func:`allgather_into_tensor_coalesced`, as its checks planned it."""
    xp, algorithm, seg, chunks, rank, size, per_rank, direct, own_chunk, aliased = plan

    def run(comm, work):
        # One pair with a contiguous output: gather straight into it.
        buf = (xp.flat(outputs[0], copy_in=False) if direct
               else xp.empty(per_rank * size, inputs[0].dtype))
        if not own_chunk:
            xp.pack(_snapshot(xp, inputs) if aliased else inputs, buf[rank * per_rank:])
        algorithm.run(comm, xp.buffer(buf), chunks, seg)
        if not direct:
            rows = buf.reshape(size, per_rank)
            col = 0
            for o, i in zip(outputs, inputs):
                # o holds rank 0's i, then rank 1's ...: row r, these columns.
                target = xp.flat(o, copy_in=False)
                xp.assign(target.reshape(size, i.size), rows[:, col:col + i.size])
                if not xp.contiguous(o):
                    xp.write(o, target)
                col += i.size
        return outs

    return run


def _gathered_remake(plan, output, input):
    """The run of an ``all_gather_into_tensor(output, input)`` that was planned
    as ``plan`` for these very arrays (a repeat: :mod:`numcoll.fast.replay`)."""
    return _gathered_run(plan, [output], [input], [output])


def _gathered_plan(ctx, name, opts, inputs, outputs, per_rank):
    """The algorithm, segment and call of the allgather family (cached)."""
    key = (name, inputs[0].dtype, shapes(inputs), shapes(outputs), per_rank,
           opts.algorithm, opts.timeout)
    return cached(ctx, key, opts, name, _build_gathered_plan, ctx, name, opts, inputs,
                  outputs, per_rank)


def _build_gathered_plan(ctx, name, opts, inputs, outputs, per_rank):
    dtype = inputs[0].dtype
    algorithm = ctx.choose("allgather", opts.algorithm, per_rank * ctx.size * dtype.itemsize,
                           device=is_device_array(inputs[0]))
    call = Call(name, ctx.timeout_for(opts, name), dtype, per_rank,
                algorithm=algorithm.name, input_sizes=shapes(inputs),
                output_sizes=shapes(outputs), nbytes=nbytes_of(inputs),
                settings=ctx.settings)
    return algorithm, ctx.segment(dtype.itemsize), call


# -- gather / scatter ------------------------------------------------------------
def gather(ctx: GroupContext, output_lists, input_list, opts: GatherOptions | None = None):
    """The root's ``output_lists[0][r]`` receives rank r's ``input_list[0]``.
    Non-roots pass ``[]`` as output. The future's value is the root's output
    list (``[]`` on other ranks)."""
    name = "gather"
    opts = opts or _GATHER_DEFAULTS
    size, rank = ctx.size, ctx.rank
    root = opts.root_rank
    check_root_rank(root, size, name)
    inputs = as_array_list(input_list, name)
    if len(inputs) != 1:
        raise ValueError(f"{name}: requires a single-element input tensor list "
                         f"(got {len(inputs)})")
    src = inputs[0]
    is_root = rank == root
    outputs, value = [], []
    if is_root:
        lst = root_list(output_lists, size, name, "output")
        outputs = as_array_list(lst, name, allow_single=False)
        xp = memory_of(name, inputs, outputs)
        check_same_type_and_size(outputs, name, like=src)
        check_writable(outputs, name)
        value = list(lst)
    elif output_lists:
        raise ValueError(f"{name}: requires empty output on non-root (rank {rank}, "
                         f"root {root})")
    else:
        xp = memory_of(name, inputs)
    # The root's own slot may be its input; any other overlap: send from a copy
    # (peers' arrays land in the outputs before the root copies its own).
    own_slot = is_root and xp.contiguous(src) and same_view(src, outputs[root])
    aliased = check_overlap(name, outputs, inputs, in_place=[(src, outputs[root])]
                            if own_slot else ())
    algorithm, seg, call = _rooted_plan(ctx, name, opts, src, root, inputs, outputs)
    plan = (xp, algorithm, seg, root, is_root, own_slot, aliased)
    run = xp.wrap(_gather_run(plan, src, outputs, value))
    if not xp.is_device:
        run.remake = (_gather_remake, plan)  # (see .context: a repeat's remake)
    return call, run


def _gather_run(plan, src, outputs, value):
    """The run of :func:`gather` sending ``src`` (into ``outputs``, the root's),
    as its checks planned it; ``value``: the future's."""
    xp, algorithm, seg, root, is_root, own_slot, aliased = plan

    def run(comm, work):
        send = _snapshot(xp, [src])[0] if aliased else xp.flat(src, copy_in=True)
        targets = [xp.flat(o, copy_in=False) for o in outputs]
        algorithm.run(comm, xp.buffer(send), [xp.buffer(t) for t in targets], root, seg)
        if is_root:
            if not own_slot:
                xp.assign(targets[root], send)
            for o, t in zip(outputs, targets):
                if not xp.contiguous(o):
                    xp.write(o, t)
        return value

    return run


def _gather_remake(plan, tensor, *blocks):
    """The run of a ``gather(tensor, blocks)`` (``blocks``: the root's list,
    none elsewhere) planned as ``plan`` for these very arrays
    (:mod:`numcoll.fast.replay`)."""
    return _gather_run(plan, tensor, list(blocks), list(blocks))


def scatter(ctx: GroupContext, output_list, input_lists, opts: ScatterOptions | None = None):
    """Rank r's ``output_list[0]`` receives the root's ``input_lists[0][r]``.
    Non-roots pass ``[]`` as input."""
    name = "scatter"
    opts = opts or _SCATTER_DEFAULTS
    size, rank = ctx.size, ctx.rank
    root = opts.root_rank
    check_root_rank(root, size, name)
    outs = originals(output_list)
    outputs = as_array_list(output_list, name)
    if len(outputs) != 1:
        raise ValueError(f"{name}: requires a single-element output tensor list "
                         f"(got {len(outputs)})")
    out = outputs[0]
    check_writable(outputs, name)
    is_root = rank == root
    inputs = []
    if is_root:
        lst = root_list(input_lists, size, name, "input")
        inputs = as_array_list(lst, name, allow_single=False)
        xp = memory_of(name, outputs, inputs)
        check_same_type_and_size(inputs, name, like=out)
    elif input_lists:
        raise ValueError(f"{name}: requires empty input on non-root (rank {rank}, "
                         f"root {root})")
    else:
        xp = memory_of(name, outputs)
    # The root's output may be its own input; any other overlap: send from copies.
    own_slot = is_root and xp.contiguous(out) and same_view(inputs[root], out)
    aliased = check_overlap(name, outputs, inputs, in_place=[(inputs[root], out)]
                            if own_slot else ())
    algorithm, seg, call = _rooted_plan(ctx, name, opts, out, root, inputs, outputs)
    plan = (xp, algorithm, seg, root, is_root, own_slot, aliased)
    run = xp.wrap(_scatter_run(plan, out, inputs, outs))
    if not xp.is_device:
        run.remake = (_scatter_remake, plan)  # (see .context: a repeat's remake)
    return call, run


def _scatter_run(plan, out, inputs, outs):
    """The run of :func:`scatter` into ``out`` (from ``inputs``, the root's),
    as its checks planned it; ``outs``: the future's value."""
    xp, algorithm, seg, root, is_root, own_slot, aliased = plan

    def run(comm, work):
        target = xp.flat(out, copy_in=False)
        sources = (_snapshot(xp, inputs) if aliased
                   else [xp.flat(a, copy_in=True) for a in inputs])
        sends = [xp.buffer(a) for a in sources]
        algorithm.run(comm, sends, xp.buffer(target), root, seg)
        if is_root and not own_slot:
            xp.assign(target, sources[root])
        if not xp.contiguous(out):
            xp.write(out, target)
        return outs

    return run


def _scatter_remake(plan, tensor, *blocks):
    """The run of a ``scatter(tensor, blocks)`` (``blocks``: the root's list,
    none elsewhere) planned as ``plan`` for these very arrays
    (:mod:`numcoll.fast.replay`)."""
    return _scatter_run(plan, tensor, list(blocks), [tensor])


def _rooted_plan(ctx, name, opts, share, root, inputs, outputs):
    """The algorithm, segment and call of gather/scatter (cached); ``share`` is
    the array every rank sends (gather) or receives (scatter)."""
    key = (name, share.dtype, share.shape, root, shapes(inputs), shapes(outputs),
           is_device_array(share), opts.algorithm, opts.timeout)
    return cached(ctx, key, opts, name, _build_rooted_plan, ctx, name, opts, share, root,
                  inputs, outputs)


def _build_rooted_plan(ctx, name, opts, share, root, inputs, outputs):
    algorithm = ctx.choose(name, opts.algorithm, share.size * share.dtype.itemsize,
                           device=is_device_array(share))
    call = Call(name, ctx.timeout_for(opts, name), share.dtype, share.size, root=root,
                algorithm=algorithm.name, input_sizes=shapes(inputs),
                output_sizes=shapes(outputs), nbytes=nbytes_of(inputs),
                settings=ctx.settings)
    return algorithm, ctx.segment(share.dtype.itemsize), call


def _snapshot(xp, arrays) -> list:
    """Flat copies of ``arrays``, taken before anything is written: what a
    call reads when its inputs share memory with its outputs."""
    return [xp.copy(xp.flat(a, copy_in=True)) for a in arrays]


def _unpack_like(buf, like):
    """Views of ``buf``, back to back, shaped like each array of ``like``."""
    views, start = [], 0
    for a in like:
        views.append(buf[start:start + a.size].reshape(a.shape))
        start += a.size
    return views
