"""The torch.distributed-style module API: a default group and free functions.

Same names, parameters and defaults as ``torch.distributed`` (tensor ->
array), so torch code ports by changing the import. Ranks given to these
functions (``src``, ``dst``, ``peer``) are global ranks, translated for
sub-groups as torch does. With ``async_op=True`` a function returns its Work;
otherwise it waits and returns None (``recv`` returns the sender's rank).
The checks made here, before the process group sees the call, keep torch's
words (``tensors with different dtypes``, ``Invalid function argument``).

This module holds init/destroy and the collectives, and re-exports the rest
of the API: group bookkeeping and rank translation (:mod:`numcoll.api.groups`),
sends, receives and their batches (:mod:`numcoll.api.p2p`), backend
queries (:mod:`numcoll.api.backend`); the object collectives are in
:mod:`numcoll.api.objects`.
"""

from __future__ import annotations

import os
import warnings
from datetime import timedelta

from ..memory.arrays import as_array
from .backend import (  # noqa: F401 - the module API re-exports them
    BACKENDS,
    Backend,
    _make_nccl_premul_sum,
    get_backend,
    get_node_local_rank,
    get_pg_count,
    is_available,
    is_backend_available,
    is_gloo_available,
    is_mpi_available,
    is_nccl_available,
    is_torchelastic_launched,
    supports_complex,
)
from .groups import (  # noqa: F401 - the module API re-exports them
    GroupMember,
    _check_group,
    _check_rank_arg,
    _check_timeout,
    _drop_thread_world,  # noqa: F401 - used by launch
    _peer,
    _process_world,
    _resolve,
    _use_thread_world,  # noqa: F401 - used by launch
    _world,
    get_default_group,
    get_global_rank,
    get_group_rank,
    get_process_group_ranks,
    group,
    new_group,
    new_subgroups,
    new_subgroups_by_enumeration,
    split_group,
)
from ..bootstrap.init_methods import rendezvous
from ..bootstrap.launcher_env import local_host_for
from ..logs import get_logger, set_rank
from ..ops import ReduceOp
from ..options import (
    AllreduceCoalescedOptions,
    BarrierOptions,
    GatherOptions,
    ReduceScatterOptions,
    ScatterOptions,
)
from .p2p import (  # noqa: F401 - the module API re-exports them
    P2POp,
    batch_isend_irecv,
    irecv,
    isend,
    recv,
    send,
)
from ..process_group import ProcessGroup, _run_blocking

__all__ = [
    "Backend", "GroupMember", "group", "init_process_group", "destroy_process_group",
    "is_initialized", "is_available", "is_gloo_available", "is_nccl_available",
    "is_mpi_available", "is_torchelastic_launched", "is_backend_available", "supports_complex",
    "get_pg_count", "all_gather_single", "reduce_scatter_single", "gather_single",
    "gather_into_tensor", "set_timeout", "get_backend", "get_rank",
    "get_world_size", "get_node_local_rank", "new_group", "new_subgroups",
    "new_subgroups_by_enumeration", "split_group", "get_default_group", "get_group_rank",
    "get_global_rank", "get_process_group_ranks", "P2POp", "batch_isend_irecv",
    "all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "all_gather",
    "all_gather_into_tensor", "all_gather_coalesced", "gather", "scatter", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier",
    "send", "recv", "isend", "irecv",
]

DEFAULT_TIMEOUT = timedelta(minutes=30)
_log = get_logger()


