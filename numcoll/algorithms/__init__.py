"""Collective algorithms, written against a small send/recv interface (a
:class:`numcoll.comm.Comm`) and a work buffer (:mod:`.buffer`) that
knows how to reduce. They never see sockets, dtypes or kernels. The
``shared`` ones (:mod:`.shared`) use the Comm's shared-arena steps instead of
messages, on groups whose ranks share memory; the ``cma`` ones
(:mod:`.single_copy`) synchronise on the arena but read the peers' buffers
where they lie (cross-memory attach), on groups whose ranks may; the ``twolevel`` ones
(:mod:`.twolevel`, :mod:`.twolevel_streams`) combine each host's ranks in its
arena and exchange between hosts by messages, on groups over several hosts.

Naming: ``<collective>_<algorithm>``. Each docstring gives the cost in steps
and bytes (P ranks, S bytes) and the source.
"""

from .allgather import allgather_ring
from .allreduce import allreduce_recursive_doubling, allreduce_ring
from .alltoall import alltoall_pairwise
from .barrier import barrier_dissemination
from .broadcast import broadcast_binomial, broadcast_chain
from .peers import (allgather_ipc, allreduce_ipc, alltoall_ipc, broadcast_ipc, gather_ipc,
                    reduce_ipc, reduce_scatter_ipc, scatter_ipc)
from .reduce import reduce_binomial, reduce_ring
from .reduce_scatter import reduce_scatter_ring
from .rooted import gather_direct, scatter_direct
from .shared import (allgather_shared, allreduce_shared, allreduce_shared_split,
                     barrier_shared, broadcast_shared, gather_shared, reduce_scatter_shared,
                     reduce_shared, scatter_shared)
from .shared_alltoall import alltoall_shared
from .single_copy import (allgather_cma, allgather_cma_measured, alltoall_cma,
                          alltoall_cma_measured, broadcast_cma, broadcast_cma_measured,
                          gather_cma, gather_cma_measured, scatter_cma, scatter_cma_measured)
from .single_copy_reduce import allreduce_cma, allreduce_cma_measured
from .twolevel import (allreduce_twolevel, allreduce_twolevel_lanes, barrier_twolevel,
                       broadcast_twolevel, broadcast_twolevel_lanes, reduce_twolevel,
                       reduce_twolevel_lanes)
from .twolevel_streams import (allgather_twolevel, allgather_twolevel_lanes,
                               reduce_scatter_twolevel, reduce_scatter_twolevel_lanes)

__all__ = [
    "allgather_cma",
    "allreduce_cma",
    "allreduce_cma_measured",
    "allgather_cma_measured",
    "alltoall_cma_measured",
    "broadcast_cma_measured",
    "gather_cma_measured",
    "scatter_cma_measured",
    "allgather_ipc",
    "alltoall_cma",
    "alltoall_ipc",
    "gather_ipc",
    "reduce_ipc",
    "scatter_ipc",
    "broadcast_cma",
    "gather_cma",
    "scatter_cma",
    "allgather_ring",
    "allgather_shared",
    "allreduce_shared",
    "allreduce_shared_split",
    "barrier_shared",
    "broadcast_shared",
    "reduce_scatter_shared",
    "reduce_shared",
    "allreduce_ipc",
    "allreduce_recursive_doubling",
    "allreduce_ring",
    "alltoall_pairwise",
    "alltoall_shared",
    "barrier_dissemination",
    "broadcast_binomial",
    "broadcast_ipc",
    "broadcast_chain",
    "gather_direct",
    "gather_shared",
    "reduce_binomial",
    "reduce_ring",
    "reduce_scatter_ipc",
    "reduce_scatter_ring",
    "scatter_direct",
    "scatter_shared",
    "allreduce_twolevel",
    "allreduce_twolevel_lanes",
    "reduce_twolevel",
    "reduce_twolevel_lanes",
    "broadcast_twolevel",
    "broadcast_twolevel_lanes",
    "allgather_twolevel",
    "allgather_twolevel_lanes",
    "reduce_scatter_twolevel",
    "reduce_scatter_twolevel_lanes",
    "barrier_twolevel",
]

