"""numcoll: the collectives of PyTorch's Gloo backend over NumPy arrays,
ZeroMQ sockets and Numba kernels — no PyTorch needed.

Quick start::

    import numpy as np
    import numcoll as nc

    def step():
        x = np.full(4, nc.get_rank() + 1.0, dtype=np.float32)
        nc.all_reduce(x)             # in place: every rank gets 1 + 2 + ... + N
        return x

    print(nc.launch(step, world_size=4, mode="thread"))
"""

import importlib as _importlib
import importlib.abc as _importlib_abc
import importlib.util as _importlib_util
import sys as _sys

from . import futures
from ._version import __version__ as _version
from .api import (
    Backend,
    GroupMember,
    P2POp,
    _make_nccl_premul_sum,
    agree,
    all_gather,
    all_gather_coalesced,
    all_gather_into_tensor,
    all_gather_into_tensor_init,
    all_gather_single,
    all_reduce,
    all_reduce_coalesced,
    all_reduce_init,
    all_to_all,
    all_to_all_single,
    all_to_all_single_init,
    barrier,
    barrier_init,
    batch_isend_irecv,
    broadcast,
    broadcast_init,
    destroy_process_group,
    empty_shared,
    gather,
    gather_into_tensor,
    gather_single,
    get_backend,
    get_default_group,
    get_global_rank,
    get_group_rank,
    get_node_local_rank,
    get_pg_count,
    get_process_group_ranks,
    get_rank,
    get_world_size,
    group as _group,
    init_process_group,
    irecv,
    is_available,
    is_backend_available,
    is_gloo_available,
    is_initialized,
    is_mpi_available,
    is_nccl_available,
    is_torchelastic_launched,
    isend,
    monitored_barrier,
    new_group,
    new_subgroups,
    new_subgroups_by_enumeration,
    PersistentRequest,
    recv,
    reduce,
    reduce_init,
    reduce_scatter,
    reduce_scatter_single,
    reduce_scatter_tensor,
    reduce_scatter_tensor_init,
    scatter,
    send,
    set_timeout,
    shrink_group,
    split_group,
    supports_complex,
    zeros_shared,
)
from .data_parallel import (
    DEFAULT_FIRST_BUCKET_BYTES as _DEFAULT_FIRST_BUCKET_BYTES,
    GradBucket,
    Reducer,
    broadcast_coalesced,
    compute_bucket_assignment_by_size,
    hooks,
)
from .dtypes import bfloat16 as _bfloat16
from .diagnostics import flight_recorder
from .errors import (CollectiveMismatchError, CollectiveTimeoutError, GroupPoisonedError,
                     GroupRevokedError, NumcollError, PeerError)
from .futures import Future
from .launcher.local import LaunchError, LaunchTimeoutError, RankFailedError, launch
from .api.objects import (
    all_gather_object,
    broadcast_object_list,
    gather_object,
    recv_object_list,
    scatter_object_list,
    send_object_list,
)
from .ops import ReduceOp
from .options import (
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
)
from .process_group import ProcessGroup
from .memory.sparse import SparseCOO
from .bootstrap.init_methods import register_rendezvous_handler, rendezvous
from .bootstrap.filestore import FileStore
from .bootstrap.store import HashStore, PrefixStore, Store, StoreTimeoutError
from .bootstrap.tcpstore import TCPStore
from .work import Work

# -- public data: documented here, where the API reference (autodoc) reads their comments --
#: numcoll's version, from its one source, ``numcoll/_version.py``.
__version__ = _version
#: The bfloat16 dtype, ``np.dtype(ml_dtypes.bfloat16)``: use it for arrays of brain
#: floating point (``np.zeros(4, nc.bfloat16)``). Collectives reduce bfloat16 (and
#: float16) in float32 and round once, so every rank gets the correctly rounded float32
#: sum; ``NUMCOLL_HALF_WIRE=native`` keeps 16 bits on the wire instead.
bfloat16 = _bfloat16
#: torch's ``group`` namespace: ``nc.group.WORLD`` is the default group (the
#: :class:`ProcessGroup` that :func:`init_process_group` made), as ``dist.group.WORLD``.
group = _group
#: The first gradient bucket's cap in a :class:`Reducer` (1 MiB), torch's
#: ``dist._DEFAULT_FIRST_BUCKET_BYTES``: a small first bucket starts communication early
#: in the backward pass.
DEFAULT_FIRST_BUCKET_BYTES = _DEFAULT_FIRST_BUCKET_BYTES

