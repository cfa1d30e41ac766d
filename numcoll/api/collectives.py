"""The collectives of the torch.distributed-style module API.

Same names, parameters and defaults as ``torch.distributed`` (tensor ->
array), so torch code ports by changing the import. Ranks given to these
functions (``src``, ``dst``) are global ranks, translated for sub-groups as
torch does. The checks made here, before the group sees the call, keep
torch's words (``tensors with different dtypes``, ``Invalid function
argument``).

Every function has one shape, given by :func:`collective` (as torch's
``distributed_c10d.py`` gives its functions theirs with decorators): find
the group (``group=None``: the default one; a rank outside the group warns
and does nothing), let the body check the arguments and build the call
(:mod:`numcoll.collectives`), and submit it -- waiting for it
(``async_op=False``: returns None, raises its error) or returning its Work.
"""

from __future__ import annotations

import functools
import inspect
import sys
import warnings
from datetime import timedelta

from ..collectives import exchange, fused_step, movement, p2p, reductions
from ..fast.repeat import rooted_sides
from ..memory.arrays import as_array
from ..ops import ReduceOp
from ..options import (AllreduceCoalescedOptions, BarrierOptions, GatherOptions,
                       ReduceScatterOptions, ScatterOptions)
from ..process_group import ProcessGroup
from .groups import _peer
from .world import (GroupMember, _check_timeout, _process_world, _thread_state,
                    _thread_worlds, _world, get_default_group)

__all__ = [
    "all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "all_gather",
    "all_gather_into_tensor", "all_gather_coalesced", "gather", "scatter", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier",
    "all_gather_single", "reduce_scatter_single", "gather_single", "gather_into_tensor",
]


def collective(body, fast=None, fast_call=None):
    """Give ``body(pg, <torch's parameters>) -> (call, run)`` torch's shape.

    The function made has ``body``'s parameters without ``pg``; it reads
    ``group`` and ``async_op`` among them (``async_op`` absent: the call
    always waits, as ``monitored_barrier``), resolves the group, calls
    ``body`` with it, and submits what ``body`` returns. ``fast(pg, <the
    same arguments>)``, if given, is tried first for a call that waits: True
    when it ran the call (a repeat, run as one fused step: :mod:`numcoll.fast`).
    ``fast_call``, if given, is the expression (over ``pg``, ``fast`` and the
    parameters) the busiest case -- the default group, waiting -- evaluates
    instead of calling ``fast``: a fast path without a frame of its own.
    Given alone, it is the whole fast path: ``fast`` is made from it.
    """
    name = body.__name__
    signature = inspect.signature(body)
    params = list(signature.parameters.values())[1:]
    names = [p.name for p in params]
    group_at = names.index("group")
    async_at = names.index("async_op") if "async_op" in names else None

    def submit(pg, args, kwargs):
        """The call on group ``pg``, whose fast path was tried already; or,
        ``pg`` None, on the group resolved here, the fast path tried here."""
        tried = pg is not None
        if async_at is None:
            async_op = False
        else:
            async_op = args[async_at] if len(args) > async_at else kwargs.get("async_op", False)
        if pg is None:
            group = args[group_at] if len(args) > group_at else kwargs.get("group")
            if group is None:
                pg = _world().pg
                if pg is None:
                    pg = get_default_group()  # raises torch's error
            elif isinstance(group, ProcessGroup):
                pg = group
            elif group is GroupMember.NON_GROUP_MEMBER:
                # (stacklevel 3: the user's line, above the collective and this)
                warnings.warn(f"Running {name} on global rank {_global_rank()} which does "
                              "not belong to the given group.", stacklevel=3)
                return None
            else:
                raise TypeError(f"group must be a ProcessGroup (from new_group), None or "
                                f"GroupMember.NON_GROUP_MEMBER, got {type(group).__name__}")
            tried = fast is None
        if not tried and not async_op and fast(pg, *args, **kwargs):
            return None
        call, run = body(pg, *args, **kwargs)
        work = pg.submit(call, run, not async_op)
        return work if async_op else None

    if fast is None and fast_call is None:
        def run_collective(*args, **kwargs):
            return submit(None, args, kwargs)
        # Frames of this function carry the collective's name, not
        # "run_collective": tracebacks read "in all_reduce", and so does
        # nc.launch's report of what a stuck rank is doing.
        run_collective.__code__ = run_collective.__code__.replace(co_name=name,
                                                                  co_qualname=name)
    else:
        # (submit reads fast when it runs: the one made here, if none was given)
        run_collective, fast = _front(name, params, fast, submit, fast_call)
    functools.update_wrapper(run_collective, body)
    run_collective.__signature__ = signature.replace(parameters=params)
    return run_collective


