"""Collectives on shared arrays: the builders' path when the arrays other
ranks read lie in the group's shared memory (``nc.empty_shared``).

Each function here is called by the ordinary builder (:mod:`.reductions`,
:mod:`.movement`) once its arguments are checked, on a group with shared
memory, for a call of at least ``shared_arrays_min_nbytes`` (every rank
agrees on those: the count and dtype are the same everywhere), and returns
``(Call, run)`` -- or None, and the ordinary path runs. The call's
algorithm is ``shared_arrays`` (:mod:`numcoll.algorithms.shared_arrays`):
the ranks read each other's arrays in place, synchronising on the arena.

Which array must be shared is the one the other ranks read: allreduce's,
broadcast's and reduce's array, the *input* of allgather_into_tensor,
reduce_scatter_tensor and alltoall_base. Every rank must pass a shared
array there, or none: a rank that passes a plain one while the others pass
shared ones fails with a mismatch error, no data exchanged. The path is not
taken where an algorithm is forced (per call or per group), where the data
must change on its way (float16 widened to float32, PREMUL_SUM's factor),
or for several arrays at once; results land in each rank's own arrays.

Overlapping arrays follow :mod:`numcoll.memory.overlap`, whose rule the
builder applies before it calls here: an output that overlaps itself or
another output was refused; an output that overlaps the shared input other
than as torch's in-place form (``aliased``, the rule's answer) cannot be
written while the peers read that input, so it is written only once every
rank has finished reading: the result goes to a scratch buffer, copied into
the output after the last step.
"""

from __future__ import annotations

import numpy as np

from ..algorithms.shared_arrays import (WHERE_NBYTES, allgather_shared_arrays,
                                        allreduce_shared_arrays, alltoall_shared_arrays,
                                        broadcast_shared_arrays, reduce_scatter_shared_arrays,
                                        reduce_shared_arrays)
from ..call import Call, nbytes_of, op_fields, shapes
from ..config import forced_algorithm
from ..memory.host import HostBuffer
from ..memory.shared import locate
from .context import GroupContext

__all__ = ["applies", "allreduce", "broadcast", "reduce", "allgather_into_tensor",
           "reduce_scatter_tensor", "alltoall_base"]

ALGORITHM = "shared_arrays"


def applies(cfg, size: int, family: str, nbytes: int, requested: str | None) -> bool:
    """Whether a call of ``family`` (a key of :data:`numcoll.algorithms.CHOICES`)
    whose shared array holds ``nbytes`` takes the shared-array path on a group
    of ``size`` configured as ``cfg`` (``requested``: the algorithm the call
    asks for): more than one rank, an arena, no algorithm forced, at least
    ``shared_arrays_min_nbytes``. (A call on float16 widened to float32, or
    with PREMUL_SUM's factor, does not either.)"""
    return (size > 1 and cfg.arena_slot_nbytes > 0 and requested is None
            and nbytes >= cfg.shared_arrays_min_nbytes and forced_algorithm(cfg, family) is None)


def _where(ctx: GroupContext, family: str, arr, opts) -> tuple[int, int] | None:
    """Where ``arr`` lies in the group's shared memory, if this call takes the
    shared-array path (see the module docstring)."""
    if type(arr) is not np.ndarray or \
            not applies(ctx.cfg, ctx.size, family, arr.nbytes, opts.algorithm):
        return None
    return locate(ctx.shared_memory, arr)


def _reduction(ctx, op, dtype, name):
    red = ctx.reduction(op, dtype, name, False)
    return None if red.widen or red.factor is not None else red


def _call(ctx, name, opts, dtype, count, inputs, outputs, nbytes, root=-1, op=None) -> Call:
    return Call(name, ctx.timeout_for(opts, name), dtype, count, root=root,
                algorithm=ALGORITHM, input_sizes=shapes(inputs), output_sizes=shapes(outputs),
                nbytes=nbytes, shared_arrays=True, settings=ctx.settings,
                **(op_fields(op) if op is not None else {}))