def init_process_group(backend: str | None = None, init_method: str | None = None,
                       timeout: timedelta | None = None, world_size: int = -1, rank: int = -1,
                       store=None, group_name: str = "", pg_options=None, device_id=None,
                       *, transport: str | None = None, threads: int = 2) -> None:
    """Create the default group (torch's signature and order of parameters).

    Parameters
    ----------
    backend : "gloo", "numcoll" or None.
    init_method : ``env://`` (the default), ``tcp://host:port``, ``file:///path``.
        ``env://`` understands torchrun's variables and, without them, Open
        MPI's, MPICH's and SLURM's (:mod:`numcoll.bootstrap.launcher_env`).
    timeout : deadline of every collective (and of the rendezvous); 30 min.
    world_size, rank : -1 = from the init method; required with ``store``.
    store : a numcoll store shared by all ranks (instead of ``init_method``).
    group_name : separates default groups sharing one store.
    pg_options : a :class:`ProcessGroup.Options`, for numcoll's own settings.
    device_id : must be None (numcoll's groups are not bound to a device).
    transport, threads : numcoll's (keyword only): see ProcessGroup.Options.

    The address peers on other hosts connect to is that of
    ``NUMCOLL_SOCKET_IFNAME`` (or ``GLOO_SOCKET_IFNAME``), else the one that
    routes to the store's host (MASTER_ADDR); 127.0.0.1 when that is local.
    """
    world = _world()
    if world.pg is not None:
        raise ValueError("trying to initialize the default process group twice!")
    if isinstance(backend, str) and "://" in backend and init_method is None:
        # numcoll before 0.1 took the init method first: keep such calls working.
        warnings.warn("init_process_group(url) is deprecated: pass init_method=url (the "
                      "first parameter is the backend, as in torch)", DeprecationWarning,
                      stacklevel=2)
        backend, init_method = None, backend
    if backend is not None and (not isinstance(backend, str)
                                or backend.lower() not in BACKENDS):
        raise ValueError(f"init_process_group: unsupported backend {backend!r} "
                         "(numcoll implements gloo's collectives: use 'gloo' or 'numcoll')")
    if init_method is not None and store is not None:
        raise ValueError("Cannot specify both init_method and store.")
    _check_timeout(timeout, "init_process_group")
    rank = _check_rank_arg(rank, "rank")
    world_size = _check_rank_arg(world_size, "world_size")
    if device_id is not None:
        raise ValueError("init_process_group: device_id is not supported (numcoll's groups "
                         "take host and CUDA arrays alike, without binding a device)")
    if pg_options is not None and not isinstance(pg_options, ProcessGroup.Options):
        raise TypeError(f"init_process_group: pg_options must be a ProcessGroup.Options, got "
                        f"{type(pg_options).__name__}")
    timeout = timeout or (pg_options.timeout if pg_options is not None else DEFAULT_TIMEOUT)
    owned = None
    if store is None:
        store, rank, world_size = next(rendezvous(init_method or "env://", rank, world_size,
                                                  timeout=timeout))
        owned = store
    elif world_size <= 0:
        raise ValueError("world_size must be positive if using store")
    elif rank < 0:
        raise ValueError("rank must be non-negative if using store")
    if pg_options is not None:
        opts = ProcessGroup.Options(**{**vars(pg_options), "timeout": timeout})
    else:
        peer = getattr(store, "host", None) or os.environ.get("MASTER_ADDR")
        opts = ProcessGroup.Options(timeout=timeout, threads=threads, transport=transport,
                                    host=local_host_for(peer))
    opts.group_name = group_name or opts.group_name or "default"
    try:
        pg = ProcessGroup(store, rank, world_size, opts)
    except BaseException:
        if owned is not None:
            owned.close()
        raise
    world.pg = pg
    world.owned_store = owned
    world.groups = {pg: list(range(world_size))}
    world.group_count = 0
    world.local_counts = {}
    world.store = store
    world.backend = "numcoll" if backend and backend.lower() == "numcoll" else "gloo"
    if world is _process_world:      # thread-ranks share the process's log lines
        set_rank(rank)
    _log.info("default group ready: rank %d of %d, transport %s, address %s", rank,
              world_size, pg.transport_kind, opts.host)


def destroy_process_group(group: ProcessGroup | None = None) -> None:
    """Shut down ``group``, or the default group and every sub-group."""
    world = _world()
    _check_group(group)
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
    if world is _process_world:
        set_rank(None)


def is_initialized() -> bool:
    """Whether the default group exists."""
    return _world().pg is not None


def get_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (-1 if it is not a member)."""
    pg = _resolve(group)
    return -1 if pg is None else pg.rank()


def get_world_size(group: ProcessGroup | None = None) -> int:
    """The number of ranks in ``group`` (-1 if this process is not a member)."""
    pg = _resolve(group)
    return -1 if pg is None else pg.size()


def _finish(async_op: bool, collective, *args, **kwargs):
    """``collective(*args, **kwargs)``, a ProcessGroup method: its Work with
    ``async_op``; else wait for it and return None. A blocking call runs on
    this thread when the group has nothing else in flight (no queue, no
    worker: :func:`numcoll.process_group._run_blocking`)."""
    if async_op:
        return collective(*args, **kwargs)
    _run_blocking(collective, *args, **kwargs)
    return None


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


# -- collectives ---------------------------------------------------------------------
def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    """Reduce ``tensor`` over the group's ranks, in place on every rank."""
    pg = _resolve(group, "all_reduce")
    if pg is None:
        return None
    return _finish(async_op, pg.allreduce, [tensor], op=op)


