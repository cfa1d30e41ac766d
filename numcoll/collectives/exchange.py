"""alltoall and alltoall_base: every rank sends a block to every rank (the
personalized exchange).

Builders (see :mod:`.context`): ``alltoall(ctx, output_list, input_list, opts)
-> (Call, run)``.
"""

from __future__ import annotations

from ..call import Call, nbytes_of, shapes
from ..memory.arrays import (_describe, as_array, as_array_list, check_writable,
                             is_device_array, memory_of)
from ..memory.overlap import check_overlap
from ..options import AllToAllOptions
from . import shared_arrays
from .checks import originals
from .context import GroupContext, cached
from .movement import _unpack_like

__all__ = ["alltoall", "alltoall_base"]

_ALLTOALL_DEFAULTS = AllToAllOptions()


def alltoall(ctx: GroupContext, output_list, input_list, opts: AllToAllOptions | None = None):
    """Rank r's ``input_list[q]`` lands in rank q's ``output_list[r]``. Every
    input and output holds as many elements (torch's rule for the list form)."""
    name = "alltoall"
    opts = opts or _ALLTOALL_DEFAULTS
    size, rank = ctx.size, ctx.rank
    outs = originals(output_list)
    outputs = as_array_list(output_list, name, allow_single=False)
    inputs = as_array_list(input_list, name, allow_single=False)
    if len(inputs) != size:
        raise ValueError(f"{name}: input tensor list size {len(inputs)} does not match "
                         f"world size {size}")
    if len(outputs) != size:
        raise ValueError(f"{name}: output tensor list size {len(outputs)} does not match "
                         f"world size {size}")
    xp = memory_of(name, inputs, outputs)
    for what, arrays in (("input", inputs), ("output", outputs)):
        for i, a in enumerate(arrays):
            if a.dtype != arrays[0].dtype or type(a) is not type(arrays[0]):
                raise TypeError(f"{name}: invalid tensor type: {what} {i} is "
                                f"{_describe(a)}, {what} 0 is {_describe(arrays[0])}")
            if a.dtype != outputs[0].dtype or type(a) is not type(outputs[0]):  # torch's words
                raise TypeError(f"{name}: input and output tensors must have the same type "
                                f"({_describe(a)} vs {_describe(outputs[0])})")
            if a.size != outputs[0].size:
                raise ValueError(f"{name}: invalid tensor size: {what} {i} has {a.size} "
                                 f"elements, output 0 has {outputs[0].size}")
    check_writable(outputs, name)
    check_overlap(name, outputs)  # inputs are packed before anything is written
    send_chunks, recv_chunks = _bounds(inputs), _bounds(outputs)
    algorithm, seg, call = _alltoall_plan(ctx, name, opts, inputs, outputs)

    def run(comm, work):
        send = xp.empty(sum(a.size for a in inputs), inputs[0].dtype)
        recv = xp.empty(sum(a.size for a in outputs), inputs[0].dtype)
        xp.pack(inputs, send)
        algorithm.run(comm, xp.buffer(send), send_chunks, xp.buffer(recv), recv_chunks, seg)
        s, n = send_chunks[rank]
        r, m = recv_chunks[rank]
        xp.assign(recv[r:r + m], send[s:s + n])
        for a, g in zip(outputs, _unpack_like(recv, outputs)):
            xp.assign(a, g)
        return outs

    run = xp.wrap(run)
    if not xp.is_device:  # (what a plan by form must match: numcoll.fast.repeat)
        run.rest_nbytes = getattr(algorithm.run, "keywords", {}).get("rest_nbytes")
    return call, run


