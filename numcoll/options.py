"""Per-call options, as dataclasses in the style of torch.distributed's.

Every option class has ``timeout`` (a ``timedelta``, or None for the group's
default) and ``algorithm`` (force an algorithm by name for this call, e.g.
"ring"; None chooses by message size). torch's camelCase attribute names
(``rootRank``, ``rootTensor``, ``reduceOp``) are accepted as aliases so code
ported from torch's tests reads the same.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import transports

from .ops import ReduceOp

__all__ = [
    "AllreduceOptions",
    "AllreduceCoalescedOptions",
    "BroadcastOptions",
    "ReduceOptions",
    "AllgatherOptions",
    "GatherOptions",
    "ScatterOptions",
    "ReduceScatterOptions",
    "AllToAllOptions",
    "BarrierOptions",
    "GroupOptions",
]

_ALIASES = {"rootRank": "root_rank", "rootTensor": "root_tensor", "reduceOp": "reduce_op"}


class _CamelAliases:
    # Field names per class, computed once: __setattr__ runs on every option
    # of every call, and dataclasses.fields() is slow.
    _field_names: frozenset = frozenset()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._field_names = None

    def __getattr__(self, name):
        if name in _ALIASES:
            return getattr(self, _ALIASES[name])
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __setattr__(self, name, value):
        name = _ALIASES.get(name, name)
        names = type(self)._field_names
        if names is None:
            names = type(self)._field_names = frozenset(f.name for f in dataclasses.fields(self))
        if name not in names:
            raise AttributeError(f"{type(self).__name__} has no option {name!r}")
        object.__setattr__(self, name, value)


@dataclasses.dataclass
class AllreduceOptions(_CamelAliases):
    reduce_op: ReduceOp = ReduceOp.SUM
    timeout: timedelta | None = None
    algorithm: str | None = None


@dataclasses.dataclass
class AllreduceCoalescedOptions(AllreduceOptions):
    pass


@dataclasses.dataclass
class BroadcastOptions(_CamelAliases):
    root_rank: int = 0
    root_tensor: int = 0
    timeout: timedelta | None = None
    algorithm: str | None = None


@dataclasses.dataclass
class ReduceOptions(_CamelAliases):
    reduce_op: ReduceOp = ReduceOp.SUM
    root_rank: int = 0
    root_tensor: int = 0
    timeout: timedelta | None = None
    algorithm: str | None = None


@dataclasses.dataclass
class AllgatherOptions(_CamelAliases):
    timeout: timedelta | None = None
    algorithm: str | None = None


@dataclasses.dataclass
class GatherOptions(_CamelAliases):
    root_rank: int = 0
    timeout: timedelta | None = None
    algorithm: str | None = None


@dataclasses.dataclass
class ScatterOptions(_CamelAliases):
    root_rank: int = 0
    timeout: timedelta | None = None
    algorithm: str | None = None


@dataclasses.dataclass
class ReduceScatterOptions(_CamelAliases):
    reduce_op: ReduceOp = ReduceOp.SUM
    timeout: timedelta | None = None
    algorithm: str | None = None


@dataclasses.dataclass
class AllToAllOptions(_CamelAliases):
    timeout: timedelta | None = None
    algorithm: str | None = None


@dataclasses.dataclass
class BarrierOptions(_CamelAliases):
    timeout: timedelta | None = None
    algorithm: str | None = None


@dataclasses.dataclass
class GroupOptions:
    """Options of a group (``ProcessGroup.Options``).

    timeout: default deadline of every collective (per-call ``opts.timeout``
        overrides it). threads: worker threads, i.e. collectives that can make
        progress at once. transport: a registered kind ("tcp", "ipc", "shm",
        "hier", "inproc", or one added with ``transports.register``), a
        transport factory, or None to choose (inproc when every rank is a
        thread of this process, else shm when all share a Linux host (ipc
        elsewhere), else hier -- shm within each host, tcp across -- when
        some host has several ranks, else tcp). host: the address tcp binds
        to. algorithm: force algorithms for this group, e.g.
        "allreduce:ring". group_name: separates groups sharing one store.
    """

    timeout: timedelta = timedelta(minutes=30)
    threads: int = 2
    transport: object = None
    host: str = "127.0.0.1"
    algorithm: str = ""
    group_name: str = "default"

    def checked(self, rank, world_size) -> GroupOptions:
        """A copy of these options for one group (its ``set_timeout()`` must not
        change other groups made with the same options), once ``rank``,
        ``world_size`` and the options pass the group's checks."""
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"ProcessGroup: world_size must be a positive int, got {world_size!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"ProcessGroup: invalid rank {rank!r} for world_size {world_size}")
        if self.threads < 1:
            raise ValueError(f"ProcessGroup: threads must be >= 1, got {self.threads}")
        if not (self.transport is None or callable(self.transport)
                or self.transport in transports.KINDS):
            raise ValueError(f"ProcessGroup: transport must be one of {transports.KINDS}, a "
                             f"transport factory, or None, got {self.transport!r}")
        return dataclasses.replace(self)