# The function a collective with a fast path is (made by _front, which fills
# in its name and parameters): explicit parameters, not ``*args, **kwargs``,
# because packing and unpacking those cost 0.11-0.16 us a call alone, 0.2-0.3 us
# of a repeated small call between two ranks (measured: docs/performance/
# small-calls.md). Compiled with this file's name and these
# lines' numbers, so tracebacks and nc.launch's reports show this text.
_FRONT_LINE = sys._getframe().f_lineno + 2
_FRONT = """
def {name}({params}):
    if group is None and not async_op:  # the busiest case: the default group, waiting
        pg = ((_thread_state.world or _process_world) if _thread_worlds[0]  # (world._world)
              else _process_world).pg
        if pg is not None and ({fast_call}):
            return None
        return submit(pg, ({args},), {{}})
    return submit(None, ({args},), {{}})
def {name}_repeat(pg, {params}):
    return {fast_call}
"""


def _front(name: str, params: list, fast, submit, fast_call=None) -> tuple:
    """The function ``name`` with torch's parameters ``params`` (each positional
    or keyword, ``group`` and ``async_op`` among them) that tries ``fast``
    (or evaluates ``fast_call``) before ``submit`` (see :func:`collective`),
    and the fast path as a function (``fast``, or one made of ``fast_call``)."""
    space = {"_thread_state": _thread_state, "_process_world": _process_world,
             "_thread_worlds": _thread_worlds, "fast": fast, "submit": submit,
             "NOT_TAKEN": fused_step.NOT_TAKEN}
    listed = []
    for p in params:
        assert p.kind is p.POSITIONAL_OR_KEYWORD, (name, p)
        if p.default is p.empty:
            listed.append(p.name)
        else:
            space[f"_default_{p.name}"] = p.default
            listed.append(f"{p.name}=_default_{p.name}")
    args = ", ".join(p.name for p in params)
    source = _FRONT.format(name=name, params=", ".join(listed), args=args,
                           fast_call=(fast_call or "fast(pg, {args})").format(args=args))
    exec(compile("\n" * (_FRONT_LINE - 2) + source, __file__, "exec"), space)
    return space[name], fast or space[f"{name}_repeat"]


def _global_rank() -> int:
    pg = _world().pg
    return -1 if pg is None else pg.rank()


def _dtype_name(tensor) -> str:
    name = str(getattr(tensor, "dtype", type(tensor).__name__)).replace("torch.", "")
    # torch lets complex64 mix with float32 (it views complex as real pairs).
    return "float32" if name == "complex64" else name


def _same_dtype(*tensors) -> None:
    """torch's _ensure_all_tensors_same_dtype, with its words."""
    last = None
    for t in (x for item in tensors
              for x in (item if isinstance(item, (list, tuple)) else (item,))):
        name = _dtype_name(t)
        if last is None:
            last = name
        elif name != last:
            raise ValueError(f"Invalid usage of tensors with different dtypes. Found {last} "
                             f"and {name}")


def _tensor_list(param, name: str) -> list:
    """torch's _check_tensor_list: a list (or tuple) of arrays, not one array."""
    if not isinstance(param, (list, tuple)) or any(isinstance(p, (list, tuple))
                                                   for p in param):
        got = type(param) if not isinstance(param, (list, tuple)) else \
            [type(p) for p in param]
        raise TypeError(f"Invalid function argument. Expected parameter `{name}` of type "
                        f"List[array] but got {got} instead.")
    return list(param)


