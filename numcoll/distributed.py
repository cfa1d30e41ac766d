"""The torch.distributed-style module API: a default group and free functions.

Same names, parameters and defaults as ``torch.distributed`` (tensor ->
array). Ranks given to these functions (``src``, ``dst``) are global ranks,
translated for sub-groups as torch does. With ``async_op=True`` a function
returns its Work; otherwise it waits and returns None (``recv`` returns the
sender's rank).

The default group is per process — or per thread for ranks started by
``numcoll.launch(..., mode="thread")``, so each thread-rank has its own.
"""

from __future__ import annotations

import threading
from datetime import timedelta

from .ops import ReduceOp
from .options import (
    AllreduceCoalescedOptions,
    AllreduceOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
)
from .process_group import ProcessGroup
from .init_methods import rendezvous

__all__ = [
    "GroupMember", "group", "init_process_group", "destroy_process_group", "is_initialized",
    "get_rank", "get_world_size", "new_group", "get_default_group",
    "all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "all_gather",
    "all_gather_into_tensor", "all_gather_coalesced", "gather", "scatter", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier",
    "send", "recv", "isend", "irecv",
]

DEFAULT_TIMEOUT = timedelta(minutes=30)


class _World:
    """Default group state: the group, the store it owns (if any), sub-groups."""

    def __init__(self):
        self.pg: ProcessGroup | None = None
        self.owned_store = None
        self.store = None
        self.groups: dict[ProcessGroup, list[int]] = {}
        self.group_count = 0


_process_world = _World()
_thread_state = threading.local()


def _world() -> _World:
    return getattr(_thread_state, "world", None) or _process_world


def _use_thread_world() -> None:
    """Give the calling thread a default group of its own (``launch`` thread mode)."""
    _thread_state.world = _World()


def _drop_thread_world() -> None:
    _thread_state.world = None


class GroupMember:
    """``GroupMember.NON_GROUP_MEMBER`` is what ``new_group`` returns on ranks
    outside the group; collectives called with it do nothing and return None."""

    NON_GROUP_MEMBER = object()


class _GroupNamespace:
    @property
    def WORLD(self) -> ProcessGroup:  # noqa: N802 - torch's name
        return get_default_group()


group = _GroupNamespace()


def init_process_group(init_method: str | None = None, *, store=None, rank: int = -1,
                       world_size: int = -1, timeout: timedelta | None = None,
                       backend: str | None = None, transport: str | None = None,
                       threads: int = 2, group_name: str = "default") -> None:
    """Create the default group.

    Either ``store`` (with ``rank`` and ``world_size``) or ``init_method``
    (``env://`` — the default —, ``tcp://host:port``, ``file:///path``).
    ``backend`` is accepted for torch compatibility ("gloo" or None).
    """
    world = _world()
    if world.pg is not None:
        raise RuntimeError("trying to initialize the default process group twice")
    if backend not in (None, "gloo", "numcoll"):
        raise ValueError(f"init_process_group: unsupported backend {backend!r} "
                         "(numcoll implements gloo's collectives)")
    timeout = timeout or DEFAULT_TIMEOUT
    owned = None
    if store is None:
        store, rank, world_size = next(rendezvous(init_method or "env://", rank, world_size,
                                                  timeout=timeout))
        owned = store
    elif rank < 0 or world_size < 1:
        raise ValueError("init_process_group: rank and world_size are required with a store")
    opts = ProcessGroup.Options(timeout=timeout, threads=threads, transport=transport,
                                group_name=group_name)
    world.pg = ProcessGroup(store, rank, world_size, opts)
    world.owned_store = owned
    world.groups = {world.pg: list(range(world_size))}
    world.group_count = 0
    world.store = store


def destroy_process_group(group: ProcessGroup | None = None) -> None:
    """Shut down ``group``, or the default group and every sub-group."""
    world = _world()
    if group is not None and group is not world.pg:
        if group is not GroupMember.NON_GROUP_MEMBER:
            group.shutdown()
            world.groups.pop(group, None)
        return
    for pg in list(world.groups):
        pg.shutdown()
    if world.owned_store is not None:
        world.owned_store.close()
    world.pg, world.owned_store, world.groups = None, None, {}


def is_initialized() -> bool:
    return _world().pg is not None


def get_default_group() -> ProcessGroup:
    pg = _world().pg
    if pg is None:
        raise RuntimeError("Default process group has not been initialized, please make sure "
                           "to call init_process_group.")
    return pg


def _resolve(group) -> ProcessGroup | None:
    if group is None:
        return get_default_group()
    if group is GroupMember.NON_GROUP_MEMBER:
        return None
    return group


def get_rank(group: ProcessGroup | None = None) -> int:
    pg = _resolve(group)
    return -1 if pg is None else pg.rank()


def get_world_size(group: ProcessGroup | None = None) -> int:
    pg = _resolve(group)
    return -1 if pg is None else pg.size()


def new_group(ranks=None, timeout: timedelta | None = None, **_ignored):
    """A sub-group of ``ranks`` (global ranks; all of them if None).

    Every rank of the default group must call it, in the same order as every
    other ``new_group`` call; ranks outside ``ranks`` get
    ``GroupMember.NON_GROUP_MEMBER``.
    """
    world = _world()
    default = get_default_group()
    world.group_count += 1
    ranks = sorted(range(default.size()) if ranks is None else ranks)
    if len(set(ranks)) != len(ranks) or any(not 0 <= r < default.size() for r in ranks):
        raise ValueError(f"new_group: invalid ranks {ranks} for world size {default.size()}")
    me = default.rank()
    if me not in ranks:
        return GroupMember.NON_GROUP_MEMBER
    opts = ProcessGroup.Options(timeout=timeout or default.options.timeout,
                                threads=default.options.threads,
                                transport=default.transport_kind,
                                group_name=f"{default.options.group_name}/sub{world.group_count}")
    pg = ProcessGroup(world.store, ranks.index(me), len(ranks), opts)
    world.groups[pg] = ranks
    return pg