def alltoall_base(ctx: GroupContext, output, input, output_split_sizes=None,
                  input_split_sizes=None, opts: AllToAllOptions | None = None):
    """Split ``input`` along dim 0 (equally, or by ``input_split_sizes``);
    block q goes to rank q, and rank r's block for us lands in ``output``'s
    r-th block (by ``output_split_sizes``)."""
    name = "alltoall_base"
    opts = opts or _ALLTOALL_DEFAULTS
    size, rank = ctx.size, ctx.rank
    out, inp = as_array(output, name), as_array(input, name)
    xp = memory_of(name, [out, inp])
    if not xp.contiguous(out) or not xp.contiguous(inp):
        raise ValueError(f"{name}: Tensors must be contiguous")
    if out.dtype != inp.dtype:
        raise TypeError(f"{name}: input and output tensors must have the same type "
                        f"({inp.dtype} vs {out.dtype})")
    check_writable([out], name)
    send_chunks = _split_bounds(inp, input_split_sizes, size, name, "input")
    recv_chunks = _split_bounds(out, output_split_sizes, size, name, "output")
    if input_split_sizes is None and output_split_sizes is None and out.size != inp.size:
        raise ValueError(f"{name}: input and output tensors must have the same size "
                         f"({inp.size} vs {out.size} elements)")
    n, m = send_chunks[rank][1], recv_chunks[rank][1]
    if n != m:
        raise ValueError(f"{name}: invalid tensor size: rank {rank} sends itself "
                         f"{n} elements but expects {m}")
    # The same memory as input and output: send from a copy, or blocks
    # received early would overwrite blocks not sent yet.
    aliased = check_overlap(name, [out], [inp])
    if ctx.shared_memory is not None and inp.nbytes >= ctx.cfg.shared_arrays_min_nbytes and \
            (found := shared_arrays.alltoall_base(ctx, out, inp, send_chunks, recv_chunks,
                                                  [output], aliased, opts)):
        return found
    # Ranks may send each other different amounts -- and a peer may pass split
    # sizes where this rank passes none -- so the choice must not depend on
    # a rank's own size: every rank's is the arena's alltoall, whose ranks
    # agree inside it whether to read the blocks single-copy (choice.choose).
    algorithm, seg, call = _alltoall_plan(ctx, name, opts, [inp], [out], uneven=True)
    plan = (xp, algorithm, seg, send_chunks, recv_chunks, rank, aliased)
    run = xp.wrap(_alltoall_base_run(plan, out, inp, output))
    if output_split_sizes is None and input_split_sizes is None and not xp.is_device \
            and output is out and input is inp:
        run.remake = (_alltoall_base_remake, plan)  # (see .context: a repeat's remake)
        # (what a repeat's fused start offers, as the algorithm does: numcoll.fast.copy)
        run.rest_nbytes = getattr(algorithm.run, "keywords", {}).get("rest_nbytes")
    return call, run


def _alltoall_base_run(plan, out, inp, output):
    """The run of :func:`alltoall_base` on ``out`` and ``inp`` (``output``: as
    the caller passed it), as its checks planned it."""
    xp, algorithm, seg, send_chunks, recv_chunks, rank, aliased = plan

    def run(comm, work):
        send, recv = xp.flat(inp, copy_in=True), xp.flat(out, copy_in=False)
        if aliased:
            send = xp.copy(send)
        algorithm.run(comm, xp.buffer(send), send_chunks, xp.buffer(recv), recv_chunks, seg)
        s, n = send_chunks[rank]
        r, m = recv_chunks[rank]
        xp.assign(recv[r:r + m], send[s:s + n])
        return [output]

    return run


def _alltoall_base_remake(plan, output, input):
    """The run of an ``all_to_all_single(output, input)`` (equal splits) that
    was planned as ``plan`` for these very arrays (:mod:`numcoll.fast.replay`)."""
    return _alltoall_base_run(plan, output, input, output)


def _alltoall_plan(ctx, name, opts, inputs, outputs, uneven: bool = False):
    """The algorithm, segment and call of alltoall(_base) (cached)."""
    key = (name, inputs[0].dtype, shapes(inputs), shapes(outputs),
           is_device_array(inputs[0]), opts.algorithm, opts.timeout, uneven)
    return cached(ctx, key, opts, name, _build_alltoall_plan, ctx, name, opts, inputs,
                  outputs, uneven)


def _build_alltoall_plan(ctx, name, opts, inputs, outputs, uneven):
    dtype = inputs[0].dtype
    algorithm = ctx.choose("alltoall", opts.algorithm, nbytes_of(inputs),
                           device=is_device_array(inputs[0]), uneven=uneven)
    # Ranks may send each other different amounts (alltoall_base's splits), so
    # no element count is stamped: each message's size is checked exactly instead.
    call = Call(name, ctx.timeout_for(opts, name), dtype, 0, algorithm=algorithm.name,
                input_sizes=shapes(inputs), output_sizes=shapes(outputs),
                nbytes=nbytes_of(inputs), settings=ctx.settings)
    return algorithm, ctx.segment(dtype.itemsize), call


def _bounds(arrays):
    bounds, start = [], 0
    for a in arrays:
        bounds.append((start, a.size))
        start += a.size
    return bounds


def _split_bounds(arr, split_sizes, size, op, what):
    rows = arr.shape[0] if arr.ndim else 1
    row_elems = arr.size // rows if rows else 0
    if split_sizes is None:
        if rows % size:
            raise ValueError(f"{op}: {what} tensor's dim 0 ({rows}) does not divide equally "
                             f"across group size {size}")
        split_sizes = [rows // size] * size
    split_sizes = list(split_sizes)
    if len(split_sizes) != size:
        raise ValueError(f"{op}: {what} split sizes has {len(split_sizes)} entries, expected "
                         f"world size {size}")
    if any(s < 0 for s in split_sizes) or sum(split_sizes) != rows:
        raise ValueError(f"{op}: {what} split sizes {split_sizes} must be non-negative and "
                         f"sum to dim 0 ({rows})")
    bounds, start = [], 0
    for s in split_sizes:
        bounds.append((start * row_elems, s * row_elems))
        start += s
    return bounds