# -- reductions ------------------------------------------------------------------------
@functools.partial(collective,
                   fast_call="(r := pg.repeats) is not None and r.allreduce(tensor, op)")
def all_reduce(pg, tensor, op=ReduceOp.SUM, group=None, async_op=False):
    """Reduce ``tensor`` over the group's ranks, in place on every rank."""
    call, run = reductions.allreduce(pg.context, [tensor], None, op)
    if (repeats := pg.repeats) is not None:
        repeats.learn(tensor, op, call, run)
    return call, run


@collective
def all_reduce_coalesced(pg, tensors, op=ReduceOp.SUM, group=None, async_op=False):
    """all_reduce of several arrays (one dtype, any shapes) in one collective."""
    tensors = list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]
    _same_dtype(tensors)
    return reductions.allreduce_coalesced(pg.context, tensors,
                                          AllreduceCoalescedOptions(reduce_op=op))


def _reduce_repeat(pg, tensor, dst=None, op=ReduceOp.SUM, group=None, async_op=False,
                   group_dst=None):
    return (repeats := pg.repeats) is not None and \
        repeats.reduce(tensor, op, _root(pg, repeats, dst, group_dst, "dst"))


@functools.partial(collective, fast=_reduce_repeat)
def reduce(pg, tensor, dst=None, op=ReduceOp.SUM, group=None, async_op=False,
           group_dst=None):
    """Reduce ``tensor`` over the group's ranks into global rank ``dst``'s."""
    call, run = reductions.reduce(pg.context, [tensor], None, op,
                                  _peer(pg, dst, group_dst, "dst"))
    if (repeats := pg.repeats) is not None:
        repeats.learn(tensor, op, call, run)
    return call, run


@collective
def reduce_scatter(pg, output, input_list, op=ReduceOp.SUM, group=None, async_op=False):
    """Reduce ``input_list[r]`` over ranks into rank r's ``output``."""
    input_list = _tensor_list(input_list, "input_list")
    _same_dtype(output, input_list)
    return reductions.reduce_scatter(pg.context, [output], [input_list],
                                     ReduceScatterOptions(reduce_op=op))


def _reduce_scatter_tensor_repeat(pg, output, input, op=ReduceOp.SUM, group=None,
                                  async_op=False):
    return (repeats := pg.repeats) is not None and \
        repeats.move("reduce_scatter_tensor", op, (output, input))


@functools.partial(collective, fast=_reduce_scatter_tensor_repeat)
def reduce_scatter_tensor(pg, output, input, op=ReduceOp.SUM, group=None, async_op=False):
    """Reduce ``input`` (world size times ``output``'s elements) over ranks;
    rank r keeps the r-th share in ``output``."""
    call, run = reductions.reduce_scatter_tensor_coalesced(
        pg.context, output, input, ReduceScatterOptions(reduce_op=op),
        name="reduce_scatter_tensor")
    if (repeats := pg.repeats) is not None:
        repeats.learn_move("reduce_scatter_tensor", op, (output, input), call, input, output,
                           run)
    return call, run


def reduce_scatter_single(output, input, op=ReduceOp.SUM, group=None, async_op=False):
    """torch's newer name of :func:`reduce_scatter_tensor`."""
    return reduce_scatter_tensor(output, input, op, group, async_op)


# -- data movement ------------------------------------------------------------------------
def _broadcast_repeat(pg, tensor, src=None, group=None, async_op=False, group_src=None):
    return (repeats := pg.repeats) is not None and \
        repeats.broadcast(tensor, _root(pg, repeats, src, group_src, "src"))


@functools.partial(collective, fast=_broadcast_repeat)
def broadcast(pg, tensor, src=None, group=None, async_op=False, group_src=None):
    """Copy global rank ``src``'s ``tensor`` into ``tensor`` on every rank."""
    call, run = movement.broadcast(pg.context, [tensor], None, _peer(pg, src, group_src, "src"))
    if (repeats := pg.repeats) is not None:
        repeats.learn(tensor, None, call, run)
    return call, run