def all_reduce_coalesced(tensors, op=ReduceOp.SUM, group=None, async_op=False):
    """all_reduce of several arrays (one dtype, any shapes) in one collective."""
    pg = _resolve(group, "all_reduce_coalesced")
    if pg is None:
        return None
    tensors = list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]
    _same_dtype(tensors)
    return _finish(async_op, pg.allreduce_coalesced, tensors,
                   AllreduceCoalescedOptions(reduce_op=op))


def broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
    """Copy global rank ``src``'s ``tensor`` into ``tensor`` on every rank."""
    pg = _resolve(group, "broadcast")
    if pg is None:
        return None
    return _finish(async_op, pg.broadcast, [tensor], root=_peer(pg, src, group_src, "src"))


def reduce(tensor, dst=None, op=ReduceOp.SUM, group=None, async_op=False, group_dst=None):
    """Reduce ``tensor`` over the group's ranks into global rank ``dst``'s."""
    pg = _resolve(group, "reduce")
    if pg is None:
        return None
    return _finish(async_op, pg.reduce, [tensor], op=op,
                   root=_peer(pg, dst, group_dst, "dst"))


def all_gather(tensor_list, tensor, group=None, async_op=False):
    """Every rank's ``tensor`` into ``tensor_list[rank]``, on every rank."""
    pg = _resolve(group, "all_gather")
    if pg is None:
        return None
    tensor_list = _tensor_list(tensor_list, "tensor_list")
    _same_dtype(tensor_list, tensor)
    return _finish(async_op, pg.allgather, [tensor_list], [tensor])


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    """Every rank's ``input_tensor``, concatenated in rank order, into ``output_tensor``."""
    pg = _resolve(group, "all_gather_into_tensor")
    if pg is None:
        return None
    return _finish(async_op, pg.allgather_into_tensor, output_tensor, input_tensor)


def all_gather_coalesced(output_tensor_lists, input_tensor_list, group=None, async_op=False):
    """all_gather of several arrays at once: ``output_tensor_lists[rank][i]``
    receives rank ``rank``'s ``input_tensor_list[i]``."""
    pg = _resolve(group, "all_gather_coalesced")
    if pg is None:
        return None
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
    return _finish(async_op, pg.allgather_coalesced, outputs, input_tensor_list)


def gather(tensor, gather_list=None, dst=None, group=None, async_op=False, group_dst=None):
    """Every rank's ``tensor`` into ``gather_list`` on global rank ``dst`` (default 0)."""
    pg = _resolve(group, "gather")
    if pg is None:
        return None
    root = _peer(pg, dst, group_dst, "dst", default=0)
    if pg.rank() == root:
        if gather_list is None:
            raise ValueError("Argument ``gather_list`` must be specified on destination rank.")
        gather_list = _tensor_list(gather_list, "gather_list")
        _same_dtype(tensor, gather_list)
    elif gather_list:
        raise ValueError("Argument ``gather_list`` must NOT be specified on non-destination "
                         "ranks.")
    outputs = [gather_list] if pg.rank() == root else []
    return _finish(async_op, pg.gather, outputs, [tensor], GatherOptions(root_rank=root))


def gather_single(tensor, gather_tensor=None, dst=None, group=None, async_op=False,
                  group_dst=None):
    """Every rank's ``tensor``, in rank order, into the one (contiguous)
    ``gather_tensor`` on global rank ``dst`` (default 0); ``gather_tensor``
    holds world size times ``tensor``'s elements, flat or stacked."""
    pg = _resolve(group, "gather_single")
    if pg is None:
        return None
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
    return _finish(async_op, pg.gather, outputs, [tensor], GatherOptions(root_rank=root))


