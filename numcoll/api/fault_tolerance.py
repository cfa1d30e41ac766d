"""Surviving a dead rank, at the module layer: :func:`shrink_group` and
:func:`agree` (Open MPI ULFM's shrink and agree; the group's own verbs,
``revoke`` included, are :mod:`numcoll.recovery`).

When the default group is shrunk, the new group becomes the default:
``nc.get_rank()``, ``nc.get_world_size()`` and every collective called
without ``group=`` use the survivors' numbering from then on.
"""

from __future__ import annotations

from datetime import timedelta

from ..logs import set_rank
from ..process_group import ProcessGroup
from .world import GroupMember, _process_world, _resolve, _world

__all__ = ["shrink_group", "agree"]


def _member(group, what: str) -> ProcessGroup:
    pg = _resolve(group)
    if pg is None:
        raise ValueError(f"{what}: this rank is not a member of the group")
    return pg


def shrink_group(group: ProcessGroup | None = None,
                 timeout: timedelta | float | None = None) -> ProcessGroup:
    """The group of ``group``'s live ranks, renumbered in order (default: the
    default group, whose shrink becomes the new default group).

    A collective of the survivors: call it on every live rank of ``group``
    after a failure (a :class:`~numcoll.PeerError` naming the dead rank, a
    :class:`~numcoll.GroupRevokedError`, or any time). The old group is
    revoked (ranks still waiting in it stop) and shut down.

    Parameters
    ----------
    group : ProcessGroup, optional
        The group to shrink; default: the default group.
    timeout : timedelta or seconds, optional
        Bounds the agreement (default ``NUMCOLL_RECOVERY_TIMEOUT_S``, 60 s).

    Returns
    -------
    ProcessGroup
        The survivors' group; ``new.old_ranks()[i]`` is the rank in ``group``
        of its rank ``i``. Sub-groups keep the global ranks they were made
        with: a shrunk sub-group's global ranks are those of its survivors.

    Raises
    ------
    CollectiveTimeoutError, NumcollError
        As :meth:`ProcessGroup.shrink`.

    Examples
    --------
    >>> try:                                        # doctest: +SKIP
    ...     nc.all_reduce(grad)
    ... except nc.NumcollError:
    ...     nc.shrink_group()                        # the default group, renumbered
    ...     print(nc.get_rank(), nc.get_world_size())
    """
    world = _world()
    pg = _member(group, "shrink_group")
    ranks = world.groups.get(pg, list(range(pg.size())))
    new = pg.shrink(timeout)
    world.groups.pop(pg, None)
    if pg is world.pg:
        world.pg = new
        world.groups[new] = list(range(new.size()))
        if world is _process_world:
            set_rank(new.rank())
    else:
        world.groups[new] = [ranks[q] for q in new.old_ranks()]
        new.set_global_ranks(world.groups[new])
    return new


def agree(flag: int | bool, group: ProcessGroup | None = None,
          timeout: timedelta | float | None = None):
    """Agree with ``group``'s live ranks: every one of them returns the same
    ``(flag, failed)`` -- the bitwise AND of the live ranks' flags and the
    sorted ranks of ``group`` found gone -- even when ranks die meanwhile.

    Works on a poisoned or revoked group (it needs only the group's store).

    Parameters
    ----------
    flag : int or bool
        This rank's flag.
    group : ProcessGroup, optional
        Default: the default group.
    timeout : timedelta or seconds, optional
        Default ``NUMCOLL_RECOVERY_TIMEOUT_S`` (60 s).

    Returns
    -------
    (flag, failed) : (same type as ``flag``, list[int])

    Raises
    ------
    CollectiveTimeoutError, NumcollError
        As :meth:`ProcessGroup.agree`.

    Examples
    --------
    >>> done, failed = nc.agree(step == last_step)  # doctest: +SKIP
    """
    if group is GroupMember.NON_GROUP_MEMBER:
        raise ValueError("agree: this rank is not a member of the group")
    return _member(group, "agree").agree(flag, timeout)
