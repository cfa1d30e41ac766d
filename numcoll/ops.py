"""Reduction operators: ``ReduceOp.SUM``, ``PRODUCT``, ``MIN``, ``MAX``, ``AVG``,
``BAND``, ``BOR``, ``BXOR``, user-defined ones from :meth:`ReduceOp.custom`, and
the scaled sum :meth:`ReduceOp.premul_sum`."""

from __future__ import annotations

import itertools
from numbers import Number
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
    PREMUL_SUM: "ReduceOp"   # torch's name; needs a factor: premul_sum(f)

    _BUILTIN_NAMES = ("SUM", "PRODUCT", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR")
    _custom_ids = itertools.count(1)

    __slots__ = ("name", "fn", "_key", "factor")

    def __init__(self, name: str, fn: Callable | None = None, _key=None, factor=None):
        self.name = name
        self.fn = fn
        self._key = _key if _key is not None else name
        self.factor = factor

    @classmethod
    def custom(cls, fn: Callable, name: str | None = None) -> "ReduceOp":
        """A user-defined reduction from a scalar binary function ``fn(a, b) -> c``.

        ``fn`` may be a plain Python function or an ``@numba.njit`` one; numcoll
        compiles it (for the CPU, and for CUDA when device arrays are used) into
        an elementwise kernel the first time it meets a dtype, and memoises it.
        It must be associative and commutative: ranks combine partial results in
        an order that depends on the algorithm.
        """
        if not callable(fn):
            raise TypeError(f"ReduceOp.custom needs a callable, got {type(fn).__name__}")
        label = name or getattr(fn, "__name__", "custom")
        return cls(f"custom({label})", fn=fn, _key=("custom", next(cls._custom_ids)))

    @classmethod
    def premul_sum(cls, factor) -> "ReduceOp":
        """A sum in which every rank's input is first multiplied by ``factor``:
        the result is ``sum over ranks of factor * x_r`` (torch's
        ``_make_nccl_premul_sum``), e.g. ``premul_sum(1 / world_size)`` to average
        gradients while summing.

        For floating point and complex dtypes only. The product is taken in the
        dtype the values travel in (float32 for float16/bfloat16, which are
        then rounded once at the end, like SUM), so ``factor`` is rounded to
        that dtype first. ``factor`` is a real number, or a complex one for
        complex dtypes.
        """
        if not isinstance(factor, Number) or isinstance(factor, bool):
            raise TypeError(f"ReduceOp.premul_sum needs a number, got {factor!r}")
        return cls("PREMUL_SUM", factor=factor, _key=("PREMUL_SUM", factor))

    @property
    def is_premul(self) -> bool:
        """Whether this is a scaled sum (``premul_sum``)."""
        return self.name == "PREMUL_SUM"

    @property
    def is_custom(self) -> bool:
        """Whether this is a user-defined operator."""
        return self.fn is not None

    @property
    def is_bitwise(self) -> bool:
        """Whether this is BAND, BOR or BXOR."""
        return self.name in ("BAND", "BOR", "BXOR")

    def __eq__(self, other):
        return isinstance(other, ReduceOp) and self._key == other._key

    def __hash__(self):
        return hash(self._key)

    def __repr__(self):
        if self.is_premul and not isinstance(self.factor, _NoFactor):
            return f"ReduceOp.premul_sum({self.factor!r})"
        return f"ReduceOp.{self.name}"

    def __reduce__(self):
        if self.is_premul and not isinstance(self.factor, _NoFactor):
            return (ReduceOp.premul_sum, (self.factor,))
        if self.fn is None:
            return (getattr, (ReduceOp, self.name))
        return (ReduceOp, (self.name, self.fn, self._key, self.factor))


class _NoFactor:
    """The factor of the bare ``ReduceOp.PREMUL_SUM``: using it is an error
    at the call, with a hint, instead of a NaN factor."""

    def _refuse(self):
        raise ValueError("ReduceOp.PREMUL_SUM needs a factor: use ReduceOp.premul_sum(factor) "
                         "(torch: dist._make_nccl_premul_sum(factor))")

    def __float__(self):
        self._refuse()

    def __complex__(self):
        self._refuse()

    def __repr__(self):
        return "<no factor>"


for _name in ReduceOp._BUILTIN_NAMES:
    setattr(ReduceOp, _name, ReduceOp(_name))
del _name
# torch spells the scaled sum's type ReduceOp.PREMUL_SUM; its factor comes from
# ReduceOp.premul_sum(f) (torch: _make_nccl_premul_sum(f)).
ReduceOp.PREMUL_SUM = ReduceOp("PREMUL_SUM", factor=_NoFactor(), _key="PREMUL_SUM")
