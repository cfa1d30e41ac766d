"""Reduction operators: ``ReduceOp.SUM``, ``PRODUCT``, ``MIN``, ``MAX``, ``AVG``,
``BAND``, ``BOR``, ``BXOR``, plus user-defined ones from :meth:`ReduceOp.custom`."""

from __future__ import annotations

import itertools
from typing import Callable

__all__ = ["ReduceOp"]


class ReduceOp:
    """A reduction operator.

    The built-in operators are class attributes (``ReduceOp.SUM`` ...). They
    compare equal by name, hash, pickle and print like torch's
    (``ReduceOp.SUM``). A user-defined operator wraps a scalar binary function
    that Numba compiles; see :meth:`custom`.
    """

    SUM: "ReduceOp"
    PRODUCT: "ReduceOp"
    MIN: "ReduceOp"
    MAX: "ReduceOp"
    AVG: "ReduceOp"
    BAND: "ReduceOp"
    BOR: "ReduceOp"
    BXOR: "ReduceOp"

    _BUILTIN_NAMES = ("SUM", "PRODUCT", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR")
    _custom_ids = itertools.count(1)

    __slots__ = ("name", "fn", "identity", "_key")

    def __init__(self, name: str, fn: Callable | None = None, identity=None, _key=None):
        self.name = name
        self.fn = fn
        self.identity = identity
        self._key = _key if _key is not None else name

    @classmethod
    def custom(cls, fn: Callable, name: str | None = None, identity=None) -> "ReduceOp":
        """A user-defined reduction from a scalar binary function ``fn(a, b) -> c``.

        ``fn`` may be a plain Python function or an ``@numba.njit`` one; numcoll
        compiles it (for the CPU, and for CUDA when device arrays are used) into
        an elementwise kernel the first time it meets a dtype, and memoises it.
        It must be associative and commutative: ranks combine partial results in
        an order that depends on the algorithm. ``identity`` (optional) is the
        neutral element; it is not needed by the current algorithms.
        """
        if not callable(fn):
            raise TypeError(f"ReduceOp.custom needs a callable, got {type(fn).__name__}")
        label = name or getattr(fn, "__name__", "custom")
        return cls(f"custom({label})", fn=fn, identity=identity,
                   _key=("custom", next(cls._custom_ids)))

    @property
    def is_custom(self) -> bool:
        return self.fn is not None

    @property
    def is_bitwise(self) -> bool:
        return self.name in ("BAND", "BOR", "BXOR")

    def __eq__(self, other):
        return isinstance(other, ReduceOp) and self._key == other._key

    def __hash__(self):
        return hash(self._key)

    def __repr__(self):
        return f"ReduceOp.{self.name}"

    def __reduce__(self):
        if self.fn is None:
            return (getattr, (ReduceOp, self.name))
        return (ReduceOp, (self.name, self.fn, self.identity, self._key))


for _name in ReduceOp._BUILTIN_NAMES:
    setattr(ReduceOp, _name, ReduceOp(_name))
del _name
