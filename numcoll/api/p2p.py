"""Point-to-point sends and receives of the module API, and their batches
(torch's ``P2POp`` / ``batch_isend_irecv``). ``dst``/``src``/``peer`` are
global ranks; ``group_dst``/``group_src``/``group_peer`` ranks of ``group``.
"""

from __future__ import annotations

from .groups import _peer, _tag, get_global_rank
from .world import _check_group, _check_rank_arg, _resolve, _world, get_default_group

__all__ = ["isend", "irecv", "send", "recv", "P2POp", "batch_isend_irecv"]


def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
    """Send ``tensor`` to global rank ``dst``; returns the Work."""
    pg = _resolve(group, "isend")
    if pg is None:
        return None
    return pg.send([tensor], _peer(pg, dst, group_dst, "dst"), _tag(tag))


def irecv(tensor, src=None, group=None, tag=0, group_src=None):
    """Receive into ``tensor`` from global rank ``src`` (any rank if None); returns the Work."""
    pg = _resolve(group, "irecv")
    if pg is None:
        return None
    if src is None and group_src is None:
        return pg.recv_anysource([tensor], _tag(tag))
    return pg.recv([tensor], _peer(pg, src, group_src, "src"), _tag(tag))


def send(tensor, dst=None, group=None, tag=0, group_dst=None) -> None:
    """Send ``tensor`` to global rank ``dst`` and wait until it is out."""
    work = isend(tensor, dst, group, tag, group_dst)
    if work is not None:
        work.wait()


def recv(tensor, src=None, group=None, tag=0, group_src=None) -> int:
    """Receive into ``tensor``; returns the sender's (global) rank (-1 off-group)."""
    pg = _resolve(group, "recv")
    if pg is None:
        return -1
    work = irecv(tensor, src, pg, tag, group_src)
    work.wait()
    ranks = _world().groups.get(pg)
    source = work.source_rank()
    return ranks[source] if ranks else source


# -- batched point-to-point ---------------------------------------------------------------
class P2POp:
    """One send or receive for :func:`batch_isend_irecv` (torch's class).

    ``op`` is :func:`isend` or :func:`irecv`; ``peer`` a global rank (or
    ``group_peer`` a rank of ``group``); ``tag`` matches sends with receives.
    """

    def __init__(self, op, tensor, peer: int | None = None, group=None, tag: int = 0,
                 group_peer: int | None = None):
        if op not in (isend, irecv):
            raise ValueError("Invalid ``op``. Expected ``op`` to be of type "
                             "``numcoll.isend`` or ``numcoll.irecv``.")
        self.op = op
        self.tensor = tensor
        self.group = group if group is not None else get_default_group()
        _check_group(self.group)
        if group_peer is not None:
            if peer is not None:
                raise ValueError("Can't specify both group_rank and global_rank")
            peer = get_global_rank(self.group, group_peer)
        if peer is None:
            raise ValueError("Must specify global_rank or group_rank")
        self.peer = _check_rank_arg(peer, "peer")
        self.tag = _tag(tag)

    def __repr__(self):
        return (f"P2POp({self.op.__name__} peer={self.peer}, tag={self.tag}, "
                f"{getattr(self.tensor, 'shape', '?')}, {getattr(self.tensor, 'dtype', '?')})")


def batch_isend_irecv(p2p_op_list: list[P2POp]) -> list:
    """Start every send and receive of ``p2p_op_list``; returns their Works, in
    the list's order.

    The sends are queued before the receives (each kind keeping its order, so
    matching by (peer, tag) is unchanged): a receive holds a worker thread
    while it waits, and receives queued ahead of sends could take every
    worker and leave two ranks waiting on each other's sends.
    """
    if not isinstance(p2p_op_list, list) or not p2p_op_list or \
            not all(isinstance(p, P2POp) for p in p2p_op_list):
        raise ValueError("Invalid ``p2p_op_list``. Each op is expected to to be of type "
                         "``numcoll.P2POp``.")
    first_group = p2p_op_list[0].group
    if not all(p.group is first_group for p in p2p_op_list):
        raise ValueError("All ops need to use the same group.")
    works: list = [None] * len(p2p_op_list)
    for want in (isend, irecv):
        for i, p in enumerate(p2p_op_list):
            if p.op is want:
                works[i] = p.op(p.tensor, p.peer, p.group, p.tag)
    return works
