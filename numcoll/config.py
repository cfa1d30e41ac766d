"""Tunables, in one place, each overridable with a ``NUMCOLL_*`` environment variable.

Values are read when :func:`current` is called (the ProcessGroup reads them once
at construction), so tests can set ``NUMCOLL_SEGMENT_NBYTES=64`` to force the
multi-segment paths with tiny arrays.
"""

from __future__ import annotations

import dataclasses
import functools
import os

__all__ = ["Config", "current"]


@dataclasses.dataclass(frozen=True)
class Config:
    #: Large messages are cut into segments of this many bytes so that transfer
    #: and reduction overlap (pipelining) and no single ZeroMQ message is huge.
    segment_nbytes: int = 4 << 20
    #: allreduce: messages up to this many bytes use recursive doubling (latency
    #: bound, log2(P) steps); larger ones use the bandwidth-optimal ring.
    allreduce_small_nbytes: int = 64 << 10
    #: broadcast: up to this many bytes use a binomial tree; larger ones a
    #: pipelined chain.
    broadcast_small_nbytes: int = 256 << 10
    #: Force an algorithm by name for every call of a collective
    #: (e.g. ``NUMCOLL_ALGORITHM=allreduce:ring,broadcast:chain``); "" = automatic.
    algorithm: str = ""
    #: Sends of at least this many bytes go out zero-copy (tracked by ZeroMQ).
    zero_copy_nbytes: int = 64 << 10
    #: float16/bfloat16 reductions travel as float32 partial sums ("float32",
    #: exact: rounded once) or in the array's own 16-bit format ("native":
    #: half the wire bytes, rounded at every step as Gloo does).
    half_wire: str = "float32"
    #: ipc transport: shared-memory slots per peer for payloads from
    #: zero_copy_nbytes up to the segment size (one copy per side instead of a
    #: socket's kernel copies); 0 sends everything through the socket.
    shm_slots: int = 8
    #: How long a crashed peer's socket may stay silent after its disconnect is
    #: seen before pending receives from it fail (seconds). Lets in-flight data
    #: that was sent before the crash still arrive.
    peer_grace_s: float = 0.25
    #: Sparse allreduce: when every rank's entries together would take more than
    #: this many times the bytes of the dense array (plus a mask of one element
    #: per row), the ranks allreduce the dense array instead of gathering them.
    sparse_dense_ratio: float = 1.0


_INT_FIELDS = {f.name for f in dataclasses.fields(Config) if f.type in ("int", int)}
_FLOAT_FIELDS = {f.name for f in dataclasses.fields(Config) if f.type in ("float", float)}


def current(**overrides) -> Config:
    """The configuration: defaults, then ``NUMCOLL_<FIELD>`` variables, then ``overrides``."""
    values = {}
    for field in dataclasses.fields(Config):
        raw = os.environ.get("NUMCOLL_" + field.name.upper())
        if raw is None:
            continue
        try:
            if field.name in _INT_FIELDS:
                values[field.name] = int(raw, 0)
            elif field.name in _FLOAT_FIELDS:
                values[field.name] = float(raw)
            else:
                values[field.name] = raw
        except ValueError:
            raise ValueError(
                f"NUMCOLL_{field.name.upper()}={raw!r} is not a valid {field.type}"
            ) from None
    values.update(overrides)
    cfg = Config(**values)
    if cfg.segment_nbytes < 8:
        raise ValueError(f"segment_nbytes must be at least 8, got {cfg.segment_nbytes}")
    if cfg.half_wire not in ("float32", "native"):
        raise ValueError(f"half_wire must be 'float32' or 'native', got {cfg.half_wire!r}")
    return cfg


@functools.lru_cache(maxsize=256)
def forced_algorithm(cfg: Config, collective: str) -> str | None:
    """The algorithm name forced for ``collective`` by ``cfg.algorithm``, if any."""
    for item in filter(None, (s.strip() for s in cfg.algorithm.split(","))):
        name, _, algo = item.partition(":")
        if name.strip() == collective and algo.strip():
            return algo.strip()
    return None
