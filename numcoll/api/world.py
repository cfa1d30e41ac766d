"""The default group: its state (per process, or per thread for thread ranks),
``init_process_group`` / ``destroy_process_group``, and how a module function
finds the group it runs on (torch.distributed's names and words).

The default group is per process -- or per thread for ranks started by
``numcoll.launch(..., mode="thread")``, so each thread-rank has its own.
"""

from __future__ import annotations

import operator
import os
import threading
import warnings
from datetime import timedelta

from ..bootstrap.init_methods import rendezvous
from ..bootstrap.launcher_env import local_host_for
from ..logs import get_logger, set_rank
from ..process_group import ProcessGroup

__all__ = ["GroupMember", "group", "get_default_group", "init_process_group",
           "destroy_process_group", "is_initialized", "get_rank", "get_world_size",
           "set_timeout"]

DEFAULT_TIMEOUT = timedelta(minutes=30)
#: The backend names ``init_process_group`` takes: numcoll implements gloo's collectives.
BACKENDS = ("gloo", "numcoll", "cpu:gloo")


class _World:
    """Default group state: the group, the store it owns (if any), sub-groups."""

    def __init__(self):
        self.pg: ProcessGroup | None = None
        self.owned_store = None
        self.store = None
        self.backend = "gloo"
        self.groups: dict[ProcessGroup, list[int]] = {}
        self.group_count = 0
        self.local_counts: dict[tuple, int] = {}


_log = get_logger()
_process_world = _World()


class _ThreadState(threading.local):
    """Per-thread state: ``world``, a thread's own default group (``launch``'s
    thread mode), else None."""

    # A class-level default: every collective reads ``world``, and a missing
    # attribute of a thread-local costs a raised and caught AttributeError
    # (0.4 us, as much as the rest of a small call's Python).
    world: _World | None = None


_thread_state = _ThreadState()
#: How many threads have a world of their own (a one-item list, which the
#: collectives' fronts hold by reference): while none has, a front reads the
#: process's world without the thread-local lookup (0.03 us of a 0.7 us
#: barrier). Counted up before a thread's world is set, down after it is
#: dropped, so a thread with a world of its own always finds it counted.
_thread_worlds = [0]
_thread_worlds_lock = threading.Lock()


def _world() -> _World:
    return (_thread_state.world or _process_world) if _thread_worlds[0] else _process_world


def _use_thread_world() -> None:
    """Give the calling thread a default group of its own (``launch`` thread mode)."""
    if _thread_state.world is None:
        with _thread_worlds_lock:
            _thread_worlds[0] += 1
    _thread_state.world = _World()


def _drop_thread_world() -> None:
    if _thread_state.world is not None:
        _thread_state.world = None
        with _thread_worlds_lock:
            _thread_worlds[0] -= 1


class _GroupMemberMeta(type):
    @property
    def WORLD(cls) -> ProcessGroup | None:  # noqa: N802 - torch's name
        """The default group, or None before init_process_group."""
        return _world().pg


class GroupMember(metaclass=_GroupMemberMeta):
    """``GroupMember.WORLD`` is the default group; ``GroupMember.NON_GROUP_MEMBER``
    is what ``new_group`` returns on ranks outside the group. A collective
    called with it does nothing, warns, and returns None (as in torch)."""

    NON_GROUP_MEMBER = object()


class _GroupNamespace:
    """torch's ``group`` namespace: ``group.WORLD`` is the default group."""

    @property
    def WORLD(self) -> ProcessGroup:  # noqa: N802 - torch's name
        """The default group (``numcoll.group.WORLD``)."""
        return get_default_group()


group = _GroupNamespace()


def get_default_group() -> ProcessGroup:
    """The default group made by ``init_process_group``."""
    pg = _world().pg
    if pg is None:
        raise RuntimeError("Default process group has not been initialized, please make sure "
                           "to call init_process_group.")
    return pg


def _check_group(group) -> None:
    if group is not None and group is not GroupMember.NON_GROUP_MEMBER \
            and not isinstance(group, ProcessGroup):
        raise TypeError(f"group must be a ProcessGroup (from new_group), None or "
                        f"GroupMember.NON_GROUP_MEMBER, got {type(group).__name__}")


def _resolve(group, op_name: str | None = None) -> ProcessGroup | None:
    """The group to run on, or None on a rank outside it (warning once per
    call site, with torch's words, when ``op_name`` is given)."""
    if group is None:
        return get_default_group()
    if group is GroupMember.NON_GROUP_MEMBER:
        if op_name is not None:
            pg = _world().pg
            warnings.warn(f"Running {op_name} on global rank {-1 if pg is None else pg.rank()} "
                          "which does not belong to the given group.", stacklevel=3)
        return None
    _check_group(group)
    return group


def _check_rank_arg(value, what: str) -> int:
    """``value`` as an int: ints and NumPy integers pass; bools, floats, strings
    and None are a TypeError (a rank of ``True`` or ``1.0`` is a mistake)."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(f"{what} must be an int, got {value!r} ({type(value).__name__})")


def _check_timeout(timeout, what: str) -> None:
    if timeout is None:
        return
    if not isinstance(timeout, timedelta):
        raise TypeError(f"{what}: timeout must be a datetime.timedelta, got "
                        f"{type(timeout).__name__}")
    if timeout <= timedelta(0):
        raise ValueError(f"{what}: timeout must be positive, got {timeout}")


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
