"""ProcessGroup: the object every collective is called on.

A call validates its arguments on the caller's thread (so a rejected call does
not take a sequence number and cannot desynchronise the ranks), takes the next
sequence number, and queues the work; ``Options.threads`` worker threads run
queued work, each collective on a :class:`~numcoll.comm.Comm` whose tags carry
the sequence number. A caller that will wait at once (:func:`_run_blocking`,
what the module API's ``async_op=False`` uses) runs the work on its own thread
instead when the group has nothing else in flight. The collectives themselves
are in :mod:`numcoll.collectives`.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import queue
import socket
import threading
import time
from datetime import timedelta
from typing import Callable

import transports

from . import config as _config
from .algorithms import SHARED
from .call import Call
from .collectives.checks import timeout_seconds
from .collectives.choice import check_forced
from .collectives.movement import DataMovement
from .collectives.p2p import PointToPoint
from .collectives.reductions import Reductions
from .comm import Comm, abort_note
from .diagnostics import flight_recorder
from .errors import GroupPoisonedError, NumcollError
from .bootstrap.store import PrefixStore, Store
from .work import Work

__all__ = ["ProcessGroup"]

_SHUTDOWN = object()
# How long shutdown() lets queued work finish before failing it: every work has
# its own deadline, but shutting down must not wait on a stalled or vanished
# peer (torch's destroy_process_group does not wait at all).
_SHUTDOWN_DRAIN_S = 2.0
# How long an aborting rank waits for its reason to reach the store before it
# closes its transport (peers that see the close then read the reason). The
# write goes on in the background: a dead store must not slow the abort.
_ABORT_PUBLISH_S = 0.25


class _Caller(threading.local):
    """Per thread: whether the collective being called will be waited for at
    once (set by :func:`_run_blocking`, taken by the next ``_enqueue``)."""

    blocking = False


_caller = _Caller()


def _run_blocking(collective: Callable, *args, **kwargs) -> None:
    """Call ``collective(*args, **kwargs)``, a :class:`ProcessGroup` collective method,
    for a caller that waits for it at once: return when it has completed, or
    raise its error (the one ``Work.wait()`` would raise).

    The group runs it on this thread when it has no other work in flight: no
    queue, no worker wake-up (see ``ProcessGroup._enqueue``); otherwise it is
    queued behind that work and this thread waits for it.
    """
    _caller.blocking = True
    try:
        work = collective(*args, **kwargs)
    finally:
        _caller.blocking = False
    if work is not None:  # it returned its Work without taking the flag: wait for it
        work.wait()


@dataclasses.dataclass
class _Options:
    """ProcessGroup options.

    timeout: default deadline of every collective (per-call ``opts.timeout``
        overrides it). threads: worker threads, i.e. collectives that can make
        progress at once. transport: a registered kind ("tcp", "ipc",
        "inproc", or one added with ``transports.register``), a transport
        factory, or None to choose (inproc when every rank is a thread of this
        process, else shm when all share a Linux host (ipc elsewhere), else
        tcp). host: the address
        tcp binds to.
        algorithm: force algorithms for this group, e.g. "allreduce:ring".
        group_name: separates groups sharing one store.
    """

    timeout: timedelta = timedelta(minutes=30)
    threads: int = 2
    transport: str | Callable | None = None
    host: str = "127.0.0.1"
    algorithm: str = ""
    group_name: str = "default"


def _host_key() -> str:
    """What ranks that can share ipc (abstract Unix sockets, /dev/shm) have in
    common: the host name, and on Linux the network namespace and boot, since
    containers and namespaces often share a host name but not their sockets."""
    key = socket.gethostname()
    try:
        key += f"/netns{os.stat('/proc/self/ns/net').st_ino}"
        with open("/proc/sys/kernel/random/boot_id") as f:
            key += f"/boot{f.read().strip()}"
    except OSError:  # not Linux: the host name alone
        pass
    return key


class ProcessGroup(Reductions, DataMovement, PointToPoint):
    """A group of ``world_size`` ranks running Gloo's collectives on arrays.

    Parameters
    ----------
    store : a numcoll store shared by all ranks (addresses are exchanged through it).
    rank, world_size : this rank and the number of ranks.
    options : :class:`ProcessGroup.Options`.

    Every collective returns a :class:`~numcoll.Work`; results are written into
    the caller's arrays and are also the future's value. Use as a context
    manager, or call :meth:`shutdown`.
    """

    Options = _Options

    def __init__(self, store: Store, rank: int, world_size: int,
                 options: _Options | None = None):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"ProcessGroup: world_size must be a positive int, got {world_size!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"ProcessGroup: invalid rank {rank!r} for world_size {world_size}")
        # A copy: set_timeout() must not change other groups made with the same options.
        self.options = dataclasses.replace(options) if options is not None else _Options()
        opts = self.options
        if opts.threads < 1:
            raise ValueError(f"ProcessGroup: threads must be >= 1, got {opts.threads}")
        if not (opts.transport is None or callable(opts.transport)
                or opts.transport in transports.KINDS):
            raise ValueError(f"ProcessGroup: transport must be one of {transports.KINDS}, a "
                             f"transport factory, or None, got {opts.transport!r}")
        self._rank, self._size = rank, world_size
        self._cfg = _config.current(**({"algorithm": opts.algorithm} if opts.algorithm else {}))
        check_forced(self._cfg)
        self._timeout_s = opts.timeout.total_seconds()
        self._reduction_plans: dict = {}  # (op, dtype, on device) -> Reduction
        self._call_plans: dict = {}  # see Reductions._call_plan

        # A generation counter keeps a group re-created on the same store from
        # reading the previous group's addresses.
        base = PrefixStore(f"numcoll/{opts.group_name}", store)
        generation = (base.add("joined", 1) - 1) // world_size
        self._store = PrefixStore(str(generation), base)
        kind = opts.transport or self._choose_transport()
        self.transport_kind = kind if isinstance(kind, str) else getattr(kind, "__name__", "custom")
        self._transport = transports.create(
            kind, rank, world_size, PrefixStore("transport", self._store),
            transports.TransportOptions(
                host=opts.host, peer_grace_s=self._cfg.peer_grace_s,
                max_unexpected_nbytes=self._cfg.max_unexpected_nbytes,
                zero_copy_nbytes=self._cfg.zero_copy_nbytes, shm_slots=self._cfg.shm_slots,
                # Every message an algorithm sends fits a slot: segments, and the
                # whole buffers of the small-message algorithms.
                shm_slot_nbytes=max(self._cfg.segment_nbytes, self._cfg.allreduce_small_nbytes,
                                    self._cfg.broadcast_small_nbytes),
                arena_slot_nbytes=self._cfg.arena_slot_nbytes))
        if getattr(self._transport, "arena", None) is None and self._cfg.arena_slot_nbytes:
            # No shared memory between these ranks: the shared algorithms are off.
            self._cfg = dataclasses.replace(self._cfg, arena_slot_nbytes=0)

        self._lock = threading.Lock()
        self._next_seq = 0
        self._order = itertools.count()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._inflight: dict[int, Work] = {}
        self._poisoned: str | None = None
        self._closed = False
        self._global_rank = rank  # in the default group: see _set_global_ranks
        fr = flight_recorder.recorder()
        self._recorder = fr
        self._pg_id = (fr.register_group(f"{opts.group_name}/{generation}",
                                         f"{self.transport_kind} group of {world_size}",
                                         list(range(world_size)))
                       if fr is not None else -1)
        self._workers = [
            threading.Thread(target=self._worker_loop, name=f"numcoll-r{rank}-w{i}", daemon=True)
            for i in range(opts.threads)
        ]
        for w in self._workers:
            w.start()

    # -- identity and settings -------------------------------------------------------
    def rank(self) -> int:
        """This process's rank in the group."""
        return self._rank

    def size(self) -> int:
        """The number of ranks in the group."""
        return self._size

    def set_timeout(self, timeout: timedelta) -> None:
        """Set the default deadline of later collectives."""
        self._timeout_s = timeout_seconds(timeout, "set_timeout")
        self.options.timeout = timeout

    _set_default_timeout = set_timeout  # torch's private name, used by ported tests

    def _choose_transport(self) -> str:
        here = f"{_host_key()}:{os.getpid()}"
        self._store.set(f"where/{self._rank}", here)
        places = [self._store.get(f"where/{r}").decode() for r in range(self._size)]
        return transports.choose_kind(here, places)

    # -- queueing ----------------------------------------------------------------
    def _timeout_for(self, opts, op_name: str = "collective") -> float:
        """The deadline in seconds for a call with options ``opts`` (the group's
        default unless ``opts.timeout`` is set; it must be a positive timedelta)."""
        t = getattr(opts, "timeout", None)
        if t is None:
            return self._timeout_s
        return timeout_seconds(t, op_name)

    def _check_usable(self, op_name: str) -> None:
        if self._closed:
            raise NumcollError(f"{op_name}: the process group on rank {self._rank} was shut down")
        if self._poisoned is not None:
            raise GroupPoisonedError(
                f"{op_name}: the process group on rank {self._rank} is unusable because "
                f"{self._poisoned}; create a new group")

    def _set_global_ranks(self, ranks: list[int]) -> None:
        """The default group's ranks of this group's ranks (``new_group`` tells
        them), for the flight recorder's records and configuration."""
        self._global_rank = ranks[self._rank]
        if self._recorder is not None:
            self._recorder.set_group_ranks(self._pg_id, ranks)

    def sequence_number(self) -> int:
        """The sequence number the next collective will take (equal on every rank)."""
        with self._lock:
            return self._next_seq

    def _enqueue(self, call: Call, run: Callable[[Comm, Work], object],
                 collective: bool = True) -> Work | None:
        """Queue ``run(comm, work)`` for ``call``; its return value becomes the
        future's value.

        Collectives take the next sequence number (in call order, under the lock,
        so the n-th collective is number n on every rank). Point-to-point ops
        pass ``collective=False``: they are matched by tag and take none.

        Under :func:`_run_blocking` it returns None once the work has completed
        (raising its error), and runs the work right here when the group has
        nothing in flight. That keeps each rank's order: nothing in flight
        means every earlier call of this group on this rank has completed, so
        this one overtakes nothing, and the check is made under the lock that
        hands out sequence numbers, so a later call from another thread finds
        this one in flight and is queued behind it. With work in flight the
        call is queued as usual and the caller waits (running it itself if no
        worker has started it, as ``Work.wait`` does). The caller would block
        in ``wait()`` anyway and is not one of the group's workers, so running
        here holds up nothing the queued path would not: it only skips the
        queue and the worker wake-up. Either way the work runs through
        :meth:`_execute`: the same records, failure handling and poisoning.
        """
        caller = _caller
        blocking = caller.blocking
        if blocking:
            caller.blocking = False  # this call only, not work its run may start
        with self._lock:
            self._check_usable(call.name)
            seq = -1
            if collective:
                seq, self._next_seq = self._next_seq, self._next_seq + 1
            work = Work(call.name, seq, call=call)
            if self._recorder is not None:
                work.record = self._recorder.record(self._pg_id, self._global_rank, seq, call)
            here = blocking and not self._inflight
            work.order = key = next(self._order)
            # Registered either way: a barrier or shutdown() on another thread
            # waits for it like any other work.
            self._inflight[key] = work
            if not here:
                work._queued(self._execute, run)
                self._queue.put((work, run))
        if not blocking:
            return work
        if here:
            self._execute(work, run)
        work.wait()
        return None

    def _earlier_work(self, work: Work) -> list[Work]:
        """Work queued on this rank before ``work`` and not finished yet."""
        with self._lock:
            return [w for k, w in self._inflight.items() if k < work.order]

    def _worker_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _SHUTDOWN:
                return
            work, run = item
            if work._claim():  # else a waiting caller already ran it
                self._execute(work, run)

    def _execute(self, work: Work, run: Callable[[Comm, Work], object]) -> None:
        """Run one work and complete its future: the one place work runs, on a
        worker, on a caller waiting for it, or on a blocking caller."""
        record = work.record
        try:
            if self._poisoned is not None:
                raise GroupPoisonedError(
                    f"{work.op_name} (collective #{work.seq}) on rank {self._rank} was not "
                    f"run because {self._poisoned}")
            if self._closed:
                raise NumcollError(f"{work.op_name} on rank {self._rank}: the process "
                                   "group was shut down before it ran")
            if work.call is not None and work.call.algorithm in SHARED:
                self._wait_arena_turn(work)
            if record is not None:
                self._recorder.started(record)
            comm = Comm(self._transport, work.seq, work.call, self._abort_reason, record,
                        self._publish_stall)
            result = run(comm, work)
        except BaseException as exc:  # noqa: BLE001 - delivered through the Work
            exc = self._fail(work, exc)
            if record is not None:
                self._recorder.ended(record, exc)
            with self._lock:
                self._inflight.pop(work.order, None)
            work.get_future().set_exception(exc)
        else:
            if record is not None:
                self._recorder.ended(record)
            with self._lock:
                self._inflight.pop(work.order, None)
            work.get_future().set_result(result)

    def _wait_arena_turn(self, work: Work) -> None:
        """Let every earlier call that uses the shared arena finish first.

        Each shared-algorithm call runs a fixed number of arena steps, and the
        ranks match steps by count, so on every rank these calls must run in
        sequence-number order; worker threads (and callers running their own
        work in ``Work.wait``) may otherwise start them in any order. An
        earlier one that no thread has claimed yet is run here.
        """
        deadline = time.monotonic() + work.call.timeout_s
        for earlier in self._earlier_work(work):
            if earlier.call is None or earlier.call.algorithm not in SHARED:
                continue
            if earlier._execute is not None and earlier._claim():
                earlier._execute(earlier, earlier._run)
            try:
                earlier.get_future().wait(max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise NumcollError(
                    f"{work.op_name} (collective #{work.seq}) on rank {self._rank} timed out "
                    f"waiting for this rank's earlier {earlier.op_name} (collective "
                    f"#{earlier.seq}), which shares the arena and must finish first") from None
            except BaseException:  # noqa: BLE001 - its own Work reports it; the group is poisoned
                pass

    def _fail(self, work: Work, exc: BaseException) -> BaseException:
        """Record a failed work; the first failure poisons and aborts the group.

        Aborting closes the transport, so peers blocked on this rank fail at
        once (naming it, with the reason published in the store) instead of
        waiting out their deadlines. Work that fails because of the abort
        reports the original cause.
        """
        if isinstance(exc, GroupPoisonedError) or self._closed:
            return exc
        with self._lock:
            first = self._poisoned is None
            if first:
                what = f"collective #{work.seq}" if work.seq >= 0 else "point-to-point op"
                self._poisoned = f"{work.op_name} ({what}) failed on rank {self._rank}: {exc}"
        if first:
            # The culprit is the rank that caused it (a dead or stalled peer, or
            # the one whose failure reached us through its neighbour), so that
            # every rank's error leads with the same rank.
            peer = getattr(exc, "peer", None)
            culprit = peer if peer is not None else self._rank
            self._abort(getattr(exc, "root_reason", None) or self._poisoned, culprit)
            self._dump_flight_recorder()
            return exc
        poisoned = GroupPoisonedError(
            f"{work.op_name} (collective #{work.seq}) on rank {self._rank} did not complete "
            f"because {self._poisoned} (its own error: {exc})")
        poisoned.__cause__ = exc
        return poisoned

    def _dump_flight_recorder(self) -> None:
        directory = _config.get("fr_dump_dir")
        if directory and self._recorder is not None:
            try:
                self._recorder.dump_to_dir(directory, self._global_rank)
            except OSError:  # noqa: PERF203 - a diagnostic must never mask the failure
                pass

    def _abort(self, reason: str, culprit: int) -> None:
        self._publish_note(abort_note(culprit, reason))
        self._transport.close()

    def _publish_stall(self, peer: int, reason: str) -> None:
        """Say, before aborting, that this rank timed out waiting for ``peer``
        (see :meth:`numcoll.comm.Comm._stall_behind`); the abort note replaces it."""
        self._publish_note(abort_note(peer, reason))

    def _publish_note(self, note: bytes) -> None:
        def publish():
            try:
                self._store.set(f"abort/{self._rank}", note)
            except Exception:  # noqa: BLE001 - best effort: peers still see the close
                pass

        # The store write is bounded so a dead store cannot delay the abort.
        writer = threading.Thread(target=publish, name=f"numcoll-r{self._rank}-abort",
                                  daemon=True)
        writer.start()
        writer.join(_ABORT_PUBLISH_S)

    def _abort_reason(self, peer: int) -> bytes | None:
        """What ``peer`` published when it aborted the group (see
        :func:`numcoll.comm.abort_note`), if it did. Bounded: a dead store
        must not delay the error this explains."""
        key = f"abort/{peer}"
        found: list = []

        def look():
            try:
                if self._store.check([key]):
                    found.append(self._store.get(key))
            except Exception:  # noqa: BLE001 - only an explanation; never mask the error
                pass

        reader = threading.Thread(target=look, name=f"numcoll-r{self._rank}-why", daemon=True)
        reader.start()
        reader.join(_ABORT_PUBLISH_S * 2)
        return found[0] if found else None

    # -- lifecycle ---------------------------------------------------------------
    def abort(self, reason: str = "aborted by the caller") -> None:
        """Abort the group now (torch: ``ProcessGroup.abort``): poison it, tell
        the peers why, and fail pending work; peers blocked on this rank fail
        at once naming it. ``shutdown()`` still releases the threads."""
        with self._lock:
            if self._closed or self._poisoned is not None:
                return
            self._poisoned = f"rank {self._rank} aborted the group: {reason}"
        self._abort(self._poisoned, self._rank)

    def shutdown(self) -> None:
        """Finish queued work (bounded), then close the transport and join the
        worker threads. Leaves no thread, socket or file behind. Idempotent."""
        with self._lock:
            if self._closed:
                return
            pending = list(self._inflight.values())
        drain_deadline = time.monotonic() + min(self._timeout_s, _SHUTDOWN_DRAIN_S)
        for w in pending:
            remaining = drain_deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                w.get_future().wait(remaining)
            except BaseException:  # noqa: BLE001 - the caller sees it through the Work
                pass
        with self._lock:
            self._closed = True
        # Closing the transport fails every pending wait at once, so workers
        # stuck on a peer return promptly.
        self._transport.close()
        for _ in self._workers:
            self._queue.put(_SHUTDOWN)
        for w in self._workers:
            w.join(timeout=5.0)
        if self._recorder is not None:  # its records may stay; its table entry goes with them
            self._recorder.release_group(self._pg_id)

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __repr__(self):
        return (f"<numcoll.ProcessGroup rank={self._rank} size={self._size} "
                f"transport={self.transport_kind}>")