def _block(ctx, itemsize: int) -> int:
    return max(1, ctx.cfg.shared_arrays_block_nbytes // itemsize)


def _reducing(ctx, family: str, arrays, op, opts):
    """(array, where, reduction, flat view, block) of a reducing call on one
    shared array, or None where the path is not taken."""
    arr = arrays[0]
    where = len(arrays) == 1 and _where(ctx, family, arr, opts)
    red = where and _reduction(ctx, op, arr.dtype, family)
    return (arr, where, red, arr.reshape(-1), _block(ctx, arr.itemsize)) if red else None


def allreduce(ctx: GroupContext, arrays, outs, op, opts):
    """One shared array, reduced in place on every rank."""
    found = _reducing(ctx, "allreduce", arrays, op, opts)
    if found is None:
        return None
    arr, where, red, flat, block = found
    call = _call(ctx, "allreduce", opts, arr.dtype, arr.size, arrays, arrays, arr.nbytes, op=op)

    def run(comm, work):
        allreduce_shared_arrays(comm, HostBuffer(flat, red.kernel), where, block)
        red.host_steps.finish(flat)
        return outs

    return call, run


def broadcast(ctx: GroupContext, arrays, outs, root: int, opts):
    """One shared array: the root's, copied into every other rank's."""
    if len(arrays) != 1:
        return None
    arr = arrays[0]
    where = _where(ctx, "broadcast", arr, opts)
    if where is None:
        return None
    flat = arr.reshape(-1)
    call = _call(ctx, "broadcast", opts, arr.dtype, arr.size, arrays, arrays, arr.nbytes,
                 root=root)

    def run(comm, work):
        broadcast_shared_arrays(comm, HostBuffer(flat), where, root)
        return outs

    return call, run


def reduce(ctx: GroupContext, arrays, outs, op, root: int, opts):
    """One shared array: every rank's, reduced into the root's."""
    found = _reducing(ctx, "reduce", arrays, op, opts)
    if found is None:
        return None
    arr, where, red, flat, block = found
    is_root = ctx.rank == root
    call = _call(ctx, "reduce", opts, arr.dtype, arr.size, arrays,
                 arrays if is_root else (), arr.nbytes, root=root, op=op)

    def run(comm, work):
        reduce_shared_arrays(comm, HostBuffer(flat, red.kernel), where, root, block)
        if is_root:
            red.host_steps.finish(flat)
        return outs

    return call, run


def allgather_into_tensor(ctx: GroupContext, output, input, outs, aliased: bool, opts):
    """One pair, the input shared: every rank copies the others' inputs
    (``aliased``: the output overlaps the input elsewhere than this rank's block)."""
    where = _where(ctx, "allgather", input, opts)
    if where is None or not output.flags.c_contiguous:
        return None
    rank, per = ctx.rank, input.size
    flat_in, flat_out = input.reshape(-1), output.reshape(-1)
    # The input is read by the peers until the last step: writing into an
    # output that overlaps it elsewhere than this rank's block must wait.
    direct = not aliased
    call = _call(ctx, "allgather_into_tensor", opts, input.dtype, per, [input], [output],
                 input.nbytes)

    def run(comm, work):
        out = flat_out if direct else np.empty_like(flat_out)
        if not _same(out[rank * per:(rank + 1) * per], flat_in):
            np.copyto(out[rank * per:(rank + 1) * per], flat_in)
        allgather_shared_arrays(comm, HostBuffer(out), where, per)
        if not direct:
            np.copyto(flat_out, out)
        return outs

    return call, run


def reduce_scatter_tensor(ctx: GroupContext, output, input, value, op, aliased: bool, opts):
    """One pair, the input shared: rank r reduces share r of every input
    (``aliased``: the output overlaps the input elsewhere than share r)."""
    where = _where(ctx, "reduce_scatter", input, opts)
    red = where and output.flags.c_contiguous and \
        _reduction(ctx, op, output.dtype, "reduce_scatter_tensor")
    if not red:
        return None
    size, rank, share = ctx.size, ctx.rank, output.size
    flat_in, flat_out = input.reshape(-1), output.reshape(-1)
    mine = flat_in[rank * share:(rank + 1) * share]
    direct = not aliased
    block = _block(ctx, output.itemsize)
    call = _call(ctx, "reduce_scatter_tensor", opts, output.dtype, share * size, [input],
                 [output], input.nbytes, op=op)

    def run(comm, work):
        out = flat_out if direct else np.empty_like(flat_out)
        if not _same(out, mine):
            np.copyto(out, mine)
        reduce_scatter_shared_arrays(comm, HostBuffer(out, red.kernel), where, share, block)
        red.host_steps.finish(out)
        if not direct:
            np.copyto(flat_out, out)
        return value

    return call, run


def alltoall_base(ctx: GroupContext, output, input, send_chunks, recv_chunks, value,
                  aliased: bool, opts):
    """The input shared: every rank copies its block out of every other's input
    (``aliased``: the output overlaps the input)."""
    where = _where(ctx, "alltoall", input, opts)
    if where is None or (WHERE_NBYTES + 16 * ctx.size) > ctx.cfg.arena_slot_nbytes:
        return None
    rank = ctx.rank
    flat_in, flat_out = input.reshape(-1), output.reshape(-1)
    direct = not aliased
    call = Call("alltoall_base", ctx.timeout_for(opts, "alltoall_base"), input.dtype,
                algorithm=ALGORITHM, input_sizes=shapes([input]),
                output_sizes=shapes([output]), nbytes=nbytes_of([input]), shared_arrays=True,
                settings=ctx.settings)

    def run(comm, work):
        out = flat_out if direct else np.empty_like(flat_out)
        s, n = send_chunks[rank]
        r, m = recv_chunks[rank]
        np.copyto(out[r:r + m], flat_in[s:s + n])
        alltoall_shared_arrays(comm, where, input.nbytes, send_chunks, HostBuffer(out),
                               recv_chunks)
        if not direct:
            np.copyto(flat_out, out)
        return value

    return call, run


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two flat arrays are the same memory (the same view)."""
    return a.__array_interface__["data"][0] == b.__array_interface__["data"][0] \
        and a.nbytes == b.nbytes
