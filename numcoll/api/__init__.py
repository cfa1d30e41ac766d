"""The torch.distributed-style module layer: the same names, parameters and
defaults as ``torch.distributed`` (tensor -> array), over the default group
and the groups made with :func:`new_group`. Also importable under its old
name, ``numcoll.distributed``.
"""

from .collectives import *  # noqa: F401,F403 - the module API
from .collectives import __all__ as _collectives_all
from .objects import *  # noqa: F401,F403
from .objects import __all__ as _objects_all

__all__ = [*_collectives_all, *_objects_all]
