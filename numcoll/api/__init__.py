"""The torch.distributed-style module layer: the same names, parameters and
defaults as ``torch.distributed`` (tensor -> array), over the default group
and the groups made with :func:`new_group`. Also importable under its old
name, ``numcoll.distributed``.

- :mod:`.world`: the default group -- ``init_process_group``,
  ``destroy_process_group``, ``get_rank`` ... -- and group resolution;
- :mod:`.groups`: sub-groups and rank translation;
- :mod:`.collectives`: the collectives, each one shape (:func:`.collectives.collective`);
- :mod:`.persistent`: persistent collectives (``all_reduce_init`` ...);
- :mod:`.shared`: shared arrays (``empty_shared``, ``zeros_shared``);
- :mod:`.p2p`: sends, receives and their batches;
- :mod:`.objects`: the object collectives;
- :mod:`.fault_tolerance`: surviving a dead rank (``shrink_group``, ``agree``);
- :mod:`.backend`: what torch.distributed says about backends and the environment.
"""

from .backend import (_make_nccl_premul_sum, Backend, get_backend, get_node_local_rank,  # noqa: F401
                      get_pg_count, is_available, is_backend_available, is_gloo_available,
                      is_mpi_available, is_nccl_available, is_torchelastic_launched,
                      supports_complex)
from .backend import __all__ as _backend_all
from .collectives import *  # noqa: F401,F403
from .collectives import __all__ as _collectives_all
from .fault_tolerance import *  # noqa: F401,F403
from .fault_tolerance import __all__ as _fault_tolerance_all
from .groups import *  # noqa: F401,F403
from .groups import __all__ as _groups_all
from .objects import *  # noqa: F401,F403
from .objects import __all__ as _objects_all
from .p2p import *  # noqa: F401,F403
from .p2p import __all__ as _p2p_all
from .persistent import *  # noqa: F401,F403
from .persistent import __all__ as _persistent_all
from .shared import *  # noqa: F401,F403
from .shared import __all__ as _shared_all
from .world import *  # noqa: F401,F403
from .world import __all__ as _world_all
from .world import DEFAULT_TIMEOUT  # noqa: F401

__all__ = [*_world_all, *_groups_all, *_collectives_all, *_p2p_all, *_objects_all,
           *_backend_all, *_persistent_all, *_shared_all, *_fault_tolerance_all]