def _group_rank(pg: ProcessGroup, global_rank: int, what: str) -> int:
    ranks = _world().groups.get(pg)
    if ranks is None:
        return global_rank
    try:
        return ranks.index(global_rank)
    except ValueError:
        raise ValueError(f"{what} rank {global_rank} is not part of the group {ranks}") from None


def _finish(work, async_op: bool):
    if async_op:
        return work
    work.wait()
    return None


# -- collectives ---------------------------------------------------------------------
def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    pg = _resolve(group)
    if pg is None:
        return None
    return _finish(pg.allreduce([tensor], AllreduceOptions(reduce_op=op)), async_op)


def all_reduce_coalesced(tensors, op=ReduceOp.SUM, group=None, async_op=False):
    pg = _resolve(group)
    if pg is None:
        return None
    return _finish(pg.allreduce_coalesced(list(tensors), AllreduceCoalescedOptions(reduce_op=op)),
                   async_op)


def broadcast(tensor, src, group=None, async_op=False):
    pg = _resolve(group)
    if pg is None:
        return None
    opts = BroadcastOptions(root_rank=_group_rank(pg, src, "src"))
    return _finish(pg.broadcast([tensor], opts), async_op)


def reduce(tensor, dst, op=ReduceOp.SUM, group=None, async_op=False):
    pg = _resolve(group)
    if pg is None:
        return None
    opts = ReduceOptions(reduce_op=op, root_rank=_group_rank(pg, dst, "dst"))
    return _finish(pg.reduce([tensor], opts), async_op)


def all_gather(tensor_list, tensor, group=None, async_op=False):
    pg = _resolve(group)
    if pg is None:
        return None
    return _finish(pg.allgather([list(tensor_list)], [tensor]), async_op)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    pg = _resolve(group)
    if pg is None:
        return None
    return _finish(pg.allgather_into_tensor(output_tensor, input_tensor), async_op)


def all_gather_coalesced(output_tensor_lists, input_tensor_list, group=None, async_op=False):
    pg = _resolve(group)
    if pg is None:
        return None
    return _finish(pg.allgather_coalesced(output_tensor_lists, list(input_tensor_list)),
                   async_op)


def gather(tensor, gather_list=None, dst=0, group=None, async_op=False):
    pg = _resolve(group)
    if pg is None:
        return None
    root = _group_rank(pg, dst, "dst")
    outputs = [list(gather_list)] if pg.rank() == root and gather_list is not None else []
    if pg.rank() != root and gather_list:
        raise ValueError("gather: Argument ``gather_list`` must NOT be specified on non-"
                         "destination ranks.")
    return _finish(pg.gather(outputs, [tensor], GatherOptions(root_rank=root)), async_op)


def scatter(tensor, scatter_list=None, src=0, group=None, async_op=False):
    pg = _resolve(group)
    if pg is None:
        return None
    root = _group_rank(pg, src, "src")
    inputs = [list(scatter_list)] if pg.rank() == root and scatter_list is not None else []
    if pg.rank() != root and scatter_list:
        raise ValueError("scatter: Argument ``scatter_list`` must NOT be specified on non-"
                         "source ranks.")
    return _finish(pg.scatter([tensor], inputs, ScatterOptions(root_rank=root)), async_op)


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False):
    pg = _resolve(group)
    if pg is None:
        return None
    return _finish(pg.reduce_scatter([output], [list(input_list)],
                                     ReduceScatterOptions(reduce_op=op)), async_op)


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False):
    pg = _resolve(group)
    if pg is None:
        return None
    return _finish(pg.reduce_scatter_tensor(output, input, ReduceScatterOptions(reduce_op=op)),
                   async_op)


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
    pg = _resolve(group)
    if pg is None:
        return None
    return _finish(pg.alltoall(list(output_tensor_list), list(input_tensor_list)), async_op)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                      group=None, async_op=False):
    pg = _resolve(group)
    if pg is None:
        return None
    return _finish(pg.alltoall_base(output, input, output_split_sizes, input_split_sizes),
                   async_op)


def barrier(group=None, async_op=False, device_ids=None, timeout: timedelta | None = None):
    pg = _resolve(group)
    if pg is None:
        return None
    return _finish(pg.barrier(BarrierOptions(timeout=timeout)), async_op)


def monitored_barrier(group=None, timeout: timedelta | None = None, wait_all_ranks=False):
    pg = _resolve(group)
    if pg is None:
        return None
    pg.monitored_barrier(timeout, wait_all_ranks).wait()
    return None


def isend(tensor, dst, group=None, tag=0):
    pg = _resolve(group)
    if pg is None:
        return None
    return pg.send([tensor], _group_rank(pg, dst, "dst"), tag)


def irecv(tensor, src=None, group=None, tag=0):
    pg = _resolve(group)
    if pg is None:
        return None
    if src is None:
        return pg.recv_anysource([tensor], tag)
    return pg.recv([tensor], _group_rank(pg, src, "src"), tag)


def send(tensor, dst, group=None, tag=0) -> None:
    work = isend(tensor, dst, group, tag)
    if work is not None:
        work.wait()


def recv(tensor, src=None, group=None, tag=0) -> int:
    """Receive into ``tensor``; returns the sender's (global) rank."""
    pg = _resolve(group)
    work = irecv(tensor, src, group, tag)
    if work is None:
        return -1
    work.wait()
    ranks = _world().groups.get(pg)
    source = work.source_rank()
    return ranks[source] if ranks else source