def gather_into_tensor(tensor, gather_tensor=None, dst=None, group=None, async_op=False,
                       group_dst=None):
    """torch's other name of :func:`gather_single`."""
    return gather_single(tensor, gather_tensor, dst, group, async_op, group_dst)


def set_timeout(timeout: timedelta, group: ProcessGroup | None = None) -> None:
    """Set the default deadline of later collectives on ``group`` (default: the
    default group)."""
    _check_timeout(timeout, "set_timeout")
    if timeout is None:
        raise TypeError("set_timeout: timeout must be a datetime.timedelta, got None")
    pg = _resolve(group)
    if pg is None:
        raise ValueError("Invalid process group specified")
    pg.set_timeout(timeout)


def scatter(tensor, scatter_list=None, src=None, group=None, async_op=False, group_src=None):
    """``scatter_list[r]`` of global rank ``src`` (default 0) into ``tensor`` on rank r."""
    pg = _resolve(group, "scatter")
    if pg is None:
        return None
    root = _peer(pg, src, group_src, "src", default=0)
    if pg.rank() == root:
        if scatter_list is None:
            raise ValueError("Argument ``scatter_list`` must be specified on source rank.")
        scatter_list = _tensor_list(scatter_list, "scatter_list")
        _same_dtype(tensor, scatter_list)
    elif scatter_list:
        raise ValueError("Argument ``scatter_list`` must NOT be specified on non-source ranks.")
    inputs = [scatter_list] if pg.rank() == root else []
    return _finish(async_op, pg.scatter, [tensor], inputs, ScatterOptions(root_rank=root))


def all_gather_single(output_tensor, input_tensor, group=None, async_op=False):
    """torch's newer name of :func:`all_gather_into_tensor`."""
    return all_gather_into_tensor(output_tensor, input_tensor, group, async_op)


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False):
    """Reduce ``input_list[r]`` over ranks into rank r's ``output``."""
    pg = _resolve(group, "reduce_scatter")
    if pg is None:
        return None
    input_list = _tensor_list(input_list, "input_list")
    _same_dtype(output, input_list)
    return _finish(async_op, pg.reduce_scatter, [output], [input_list],
                   ReduceScatterOptions(reduce_op=op))


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False):
    """Reduce ``input`` (world size times ``output``'s elements) over ranks;
    rank r keeps the r-th share in ``output``."""
    pg = _resolve(group, "reduce_scatter_tensor")
    if pg is None:
        return None
    return _finish(async_op, pg.reduce_scatter_tensor, output, input,
                   ReduceScatterOptions(reduce_op=op))


def reduce_scatter_single(output, input, op=ReduceOp.SUM, group=None, async_op=False):
    """torch's newer name of :func:`reduce_scatter_tensor`."""
    return reduce_scatter_tensor(output, input, op, group, async_op)


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
    """Rank r's ``input_tensor_list[q]`` lands in rank q's ``output_tensor_list[r]``."""
    pg = _resolve(group, "all_to_all")
    if pg is None:
        return None
    output_tensor_list = _tensor_list(output_tensor_list, "output_tensor_list")
    input_tensor_list = _tensor_list(input_tensor_list, "input_tensor_list")
    _same_dtype(output_tensor_list, input_tensor_list)
    return _finish(async_op, pg.alltoall, output_tensor_list, input_tensor_list)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                      group=None, async_op=False):
    """all_to_all on the first dimension of single arrays (equal or given splits)."""
    pg = _resolve(group, "all_to_all_single")
    if pg is None:
        return None
    _same_dtype(output, input)
    return _finish(async_op, pg.alltoall_base, output, input, output_split_sizes,
                   input_split_sizes)


def barrier(group=None, async_op=False, device_ids=None, timeout: timedelta | None = None):
    """Wait until every rank of the group (and every earlier collective) got here."""
    pg = _resolve(group, "barrier")
    if pg is None:
        return None
    _check_timeout(timeout, "barrier")
    return _finish(async_op, pg.barrier, BarrierOptions(timeout=timeout))


def monitored_barrier(group=None, timeout: timedelta | None = None, wait_all_ranks=False):
    """A barrier that names the ranks that did not arrive in time."""
    pg = _resolve(group, "monitored_barrier")
    if pg is None:
        return None
    _check_timeout(timeout, "monitored_barrier")
    return _finish(False, pg.monitored_barrier, timeout, wait_all_ranks)
