"""ProcessGroup: the object every collective is called on, and the one place
calls are numbered, queued and run.

A collective method is one line: the collective's builder
(:mod:`numcoll.collectives`) checks the arguments on the caller's thread and
returns ``(call, run)``; :meth:`ProcessGroup.submit` numbers the call (a
rejected call never takes a number, so it cannot desynchronise the ranks)
and runs it -- on one of ``Options.threads`` worker threads, or, for a caller
that waits at once (``blocking=True``: the module API's ``async_op=False``),
on the caller's own thread when the group has nothing else in flight. Every
run goes through :meth:`_execute`: the flight recorder, the shared arena's
turn, failure handling and poisoning are in one place.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from datetime import timedelta
from typing import Callable

import numpy as np

import transports
from transports.endpoint import forget

from . import config as _config
from .algorithms import ARENA
from .call import SEQ_MASK, Call
from .collectives import exchange, movement, p2p, persistent, reductions
from .collectives.checks import timeout_seconds
from .collectives.choice import check_forced
from .collectives.context import GroupContext
from .collectives.fused_step import GROUP_BLOCKED, GROUP_CLAIMED, GROUP_SEQ, GROUP_WORDS
from .comm import AbortNotes, Comm
from .diagnostics import flight_recorder
from .diagnostics.mismatch import Finished
from .errors import CollectiveMismatchError, GroupPoisonedError, NumcollError
from .fast import Repeats, make_request, take_back, update_blocked
from .options import GroupOptions
from .recovery import SHRINK_HINT, Recoverable
from .bootstrap.store import PrefixStore, Store
from .work import ArenaOrder, Work, wait_for_earlier

__all__ = ["ProcessGroup"]

_SHUTDOWN = object()
# How long shutdown() lets queued work finish before failing it: every work has
# its own deadline, but shutting down must not wait on a stalled or vanished
# peer (torch's destroy_process_group does not wait at all).
_SHUTDOWN_DRAIN_S = 2.0


class ProcessGroup(persistent.InitMethods, p2p.P2PMethods, Recoverable):
    """A group of ``world_size`` ranks running Gloo's collectives on arrays.

    Parameters
    ----------
    store : a numcoll store shared by all ranks (addresses are exchanged through it).
    rank, world_size : this rank and the number of ranks.
    options : :class:`ProcessGroup.Options`.

    Notes
    -----
    Every collective returns a :class:`~numcoll.Work`; results are written into
    the caller's arrays and are also the future's value (``*_init``: persistent
    twins). Use as a context manager, or call :meth:`shutdown`.
    """

    Options = GroupOptions
    _make_request = make_request  # persistent requests: fused where one arena step does it

    def __init__(self, store: Store, rank: int, world_size: int,
                 options: GroupOptions | None = None, *, generation: int | None = None):
        self.options = opts = (options or GroupOptions()).checked(rank, world_size)
        self._rank, self._size = rank, world_size
        cfg = _config.current(**({"algorithm": opts.algorithm} if opts.algorithm else {}))
        check_forced(cfg)
        #: What the collectives' builders see of this group (rank, size,
        #: configuration, default deadline, plan cache).
        self.context = GroupContext(rank, world_size, cfg, opts.timeout.total_seconds())

        # A generation counter keeps a group re-created on the same store from
        # reading the previous group's addresses. A caller whose name is never
        # reused on this store (a sub-group: see api/groups.py) gives the
        # generation itself, and the store keeps no counter for it.
        base = PrefixStore(f"numcoll/{opts.group_name}", store)
        if generation is None:
            generation = (base.add("joined", 1) - 1) // world_size
        #: Which incarnation of the name ``options.group_name`` this group is.
        self.generation = generation
        self._store = PrefixStore(str(generation), base)
        self._recovery_init(store, generation)  # revoke / agree / shrink: numcoll.recovery
        kind = opts.transport or self._choose_transport()
        self.transport_kind = kind if isinstance(kind, str) else getattr(kind, "__name__", "custom")
        self._transport = transports.create(
            kind, rank, world_size, PrefixStore("transport", self._store),
            transports.TransportOptions(
                host=opts.host, peer_grace_s=cfg.peer_grace_s,
                max_unexpected_nbytes=cfg.max_unexpected_nbytes,
                zero_copy_nbytes=cfg.zero_copy_nbytes, shm_slots=cfg.shm_slots,
                # Every message an algorithm sends fits a slot: segments, and the
                # whole buffers of the small-message algorithms.
                shm_slot_nbytes=max(cfg.segment_nbytes, cfg.allreduce_small_nbytes,
                                    cfg.broadcast_small_nbytes),
                arena_slot_nbytes=cfg.arena_slot_nbytes))
        # Its shared arena and memory, and which ranks share a host (hier), if any.
        self._topology = self.context.attach(self._transport)
        self._notes = AbortNotes(self._store, rank)

        self._lock = threading.Lock()
        # The next number (from 1, as torch's) and more: fused_step.GROUP_WORDS
        self._fast_words = np.zeros(GROUP_WORDS, np.int64)
        self._word = memoryview(self._fast_words)
        self._word[GROUP_SEQ] = 1
        self._order = 0  # every submitted call's place in this rank's order
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._inflight: dict[int, Work] = {}  # by order
        self._arena_order = ArenaOrder(rank)  # the shared arena's calls run in submission order
        self._fast_held = None  # a fused call in progress: promote() it before any other
        self.repeats = Repeats(self) if world_size > 1 and self._transport.arena else None
        self._poisoned: str | None = None
        self._closed = False
        self._global_rank = rank  # in the default group: see set_global_ranks
        fr = flight_recorder.recorder()
        self._recorder = fr
        self._pg_id = (fr.register_group(f"{opts.group_name}/{generation}",
                                         f"{self.transport_kind} group of {world_size}",
                                         list(range(world_size)))
                       if fr is not None else -1)
        self._done = Finished(getattr(self._transport, "mailbox", None), rank,
                              fr, self._pg_id)  # mismatches found late
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
        self.context.set_timeout(timeout_seconds(timeout, "set_timeout"))
        self.options.timeout = timeout
        if self.repeats is not None:  # (their plans hold the old deadline)
            self.repeats.clear()

    _set_default_timeout = set_timeout  # torch's private name, used by ported tests

    def sequence_number(self) -> int:
        """How many collectives this group has numbered so far (equal on every
        rank; the last one's ``collective #N``), as torch's
        ``_get_sequence_number_for_group``."""
        with self._lock:
            return self._word[GROUP_SEQ] - 1

    def _choose_transport(self) -> str:
        here = f"{transports.host_key()}:{os.getpid()}"
        self._store.set(f"where/{self._rank}", here)
        places = [self._store.get(f"where/{r}").decode() for r in range(self._size)]
        if self._store.add("where/read", 1) == self._size:
            # Every rank has read every place: a store shared by many groups
            # (sub-groups come and go) need not keep them.
            for key in [f"where/{r}" for r in range(self._size)] + ["where/read"]:
                forget(self._store, key)
        return transports.choose_kind(here, places)

    def set_global_ranks(self, ranks: list[int]) -> None:
        """The default group's ranks of this group's ranks (``new_group`` tells
        them), for the flight recorder's records and configuration."""
        self._global_rank = ranks[self._rank]
        if self._recorder is not None:
            self._recorder.set_group_ranks(self._pg_id, ranks)

    # -- the collectives: each checks on this thread, then submit() -----------------
    def allreduce(self, arrays, opts=None, *, op=None, blocking: bool = False):
        """Reduce ``arrays`` (one array, or same-shape arrays reduced locally
        first) across ranks; every array of every rank gets the result."""
        call, run = reductions.allreduce(self.context, arrays, opts, op)
        return self.submit(call, run, blocking)

    def allreduce_coalesced(self, arrays, opts=None, *, blocking: bool = False):
        """Allreduce a list of arrays of one dtype and any shapes as one message."""
        call, run = reductions.allreduce_coalesced(self.context, arrays, opts)
        return self.submit(call, run, blocking)

    def reduce(self, arrays, opts=None, *, op=None, root=None, blocking: bool = False):
        """Reduce into ``arrays[opts.root_tensor]`` of rank ``opts.root_rank``
        (``root`` overrides it); other ranks' arrays are left unchanged."""
        call, run = reductions.reduce(self.context, arrays, opts, op, root)
        return self.submit(call, run, blocking)

    def reduce_scatter(self, output_list, input_lists, opts=None, *, blocking: bool = False):
        """Rank r gets the reduction over ranks of ``input_lists[0][r]`` in ``output_list[0]``."""
        call, run = reductions.reduce_scatter(self.context, output_list, input_lists, opts)
        return self.submit(call, run, blocking)

    def reduce_scatter_tensor(self, output, input, opts=None, *, blocking: bool = False):
        """Rank r gets the reduction of the r-th of ``world_size`` equal slices
        of every rank's ``input`` (``input.size == output.size * world_size``)."""
        call, run = reductions.reduce_scatter_tensor_coalesced(self.context, output, input,
                                                               opts, name="reduce_scatter_tensor")
        return self.submit(call, run, blocking)

    _reduce_scatter_base = reduce_scatter_tensor  # torch's older name

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None, *,
                                        blocking: bool = False):
        """``reduce_scatter_tensor`` for several (output, input) pairs in one ring."""
        call, run = reductions.reduce_scatter_tensor_coalesced(self.context, outputs,
                                                               inputs, opts)
        return self.submit(call, run, blocking)

    def broadcast(self, arrays, opts=None, *, root=None, blocking: bool = False):
        """Copy ``arrays[opts.root_tensor]`` of rank ``opts.root_rank`` (``root``
        overrides it) into every array on every rank."""
        call, run = movement.broadcast(self.context, arrays, opts, root)
        return self.submit(call, run, blocking)

    def allgather(self, output_lists, input_list, opts=None, *, blocking: bool = False):
        """Every rank's inputs, in rank order, into every output list (n inputs:
        each of the n output lists holds n * world_size arrays)."""
        call, run = movement.allgather(self.context, output_lists, input_list, opts)
        return self.submit(call, run, blocking)

    def allgather_coalesced(self, output_lists, input_list, opts=None, *,
                            blocking: bool = False):
        """``output_lists[r][j]`` receives rank r's ``input_list[j]`` (any shapes, one dtype)."""
        call, run = movement.allgather_coalesced(self.context, output_lists, input_list, opts)
        return self.submit(call, run, blocking)

    def allgather_into_tensor(self, output, input, opts=None, *, blocking: bool = False):
        """``output`` (``world_size`` times ``input``'s size) gets every rank's
        ``input`` back to back, in rank order."""
        call, run = movement.allgather_into_tensor_coalesced(self.context, output, input,
                                                             opts, name="allgather_into_tensor")
        return self.submit(call, run, blocking)

    _allgather_base = allgather_into_tensor  # torch's older name

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None, *,
                                        blocking: bool = False):
        """``allgather_into_tensor`` for several (output, input) pairs in one ring."""
        call, run = movement.allgather_into_tensor_coalesced(self.context, outputs, inputs,
                                                             opts)
        return self.submit(call, run, blocking)

    def gather(self, output_lists, input_list, opts=None, *, blocking: bool = False):
        """The root's ``output_lists[0][r]`` receives rank r's ``input_list[0]``
        (non-roots pass ``[]``)."""
        call, run = movement.gather(self.context, output_lists, input_list, opts)
        return self.submit(call, run, blocking)

    def scatter(self, output_list, input_lists, opts=None, *, blocking: bool = False):
        """Rank r's ``output_list[0]`` receives the root's ``input_lists[0][r]``
        (non-roots pass ``[]``)."""
        call, run = movement.scatter(self.context, output_list, input_lists, opts)
        return self.submit(call, run, blocking)

    def alltoall(self, output_list, input_list, opts=None, *, blocking: bool = False):
        """Rank r's ``input_list[q]`` lands in rank q's ``output_list[r]``."""
        call, run = exchange.alltoall(self.context, output_list, input_list, opts)
        return self.submit(call, run, blocking)

    def alltoall_base(self, output, input, output_split_sizes=None, input_split_sizes=None,
                      opts=None, *, blocking: bool = False):
        """``input`` split along dim 0 (equally or by ``input_split_sizes``):
        block q to rank q; rank r's block lands in ``output``'s r-th block."""
        call, run = exchange.alltoall_base(self.context, output, input, output_split_sizes,
                                           input_split_sizes, opts)
        return self.submit(call, run, blocking)

    # -- running calls ----------------------------------------------------------------
    def submit(self, call: Call, run: Callable, blocking: bool = False, publish=None) -> Work:
        """Number ``call`` and run ``run(comm, work)`` for it; its return value
        becomes the future's value.

        Collectives take the next sequence number (in call order, under the
        lock, so the n-th collective is number n on every rank); sends and
        receives (``call.collective`` false) are matched by tag and take none.

        ``blocking=False`` returns the :class:`Work` at once. ``blocking=True``
        returns it once the call has completed (raising its error, as
        ``Work.wait()`` would), and runs it right here when the group has
        nothing in flight (every collective method takes ``blocking=``, for a
        caller that will wait at once: the module API, the torch backend).
        That keeps each rank's order: nothing in flight means every earlier
        call of this group on this rank has completed, so this one overtakes
        nothing, and the check is made under the lock that hands out sequence
        numbers, so a later call from another thread finds this one in flight
        and is queued behind it. The caller would block anyway and is not one
        of the group's workers, so running here holds up nothing the queued
        path would not: it skips the queue and the worker wake-up. A
        persistent start's ``publish(comm)`` runs here when nothing is in
        flight; its Work is then *held* (on no queue) until ``wait()``.
        """
        with self._lock:
            if self._poisoned is not None or self._closed:
                self._refuse(call.name)
            # No fused call claims from here on (they claim without the lock,
            # holding the GIL; this call will be in flight); one claimed or
            # held goes first.
            self._word[GROUP_BLOCKED] = 1
            if self._fast_held is not None or self._word[GROUP_CLAIMED]:
                take_back(self, call.name)
            seq = -1
            if call.collective:
                seq = self._word[GROUP_SEQ]
                self._word[GROUP_SEQ] = seq + 1
            work = Work(call.name, seq, call=call)
            here = blocking and not self._inflight
            held = publish is not None and not self._inflight
            if self._recorder is not None:
                work.record = self._recorder.record(self._pg_id, self._global_rank, seq, call,
                                                    started=here or held)
            work.order = order = self._order
            self._order = order + 1
            self._inflight[order] = work  # (either way: another thread's shutdown waits)
            if call.algorithm in ARENA:
                self._arena_order.ticket(work, queued=not here)
            if not here:
                work._queued(self._execute, run)
                if not held:
                    self._queue.put((work, run))
        if held:
            comm = Comm(self._transport, seq, call, self._notes, work.record, self._topology)
            work._run = persistent.first_half(publish, comm, run)
        elif here:
            error = self._execute(work, run)
            if error is not None:
                raise error
        elif blocking:
            work.wait()
        return work

    def _usable(self) -> str | None:
        """Why this group can run nothing more (None while it can)."""
        if self._poisoned is not None:
            return self._poisoned
        return "the group was shut down" if self._closed else None

    def _refuse(self, op_name: str) -> None:
        if self._closed:
            raise NumcollError(f"{op_name}: the process group on rank {self._rank} was shut down")
        raise self._poison_class(
            f"{op_name}: the process group on rank {self._rank} is unusable because "
            f"{self._poisoned}; create a new group, or {SHRINK_HINT}")

    def _worker_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _SHUTDOWN:
                return
            work, run = item
            if work._claim():  # else a waiting caller already ran it
                self._execute(work, run)

    def _execute(self, work: Work, run: Callable) -> BaseException | None:
        """Run one work and complete its future (returning its error, if any):
        the one place work runs, on a worker, on a caller waiting for it, or
        on a blocking caller."""
        record, call, done = work.record, work.call, self._done
        error = result = comm = None
        try:
            if self._poisoned is not None:
                raise self._poison_class(
                    f"{work.op_name} (collective #{work.seq}) on rank {self._rank} was not "
                    f"run because {self._poisoned}")
            if self._closed:
                raise NumcollError(f"{work.op_name} on rank {self._rank}: the process "
                                   "group was shut down before it ran")
            if call.after_earlier:  # a barrier
                with self._lock:
                    earlier = [w for k, w in self._inflight.items() if k < work.order]
                wait_for_earlier(work, earlier, self._rank)
            # A call run where it was submitted (``here``: nothing in flight) has
            # the turn already: every earlier ticket ended before it was issued.
            if work.arena_ticket >= 0 and work._execute is not None:
                self._arena_order.take_turn(work, self._usable)
            if record is not None and record.time_started_ns is None:
                self._recorder.started(record)
            comm = Comm(self._transport, work.seq, call, self._notes, record, self._topology)
            held, key = done.mailbox, work.seq & SEQ_MASK  # messages no call took yet:
            if held.held_calls and held.oldest_call < key:  # any of a finished call?
                done.check(work.seq, call, False, self._lowest_in_flight())
            result = run(comm, work)
            if held.held_calls and held.oldest_call <= key:
                done.check(work.seq, call, True, self._lowest_in_flight())
        except BaseException as exc:  # noqa: BLE001 - delivered through the Work
            alone = comm is not None and comm.alone(exc)  # then the group is not poisoned
            error = exc if alone else self._fail(
                work, done.explain(work.seq, call, exc, self._lowest_in_flight()))
        if work.arena_ticket >= 0:
            self._arena_order.end_turn(work)
        if record is not None:
            self._recorder.ended(record, error)
        with self._lock:
            self._inflight.pop(work.order, None)
            if not self._inflight:  # (update_blocked: no call is held while one is in flight)
                self._word[GROUP_BLOCKED] = self._poisoned is not None or self._closed
        future = work.future
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
        return error

    def _lowest_in_flight(self) -> int:  # of a collective (``_inflight`` is in order)
        with self._lock:
            return next((w.seq for w in self._inflight.values() if w.seq > 0),
                        self._word[GROUP_SEQ])

    def _fail(self, work: Work, exc: BaseException) -> BaseException:
        """Record a failed work; the first failure poisons and aborts the group.

        Aborting closes the transport, so peers blocked on this rank fail at
        once (naming it, with the reason published in the store) instead of
        waiting out their deadlines. Work that fails because of the abort
        reports the original cause.
        """
        if isinstance(exc, GroupPoisonedError) or self._closed:
            return exc
        exc = self._revoked_error(work, exc)  # a peer's revoke makes it a GroupRevokedError
        with self._lock:
            first = self._poisoned is None
            if first:
                what = f"collective #{work.seq}" if work.seq >= 0 else "point-to-point op"
                self._poisoned = f"{work.op_name} ({what}) failed on rank {self._rank}: {exc}"
                update_blocked(self)
        if first:
            # The culprit is the rank that caused it (a dead or stalled peer, or
            # the one whose failure reached us through its neighbour), so that
            # every rank's error leads with the same rank.
            peer = getattr(exc, "peer", None)
            culprit = peer if peer is not None else self._rank
            mismatch = (getattr(exc, "mismatch", None) or str(exc)) \
                if isinstance(exc, CollectiveMismatchError) else None
            self._abort(getattr(exc, "root_reason", None) or self._poisoned, culprit, mismatch)
            flight_recorder.dump_on_failure(self._recorder, self._global_rank)
            return exc
        poisoned = self._poison_class(
            f"{work.op_name} (collective #{work.seq}) on rank {self._rank} did not complete "
            f"because {self._poisoned} (its own error: {exc})")
        poisoned.__cause__ = exc
        return poisoned

    def _abort(self, reason: str, culprit: int, mismatch: str | None = None) -> None:
        self._notes.publish(culprit, reason, mismatch)
        self._transport.close()
        self._arena_order.wake()

    # -- lifecycle ---------------------------------------------------------------
    def abort(self, reason: str = "aborted by the caller") -> None:
        """Abort the group now (torch: ``ProcessGroup.abort``): poison it, tell
        the peers why, and fail pending work; peers blocked on this rank fail
        at once naming it. ``shutdown()`` still releases the threads."""
        with self._lock:
            if self._closed or self._poisoned is not None:
                return
            self._poisoned = f"rank {self._rank} aborted the group: {reason}"
            update_blocked(self)
        self._abort(self._poisoned, self._rank)

    def shutdown(self) -> None:
        """Finish queued work (bounded), then close the transport and join the
        worker threads. Leaves no thread, socket or file behind. Idempotent."""
        with self._lock:
            if self._closed:
                return
            take_back(self, "shutdown", give_up_s=min(self.context.timeout_s, _SHUTDOWN_DRAIN_S))
            pending = list(self._inflight.values())
            for w in pending:  # held starts (see submit) are on no queue: a worker runs them
                if w._claim_lock is not None:
                    self._queue.put((w, w._run))
        drain_deadline = time.monotonic() + min(self.context.timeout_s, _SHUTDOWN_DRAIN_S)
        for w in pending:
            remaining = drain_deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                w.get_future().wait(remaining)
            except BaseException:  # noqa: BLE001 - the caller sees it through the Work
                pass
        self._leave()
        with self._lock:
            self._closed = True
            update_blocked(self)
        # Closing the transport fails every pending wait at once, so workers
        # stuck on a peer return promptly.
        self._transport.close()
        self._arena_order.wake()
        for _ in self._workers:
            self._queue.put(_SHUTDOWN)
        for w in self._workers:
            w.join(timeout=5.0)
        self.context.plans.clear()
        self.repeats = None  # (small calls fused when they repeat: numcoll.fast)
        if self._recorder is not None:  # its records may stay; its table entry goes with them
            self._recorder.release_group(self._pg_id)

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __repr__(self):
        return (f"<numcoll.ProcessGroup rank={self._rank} size={self._size} "
                f"transport={self.transport_kind}>")