def _all_gather_form(pg, tensor_list, tensor, group=None, async_op=False):
    return (repeats := pg.repeats) is not None and type(tensor_list) is list and \
        repeats.all_gather(tensor_list, tensor)


@functools.partial(collective, fast=_all_gather_form)
def all_gather(pg, tensor_list, tensor, group=None, async_op=False):
    """Every rank's ``tensor`` into ``tensor_list[rank]``, on every rank."""
    tensor_list = _tensor_list(tensor_list, "tensor_list")
    _same_dtype(tensor_list, tensor)
    call, run = movement.allgather(pg.context, [tensor_list], [tensor])
    if (repeats := pg.repeats) is not None:
        repeats.learn_all_gather(tensor_list, tensor, call)
    return call, run


def _all_gather_into_tensor_repeat(pg, output_tensor, input_tensor, group=None,
                                   async_op=False):
    return (repeats := pg.repeats) is not None and \
        repeats.allgather(output_tensor, input_tensor)


@functools.partial(collective, fast=_all_gather_into_tensor_repeat)
def all_gather_into_tensor(pg, output_tensor, input_tensor, group=None, async_op=False):
    """Every rank's ``input_tensor``, concatenated in rank order, into ``output_tensor``."""
    call, run = movement.allgather_into_tensor_coalesced(pg.context, output_tensor,
                                                         input_tensor, name="allgather_into_tensor")
    if (repeats := pg.repeats) is not None:
        repeats.learn_allgather(output_tensor, input_tensor, call, run)
    return call, run


def all_gather_single(output_tensor, input_tensor, group=None, async_op=False):
    """torch's newer name of :func:`all_gather_into_tensor`."""
    return all_gather_into_tensor(output_tensor, input_tensor, group, async_op)


@collective
def all_gather_coalesced(pg, output_tensor_lists, input_tensor_list, group=None,
                         async_op=False):
    """all_gather of several arrays at once: ``output_tensor_lists[rank][i]``
    receives rank ``rank``'s ``input_tensor_list[i]``."""
    input_tensor_list = _tensor_list(input_tensor_list, "input_tensor_list")
    _same_dtype(input_tensor_list)
    if not isinstance(output_tensor_lists, (list, tuple)):
        raise TypeError("Invalid function argument: output_tensor_lists should be a list")
    outputs = []
    for output_tensor_list in output_tensor_lists:
        if not isinstance(output_tensor_list, (list, tuple)):
            raise TypeError(f"Invalid function argument. Expected parameter "
                            f"`output_tensor_lists` of type List[List[array]] but got "
                            f"{type(output_tensor_list)} elements instead.")
        _same_dtype(output_tensor_list)
        outputs.append(list(output_tensor_list))
    return movement.allgather_coalesced(pg.context, outputs, input_tensor_list)


def _rooted_list(pg, tensor, lst, root: int, what: str, side: str) -> list:
    """torch's checks of gather's and scatter's list, in torch's order: the
    list's type, then every dtype (on every rank), then whether this rank
    (the root or not) must give it."""
    # torch: "may be left unspecified" -- None and [] alike.
    if lst is None or (isinstance(lst, (list, tuple)) and not lst):
        lst = []
    else:
        lst = _tensor_list(lst, what)
    _same_dtype(tensor, lst)
    if pg.rank() == root:
        if not lst:
            raise ValueError(f"Argument ``{what}`` must be specified on {side} rank.")
    elif lst:
        raise ValueError(f"Argument ``{what}`` must NOT be specified on non-{side} ranks.")
    return lst


def _root(pg, repeats, peer, group_peer, which: str, default=None) -> int:
    """``_peer(pg, peer, group_peer, which, default)`` for a repeat path: a
    global rank given as an int (or the default) is translated once per
    group and kept (``repeats.roots``): translating took 0.25 us of a
    repeated 64-byte broadcast's 1.9 (docs/performance/small-calls.md)."""
    given = peer if peer is not None or default is None else default
    if group_peer is None and type(given) is int:
        root = repeats.roots.get(given)
        if root is None:
            root = repeats.roots[given] = _peer(pg, given, None, which)
        return root
    return _peer(pg, peer, group_peer, which, default)