__all__ = [
    # ops and options
    "ReduceOp", "AllreduceOptions", "AllreduceCoalescedOptions", "BroadcastOptions",
    "ReduceOptions", "AllgatherOptions", "GatherOptions", "ScatterOptions",
    "ReduceScatterOptions", "AllToAllOptions", "BarrierOptions", "bfloat16",
    # stores and rendezvous
    "Store", "HashStore", "FileStore", "PrefixStore", "TCPStore", "StoreTimeoutError",
    "rendezvous", "register_rendezvous_handler",
    # groups, work, futures, errors
    "ProcessGroup", "Work", "Future", "futures", "NumcollError", "CollectiveTimeoutError",
    "PeerError", "GroupPoisonedError", "RankFailedError", "CollectiveMismatchError",
    "LaunchError", "LaunchTimeoutError", "GroupRevokedError",
    # surviving a dead rank
    "shrink_group", "agree",
    # diagnostics
    "flight_recorder",
    # module-level API
    "init_process_group", "destroy_process_group", "is_initialized", "is_available",
    "is_gloo_available", "is_nccl_available", "is_mpi_available", "is_torchelastic_launched",
    "Backend", "is_backend_available", "supports_complex", "get_pg_count",
    "get_backend", "get_rank", "get_world_size", "get_node_local_rank",
    "new_group", "new_subgroups", "new_subgroups_by_enumeration", "split_group",
    "get_default_group", "group", "GroupMember", "get_group_rank", "get_global_rank",
    "get_process_group_ranks", "P2POp", "batch_isend_irecv",
    "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
    "send_object_list", "recv_object_list",
    "all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "all_gather",
    "all_gather_into_tensor", "all_gather_coalesced", "gather", "scatter", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier",
    "monitored_barrier", "send", "recv", "isend", "irecv", "all_gather_single",
    "reduce_scatter_single", "gather_single", "gather_into_tensor", "set_timeout",
    # persistent collectives (MPI-4's *_init)
    "all_reduce_init", "broadcast_init", "reduce_init", "all_gather_into_tensor_init",
    "reduce_scatter_tensor_init", "all_to_all_single_init", "barrier_init", "PersistentRequest",
    # shared arrays
    "empty_shared", "zeros_shared",
    # data parallelism and sparse arrays
    "DEFAULT_FIRST_BUCKET_BYTES", "compute_bucket_assignment_by_size", "broadcast_coalesced",
    "Reducer", "GradBucket", "hooks", "SparseCOO",
    # running ranks
    "launch",
    "__version__",
]


# -- old import paths ------------------------------------------------------------------
#: Modules that moved, under the names users and scripts may still use: ``import
#: numcoll.distributed`` gives the module API, ``python -m numcoll.fr DIR`` runs the
#: flight-recorder analyser. Bound here and nowhere else.
_ALIASES = {
    "numcoll.distributed": "numcoll.api",
    "numcoll.flight_recorder": "numcoll.diagnostics.flight_recorder",
    "numcoll.fr": "numcoll.diagnostics.fr_trace",
    "numcoll.demo": "numcoll.bench.demo",
    "numcoll.faults": "numcoll.bench.fault_table",   # the command; the scenarios: bench.faults
}


class _AliasFinder(_importlib_abc.MetaPathFinder, _importlib_abc.Loader):
    """Imports an old name as the module it moved to (the same module object,
    not a copy), and runs it with ``python -m old.name``."""

    def find_spec(self, name, path=None, target=None):
        if name not in _ALIASES:
            return None
        moved = _importlib_util.find_spec(_ALIASES[name])
        return _importlib_util.spec_from_loader(name, self, origin=moved.origin)

    def create_module(self, spec):
        module = _importlib.import_module(_ALIASES[spec.name])
        spec.loader_state = module.__spec__  # the import system overwrites it: restored below
        return module

    def exec_module(self, module):
        """Nothing to run (``create_module`` returned the imported module): give
        it back its own ``__spec__``."""
        module.__spec__ = module.__spec__.loader_state

    def get_code(self, name):
        """For ``python -m``: run the moved module as ``__main__``, in its own package."""
        return compile(f"import runpy; runpy.run_module({_ALIASES[name]!r}, "
                       "run_name='__main__', alter_sys=True)", f"<numcoll alias {name}>",
                       "exec")


if not any(isinstance(f, _AliasFinder) for f in _sys.meta_path):
    _sys.meta_path.append(_AliasFinder())
