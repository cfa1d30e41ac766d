"""Which algorithm runs a collective: by message size, world size and the
group's hosts, unless forced per call (``opts.algorithm``), per group
(``Options.algorithm``) or by ``NUMCOLL_ALGORITHM``. Every collective goes
through :func:`choose`, at the call, so an unknown name, or one this group
cannot run, is a ``ValueError`` before anything is queued.

The automatic choice, in order:

- a group over several hosts with an arena on each (the ``hier``
  transport), some host having several ranks: the ``twolevel`` algorithms
  (:mod:`numcoll.algorithms.twolevel`) for allreduce, reduce, broadcast,
  allgather, reduce_scatter and barrier. gather, scatter and alltoall keep
  their flat algorithms: each of their bytes crosses between hosts once
  already (the hier transport carries a message between two ranks of one
  host through shared memory), so two levels would save no bytes;
- device arrays (every collective but the barrier), ranks on one host that
  can address each other's device memory (``device_peers``: threads of one
  process, or CUDA IPC; config ``cuda_ipc``): ``ipc``
  (:mod:`numcoll.algorithms.peers`);
- a group whose ranks share one arena (``shm``): the ``cma`` (single-copy)
  algorithms for the collectives that move data without reducing it and for
  allreduce (a reduce-scatter and an allgather by reads), from
  ``single_copy_min_nbytes`` (``single_copy_rooted_min_nbytes`` for gather,
  ``single_copy_alltoall_min_nbytes`` for alltoall,
  ``single_copy_allreduce_min_nbytes`` for allreduce,
  ``single_copy_crowded_min_nbytes`` with more ranks than CPUs, but for
  alltoall and scatter), where the ranks may read each other's memory:
  ``cma_measured``, single copy or the arena as rank 0 measured them; and
  ``cma`` itself, unmeasured, for broadcast, scatter and allgather from
  thresholds of their own up to there (``single_copy_broadcast_min_nbytes``,
  ``single_copy_scatter_min_nbytes``, ``single_copy_allgather_min_nbytes``);
  the ``shared`` algorithms otherwise. An ``all_to_all_single``
  (``uneven``) is the arena's at every size: its ranks may send each other
  different amounts, and a peer may pass split sizes where this rank passes
  none, so a threshold on a rank's own buffer would part ranks whose buffers
  lie either side of it. Where the ranks may read each other,
  the arena's alltoall agrees after its first round whether the rest of
  its blocks is read single-copy (``single_copy_alltoall_rest_min_nbytes``;
  :func:`numcoll.algorithms.shared_alltoall.alltoall_shared`);
- else by size: recursive doubling, binomial trees for small messages; the
  ring, the chain for large ones.
"""

from __future__ import annotations

import os
from functools import partial
from typing import Callable, NamedTuple

from ..algorithms import ARENA, CHOICES, DEVICE_PEERS, SHARED, SINGLE_COPY, TWO_LEVEL
from ..algorithms.shared_alltoall import alltoall_head_nbytes
from ..algorithms.single_copy import where_nbytes
from ..config import Config, forced_algorithm

__all__ = ["Choice", "choose", "check_forced", "segment_count"]


class Choice(NamedTuple):
    """The algorithm chosen for a call: its name (for the flight recorder and
    messages) and the function that runs it."""

    name: str
    run: Callable


#: The families with two-level algorithms (chosen automatically over hosts).
TWO_LEVEL_FAMILIES = frozenset(f for f, names in CHOICES.items() if TWO_LEVEL & set(names))
#: The two-level variant chosen automatically: ``twolevel_lanes`` (every rank
#: of a host carries a share between hosts and combines a share) rather than
#: ``twolevel`` (one leader per host does both). On a limited cable they tie
#: (within 2 %: docs/guide/many-hosts.md); where the cable is fast, one
#: leader's combining of every slot is what the call waits for, and lanes
#: spread it over the host's cores (on the 2-core VM, with more ranks than
#: cores, that could not show: leader and lanes traded places). The barrier
#: has the one variant, ``twolevel``.
TWO_LEVEL_DEFAULT = "twolevel_lanes"


#: Why a group without a ``single_copy`` capability reads no peer's memory.
NO_SINGLE_COPY = "its transport offers no single-copy reads (the shm transport does)"


