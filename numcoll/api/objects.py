"""Object collectives: any picklable Python object, torch.distributed's names.

Objects travel as pickles (written with cloudpickle, so lambdas and classes
defined in ``__main__`` or a notebook work) inside uint8 arrays moved by the
ordinary collectives: first the sizes, then the bytes.

.. warning::
   Unpickling runs code chosen by whoever wrote the bytes. Use these functions
   only between ranks you trust — as torch's documentation says of its own.
   numcoll only unpickles bytes that arrived from members of the group, but a
   member can make every other member run anything.
"""

from __future__ import annotations

import pickle
from typing import Any

import cloudpickle
import numpy as np

from .groups import _peer
from .world import _resolve, _world
from ..options import BroadcastOptions, GatherOptions, ScatterOptions

__all__ = ["all_gather_object", "broadcast_object_list", "gather_object",
           "scatter_object_list", "send_object_list", "recv_object_list"]


def _dumps(obj: Any) -> np.ndarray:
    return np.frombuffer(cloudpickle.dumps(obj), dtype=np.uint8)


def _loads(buf: np.ndarray) -> Any:
    return pickle.loads(buf.tobytes())


def _check_device(device) -> None:
    if device is not None and str(device) != "cpu":
        raise ValueError(f"device must be None or 'cpu' (numcoll pickles on the host), got "
                         f"{device!r}")


def _list_arg(value, name: str, min_len: int = 0) -> list:
    if not isinstance(value, list):
        raise TypeError(f"{name} must be a list, got {type(value).__name__}")
    if len(value) < min_len:
        raise ValueError(f"Expected argument {name} to be a list of size at least {min_len}.")
    return value


def _root(pg, rank, group_rank, what: str) -> int:
    return _peer(pg, rank, group_rank, what, default=0)


def _all_sizes(pg, nbytes: int) -> np.ndarray:
    sizes = np.zeros(pg.size(), dtype=np.int64)
    pg.allgather_into_tensor(sizes, np.array([nbytes], dtype=np.int64)).wait()
    return sizes


def all_gather_object(object_list: list, obj: Any, group=None) -> None:
    """``object_list[r]`` becomes rank r's ``obj``, on every rank (trusted ranks only)."""
    pg = _resolve(group, "all_gather_object")
    if pg is None:
        return
    _list_arg(object_list, "object_list")
    if len(object_list) < pg.size():
        raise ValueError(f"all_gather_object: object_list has {len(object_list)} entries; it "
                         f"should be sized as the group ({pg.size()})")
    data = _dumps(obj)
    sizes = _all_sizes(pg, data.size)
    width = int(sizes.max())
    mine = np.zeros(width, dtype=np.uint8)
    mine[:data.size] = data
    gathered = np.empty(width * pg.size(), dtype=np.uint8)
    pg.allgather_into_tensor(gathered, mine).wait()
    for r in range(pg.size()):
        object_list[r] = _loads(gathered[r * width:r * width + int(sizes[r])])


def broadcast_object_list(object_list: list, src: int | None = None, group=None, device=None,
                          group_src: int | None = None) -> None:
    """Replace ``object_list``'s entries with those of global rank ``src``
    (default 0); every rank passes a list of the same length."""
    pg = _resolve(group, "broadcast_object_list")
    if pg is None:
        return
    _check_device(device)
    _list_arg(object_list, "object_list")
    root = _root(pg, src, group_src, "src")
    opts = BroadcastOptions(root_rank=root)
    if pg.rank() == root:
        pickles = [_dumps(o) for o in object_list]
        sizes = np.array([p.size for p in pickles], dtype=np.int64)
    else:
        sizes = np.zeros(len(object_list), dtype=np.int64)
    if sizes.size:
        pg.broadcast([sizes], opts).wait()
    payload = np.concatenate(pickles) if pg.rank() == root and pickles else \
        np.empty(int(sizes.sum()), dtype=np.uint8)
    if payload.size:
        pg.broadcast([payload], opts).wait()
    if pg.rank() != root:
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        for i in range(len(object_list)):
            object_list[i] = _loads(payload[offsets[i]:offsets[i + 1]])


