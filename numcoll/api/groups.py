"""Sub-groups of the module API and the translation between global and group
ranks (torch.distributed's names). Every group made by :func:`new_group` (and
its relatives) is registered, in the default group's state
(:mod:`.world`), with the global ranks it spans, in group-rank order.
"""

from __future__ import annotations

import os
from datetime import timedelta

from ..logs import get_logger
from ..process_group import ProcessGroup
from .world import (GroupMember, _check_group, _check_rank_arg, _check_timeout, _world,
                    get_default_group)

__all__ = ["get_group_rank", "get_global_rank", "get_process_group_ranks", "new_group",
           "new_subgroups", "new_subgroups_by_enumeration", "split_group"]

_log = get_logger()


def _ranks_of(pg: ProcessGroup) -> list[int]:
    world = _world()
    ranks = world.groups.get(pg)
    if ranks is None:
        raise ValueError(f"Group {pg} is not registered, please create group with "
                         "numcoll.new_group")
    return ranks


def get_group_rank(group: ProcessGroup, global_rank: int) -> int:
    """Translate a global rank into ``group``'s rank.

    Raises
    ------
    ValueError
        If ``group`` was not made by ``new_group`` (``... is not registered``)
        or ``global_rank`` is not in it.
    """
    global_rank = _check_rank_arg(global_rank, "global_rank")
    if group is GroupMember.WORLD:
        return global_rank
    ranks = _ranks_of(group)
    if global_rank not in ranks:
        raise ValueError(f"Global rank {global_rank} is not part of group {group}")
    return ranks.index(global_rank)


def get_global_rank(group: ProcessGroup, group_rank: int) -> int:
    """Translate ``group``'s rank ``group_rank`` into a global rank."""
    group_rank = _check_rank_arg(group_rank, "group_rank")
    if group is GroupMember.WORLD:
        return group_rank
    ranks = _ranks_of(group)
    if not 0 <= group_rank < len(ranks):
        raise ValueError(f"Group rank {group_rank} is not part of group {group}")
    return ranks[group_rank]


def get_process_group_ranks(group: ProcessGroup | None) -> list[int]:
    """The global ranks of ``group`` (default: the default group), in group-rank order."""
    return list(_ranks_of(group if group is not None else get_default_group()))


def _group_rank(pg: ProcessGroup, global_rank, what: str) -> int:
    """``src``/``dst`` of a module function (a global rank) as a rank of ``pg``."""
    global_rank = _check_rank_arg(global_rank, what)
    ranks = _world().groups.get(pg)
    if ranks is None:
        return global_rank
    try:
        return ranks.index(global_rank)
    except ValueError:
        raise ValueError(f"{what} rank {global_rank} is not part of the group {ranks}") from None


def _peer(pg: ProcessGroup, rank, group_rank, what: str, default=None) -> int:
    """A global rank (``src``/``dst``/``peer``) or a group rank (``group_src``...)
    as a rank of ``pg``; both given is an error, as in torch."""
    if group_rank is not None:
        if rank is not None:
            raise ValueError("Can't specify both group_rank and global_rank")
        return _check_rank_arg(group_rank, f"group_{what}")
    if rank is None:
        if default is None:
            raise ValueError("Must specify global_rank or group_rank")
        rank = default
    return _group_rank(pg, rank, what)


def _tag(tag) -> int:
    return _check_rank_arg(tag, "tag")


def _check_ranks(ranks, size: int, what: str) -> list[int]:
    ranks = [_check_rank_arg(r, f"{what}: rank") for r in ranks]
    if len(set(ranks)) != len(ranks) or any(not 0 <= r < size for r in ranks):
        raise ValueError(f"{what}: invalid ranks {ranks} for world size {size}")
    return ranks


def _make_group(ranks: list[int], timeout, name: str) -> ProcessGroup:
    world = _world()
    default = get_default_group()
    opts = ProcessGroup.Options(timeout=timeout or default.options.timeout,
                                threads=default.options.threads,
                                transport=default.transport_kind,
                                host=default.options.host,
                                group_name=f"{default.options.group_name}/{name}")
    # Sub-group names restart with each default group, so the default group's
    # generation makes (name, generation) new on the store: no counter key is
    # written, and a destroyed sub-group leaves nothing in the store.
    pg = ProcessGroup(world.store, ranks.index(default.rank()), len(ranks), opts,
                      generation=default.generation)
    pg.set_global_ranks(ranks)
    world.groups[pg] = ranks
    _log.debug("group %s ready: global ranks %s, this rank is %d in it", opts.group_name,
               ranks, pg.rank())
    return pg


