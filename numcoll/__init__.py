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

from . import futures
from .distributed import (
    GroupMember,
    all_gather,
    all_gather_coalesced,
    all_gather_into_tensor,
    all_reduce,
    all_reduce_coalesced,
    all_to_all,
    all_to_all_single,
    barrier,
    broadcast,
    destroy_process_group,
    gather,
    get_default_group,
    get_rank,
    get_world_size,
    group,
    init_process_group,
    irecv,
    is_initialized,
    isend,
    monitored_barrier,
    new_group,
    recv,
    reduce,
    reduce_scatter,
    reduce_scatter_tensor,
    scatter,
    send,
)
from .dtypes import bfloat16
from . import flight_recorder
from .errors import (CollectiveMismatchError, CollectiveTimeoutError, GroupPoisonedError,
                     NumcollError, PeerError)
from .futures import Future
from .launch import RankFailedError, launch
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
from .init_methods import register_rendezvous_handler, rendezvous
from .store import FileStore, HashStore, PrefixStore, Store, StoreTimeoutError
from .tcpstore import TCPStore
from .work import Work

__version__ = "0.1.0"

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
    # diagnostics
    "flight_recorder",
    # module-level API
    "init_process_group", "destroy_process_group", "is_initialized", "get_rank",
    "get_world_size", "new_group", "get_default_group", "group", "GroupMember",
    "all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "all_gather",
    "all_gather_into_tensor", "all_gather_coalesced", "gather", "scatter", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier",
    "monitored_barrier", "send", "recv", "isend", "irecv",
    # running ranks
    "launch",
    "__version__",
]
