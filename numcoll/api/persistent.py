"""Persistent collectives at module level: ``all_reduce_init`` and its kin.

Each takes the parameters of its torch.distributed-style twin (without
``async_op``: a persistent request is started, and waited for, by its
caller) and returns a :class:`~numcoll.PersistentRequest`::

    req = nc.all_reduce_init(x)            # every check and plan, once
    for _ in range(steps):
        x[...] = local_gradient()
        req.start()                        # a Work, numbered like any collective
        req.wait()

Every rank of the group makes and starts the same requests, in the same
order relative to its other collectives. A rank outside ``group`` gets None
(and a warning), as the collectives do.
"""

from __future__ import annotations

from ..collectives.persistent import PersistentRequest
from ..ops import ReduceOp
from ..options import (AllgatherOptions, AllreduceOptions, AllToAllOptions, BarrierOptions,
                       BroadcastOptions, ReduceOptions, ReduceScatterOptions)
from .groups import _peer
from .world import _check_timeout, _resolve

__all__ = ["all_reduce_init", "broadcast_init", "reduce_init", "all_gather_into_tensor_init",
           "reduce_scatter_tensor_init", "all_to_all_single_init", "barrier_init",
           "PersistentRequest"]


def all_reduce_init(tensor, op=ReduceOp.SUM, group=None) -> PersistentRequest | None:
    """A persistent :func:`~numcoll.all_reduce` of ``tensor`` (in place)."""
    pg = _resolve(group, "all_reduce_init")
    return pg and pg.allreduce_init([tensor], AllreduceOptions(reduce_op=op))


def broadcast_init(tensor, src=None, group=None, group_src=None) -> PersistentRequest | None:
    """A persistent :func:`~numcoll.broadcast` from global rank ``src``."""
    pg = _resolve(group, "broadcast_init")
    return pg and pg.broadcast_init([tensor], BroadcastOptions(
        root_rank=_peer(pg, src, group_src, "src")))


def reduce_init(tensor, dst=None, op=ReduceOp.SUM, group=None,
                group_dst=None) -> PersistentRequest | None:
    """A persistent :func:`~numcoll.reduce` into global rank ``dst``'s ``tensor``."""
    pg = _resolve(group, "reduce_init")
    return pg and pg.reduce_init([tensor], ReduceOptions(
        reduce_op=op, root_rank=_peer(pg, dst, group_dst, "dst")))


def all_gather_into_tensor_init(output_tensor, input_tensor,
                                group=None) -> PersistentRequest | None:
    """A persistent :func:`~numcoll.all_gather_into_tensor`."""
    pg = _resolve(group, "all_gather_into_tensor_init")
    return pg and pg.allgather_into_tensor_init(output_tensor, input_tensor,
                                                AllgatherOptions())


def reduce_scatter_tensor_init(output, input, op=ReduceOp.SUM,
                               group=None) -> PersistentRequest | None:
    """A persistent :func:`~numcoll.reduce_scatter_tensor`."""
    pg = _resolve(group, "reduce_scatter_tensor_init")
    return pg and pg.reduce_scatter_tensor_init(output, input,
                                                ReduceScatterOptions(reduce_op=op))


def all_to_all_single_init(output, input, output_split_sizes=None, input_split_sizes=None,
                           group=None) -> PersistentRequest | None:
    """A persistent :func:`~numcoll.all_to_all_single`."""
    pg = _resolve(group, "all_to_all_single_init")
    return pg and pg.alltoall_base_init(output, input, output_split_sizes, input_split_sizes,
                                        AllToAllOptions())


def barrier_init(group=None, timeout=None) -> PersistentRequest | None:
    """A persistent :func:`~numcoll.barrier` (``timeout``: a timedelta, each start's deadline)."""
    _check_timeout(timeout, "barrier_init")
    pg = _resolve(group, "barrier_init")
    return pg and pg.barrier_init(BarrierOptions(timeout=timeout))
