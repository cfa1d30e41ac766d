"""The call descriptor: what one collective call is, built once at the call.

Every collective builds a :class:`Call` on the caller's thread, after its
arguments are checked and before it is queued. The Work keeps it, and
everything that must describe or verify the call reads it instead of the
collective's own parameters:

- the messages' **stamp** (:attr:`Call.stamp`): every message of a collective
  carries the fields that all ranks must agree on (collective, dtype, op,
  root, element count, the algorithm, and a fingerprint of the settings that
  decide which messages a call sends: :data:`numcoll.config.AGREED`), and a
  receiver compares them with its own before touching the data, so ranks
  that disagree fail instead of exchanging wrong bytes or waiting for
  messages that never come (:func:`describe_stamp` renders the other side's
  call for the error message);
- timeout and mismatch messages (:meth:`Call.summary`);
- the flight recorder (:mod:`numcoll.diagnostics.flight_recorder`).
"""

from __future__ import annotations

import struct
import numpy as np

from .dtypes import SUPPORTED_DTYPES, dtype_name

__all__ = ["Call", "describe_stamp", "stamp_settings", "SEQ_MASK", "COLLECTIVES", "ALGORITHMS",
           "TORCH_NAMES", "shapes", "nbytes_of", "op_fields"]

#: A collective's number as its messages' tags carry it (``tag >> CALL_SHIFT``):
#: numbers wrap at 2**31.
SEQ_MASK = (1 << 31) - 1
#: Names of the calls, in a fixed order: a call's index is its code in the stamp.
#: Append only (codes travel between processes of possibly different versions).
COLLECTIVES = (
    "allreduce", "allreduce_coalesced", "broadcast", "reduce", "allgather",
    "allgather_coalesced", "allgather_into_tensor", "allgather_into_tensor_coalesced",
    "gather", "scatter", "reduce_scatter", "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced", "alltoall", "alltoall_base", "barrier",
    "monitored_barrier", "p2p", "sparse_allreduce", "broadcast_coalesced",
)
_CODE = {name: i for i, name in enumerate(COLLECTIVES)}
#: Each call's name in torch.distributed (the module function that issues it),
#: for the flight recorder's ``profiling_name`` (``numcoll:all_reduce``), as
#: torch's records say ``gloo:all_reduce``.
TORCH_NAMES = {
    "allreduce": "all_reduce", "allreduce_coalesced": "all_reduce_coalesced",
    "allgather": "all_gather", "allgather_coalesced": "all_gather_coalesced",
    "allgather_into_tensor": "all_gather_into_tensor",
    "allgather_into_tensor_coalesced": "all_gather_into_tensor_coalesced",
    "alltoall": "all_to_all", "alltoall_base": "all_to_all_single",
    "sparse_allreduce": "sparse_all_reduce",
}
# A send and the receive that matches it stamp alike.
_CODE.update(send=_CODE["p2p"], recv=_CODE["p2p"], recv_anysource=_CODE["p2p"])
_OPS = ("", "SUM", "PRODUCT", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR", "PREMUL_SUM")
_OP_CODE = {name: i for i, name in enumerate(_OPS)}
_CUSTOM_OP = 255
_NO_DTYPE = 255
_DTYPE_CODE = {dt: i for i, dt in enumerate(SUPPORTED_DTYPES)}
#: The algorithms' names, in a fixed order: an algorithm's index is its code in
#: the stamp (255: one not listed). Append only, as :data:`COLLECTIVES`.
ALGORITHMS = ("", "ring", "recursive_doubling", "shared", "shared_split", "binomial", "chain",
              "direct", "pairwise", "dissemination", "gather_release", "allgather_coalesce",
              "shared_arrays", "twolevel", "twolevel_lanes",
              "ipc", "cma", "cma_measured")
_ALGORITHM_CODE = {name: i for i, name in enumerate(ALGORITHMS)}
_OTHER_ALGORITHM = 255
#: version, collective, dtype, op, algorithm, settings fingerprint, then root + 1
#: (3 bytes; 0: none) and the element count (6 bytes): 16 bytes, what the
#: shared arena's slot header holds (transports.shm.arena.STAMP_NBYTES).
_STAMP = struct.Struct("<BBBBBH")
_STAMP_NBYTES = 16
_STAMP_VERSION = 2
#: Set in the collective's code for a call on shared arrays (``Call.shared_arrays``).
_SHARED_ARRAYS = 0x80


class Call:
    """One collective call, as every rank must agree on it, plus what this rank passed.

    ``name`` is the collective; ``op`` the reduce op's name (or None);
    ``dtype`` the element type; ``count`` the elements per rank that every
    rank must agree on (0 where ranks may legitimately differ, e.g. alltoall);
    ``root`` the root rank (-1 if none); ``algorithm`` the algorithm chosen;
    ``settings`` the group's :func:`numcoll.config.fingerprint` (0: none);
    ``timeout_s`` its deadline in seconds. ``input_sizes``/``output_sizes``
    (shapes) and ``nbytes`` (bytes this rank contributes) are for the flight
    recorder. Two flags are for the group that runs it: ``collective``
    (False for sends and receives, which take no sequence number) and
    ``after_earlier`` (a barrier: runs once every earlier call of this rank
    has finished). The sequence number is the Work's: it is taken when the
    call is submitted. Immutable by convention; the stamp is made once, here.
    """

    __slots__ = ("name", "timeout_s", "dtype", "count", "op", "root", "algorithm",
                 "input_sizes", "output_sizes", "nbytes", "custom_op", "collective",
                 "after_earlier", "settings", "shared_arrays", "stamp")

    def __init__(self, name: str, timeout_s: float, dtype: np.dtype | None = None,
                 count: int = 0, op: str | None = None, root: int = -1, algorithm: str = "",
                 input_sizes: tuple = (), output_sizes: tuple = (), nbytes: int = 0,
                 custom_op: bool = False, collective: bool = True,
                 after_earlier: bool = False, settings: int = 0,
                 shared_arrays: bool = False):
        self.name, self.timeout_s, self.dtype, self.count = name, timeout_s, dtype, count
        self.op, self.root, self.algorithm = op, root, algorithm
        self.input_sizes, self.output_sizes, self.nbytes = input_sizes, output_sizes, nbytes
        self.custom_op, self.collective, self.after_earlier = custom_op, collective, after_earlier
        self.settings = settings
        #: Whether the ranks read each other's arrays in place (``nc.empty_shared``):
        #: a rank that passed plain arrays runs another call, and must be told so.
        self.shared_arrays = shared_arrays
        code = _DTYPE_CODE.get(dtype, _NO_DTYPE) if dtype is not None else _NO_DTYPE
        op_code = _CUSTOM_OP if custom_op else _OP_CODE.get(op or "", 0)
        name_code = _CODE[name] | (_SHARED_ARRAYS if shared_arrays else 0)
        #: The bytes every message of this call carries (see :func:`describe_stamp`).
        self.stamp = (_STAMP.pack(_STAMP_VERSION, name_code, code, op_code,
                                  _ALGORITHM_CODE.get(algorithm, _OTHER_ALGORITHM),
                                  settings & 0xFFFF)
                      + ((root + 1) & 0xFFFFFF).to_bytes(3, "little")
                      + (count & 0xFFFF_FFFF_FFFF).to_bytes(6, "little"))

    def summary(self, seq: int | None = None, detail: bool = False) -> str:
        """``allreduce(float32, 4 elements, SUM) #12``: how messages name the call
        (with ``detail``, also its algorithm and settings: ``... via ring,
        settings 3fa2``, as :func:`describe_stamp` renders a stamp)."""
        extra = (self.algorithm, self.settings) if detail else None
        return _render(self.name, self.dtype, self.count, self.op, self.root, seq, extra,
                       self.shared_arrays)

    def __repr__(self) -> str:
        return f"<Call {self.summary()} algorithm={self.algorithm or '-'}>"


def describe_stamp(stamp: bytes, seq: int | None = None, detail: bool = True) -> str:
    """Render a stamp received from another rank as :meth:`Call.summary` would
    (with ``detail``: also the algorithm and the settings fingerprint, where set)."""
    try:
        if len(stamp) != _STAMP_NBYTES:
            raise ValueError
        version, code, dtype, op, algorithm, settings = _STAMP.unpack_from(stamp)
        if version != _STAMP_VERSION:
            raise ValueError
        name = COLLECTIVES[code & ~_SHARED_ARRAYS]
    except (struct.error, ValueError, IndexError):
        return f"an unknown call (stamp {stamp.hex()})"
    root = int.from_bytes(stamp[_STAMP.size:_STAMP.size + 3], "little") - 1
    count = int.from_bytes(stamp[_STAMP.size + 3:], "little")
    dt = SUPPORTED_DTYPES[dtype] if dtype < len(SUPPORTED_DTYPES) else None
    op_name = "custom" if op == _CUSTOM_OP else (_OPS[op] if op < len(_OPS) else "?") or None
    algorithm_name = ALGORITHMS[algorithm] if algorithm < len(ALGORITHMS) else "another"
    extra = (algorithm_name, settings) if detail else None
    return _render(name, dt, count, op_name, root, seq, extra, bool(code & _SHARED_ARRAYS))


def stamp_settings(stamp: bytes) -> int | None:
    """The settings fingerprint a stamp carries (None if it is not a stamp of this version)."""
    if len(stamp) != _STAMP_NBYTES or stamp[0] != _STAMP_VERSION:
        return None
    return _STAMP.unpack_from(stamp)[5]


def stamp_call(stamp: bytes) -> tuple[str, str] | None:
    """The collective and the algorithm a stamp names (None if it is not a
    stamp of this version)."""
    if len(stamp) != _STAMP_NBYTES or stamp[0] != _STAMP_VERSION:
        return None
    _, code, _, _, algorithm, _ = _STAMP.unpack_from(stamp)
    code &= ~_SHARED_ARRAYS
    return (COLLECTIVES[code] if code < len(COLLECTIVES) else "?",
            ALGORITHMS[algorithm] if algorithm < len(ALGORITHMS) else "another")


def _render(name, dtype, count, op, root, seq, extra=None, shared_arrays=False) -> str:
    parts = []
    if dtype is not None:
        parts.append(dtype_name(dtype))
    if count or dtype is not None:
        parts.append(f"{count} element{'s' if count != 1 else ''}")
    if op:
        parts.append(op)
    if root >= 0:
        parts.append(f"root {root}")
    if shared_arrays:
        parts.append("shared arrays")
    text = f"{name}({', '.join(parts)})"
    if seq is not None:
        text += f" #{seq}"
    algorithm, settings = extra or ("", 0)
    more = ([f"via {algorithm}"] if algorithm else []) + \
        ([f"settings {settings:04x}"] if settings else [])
    return f"{text} {', '.join(more)}" if more else text


def shapes(arrays) -> tuple:
    """The shapes of ``arrays``, for :attr:`Call.input_sizes` / ``output_sizes``."""
    return tuple(tuple(a.shape) for a in arrays)


def nbytes_of(arrays) -> int:
    return sum(a.size * a.dtype.itemsize for a in arrays)


def op_fields(op) -> dict:
    """The :class:`Call` fields of a reduce op."""
    return {"op": op.name, "custom_op": op.is_custom}
