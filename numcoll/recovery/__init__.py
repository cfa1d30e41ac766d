"""Surviving a dead rank (Open MPI ULFM's revoke / agree / shrink).

- :mod:`.liveness`: which ranks of a group are gone (store, OS, transport);
- :mod:`.agreement`: every survivor's same answer, through the store;
- :mod:`.group`: the ProcessGroup's verbs (``revoke``, ``agree``,
  ``shrink``, ``old_ranks``), a base class of :class:`numcoll.ProcessGroup`.

The module functions (``nc.shrink_group``, ``nc.agree``) are in
:mod:`numcoll.api.fault_tolerance`.
"""

from .agreement import ExcludedError, agree_in_store
from .group import REVOKED, SHRINK_HINT, Recoverable
from .liveness import Liveness

__all__ = ["Recoverable", "Liveness", "agree_in_store", "ExcludedError", "REVOKED",
           "SHRINK_HINT"]