def _rooted_repeat(pg, name: str, tensor, blocks, peer, group_peer, which: str) -> bool:
    """The repeat path of gather and scatter (``name``): ``blocks`` is the
    root's list (None elsewhere), the root is given as ``_peer`` takes it."""
    return (repeats := pg.repeats) is not None and \
        isinstance(blocks, (list, tuple, type(None))) and \
        repeats.move(name, _root(pg, repeats, peer, group_peer, which, default=0),
                     (tensor, *(blocks or ())))


def _learn_rooted(pg, name: str, root: int, tensor, blocks: list, call, run) -> None:
    """Let the group plan a repeat of gather or scatter (``name``): fused when
    the root's ``blocks`` (or none, off the root) lie back to back in one
    array, else a replay."""
    if (repeats := pg.repeats) is None:
        return
    inp, out, fuse = rooted_sides(name, tensor, blocks)
    repeats.learn_move(name, root, (tensor, *blocks), call, inp, out, run, fuse)


def _gather_repeat(pg, tensor, gather_list=None, dst=None, group=None, async_op=False,
                   group_dst=None):
    return _rooted_repeat(pg, "gather", tensor, gather_list, dst, group_dst, "dst")


@functools.partial(collective, fast=_gather_repeat)
def gather(pg, tensor, gather_list=None, dst=None, group=None, async_op=False,
           group_dst=None):
    """Every rank's ``tensor`` into ``gather_list`` on global rank ``dst`` (default 0)."""
    root = _peer(pg, dst, group_dst, "dst", default=0)
    gather_list = _rooted_list(pg, tensor, gather_list, root, "gather_list", "destination")
    outputs = [gather_list] if pg.rank() == root else []
    call, run = movement.gather(pg.context, outputs, [tensor], GatherOptions(root_rank=root))
    _learn_rooted(pg, "gather", root, tensor, gather_list, call, run)
    return call, run


@collective
def gather_single(pg, tensor, gather_tensor=None, dst=None, group=None, async_op=False,
                  group_dst=None):
    """Every rank's ``tensor``, in rank order, into the one (contiguous)
    ``gather_tensor`` on global rank ``dst`` (default 0); ``gather_tensor``
    holds world size times ``tensor``'s elements, flat or stacked."""
    root = _peer(pg, dst, group_dst, "dst", default=0)
    outputs = []
    if pg.rank() == root:
        if gather_tensor is None:
            raise ValueError("gather_tensor must be specified on the destination rank")
        _same_dtype(tensor, gather_tensor)
        flat, part = as_array(gather_tensor, "gather_single"), as_array(tensor, "gather_single")
        if not flat.flags.c_contiguous:
            raise ValueError("gather_single: gather_tensor must be contiguous")
        if flat.size != part.size * pg.size():
            raise ValueError(f"gather_single: gather_tensor has {flat.size} elements; it must "
                             f"hold world size ({pg.size()}) times the input's {part.size}")
        flat = flat.reshape(-1)
        outputs = [[flat[r * part.size:(r + 1) * part.size].reshape(part.shape)
                    for r in range(pg.size())]]
    return movement.gather(pg.context, outputs, [tensor], GatherOptions(root_rank=root))


def gather_into_tensor(tensor, gather_tensor=None, dst=None, group=None, async_op=False,
                       group_dst=None):
    """torch's other name of :func:`gather_single`."""
    return gather_single(tensor, gather_tensor, dst, group, async_op, group_dst)


def _scatter_repeat(pg, tensor, scatter_list=None, src=None, group=None, async_op=False,
                    group_src=None):
    return _rooted_repeat(pg, "scatter", tensor, scatter_list, src, group_src, "src")