def choose(cfg: Config, collective: str, requested: str | None, nbytes: int,
           size: int, shared: bool = True, topology=None,
           device_peers: str | None = "host arrays",
           single_copy_refused: str | None = NO_SINGLE_COPY, uneven: bool = False) -> Choice:
    """The algorithm for ``collective`` (a key of :data:`numcoll.algorithms.CHOICES`)
    on ``nbytes`` bytes over ``size`` ranks. ``shared=False``: not one of the
    arena's (for a collective run inside another call, whose arena turn was
    not taken: a configured arena algorithm gives way to the automatic
    choice). ``topology``: the group's :class:`numcoll.algorithms.levels.Topology`, if it
    knows which ranks share a host. ``device_peers``: None for device arrays
    whose ranks can address each other's device memory, else why not.
    ``single_copy_refused``: why this group's ranks cannot read each other's
    memory, None where they can. ``uneven``: an alltoall whose ranks may send
    each other different amounts (``all_to_all_single``, with split sizes or
    without: a peer may pass them where this rank passes none)."""
    options = CHOICES[collective]
    if requested is not None and not isinstance(requested, str):
        raise TypeError(f"{collective}: algorithm must be a str, got {type(requested).__name__}")
    name = requested or forced_algorithm(cfg, collective)
    automatic = name is None or (not shared and requested is None and name in ARENA)
    if automatic:
        name = _automatic(cfg, collective, nbytes, size, shared, topology,
                          single_copy_refused, uneven)
        if collective in _DEVICE_PEER_FAMILIES and device_peers is None and size > 1 \
                and _hosts(topology) == 1 and cfg.cuda_ipc == "auto":
            name = _DEVICE_PEER_FAMILIES[collective]
    try:
        choice = Choice(name, options[name])
    except KeyError:
        raise ValueError(f"{collective}: unknown algorithm {name!r}; choose one of "
                         f"{sorted(options)}") from None
    if automatic and collective == "alltoall" and name == "shared" and size > 1 \
            and single_copy_refused is None and cfg.single_copy and _hosts(topology) == 1:
        # The arena's alltoall, whose ranks agree after its first round to
        # read the rest of large blocks single-copy (alltoall_shared).
        choice = Choice(name, partial(options[name],
                                      rest_nbytes=cfg.single_copy_alltoall_rest_min_nbytes))
    if name in SINGLE_COPY and size > 1:
        why = single_copy_refused or (None if cfg.single_copy else
                                      "single_copy is 0 (NUMCOLL_SINGLE_COPY)")
        if why is None and _hosts(topology) > 1:
            why = f"this group spans {_hosts(topology)} hosts"
        if why is None and not _single_copy_fits(cfg, size):
            why = f"the arena's {cfg.arena_slot_nbytes}-byte slot cannot hold {size} addresses"
        if why is not None:
            raise ValueError(f"{collective}: algorithm {name!r} reads the peers' buffers "
                             f"where they lie, which this group cannot: {why}")
    if name in SHARED and size > 1:
        if not cfg.arena_slot_nbytes:
            raise ValueError(f"{collective}: algorithm {name!r} needs ranks that share "
                             "memory (the shm transport, with arena_slot_nbytes > 0); this "
                             "group has no shared arena")
        if _hosts(topology) > 1:
            raise ValueError(f"{collective}: algorithm {name!r} needs ranks that share "
                             f"memory; this group spans {_hosts(topology)} hosts (use "
                             f"'twolevel', or a flat algorithm)")
    if name in DEVICE_PEERS and size > 1 and (device_peers is not None or _hosts(topology) > 1):
        raise ValueError(f"{collective}: algorithm {name!r} needs device arrays on ranks of "
                         "one host that can address each other's device memory; "
                         f"{device_peers or f'this group spans {_hosts(topology)} hosts'}")
    if name in TWO_LEVEL and (topology is None or not topology.slot_nbytes):
        raise ValueError(f"{collective}: algorithm {name!r} needs a group that knows its "
                         "hosts and has a shared arena on each (the hier transport, with "
                         "arena_slot_nbytes > 0); this group has "
                         f"{'no topology' if topology is None else 'no arenas'}")
    return choice


#: The collectives with an algorithm over the peers' device memory, and its name.
_DEVICE_PEER_FAMILIES = {f: n for f, names in CHOICES.items() for n in names
                         if n in DEVICE_PEERS}


