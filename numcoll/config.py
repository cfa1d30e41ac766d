"""Tunables, in one place, each overridable with a ``NUMCOLL_*`` environment variable.

Values are read when :func:`current` is called (the ProcessGroup reads them once
at construction), so tests can set ``NUMCOLL_SEGMENT_NBYTES=64`` to force the
multi-segment paths with tiny arrays.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import zlib

__all__ = ["Config", "current", "get", "replace", "AGREED", "fingerprint"]


@dataclasses.dataclass(frozen=True)
class Config:
    #: Large messages are cut into segments of this many bytes so that transfer
    #: and reduction overlap (pipelining) and no single ZeroMQ message is huge.
    segment_nbytes: int = 4 << 20
    #: allreduce: messages up to this many bytes use recursive doubling (latency
    #: bound, log2(P) steps); larger ones use the bandwidth-optimal ring.
    allreduce_small_nbytes: int = 64 << 10
    #: broadcast: up to this many bytes use a binomial tree; larger ones a
    #: pipelined chain.
    broadcast_small_nbytes: int = 256 << 10
    #: Force an algorithm by name for every call of a collective
    #: (e.g. ``NUMCOLL_ALGORITHM=allreduce:ring,broadcast:chain``); "" = automatic.
    algorithm: str = ""
    #: Sends of at least this many bytes go out zero-copy (tracked by ZeroMQ).
    zero_copy_nbytes: int = 64 << 10
    #: float16/bfloat16 reductions travel as float32 partial sums ("float32",
    #: exact: rounded once) or in the array's own 16-bit format ("native":
    #: half the wire bytes, rounded at every step as Gloo does).
    half_wire: str = "float32"
    #: ipc transport: shared-memory slots per peer for payloads from
    #: zero_copy_nbytes up to the segment size (one copy per side instead of a
    #: socket's kernel copies); 0 sends everything through the socket.
    shm_slots: int = 8
    #: shm transport: payload bytes per rank and step of the shared arena that
    #: the ``shared`` algorithms use (a multiple of 64, at least 4096; 0 turns
    #: the arena and those algorithms off). Rank 0's region holds 2 x P slots,
    #: whose pages are only touched as messages need them.
    arena_slot_nbytes: int = 1 << 20
    #: On groups with a shared arena, collectives of up to this many bytes (as
    #: the size rules count them: a rank's buffer; allgather's whole output)
    #: use the ``shared`` algorithms; larger ones the ring family.
    shared_max_nbytes: int = 1 << 62
    #: On groups with a shared arena, allreduces of at least this many bytes
    #: split the reduction among the ranks (``shared_split``: each rank copies
    #: in only what the others reduce, rounds pipelined one step each) instead
    #: of every rank reducing every slot (``shared``: the fewest steps, for
    #: smaller messages). From measurement: docs/performance/index.md.
    shared_split_nbytes: int = 1 << 20
    #: Collectives on shared arrays (``nc.empty_shared``) of at least this many
    #: bytes per rank read the other ranks' arrays in place (two or three
    #: synchronisations, one copy or none); smaller ones go through the arena
    #: like any array (one synchronisation per round, a copy more). Measured
    #: on 2 and 4 ranks, 2 cores: the arena wins below 1 MiB (64 KiB: 12 against
    #: 31 us on 2 ranks), shared arrays from there (2 MiB: 84 against 110 us).
    shared_arrays_min_nbytes: int = 1 << 20
    #: Collectives on shared arrays reduce and copy in blocks of this many
    #: bytes (each block of a rank's share taken from every peer in turn
    #: while it is in cache).
    shared_arrays_block_nbytes: int = 1 << 20
    #: shm groups whose ranks may read each other's memory (cross-memory
    #: attach: :mod:`transports.shm.single_copy`): 1 lets collectives that
    #: move data without reducing it read the peers' buffers where they lie,
    #: one copy instead of the arena's two (the ``cma`` algorithms); 0 refuses
    #: them (the arena carries everything, as where the kernel forbids it).
    single_copy: int = 1
    #: ... from this many bytes (as the size rules count them: allgather's
    #: whole output, a rank's buffer otherwise); smaller calls take the arena,
    #: whose one synchronisation and cache-resident slots beat the
    #: single-copy path's two synchronisations and page pinning (the kernel
    #: reads at ~12 GB/s here, cached or not). Measured on 2 ranks, 2 cores,
    #: the same algorithm call after call, when every single-copy call took
    #: its ordinary path (docs/performance/single-copy.md):
    #: the arena faster at 1 MiB (min 245 vs 428 us allgather), a tie at
    #: 4 MiB, single-copy 2.2-2.6x faster at 16 MiB. At 8 MiB, the two
    #: alternated in one launch: single copy 9-17 % faster for allgather,
    #: alltoall and broadcast, scatter's 3-7 % slower, where the VM's vCPUs
    #: were near each other, and 3-10x faster where they were far apart (a
    #: cache line's round trip 0.3 us: the arena then copies at ~2 GB/s;
    #: docs/performance/open-mpi.md, the far state). What is chosen from here
    #: is ``cma_measured``: single copy or the arena, call by call, as rank 0
    #: measured them lately. It was 4 MiB, above the calls one fused arena
    #: step moves, while a repeated measured call within a slot kept single
    #: copy's ordinary path; now such a call is a compiled start of its own
    #: (numcoll.fast.copy). 2 ranks, the round trip 0.15-0.2 us, paired beside
    #: Open MPI, busbw ratio, the tree before / after: allgather 1 MiB
    #: 0.75 / 0.97 (in place 0.42 / 0.88), 2 MiB 0.75 / 0.99; broadcast 1 MiB
    #: 1.04 / 2.15, 2 MiB 0.83 / 1.93; scatter 2 MiB 0.88 / 0.96. From 512 KiB
    #: rather than 1 MiB: allgather 512 KiB 0.54-0.60 / 0.85-0.89, broadcast
    #: 512 KiB 0.95 / 1.55, scatter 1 MiB (512 KiB a rank) 0.58 / 1.22; at
    #: 256 KiB a call that does not repeat lost more than a repeated one gained
    #: (docs/performance/single-copy.md).
    single_copy_min_nbytes: int = 512 << 10
    #: The threshold for gather, a rank's block (by default the general one).
    #: It was 64 MiB while the root copied every byte of a single-copy gather
    #: (2 ranks, 16 MiB: 1126 us against the arena's 840); since the root and
    #: each peer copy from both ends at once, 4 MiB, and 512 KiB since a
    #: repeated measured call within a slot runs as a compiled start: 2 ranks,
    #: paired beside Open MPI, busbw ratio, the bench's sizes (the root's whole
    #: output) 1 MiB 0.93 -> 1.50, 2 MiB 1.17-1.19 -> 1.34-1.37, 4 MiB 0.91 ->
    #: 1.31 (docs/performance/single-copy.md).
    single_copy_rooted_min_nbytes: int = 512 << 10
    #: Below the general threshold, broadcast, scatter and allgather read
    #: single-copy *unmeasured* (``cma``) from thresholds of their own up to
    #: it (where the measured choice, ``cma_measured``, takes over); on a
    #: group with more ranks than the host has CPUs, counted as the general
    #: one is there (below: broadcast and allgather from the crowded one, so
    #: not at all; scatter's list against twice it). Broadcast, a rank's
    #: buffer: a broadcast through the arena is two copies one after the
    #: other (the root's in, then the peers' out), and in the VM's far state
    #: (a cache line's round trip 0.3 us) the arena moves ~2 GB/s, while a
    #: single-copy read is one copy, near or far. 2 ranks, paired beside Open
    #: MPI, busbw ratio, three runs each, 512 KiB -> 64 KiB (measured then):
    #: 64 KiB 0.67-2.29 -> 0.94-1.13, 128 KiB 0.58-2.33 -> 1.18-1.32, 256 KiB
    #: 0.65-1.44 -> 1.42-1.61 (docs/performance/single-copy.md). Unmeasured
    #: rather than measured, three runs: 64 KiB 0.93-1.09 -> 1.16-1.17, 128 KiB
    #: 1.19-1.50 -> 1.37-1.46, 256 KiB 1.42-1.84 -> 1.57-1.73, 512 KiB
    #: 1.46-1.70 -> 1.80-1.85: rank 0 timing each call and saying which way
    #: it goes cost 1.5-5 us a call, its calls through the arena the ordinary
    #: path (a fused start cannot take them).
    single_copy_broadcast_min_nbytes: int = 64 << 10
    #: ... scatter, a rank's block: its arena path is two copies one after the
    #: other too. 2 ranks, the root's whole list, two runs, the arena / forced
    #: cma / cma_measured: 128 KiB 0.71-0.78 / 0.90-0.96 / 0.75, 256 KiB
    #: 0.71-0.72 / 0.99-1.08 / 0.72-0.77, 512 KiB 0.74 / 1.16 / 0.81-1.13.
    single_copy_scatter_min_nbytes: int = 64 << 10
    #: ... allgather, its whole output: the arena's copies run side by side,
    #: but in a launch where handing the slot's lines from core to core is
    #: slow (as often as every other launch in one hour) they move a quarter
    #: of Open MPI's bytes, while a single-copy read does not slow down. 2
    #: ranks, three runs, the arena / forced cma (out of place, in place):
    #: 64 KiB 0.37-0.98 / 0.93-1.02, 128 KiB 0.27-0.79 / 0.85-1.04, 256 KiB
    #: 0.21-0.88 / 0.95-1.03; at 32 KiB the arena's fast launches were ahead
    #: (1.24-1.27 against 0.89-0.97). Counted so that each peer's chunk is as
    #: large as on 2 ranks (times the ranks over 2): more ranks read smaller
    #: chunks, one read each, where the arena's copies are unchanged (not
    #: measured: this VM has 2 CPUs, and more ranks than CPUs never take it).
    single_copy_allgather_min_nbytes: int = 64 << 10
    #: The same threshold for groups with more ranks than the host has CPUs
    #: (allgather, broadcast, gather -- a rank's block; alltoall and scatter
    #: keep the general one, a scatter counting the root's whole list against
    #: twice it). 4 ranks on 2 cores, paired beside Open MPI, busbw ratio,
    #: 4 MiB -> 512 KiB alternated, two runs each: allgather 1 MiB
    #: 0.85-0.86 -> 0.93-0.96 (in place 0.68-0.86 -> 0.94-1.32), 2 MiB
    #: 0.82-0.86 -> 1.08-1.26, broadcast 1 MiB 0.66-0.81 -> 1.02-1.07, gather
    #: 4 MiB 0.71-0.82 -> 0.91-1.12; at 512 KiB 4 ranks gained too, but 8 ranks
    #: lost (allgather 1.24-1.26 -> 0.93-0.94, broadcast 0.95 -> 0.72), hence
    #: 1 MiB. It was 32 MiB while single copy, forced, took 1.1-2.4x the arena's
    #: time up to 16 MiB with 4 ranks on 2 cores in the VM's near state; since
    #: rank 0 measures both ways call by call and a repeated call runs as one
    #: compiled start, 4 ranks on 2 cores, paired beside Open MPI, busbw ratio
    #: allgather 8 MiB 0.59-0.69 -> 0.95-1.49, broadcast 4 MiB 0.68-0.75 ->
    #: 1.58-1.95, 16 MiB 0.75-1.54 -> 3.44-3.61, gather 16 MiB 0.71-0.74 ->
    #: 1.38-1.53; then 4 MiB (docs/performance/single-copy.md).
    single_copy_crowded_min_nbytes: int = 1 << 20
    #: The threshold for the list form of alltoall (``all_to_all``), which
    #: counts a rank's own buffer: every rank of such a call holds as much
    #: (torch's rules), so they choose alike. ``all_to_all_single`` never
    #: takes it, with split sizes or without: a peer may pass them where this
    #: rank passes none, and ranks may send each other different amounts, so
    #: ranks that chose by their own buffers' sizes could part. It goes
    #: through the arena's alltoall, whose ranks agree inside it whether to
    #: read the blocks single-copy (``single_copy_alltoall_rest_min_nbytes``).
    single_copy_alltoall_min_nbytes: int = 8 << 20
    #: The arena's alltoall (the automatic choice for ``all_to_all_single``,
    #: and for the list form below ``single_copy_alltoall_min_nbytes``): a
    #: rank whose largest block is at least this many bytes offers its blocks
    #: to be read whole (its data starts a round late; 0: where it needs more
    #: than one round), and after the first round, when every rank has read
    #: every rank's header, all of them read what is left of every block
    #: single-copy where every rank offers it and the largest block's rest is
    #: at least the largest threshold offered
    #: (:func:`numcoll.algorithms.shared_alltoall.alltoall_shared`). A
    #: repeated call whose blocks are read whole runs as one compiled start.
    #: 128 KiB: 2 ranks, paired beside Open MPI, busbw ratio, a rank's whole
    #: buffer, 0 -> 128 KiB: 256 KiB 0.62-0.63 -> 0.86, 1 MiB 0.56-0.61 ->
    #: 0.87, 4 MiB 0.58-0.68 -> 0.84; 4 ranks on 2 cores 512 KiB 0.54 -> 0.82,
    #: 2 MiB 0.43 -> 0.92; at 64 KiB blocks (4 ranks, 256 KiB) the two tie
    #: (docs/performance/single-copy.md).
    single_copy_alltoall_rest_min_nbytes: int = 128 << 10
    #: The threshold for allreduce (``cma_measured``: a reduce-scatter and an
    #: allgather by single-copy reads, or the arena's ``shared_split``, as
    #: rank 0 measured them lately); by default the general one. 2 ranks, the
    #: round trip 0.15-0.2 us, paired beside Open MPI, busbw ratio, the arena
    #: -> cma_measured: 4 MiB 0.67-0.70 -> 0.73-0.89, 6 MiB 0.66-0.71 ->
    #: 0.81-0.90, 16 MiB 0.63-0.67 -> 0.89 (docs/performance/single-copy.md);
    #: at 1 MiB the arena was ahead (1.05-1.09 against forced cma's 0.62-0.74).
    #: 1 MiB since a repeated one runs as one compiled call (numcoll.fast.sum):
    #: 4 MiB -> 1 MiB, the same hour, 2 ranks 1 MiB 0.82-0.84 -> 0.92, 2 MiB
    #: 0.69-0.71 -> 1.00, 4 MiB 0.80 -> 1.20; 4 ranks on 2 cores 1 MiB 0.61 ->
    #: 0.90, 4 MiB 0.88 -> 1.13. On a group with more ranks than CPUs it is
    #: divided by the ranks (collectives.choice._single_copy_min): 4 ranks
    #: 256 KiB 0.57 -> 1.03, 8 ranks 512 KiB 0.39 -> 1.01.
    single_copy_allreduce_min_nbytes: int = 1 << 20
    #: How long a crashed peer's socket may stay silent after its disconnect is
    #: seen before pending receives from it fail (seconds). Lets in-flight data
    #: that was sent before the crash still arrive.
    peer_grace_s: float = 0.25
    #: ``agree`` and ``shrink`` (:mod:`numcoll.recovery`): how often a rank
    #: waiting for the others' votes looks at the store again (seconds), and
    #: how long it waits at most when the call gives no timeout (seconds).
    recovery_poll_s: float = 0.002
    recovery_timeout_s: float = 60.0
    #: CUDA kernels: threads per block (256 keeps several blocks resident per SM
    #: for these memory-bound loops) and the most blocks of a grid-stride launch
    #: (beyond what the device keeps resident, more blocks only add scheduling;
    #: not tuned on hardware yet: see benchmarks/bench_cuda.py). Read at each
    #: launch, so tests can force the multi-iteration paths (4 x 2).
    cuda_threads: int = 256
    cuda_blocks: int = 1024
    #: Idle pinned host memory the CUDA staging pool keeps for reuse (bytes).
    cuda_staging_idle_nbytes: int = 1 << 30
    #: A staged device buffer comes to the host in this many asynchronous
    #: copies, each followed by an event, so the host algorithm starts on the
    #: first piece it needs while the rest are still copying; pieces are at
    #: least ``cuda_staging_piece_min_nbytes`` (smaller buffers: fewer pieces).
    #: The count is fixed, so the host work of a call does not grow with its size.
    cuda_staging_pieces: int = 4
    cuda_staging_piece_min_nbytes: int = 1 << 20
    #: Idle device memory kept for the collectives' device temporaries (bytes;
    #: the most recently released block is kept whatever its size). Reusing the
    #: same allocations also lets peers keep them open for CUDA IPC.
    cuda_device_idle_nbytes: int = 256 << 20
    #: Device allreduce between ranks on one host that can address each
    #: other's device memory (threads of one process, or processes with CUDA
    #: IPC): "auto" chooses the ``ipc`` algorithm there (kernels reduce straight
    #: from the peers' memory); "off" never chooses it (device data is staged
    #: through pinned host memory). Forcing it: ``NUMCOLL_ALGORITHM=allreduce:ipc``.
    cuda_ipc: str = "auto"
    #: Peers' device allocations a process keeps open (CUDA IPC mappings), the
    #: least recently used closed beyond this.
    cuda_ipc_open_max: int = 16
    #: Flight recorder: collectives kept per process (0: off); read when the
    #: first group is created.
    fr_buffer_size: int = 2000
    #: Flight recorder: where a rank whose group is poisoned writes its records
    #: ("" = nowhere).
    fr_dump_dir: str = ""
    #: Sparse allreduce: when every rank's entries together would take more than
    #: this many times the bytes of the dense array (plus a mask of one element
    #: per row), the ranks allreduce the dense array instead of gathering them.
    sparse_dense_ratio: float = 1.0
    #: Rendezvous: how often a rank waiting for the store or for other ranks
    #: logs who is missing (seconds).
    rendezvous_log_s: float = 10.0
    #: Rendezvous: how long a store that accepted the connection may take to
    #: answer a first request before the port is declared not a numcoll store.
    store_probe_s: float = 5.0
    #: TCPStore server: the largest request frame it accepts (bytes); a client
    #: that announces more is dropped before the server buffers it.
    store_max_frame_nbytes: int = 64 << 20
    #: Bytes a peer may have waiting for receives (messages no receive has
    #: taken yet) before it is cut off: bounds what a stray or hostile sender
    #: can make a rank hold.
    max_unexpected_nbytes: int = 512 << 20
    #: Call plans a group keeps (checks, algorithm, reduction plan and call
    #: descriptor of a repeated call): one per shape, dtype and op in use,
    #: the least recently used dropped beyond this.
    call_plans_kept: int = 256


#: The settings that decide which messages a call sends (its algorithm, how
#: it cuts the data): ranks whose values differ would exchange messages that do
#: not match, or wait for ones that never come. Every message carries their
#: :func:`fingerprint`, so such ranks fail at their first call naming these.
AGREED = ("algorithm", "segment_nbytes", "allreduce_small_nbytes", "broadcast_small_nbytes",
          "half_wire", "arena_slot_nbytes", "shared_max_nbytes", "shared_split_nbytes",
          "sparse_dense_ratio", "cuda_ipc", "single_copy", "single_copy_min_nbytes",
          "single_copy_rooted_min_nbytes", "single_copy_crowded_min_nbytes",
          "single_copy_alltoall_min_nbytes", "single_copy_allreduce_min_nbytes")


def fingerprint(cfg: Config) -> int:
    """16 bits that tell two configurations' :data:`AGREED` settings apart
    (a different value gives another fingerprint but once in 65,535); never 0."""
    text = repr(tuple(getattr(cfg, name) for name in AGREED))
    return zlib.crc32(text.encode()) % 0xFFFF + 1


_INT_FIELDS = {f.name for f in dataclasses.fields(Config) if f.type in ("int", int)}
_FLOAT_FIELDS = {f.name for f in dataclasses.fields(Config) if f.type in ("float", float)}


_FIELDS = {f.name: f for f in dataclasses.fields(Config)}
_DEFAULTS = Config()
#: Inclusive ranges of the integer tunables that have one.
_RANGES = {"segment_nbytes": (8, None), "cuda_threads": (1, 1024),  # CUDA's block limit
           "cuda_blocks": (1, 2**31 - 1), "cuda_staging_idle_nbytes": (0, None),
           "cuda_staging_pieces": (1, 64), "cuda_staging_piece_min_nbytes": (1, None),
           "cuda_ipc_open_max": (1, None), "cuda_device_idle_nbytes": (0, None),
           "fr_buffer_size": (0, None), "shm_slots": (0, None), "zero_copy_nbytes": (0, None),
           "store_max_frame_nbytes": (1024, None), "shared_max_nbytes": (0, None),
           "shared_split_nbytes": (0, None), "call_plans_kept": (1, None),
           "shared_arrays_min_nbytes": (0, None), "shared_arrays_block_nbytes": (64, None),
           "single_copy": (0, 1), "single_copy_min_nbytes": (0, None),
           "single_copy_rooted_min_nbytes": (0, None),
           "single_copy_crowded_min_nbytes": (0, None),
           "single_copy_alltoall_rest_min_nbytes": (0, None),
           "single_copy_alltoall_min_nbytes": (0, None),
           "single_copy_allreduce_min_nbytes": (0, None),
           "single_copy_broadcast_min_nbytes": (0, None),
           "single_copy_scatter_min_nbytes": (0, None),
           "single_copy_allgather_min_nbytes": (0, None)}


def _from_env(name: str):
    """The ``NUMCOLL_<NAME>`` override of field ``name``, parsed, or None."""
    var = "NUMCOLL_" + name.upper()
    raw = os.environ.get(var)
    if raw is None:
        return None
    try:
        if name in _INT_FIELDS:
            return int(raw, 0)
        if name in _FLOAT_FIELDS:
            return float(raw)
    except ValueError:
        raise ValueError(f"{var}={raw!r} is not a valid {_FIELDS[name].type}") from None
    return raw


def _check(name: str, value):
    low, high = _RANGES.get(name, (None, None))
    if (low is not None and value < low) or (high is not None and value > high):
        span = f"{low}..{high}" if high is not None else f"at least {low}"
        raise ValueError(f"{name} (NUMCOLL_{name.upper()}) must be {span}, got {value}")
    if name == "arena_slot_nbytes" and value and (value < 4096 or value % 64):
        raise ValueError(f"arena_slot_nbytes (NUMCOLL_ARENA_SLOT_NBYTES) must be 0 or a "
                         f"multiple of 64 of at least 4096, got {value}")
    if name == "half_wire" and value not in ("float32", "native"):
        raise ValueError(f"half_wire must be 'float32' or 'native', got {value!r}")
    if name == "cuda_ipc" and value not in ("auto", "off"):
        raise ValueError(f"cuda_ipc (NUMCOLL_CUDA_IPC) must be 'auto' or 'off', got {value!r}")
    return value


def current(**overrides) -> Config:
    """The configuration: defaults, then ``NUMCOLL_<FIELD>`` variables, then ``overrides``."""
    values = {}
    for name in _FIELDS:
        value = _from_env(name)
        if value is not None:
            values[name] = value
    values.update(overrides)
    for name, value in values.items():
        _check(name, value)
    return Config(**values)


def replace(cfg: Config, **changes) -> Config:
    """``cfg`` with ``changes`` (checked as :func:`current` checks them)."""
    for name, value in changes.items():
        _check(name, value)
    return dataclasses.replace(cfg, **changes)


def get(name: str):
    """One tunable's current value (default, or its ``NUMCOLL_*`` override):
    cheaper than :func:`current` where a single value is read per call."""
    value = _from_env(name)
    return getattr(_DEFAULTS, name) if value is None else _check(name, value)


@functools.lru_cache(maxsize=256)
def forced_algorithm(cfg: Config, collective: str) -> str | None:
    """The algorithm name forced for ``collective`` by ``cfg.algorithm``, if any."""
    for item in filter(None, (s.strip() for s in cfg.algorithm.split(","))):
        name, _, algo = item.partition(":")
        if name.strip() == collective and algo.strip():
            return algo.strip()
    return None
