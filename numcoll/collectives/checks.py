"""Argument checks shared by the collectives, worded as Gloo words them."""

from __future__ import annotations

from ..arrays import _describe

__all__ = ["check_root_rank", "check_root_tensor", "check_same_dtype", "originals",
           "check_peer"]


def check_root_rank(root: int, size: int, op: str) -> None:
    if not isinstance(root, int) or not 0 <= root < size:
        raise ValueError(f"{op}: invalid root rank: {root} (world size {size})")


def check_root_tensor(index: int, count: int, op: str) -> None:
    if not isinstance(index, int) or not 0 <= index < count:
        raise ValueError(f"{op}: invalid root tensor: {index} (the list has {count} arrays)")


def check_peer(peer: int, size: int, rank: int, op: str, role: str) -> None:
    if not isinstance(peer, int) or not 0 <= peer < size:
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