def _hosts(topology) -> int:
    return 1 if topology is None else len(topology.hosts)


def check_forced(cfg: Config) -> None:
    """``ValueError`` unless every ``collective:algorithm`` forced by
    ``cfg.algorithm`` names a known collective family and one of its algorithms."""
    for item in filter(None, (s.strip() for s in cfg.algorithm.split(","))):
        collective, _, name = (part.strip() for part in item.partition(":"))
        if collective not in CHOICES:
            raise ValueError(f"algorithm {item!r}: unknown collective {collective!r}; choose "
                             f"one of {sorted(CHOICES)}")
        if name not in CHOICES[collective]:
            raise ValueError(f"algorithm {item!r}: unknown algorithm {name!r} for "
                             f"{collective}; choose one of {sorted(CHOICES[collective])}")


#: The collectives whose single copy beats the arena with more ranks than CPUs
#: as without (each rank reads only its own part, and the arena's takes several
#: rounds): 3, 4 and 8 ranks on 2 CPUs, the two alternated in one launch,
#: alltoall 21-67 % and scatter 8-60 % faster from 8 MiB in both of the VM's
#: states; allgather and broadcast 5-44 % slower up to 16 MiB where the vCPUs
#: sit near (docs/performance/single-copy.md). They keep the general threshold.
#: Scatter there counts the root's whole list rather than a rank's share: with
#: 4 ranks, 2 MiB a rank (8 MiB in all) took 18-19 % less time single-copy and
#: 1 MiB a rank tied (-3 to +6 %); 8 ranks, 0.5 to 2 MiB a rank, 1.7-2.7x less.
#: And twice the general threshold: 4 ranks, the round trip 0.15-0.2 us, paired
#: beside Open MPI, a list of 512 KiB took the arena 75-131 us and single copy
#: 110-187 (busbw ratio 0.40-0.77 against 0.31-0.67); from 1 MiB single copy
#: was ahead (1 MiB 0.50 -> 0.98, 2 MiB 0.43 -> 1.00). Gather alike (the root
#: alone reads, each peer writes its part): forced, paired beside Open MPI,
#: single copy / the arena, 4 ranks, the root's output 1 MiB 1.42 / 0.66,
#: 2 MiB 1.34 / 0.66, 256 KiB 0.59 / 0.55; 8 ranks 1 MiB 1.00 / 0.80, 2 MiB
#: 1.44 / 0.93, 4 MiB 1.70 / 0.75. It counts the root's whole output.
_UNCROWDED = frozenset(("alltoall", "scatter", "gather"))


#: The collectives that read single-copy unmeasured (``cma``) below the general
#: threshold, from a threshold of their own (its Config field): numcoll.config.
_UNMEASURED = {"broadcast": "single_copy_broadcast_min_nbytes",
               "scatter": "single_copy_scatter_min_nbytes",
               "allgather": "single_copy_allgather_min_nbytes"}


def _unmeasured_min(cfg: Config, collective: str, size: int) -> int:
    """The size from which ``collective`` (one of :data:`_UNMEASURED`) reads
    single-copy unmeasured: its threshold, adjusted as the general one is; an
    allgather's (its whole output) scaled so that each peer's chunk is as
    large as on 2 ranks (measured there: more ranks read smaller chunks, one
    ``process_vm_readv`` each, where the arena's copies are unchanged)."""
    least = getattr(cfg, _UNMEASURED[collective])
    if collective == "allgather":
        least = least * size // 2
    return _single_copy_min(cfg, collective, size, least)


