"""Argument checks shared by the collectives, worded as Gloo words them."""

from __future__ import annotations

from datetime import timedelta

from ..memory.arrays import _describe

__all__ = ["check_root_rank", "check_root_tensor", "check_same_dtype", "originals",
           "root_list", "check_pairs", "check_peer", "timeout_seconds"]


def timeout_seconds(timeout, op: str) -> float:
    """A positive ``timedelta`` as seconds; ``TypeError``/``ValueError`` otherwise."""
    if not isinstance(timeout, timedelta):
        raise TypeError(f"{op}: timeout must be a datetime.timedelta, got "
                        f"{type(timeout).__name__}")
    if timeout <= timedelta(0):
        raise ValueError(f"{op}: timeout must be positive, got {timeout}")
    return timeout.total_seconds()


def check_root_rank(root: int, size: int, op: str) -> None:
    if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < size:
        raise ValueError(f"{op}: invalid root rank: {root} (world size {size})")


def check_root_tensor(index: int, count: int, op: str) -> None:
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
        raise ValueError(f"{op}: invalid root tensor: {index} (the list has {count} arrays)")


def check_peer(peer: int, size: int, rank: int, op: str, role: str) -> None:
    if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < size:
        raise ValueError(f"{op}: invalid {role} rank {peer} (world size {size})")
    if peer == rank:
        raise ValueError(f"{op}: invalid {role} rank {peer}: should not be the same as the "
                         "rank of the current process")


def check_same_dtype(arrays, op: str) -> None:
    """Gloo's allreduce_coalesced check: one dtype (shapes may differ)."""
    for i, a in enumerate(arrays[1:], 1):
        if a.dtype != arrays[0].dtype or type(a) is not type(arrays[0]):
            raise TypeError(f"{op}: tensors must all have the same type (index {i} is "
                            f"{_describe(a)}, index 0 is {_describe(arrays[0])})")


def originals(arrays) -> list:
    """What the caller passed, as a list: the future's value hands back the
    caller's own objects (torch tensors stay torch tensors)."""
    return list(arrays) if isinstance(arrays, (list, tuple)) else [arrays]


def root_list(lists, size: int, op: str, what: str) -> list:
    """The root's one list of ``size`` arrays (gather's outputs, scatter's
    inputs), checked with Gloo's wording."""
    if not isinstance(lists, (list, tuple)) or len(lists) != 1:
        raise ValueError(f"{op}: requires a single-element {what} list")
    lst = lists[0]
    if not isinstance(lst, (list, tuple)) or len(lst) != size:
        got = len(lst) if isinstance(lst, (list, tuple)) else type(lst).__name__
        raise ValueError(f"{op}: Incorrect {what} list size {got}. "
                         f"{what.capitalize()} list size should be {size}")
    return lst


def check_pairs(outputs, inputs, size: int, op: str, gathered: str) -> None:
    """(output, input) pairs of the ``*_tensor`` collectives: same dtype, and the
    ``gathered`` side ("output" for allgather, "input" for reduce_scatter)
    holds ``size`` times the other's elements."""
    if len(outputs) != len(inputs):
        raise ValueError(f"{op}: requires input/output tensor lists to have the same "
                         f"length ({len(inputs)} inputs, {len(outputs)} outputs)")
    if not outputs:
        raise ValueError(f"{op}: requires non-empty tensor list")
    for o, i in zip(outputs, inputs):
        if o.dtype != i.dtype:
            raise TypeError(f"{op}: input and output tensors must have the same type "
                            f"({i.dtype} vs {o.dtype})")
        big, small = (o, i) if gathered == "output" else (i, o)
        if big.size != small.size * size:
            other = "input" if gathered == "output" else "output"
            raise ValueError(
                f"{op}: input and output tensors must have the same size: the {gathered} "
                f"must hold world size times the {other}'s elements ({big.size} vs "
                f"{small.size} x {size} ranks)")