#: The one table of algorithms: for every collective family, the algorithms
#: selectable by name (config ``algorithm``, ``Options(algorithm=...)`` per
#: group, ``opts.algorithm`` per call). Which one runs by default is decided
#: in :mod:`numcoll.collectives.choice`; the bench reads this table too.
#: The coalesced and ``*_tensor`` variants use their family's entry
#: (``allreduce_coalesced`` -> "allreduce", ``allgather_into_tensor`` ->
#: "allgather", ``reduce_scatter_tensor`` -> "reduce_scatter", ``alltoall_base``
#: -> "alltoall"). The ``shared*`` algorithms need a transport with a shared
#: arena (``shm``): see :data:`SHARED`.
CHOICES = {
    "allreduce": {"ring": allreduce_ring, "recursive_doubling": allreduce_recursive_doubling,
                  "shared": allreduce_shared, "shared_split": allreduce_shared_split,
                  "cma": allreduce_cma, "cma_measured": allreduce_cma_measured,
                  "twolevel": allreduce_twolevel, "twolevel_lanes": allreduce_twolevel_lanes,
                  "ipc": allreduce_ipc},
    "broadcast": {"binomial": broadcast_binomial, "chain": broadcast_chain,
                  "shared": broadcast_shared, "cma": broadcast_cma,
                  "cma_measured": broadcast_cma_measured,
                  "twolevel": broadcast_twolevel,
                  "twolevel_lanes": broadcast_twolevel_lanes, "ipc": broadcast_ipc},
    "reduce": {"binomial": reduce_binomial, "ring": reduce_ring, "shared": reduce_shared,
               "twolevel": reduce_twolevel, "twolevel_lanes": reduce_twolevel_lanes,
               "ipc": reduce_ipc},
    "allgather": {"ring": allgather_ring, "shared": allgather_shared, "cma": allgather_cma,
                  "cma_measured": allgather_cma_measured,
                  "twolevel": allgather_twolevel, "twolevel_lanes": allgather_twolevel_lanes,
                  "ipc": allgather_ipc},
    "gather": {"direct": gather_direct, "shared": gather_shared, "cma": gather_cma,
               "cma_measured": gather_cma_measured,
               "ipc": gather_ipc},
    "scatter": {"direct": scatter_direct, "shared": scatter_shared, "cma": scatter_cma,
                "cma_measured": scatter_cma_measured,
                "ipc": scatter_ipc},
    "reduce_scatter": {"ring": reduce_scatter_ring, "shared": reduce_scatter_shared,
                       "twolevel": reduce_scatter_twolevel,
                       "twolevel_lanes": reduce_scatter_twolevel_lanes, "ipc": reduce_scatter_ipc},
    "alltoall": {"pairwise": alltoall_pairwise, "shared": alltoall_shared,
                 "cma": alltoall_cma, "cma_measured": alltoall_cma_measured,
                 "ipc": alltoall_ipc},
    "barrier": {"dissemination": barrier_dissemination, "shared": barrier_shared,
                "twolevel": barrier_twolevel},
}

#: The algorithms that run on the transport's shared arena: only groups whose
#: ranks share memory offer them, and on a rank they must run in
#: sequence-number order (they share one arena; see ``ProcessGroup._execute``).
#: ``shared_arrays`` is not chosen by name: collectives take it on shared
#: arrays (:mod:`.shared_arrays`, :mod:`numcoll.collectives.shared_arrays`).
SHARED = frozenset({"shared", "shared_split", "shared_arrays"})
#: The two-level algorithms: groups over several hosts with the ``hier``
#: transport (an arena on each host) offer them.
TWO_LEVEL = frozenset({"twolevel", "twolevel_lanes"})
#: The single-copy algorithms (:mod:`.single_copy`): groups whose ranks share
#: an arena and may read each other's memory (``transport.single_copy``) offer
#: them. ``cma_measured`` takes, call by call, single copy or the arena's
#: ``shared``, as rank 0 measured them lately.
SINGLE_COPY = frozenset({"cma", "cma_measured"})
#: Every algorithm that takes steps of an arena, so runs in sequence-number order.
ARENA = SHARED | TWO_LEVEL | SINGLE_COPY
#: The algorithms over the peers' device memory (:mod:`.peers`): device arrays
#: only, between ranks of one host that can address each other's device memory.
DEVICE_PEERS = frozenset({"ipc"})