def new_group(ranks=None, timeout: timedelta | None = None, backend=None, pg_options=None,
              use_local_synchronization: bool = False, group_desc: str | None = None,
              device_id=None, sort_ranks: bool = True):
    """A sub-group of ``ranks`` (global ranks; all of them if None).

    Every rank of the default group must call it, in the same order as every
    other ``new_group`` call — except with ``use_local_synchronization=True``,
    where only the members call it (and must agree on the order of their own
    calls for the same ranks). Ranks outside ``ranks`` get
    ``GroupMember.NON_GROUP_MEMBER``. With ``sort_ranks=False`` group rank i is
    ``ranks[i]``; otherwise ranks are sorted first. ``backend`` may be None,
    "gloo" or "numcoll"; ``pg_options``/``device_id`` must be None (they are
    for other backends). Unknown keyword arguments are a TypeError.
    """
    world = _world()
    default = get_default_group()
    _check_timeout(timeout, "new_group")
    if backend not in (None, "gloo", "numcoll", "cpu:gloo"):
        raise ValueError(f"new_group: unsupported backend {backend!r}")
    if pg_options is not None or device_id is not None:
        raise ValueError("new_group: pg_options and device_id are not supported by numcoll "
                         "(they configure other backends)")
    ranks = _check_ranks(range(default.size()) if ranks is None else ranks, default.size(),
                         "new_group")
    if sort_ranks:
        ranks = sorted(ranks)
    if use_local_synchronization:
        # Only members call: name the group after its ranks, not a global count.
        key = tuple(sorted(ranks))
        if default.rank() not in ranks:
            return GroupMember.NON_GROUP_MEMBER
        n = world.local_counts[key] = world.local_counts.get(key, 0) + 1
        return _make_group(ranks, timeout, f"local{'-'.join(map(str, key))}#{n}")
    world.group_count += 1
    if default.rank() not in ranks:
        return GroupMember.NON_GROUP_MEMBER
    return _make_group(ranks, timeout, f"sub{world.group_count}")


def new_subgroups_by_enumeration(ranks_per_subgroup_list, timeout=None, backend=None,
                                 pg_options=None, group_desc=None):
    """One group per list of ranks (disjoint lists); every rank calls it.

    Returns ``(the group containing this rank or None, [one entry per list])``
    as torch does: the entry is the group on its members and
    ``GroupMember.NON_GROUP_MEMBER`` elsewhere.
    """
    if not ranks_per_subgroup_list:
        raise ValueError("The arg 'ranks_per_subgroup_list' cannot be empty")
    seen: dict[int, list] = {}
    for ranks in ranks_per_subgroup_list:  # checked before any group is made
        for rank in ranks:
            if rank in seen:
                raise ValueError(f"Rank {rank} has appeared in both subgroup {seen[rank]} "
                                 f"and {list(ranks)}")
            seen[rank] = list(ranks)
    mine, made = None, []
    for ranks in ranks_per_subgroup_list:
        pg = new_group(ranks, timeout=timeout, backend=backend, pg_options=pg_options)
        made.append(pg)
        if pg is not GroupMember.NON_GROUP_MEMBER:
            mine = pg
    return mine, made


def new_subgroups(group_size: int | None = None, group=None, timeout=None, backend=None,
                  pg_options=None, group_desc=None):
    """Split ``group`` (default: the default group) into consecutive groups of
    ``group_size`` ranks; returns ``(this rank's group, [groups made])``.

    ``group_size`` defaults to ``LOCAL_WORLD_SIZE`` (the ranks on one host,
    as set by ``numcoll run`` and torchrun) where torch uses the GPU count.
    """
    if group_size is None:
        local = os.environ.get("LOCAL_WORLD_SIZE")
        if not local:
            raise ValueError("Default group size only takes effect under a launcher that sets "
                             "LOCAL_WORLD_SIZE; please pass in 'group_size' correctly.")
        group_size = int(local)
    group_size = _check_rank_arg(group_size, "group_size")
    if group_size <= 0:
        raise ValueError(f"The arg 'group_size' ({group_size}) must be positive")
    ranks = get_process_group_ranks(group)
    world_size = len(ranks)
    if world_size < group_size:
        raise ValueError(f"The arg 'group_size' ({group_size}) must not exceed the world size "
                         f"({world_size})")
    if world_size % group_size != 0:
        raise ValueError(f"The world size ({world_size}) must be divisible by "
                         f"'group_size={group_size}'")
    return new_subgroups_by_enumeration(
        [ranks[i:i + group_size] for i in range(0, world_size, group_size)],
        timeout=timeout, backend=backend, pg_options=pg_options)


def split_group(parent_pg: ProcessGroup | None = None, split_ranks: list | None = None,
                timeout: timedelta | None = None, pg_options=None, group_desc=None,
                backend=None) -> ProcessGroup | None:
    """Split ``parent_pg`` (default: the default group) into disjoint groups.

    ``split_ranks`` is a list of lists of ranks *of the parent group* (as in
    torch). Every rank of the parent calls it; each rank joins only the group
    listing it and gets it back, or None if no list names it.
    """
    world = _world()
    if not split_ranks:
        raise ValueError("split_ranks cannot be None or empty")
    if not all(isinstance(s, (list, tuple)) for s in split_ranks):
        raise ValueError("split_ranks must be a list of lists of ranks")
    parent = parent_pg if parent_pg is not None else get_default_group()
    _check_group(parent)
    if parent is GroupMember.NON_GROUP_MEMBER or parent not in world.groups:
        raise ValueError(f"Group {parent} is not registered")
    _check_timeout(timeout, "split_group")
    parent_ranks = world.groups[parent]
    seen: set[int] = set()
    splits = []
    for ranks in split_ranks:
        ranks = _check_ranks(ranks, len(parent_ranks), "split_group")
        if seen.intersection(ranks):
            raise ValueError(f"split_group: the splits {split_ranks} overlap")
        seen.update(ranks)
        splits.append(sorted(parent_ranks[g] for g in ranks))
    # Only the parent's members call: count splits per parent, not globally.
    key = ("split", parent.options.group_name)
    n = world.local_counts[key] = world.local_counts.get(key, 0) + 1
    me = get_default_group().rank()
    for i, ranks in enumerate(splits):
        if me in ranks:
            return _make_group(ranks, timeout, f"split({parent.options.group_name})#{n}.{i}")
    return None
