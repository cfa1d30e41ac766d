"""numcoll's runtime failures as torch.distributed's exception classes.

A collective that fails through the torch backend raises an exception that is
*both* torch's and numcoll's: ``DistBackendError`` (so code written for torch,
which catches ``DistBackendError``, ``DistError`` or ``RuntimeError``, keeps
working) and the numcoll class that says what happened
(``CollectiveTimeoutError`` -- also a ``TimeoutError`` --, ``PeerError`` with
its ``.peer``, ``CollectiveMismatchError``, ``GroupPoisonedError``). Store
failures become ``DistStoreError`` (a timeout) or ``DistNetworkError`` (the
store cannot be reached), as torch's own stores raise them. Argument errors
are raised at the call as ``ValueError``/``TypeError`` that are also
``RuntimeError`` (gloo raises ``RuntimeError`` with the same words).
"""

from __future__ import annotations

import torch.distributed as dist

from ..bootstrap.store import StoreTimeoutError
from ..bootstrap.tcpstore import StoreConnectionError
from ..errors import NumcollError

__all__ = ["to_torch_error"]

_classes: dict[type, type] = {}


def _torch_base(exc: BaseException) -> type:
    if isinstance(exc, StoreTimeoutError):
        return dist.DistStoreError
    if isinstance(exc, StoreConnectionError):
        return dist.DistNetworkError
    return dist.DistBackendError


def to_torch_error(exc: BaseException) -> BaseException:
    """``exc`` as an instance of a class deriving from both torch's matching
    ``Dist*Error`` and ``type(exc)``, with the same message and attributes
    (``peer``, ``keys``...) and traceback. An argument error (``ValueError``,
    ``TypeError``) becomes one that is also a ``RuntimeError``, as gloo's
    argument checks raise. Other errors, and ones already converted, are
    returned as they are."""
    if isinstance(exc, NumcollError) and not isinstance(exc, dist.DistError):
        base = _torch_base(exc)
    elif type(exc) in (ValueError, TypeError):
        base = RuntimeError
    else:
        return exc
    cls = type(exc)
    both = _classes.get(cls)
    if both is None:
        both = _classes[cls] = type(cls.__name__, (base, cls) if base is not RuntimeError
                                    else (cls, RuntimeError),
                                    {"__module__": __name__,
                                     "__doc__": f"{cls.__name__} raised through torch."})
    converted = both(*exc.args)
    converted.__dict__.update(getattr(exc, "__dict__", {}))
    converted.__traceback__ = exc.__traceback__
    return converted