def _single_copy_min(cfg: Config, collective: str, size: int, least: int | None = None) -> int:
    """The size from which the ``cma_measured`` algorithms are chosen: the
    general threshold, the larger of two for gather, for alltoall (its list
    form: see ``single_copy_alltoall_min_nbytes``) and for allreduce, and the
    larger again on a group with more ranks than the host has CPUs (the same
    on every rank of one host, as an shm group's ranks are), but for alltoall, scatter and
    gather (a scatter's or gather's block then counts ``size`` times -- the
    root's whole list -- against twice its threshold) and allreduce (its
    threshold divided by ``size``). ``least``: another threshold (one of
    :data:`_UNMEASURED`'s), adjusted for such a group as the general one is."""
    least = cfg.single_copy_min_nbytes if least is None else least
    if collective == "gather":
        least = max(least, cfg.single_copy_rooted_min_nbytes)
    elif collective == "alltoall":
        least = max(least, cfg.single_copy_alltoall_min_nbytes)
    elif collective == "allreduce":
        least = max(least, cfg.single_copy_allreduce_min_nbytes)
    if size > (os.cpu_count() or 1):
        if collective == "allreduce":
            # (the arena's one-step allreduce reads (P-1) S a rank, single copy
            # 2 (P-1)/P S: forced, paired beside Open MPI, single copy / the
            # arena, 4 ranks 256 KiB 0.92 / 0.61, 512 KiB 0.83 / 0.64; 8 ranks
            # 256 KiB 0.80-0.89 / 0.51-0.53, 512 KiB 0.93 / 0.44; 128 KiB tied)
            least = -(-least // size)
        elif collective not in _UNCROWDED:
            least = max(least, cfg.single_copy_crowded_min_nbytes)
        elif collective in ("scatter", "gather"):
            least = -(-2 * least // size)
    return least


def _single_copy_fits(cfg: Config, size: int) -> bool:
    """Whether the arena's slot holds a single-copy *where* for every rank."""
    return 0 < cfg.arena_slot_nbytes and where_nbytes(size) <= cfg.arena_slot_nbytes


def _automatic(cfg: Config, collective: str, nbytes: int, size: int, shared: bool,
               topology, single_copy_refused: str | None = NO_SINGLE_COPY,
               uneven: bool = False) -> str:
    if topology is not None and len(topology.hosts) > 1:
        if shared and topology.two_level and collective in TWO_LEVEL_FAMILIES:
            return TWO_LEVEL_DEFAULT if TWO_LEVEL_DEFAULT in CHOICES[collective] \
                else "twolevel"
        on_arena = None  # an arena here is a host's, not the group's
    else:
        on_arena = _shared(cfg, collective, nbytes, size) if shared else None
        # (Not an all_to_all_single: its ranks' buffers may differ, and
        # ranks whose buffers lie either side of a threshold would part; the
        # arena's alltoall agrees after its first round whether to read the
        # rest single-copy: choose().)
        if on_arena in ("shared", "shared_split") and "cma" in CHOICES[collective] \
                and not uneven \
                and single_copy_refused is None and cfg.single_copy \
                and _single_copy_fits(cfg, size):
            if nbytes >= _single_copy_min(cfg, collective, size):
                on_arena = "cma_measured"
            elif collective in _UNMEASURED and nbytes >= _unmeasured_min(cfg, collective, size):
                on_arena = "cma"
    if on_arena is not None:
        return on_arena
    if collective == "allreduce":
        return "recursive_doubling" if nbytes <= cfg.allreduce_small_nbytes else "ring"
    if collective == "broadcast":
        return "binomial" if nbytes <= cfg.broadcast_small_nbytes else "chain"
    if collective == "reduce":
        return "binomial" if nbytes <= cfg.allreduce_small_nbytes else "ring"
    # One algorithm each, besides the arena's and the device peers': the table's other entry.
    (only,) = (name for name in CHOICES[collective] if name not in ARENA | DEVICE_PEERS)
    return only


def _shared(cfg: Config, collective: str, nbytes: int, size: int) -> str | None:
    """The shared-arena algorithm for this call, if the group has an arena
    and one applies (the thresholds: see :mod:`numcoll.config`)."""
    if not cfg.arena_slot_nbytes or size == 1 or nbytes > cfg.shared_max_nbytes:
        return None
    if collective == "allreduce":
        return "shared_split" if nbytes >= cfg.shared_split_nbytes else "shared"
    if collective in ("reduce_scatter", "scatter", "alltoall") and \
            cfg.arena_slot_nbytes < 16 * size + max(8 * (size + 8), alltoall_head_nbytes(size)):
        return None  # a round holds an element for every rank (and alltoall's header)
    return "shared" if "shared" in CHOICES[collective] else None


def segment_count(cfg: Config, itemsize: int) -> int:
    """Elements per segment for arrays of ``itemsize`` bytes."""
    return max(1, cfg.segment_nbytes // max(1, itemsize))