@functools.partial(collective, fast=_scatter_repeat)
def scatter(pg, tensor, scatter_list=None, src=None, group=None, async_op=False,
            group_src=None):
    """``scatter_list[r]`` of global rank ``src`` (default 0) into ``tensor`` on rank r."""
    root = _peer(pg, src, group_src, "src", default=0)
    scatter_list = _rooted_list(pg, tensor, scatter_list, root, "scatter_list", "source")
    inputs = [scatter_list] if pg.rank() == root else []
    call, run = movement.scatter(pg.context, [tensor], inputs, ScatterOptions(root_rank=root))
    _learn_rooted(pg, "scatter", root, tensor, scatter_list, call, run)
    return call, run


def _all_to_all_form(pg, output_tensor_list, input_tensor_list, group=None, async_op=False):
    return (repeats := pg.repeats) is not None and \
        repeats.all_to_all(output_tensor_list, input_tensor_list)


@functools.partial(collective, fast=_all_to_all_form)
def all_to_all(pg, output_tensor_list, input_tensor_list, group=None, async_op=False):
    """Rank r's ``input_tensor_list[q]`` lands in rank q's ``output_tensor_list[r]``."""
    output_tensor_list = _tensor_list(output_tensor_list, "output_tensor_list")
    input_tensor_list = _tensor_list(input_tensor_list, "input_tensor_list")
    _same_dtype(output_tensor_list, input_tensor_list)
    call, run = exchange.alltoall(pg.context, output_tensor_list, input_tensor_list)
    if (repeats := pg.repeats) is not None:
        repeats.learn_all_to_all(output_tensor_list, input_tensor_list, call, run)
    return call, run


def _all_to_all_single_repeat(pg, output, input, output_split_sizes=None,
                              input_split_sizes=None, group=None, async_op=False):
    return (repeats := pg.repeats) is not None and output_split_sizes is None and \
        input_split_sizes is None and repeats.move("alltoall_base", None, (output, input))


@functools.partial(collective, fast=_all_to_all_single_repeat)
def all_to_all_single(pg, output, input, output_split_sizes=None, input_split_sizes=None,
                      group=None, async_op=False):
    """all_to_all on the first dimension of single arrays (equal or given splits)."""
    _same_dtype(output, input)
    call, run = exchange.alltoall_base(pg.context, output, input, output_split_sizes,
                                       input_split_sizes)
    if (repeats := pg.repeats) is not None and output_split_sizes is None and \
            input_split_sizes is None:
        repeats.learn_move("alltoall_base", None, (output, input), call, input, output, run)
    return call, run


# -- barriers ------------------------------------------------------------------------------
def _barrier_repeat(pg, group=None, async_op=False, device_ids=None, timeout=None):
    if (repeats := pg.repeats) is None:
        return False
    if timeout is None:  # nc.barrier(): the group's fused barrier, no key to look up
        fused = repeats.default_barrier
        return fused is not None and fused.run()
    return type(timeout) is timedelta and repeats.barrier(timeout)


# nc.barrier()'s own fast path, inlined in its front: the default group's
# fused barrier with no key to look up (0.06 us of 0.7), and FusedCall.run's
# two lines (its frame another 0.04): the compiled start, hold() if not done.
_DEFAULT_BARRIER = ("(r := pg.repeats) is not None and (f := r.default_barrier) is not None "
                    "and ((g := f._start(f.address, 0, f.spin_ns)) == -1 "
                    "or g != NOT_TAKEN and f.hold(g)) if timeout is None else fast(pg, {args})")


@functools.partial(collective, fast=_barrier_repeat, fast_call=_DEFAULT_BARRIER)
def barrier(pg, group=None, async_op=False, device_ids=None, timeout: timedelta | None = None):
    """Wait until every rank of the group (and every earlier collective) got here."""
    _check_timeout(timeout, "barrier")
    call, run = p2p.barrier(pg.context, BarrierOptions(timeout=timeout))
    if (repeats := pg.repeats) is not None:
        repeats.learn_barrier(timeout, call)
    return call, run


@collective
def monitored_barrier(pg, group=None, timeout: timedelta | None = None, wait_all_ranks=False):
    """A barrier that names the ranks that did not arrive in time (always waits)."""
    _check_timeout(timeout, "monitored_barrier")
    return p2p.monitored_barrier(pg.context, timeout, wait_all_ranks)