def gather_object(obj: Any, object_gather_list: list | None = None, dst: int | None = None,
                  group=None, group_dst: int | None = None) -> None:
    """Every rank's ``obj`` into ``object_gather_list`` on global rank ``dst`` (default 0)."""
    pg = _resolve(group, "gather_object")
    if pg is None:
        return
    root = _root(pg, dst, group_dst, "dst")
    if pg.rank() == root:
        if object_gather_list is None:
            raise ValueError("Argument ``gather_list`` must be specified on destination rank.")
        _list_arg(object_gather_list, "object_gather_list", pg.size())
    elif object_gather_list:
        raise ValueError("Argument ``gather_list`` must NOT be specified on non-destination "
                         "ranks.")
    data = _dumps(obj)
    sizes = _all_sizes(pg, data.size)
    width = int(sizes.max())
    mine = np.zeros(width, dtype=np.uint8)
    mine[:data.size] = data
    outputs = [[np.empty(width, dtype=np.uint8) for _ in range(pg.size())]] \
        if pg.rank() == root else []
    pg.gather(outputs, [mine], GatherOptions(root_rank=root)).wait()
    if pg.rank() == root:
        for r, buf in enumerate(outputs[0]):
            object_gather_list[r] = _loads(buf[:int(sizes[r])])


def scatter_object_list(scatter_object_output_list: list,
                        scatter_object_input_list: list | None = None, src: int | None = None,
                        group=None, group_src: int | None = None) -> None:
    """Rank r gets global rank ``src``'s ``scatter_object_input_list[r]`` in
    ``scatter_object_output_list[0]``."""
    pg = _resolve(group, "scatter_object_list")
    if pg is None:
        return
    _list_arg(scatter_object_output_list, "scatter_object_output_list", 1)
    root = _root(pg, src, group_src, "src")
    sizes = np.zeros(pg.size(), dtype=np.int64)
    if pg.rank() == root:
        if scatter_object_input_list is None:
            raise ValueError("Argument ``scatter_object_input_list`` must be specified on "
                             "source rank.")
        _list_arg(scatter_object_input_list, "scatter_object_input_list", pg.size())
        pickles = [_dumps(o) for o in scatter_object_input_list[:pg.size()]]
        sizes[:] = [p.size for p in pickles]
    pg.broadcast([sizes], BroadcastOptions(root_rank=root)).wait()
    width = int(sizes.max())
    inputs = []
    if pg.rank() == root:
        padded = []
        for p in pickles:
            buf = np.zeros(width, dtype=np.uint8)
            buf[:p.size] = p
            padded.append(buf)
        inputs = [padded]
    mine = np.empty(width, dtype=np.uint8)
    pg.scatter([mine], inputs, ScatterOptions(root_rank=root)).wait()
    scatter_object_output_list[0] = _loads(mine[:int(sizes[pg.rank()])])


def send_object_list(object_list: list, dst: int | None = None, group=None, device=None,
                     group_dst: int | None = None) -> None:
    """Send ``object_list``'s objects to global rank ``dst`` (which calls
    :func:`recv_object_list` with a list of the same length)."""
    pg = _resolve(group, "send_object_list")
    if pg is None:
        return
    _check_device(device)
    _list_arg(object_list, "object_list", 1)
    peer = _peer(pg, dst, group_dst, "dst")
    pickles = [_dumps(o) for o in object_list]
    sizes = np.array([p.size for p in pickles], dtype=np.int64)
    pg.send([sizes], peer).wait()
    pg.send([np.concatenate(pickles)], peer).wait()


def recv_object_list(object_list: list, src: int | None = None, group=None, device=None,
                     group_src: int | None = None) -> int:
    """Fill ``object_list`` with the objects sent by global rank ``src`` (any
    rank if None); returns the sender's global rank."""
    pg = _resolve(group, "recv_object_list")
    if pg is None:
        return -1
    _check_device(device)
    _list_arg(object_list, "object_list", 1)
    sizes = np.zeros(len(object_list), dtype=np.int64)
    if src is None and group_src is None:
        work = pg.recv_anysource([sizes])
    else:
        work = pg.recv([sizes], _peer(pg, src, group_src, "src"))
    work.wait()
    sender = work.source_rank()
    payload = np.empty(int(sizes.sum()), dtype=np.uint8)
    pg.recv([payload], sender).wait()   # the bytes come from whoever sent the sizes
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    for i in range(len(object_list)):
        object_list[i] = _loads(payload[offsets[i]:offsets[i + 1]])
    ranks = _world().groups.get(pg)
    return ranks[sender] if ranks else sender
