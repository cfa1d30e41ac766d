"""Comm: one collective's view of the transport.

A Comm binds the collective's sequence number (every message tag carries it,
so concurrent collectives never see each other's messages), its deadline and
its name. Transport exceptions are translated into numcoll's errors here and
nowhere else, with messages that say what was waited for, how long, and
between which ranks.
"""

from __future__ import annotations

import time

from transports import (
    CALL_SHIFT,
    MessageSizeError,
    PeerClosed,
    SingleCopyRefused,
    StampMismatch,
    TransportClosed,
    TransportError,
    TransportTimeout,
)
# The single-copy exchange's layout, for the algorithms that build its rows and
# read its *where* (the transport's, defined once: Comm.single_copy_exchange).
from transports.shm.single_copy_steps import READ as COPY_READ
from transports.shm.single_copy_steps import WHERE_HEADER_NBYTES
from transports.shm.single_copy_steps import WRITE as COPY_WRITE

from .call import SEQ_MASK, Call
from .diagnostics.abort_notes import AbortNotes, abort_note, note_mismatch, read_note
from .diagnostics.mismatch import AGREE, both_calls, settings_hint
from .errors import CollectiveMismatchError, CollectiveTimeoutError, NumcollError, PeerError
from .logs import get_logger

__all__ = ["Comm", "AbortNotes", "COPY_READ", "COPY_WRITE", "WHERE_HEADER_NBYTES",
           "collective_tag", "p2p_tag", "abort_note", "MAX_STEP",
           "MAX_USER_TAG"]

_STEP_BITS = CALL_SHIFT  # so the transport knows which tags belong to one call
MAX_STEP = (1 << _STEP_BITS) - 1
_P2P_BIT = 1 << 63
MAX_USER_TAG = _P2P_BIT - 1
_log = get_logger("comm")


def collective_tag(seq: int, step: int) -> int:
    """Tag of message ``step`` of collective number ``seq`` (seq wraps at 2**31)."""
    if not 0 <= step <= MAX_STEP:
        raise ValueError(f"step {step} out of range")
    return ((seq & SEQ_MASK) << _STEP_BITS) | step


def p2p_tag(user_tag: int) -> int:
    """Tag of a point-to-point send/recv: a namespace of its own (bit 63 set),
    so user tags never collide with collective traffic."""
    if not 0 <= user_tag <= MAX_USER_TAG:
        raise ValueError(f"tag must be in [0, {MAX_USER_TAG}], got {user_tag}")
    return _P2P_BIT | user_tag


class Pending:
    """A posted send/recv, with what the error message needs to know."""

    __slots__ = ("request", "peer", "what", "step")

    def __init__(self, request, peer: int, what: str, step: int | None):
        self.request, self.peer, self.what, self.step = request, peer, what, step

    @property
    def source(self) -> int | None:
        return self.request.source


# After a timeout, how long to wait for the awaited peer's abort note (which
# names the rank it was stuck on); only a failing collective pays it.
_STALL_NOTE_WAIT_S = 1.0


#: What a survivor's error says it can do (numcoll.recovery).
_SHRINK = "the survivors can continue without it: nc.shrink_group()"


def _hinted(text: str) -> str:
    """``text`` ending with what the survivors can do (said once)."""
    return text if "nc.shrink_group()" in text else f"{text}; {_SHRINK}"


class Comm:
    """Send/recv by (peer, step) for one collective, waits bounded by its deadline.

    Every message carries the call's stamp (:meth:`numcoll.call.Call.stamp`);
    a receive whose peer is running another call fails with
    :class:`~numcoll.errors.CollectiveMismatchError` instead of taking its bytes.
    """

    #: Whether a timeout looks for the rank the peer was stuck on (a monitored
    #: barrier's timeouts are its answer, not a failure to explain).
    follow_stalls = True

    def __init__(self, transport, seq: int, call: Call, notes: AbortNotes | None = None,
                 record=None, topology=None):
        # One is built for every collective run: plain assignments only.
        self.transport = transport
        #: Which ranks share a host (:class:`numcoll.algorithms.levels.Topology`,
        #: groups over several hosts), else None.
        self.topology = topology
        self.rank, self.size = transport.rank, transport.size
        self.seq = seq if seq > 0 else 0
        self.call = call
        self.op_name = call.name
        self.timeout_s = timeout_s = call.timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.stamp = call.stamp
        self._notes = notes
        self._record = record  # the flight recorder's entry: waiting_for is kept current
        #: Whether the call has posted a message or taken an arena step: until
        #: then nothing left this rank, and a failure concerns this rank alone.
        self.started = False

    def alone(self, exc: BaseException) -> bool:
        """Whether ``exc`` concerns this rank alone: raised before anything left
        it (a MemoryError while the call prepared its buffers, say), so ranks
        that all fail alike are still in step and the group need not be poisoned."""
        return not self.started and isinstance(exc, Exception) \
            and not isinstance(exc, NumcollError)

    # -- posting ----------------------------------------------------------------
    def isend(self, peer: int, step: int, buf) -> Pending:
        return self._post(self.transport.isend, peer, collective_tag(self.seq, step), buf,
                          "send", step)

    def irecv(self, peer: int, step: int, buf=None) -> Pending:
        self.started = True
        try:
            request = self.transport.irecv(peer, collective_tag(self.seq, step), buf,
                                           self.stamp, True)
        except TransportError as exc:
            raise self._translate(exc, peer, "recv") from exc
        return Pending(request, peer, "recv", step)

    def isend_tagged(self, peer: int, tag: int, buf) -> Pending:
        return self._post(self.transport.isend, peer, tag, buf, "send", None)

    def irecv_tagged(self, peer: int, tag: int, buf=None) -> Pending:
        return self._post(self.transport.irecv, peer, tag, buf, "recv", None)

    def _post(self, fn, peer, tag, buf, what, step) -> Pending:
        self.started = True
        try:
            return Pending(fn(peer, tag, buf, self.stamp), peer, what, step)
        except TransportError as exc:
            raise self._translate(exc, peer, what) from exc

    # -- waiting ----------------------------------------------------------------
    def wait(self, pending: Pending):
        """Wait for ``pending`` until the collective's deadline; return what the
        transport returns (the message for a receive posted without a buffer)."""
        record = self._record
        if record is not None:
            record.waiting_for, record.waiting_op = pending.peer, pending.what
        try:
            return pending.request.wait(self.deadline)
        except TransportError as exc:
            raise self._translate(exc, pending.peer, pending.what) from exc

    def wait_all(self, pendings) -> None:
        for p in pendings:
            self.wait(p)

    def sendrecv(self, send_peer: int, recv_peer: int, step: int, send_buf, recv_buf=None):
        """Exchange: post the receive, then the send, wait for both (no deadlock
        when both sides call it at once: nothing blocks before both are posted)."""
        r = self.irecv(recv_peer, step, recv_buf)
        s = self.isend(send_peer, step, send_buf)
        data = self.wait(r)
        self.wait(s)
        return data

    # -- the shared arena (a capability some transports declare) -----------------
    @property
    def arena_slot_nbytes(self) -> int:
        """Payload bytes per rank and step of the transport's shared arena
        (:mod:`transports.shm.arena`): what one step can carry."""
        return self.transport.arena.slot_nbytes

    def next_slot(self):
        """This rank's slot (a uint8 array) for the arena's next step, to write
        a payload in place before :meth:`shared_step` publishes it."""
        self.started = True
        arena = self.transport.arena
        return arena.mine(arena.next_step)

    def shared_step(self, payload=None, nbytes: int | None = None) -> int:
        """One step of the shared arena: publish ``payload`` (uint8; or, with
        None, the ``nbytes`` already written into ``arena.mine(arena.next_step)``)
        and wait until every rank has published its part of the same step of
        the same call. Returns the step, for :meth:`shared_view`."""
        self.started = True
        record = self._record
        if record is not None:
            record.waiting_for, record.waiting_op = None, "arena"
        try:
            # The call's key in ring tags (collective_tag(seq, step) >> CALL_SHIFT).
            return self.transport.arena.step(payload, self.seq, self.stamp, self.deadline,
                                             self.seq & SEQ_MASK, nbytes)
        except TransportError as exc:
            raise self._translate(exc, exc.peer, "arena") from exc

    def shared_publish(self, payload=None, nbytes: int | None = None) -> int:
        """The first half of :meth:`shared_step`: publish this rank's part of
        the next step, without waiting for the others (it never blocks).
        Returns the step, for :meth:`shared_wait`."""
        self.started = True
        try:
            return self.transport.arena.put(payload, self.seq, self.stamp, nbytes)
        except TransportError as exc:
            raise self._translate(exc, exc.peer, "arena") from exc

    def shared_wait(self, step: int) -> None:
        """The second half of :meth:`shared_step`: wait until every rank has
        published ``step`` of this call (the call's deadline bounds it)."""
        self.started = True
        record = self._record
        if record is not None:
            record.waiting_for, record.waiting_op = None, "arena"
        try:
            self.transport.arena.wait(step, self.seq, self.stamp, self.deadline,
                                      self.seq & SEQ_MASK)
        except TransportError as exc:
            raise self._translate(exc, exc.peer, "arena") from exc

    def shared_slots(self) -> list:
        """Every rank's whole slot in each of the arena's two sets (``[set][rank]``,
        uint8; set ``step % 2`` for a step), to read call after call (a persistent
        request): a step's stamp fixes every rank's byte count."""
        arena = self.transport.arena
        try:
            return [[arena.view(s, r) for r in range(self.size)] for s in (0, 1)]
        except TransportError as exc:
            raise self._translate(exc, None, "arena") from exc

    def shared_view(self, step: int, peer: int, start: int, nbytes: int):
        """Bytes ``start:start + nbytes`` of what ``peer`` published at ``step``
        (read in place: valid until this rank's step after next); a peer that
        published fewer bytes fails as a wrong-size message."""
        arena = self.transport.arena
        try:
            published = arena.nbytes(step, peer)
            if start + nbytes > published:
                raise MessageSizeError(f"rank {peer} published {published} bytes, this rank "
                                       f"reads bytes {start}..{start + nbytes}", peer)
            return arena.view(step, peer, start, nbytes)
        except TransportError as exc:
            raise self._translate(exc, peer, "recv") from exc

    def published_nbytes(self, step: int, peer: int) -> int:
        """How many bytes ``peer`` published at ``step`` of the arena."""
        try:
            return self.transport.arena.nbytes(step, peer)
        except TransportError as exc:
            raise self._translate(exc, peer, "arena") from exc

    # -- single-copy reads (a capability some transports declare) ---------------------
    def read_peer(self, peer: int, address: int, out) -> str | None:
        """Copy ``out.nbytes`` bytes from ``address`` in ``peer``'s memory into
        ``out`` (uint8, C-contiguous), in one copy (the transport's
        ``single_copy``). Returns None, or why the kernel refused the read (the
        algorithm then finishes the call another way)."""
        return self._single_copy(self.transport.single_copy.read, peer, address, out, "recv")

    def single_copy_usable(self) -> bool:
        """Whether this group's ranks may read each other's memory now: its
        transport offers single-copy reads and no call has found one refused
        (what every rank knows alike: :meth:`refuse_single_copy`)."""
        single_copy = getattr(self.transport, "single_copy", None)
        return single_copy is not None and single_copy.usable

    def read_sum_peers(self, peers, addresses, mine, scratch, piece: int, start: int) -> int:
        """:meth:`read_peer` of every one of ``peers``' ranges (at
        ``addresses``), a piece of ``piece`` elements at a time into
        ``scratch``, each piece added into ``mine`` at once, in one compiled
        call from element ``start``. Returns the elements of ``mine`` summed:
        where that is fewer, a read failed or copies are off (the caller goes
        on with :meth:`read_peer`, which says why)."""
        self.started = True
        return self.transport.single_copy.read_sum(peers, addresses, mine, scratch, piece, start)

    def write_peer(self, peer: int, address: int, data) -> str | None:
        """:meth:`read_peer`'s other direction: copy ``data`` (uint8,
        C-contiguous) to ``address`` in ``peer``'s memory, a range ``peer``
        published for this rank to fill."""
        return self._single_copy(self.transport.single_copy.write, peer, address, data, "send")

    def single_copy_exchange(self, where, copies) -> tuple[str, int] | None:
        """Both arena steps of a single-copy call and its copies, compiled:
        :meth:`transports.shm.single_copy.SingleCopy.exchange`."""
        self.started, t = True, self.transport
        try:
            return t.single_copy.exchange(t.arena, self.seq, self.stamp, where, copies,
                                          self.deadline)
        except TransportError as exc:
            raise self._translate(exc, exc.peer, "arena") from exc

    def single_copy_tuning(self) -> dict:
        """A dict the single-copy algorithms keep with the group (rank 0's
        times of single copy and of the arena, by kind of call)."""
        return self.transport.single_copy.tuning

    def _single_copy(self, copy, peer: int, address: int, here, kind: str) -> str | None:
        self.started = True
        try:
            copy(peer, address, here)
        except SingleCopyRefused as exc:
            return str(exc)
        except TransportError as exc:
            raise self._translate(exc, peer, kind) from exc
        return None

    def refuse_single_copy(self, reason: str) -> None:
        """Every rank agreed, in this call, that a single-copy read was refused:
        later reads fail at once (their calls finish through the arena); the
        first refusal is logged with ``reason``."""
        if self.transport.single_copy.refuse(reason):
            _log.warning("%s (collective #%d) on rank %d: a single-copy read was refused; "
                         "this call and later single-copy calls finish through the arena "
                         "(NUMCOLL_SINGLE_COPY=0 chooses the arena from the start): %s",
                         self.op_name, self.seq, self.rank, reason)

    def ran_instead(self, algorithm: str) -> None:
        """This call finished by ``algorithm``, not the algorithm it was
        chosen with (every rank agreed on a fallback): the flight recorder's
        entry, and so the bench's algorithm column, says what ran."""
        record = self._record
        if record is not None:
            record.algorithm = algorithm

    # -- shared arrays (a capability some transports declare) ------------------------
    def shared_array(self, peer: int, key: int, start: int, nbytes: int):
        """Bytes ``start:start + nbytes`` of ``peer``'s part of the group's
        shared allocation ``key`` (uint8; :mod:`numcoll.memory.shared`), to
        read -- or write -- in place. A part this rank does not map (released
        here, or never allocated) fails naming the peer."""
        part = self.transport.shared_memory.part(key, peer)
        if part is None or start < 0 or start + nbytes > part.size:
            where = f"{self.op_name} (collective #{self.seq}) on rank {self.rank}"
            raise CollectiveMismatchError(
                f"{where}: rank {peer} passed bytes {start}..{start + nbytes} of its shared "
                f"array #{key}, which this rank does not map; every rank must pass shared "
                "arrays of this group, kept alive on every rank alike", peer=peer)
        return part[start:start + nbytes]

    def size_mismatch(self, peer: int, detail: str):
        """Fail as a wrong-size message from ``peer`` (for algorithms that learn
        the sizes a peer uses from what it published)."""
        raise self._translate(MessageSizeError(detail, peer), peer, "recv")

    def _stall_behind(self, peer: int | None) -> tuple[int | None, str | None, list | None]:
        """After a timeout on ``peer``: the stalled rank at the end of the chain
        of ranks waiting for each other, if it is not ``peer`` itself, and the
        reason its waiter gave; or, where the chain comes back to a rank on it
        (this one included), the waits in order, from this rank to the rank
        met again: then no rank stalled -- each rank of that loop timed out
        waiting for the next, for a message that was lost or never sent.

        Every rank whose wait times out first says whom it waited for (its
        abort note), then follows the others' notes: rank 2 waited for 1, 1
        for 0, 0 for 3, and 3 says nothing -- it is the one that stalled.
        Deadlines along such a chain pass at about the same moment, so a note
        is given :data:`_STALL_NOTE_WAIT_S` to appear.
        """
        if self._notes is None or peer is None or not self.follow_stalls:
            return None, None, None
        self._notes.publish(peer, f"{self.op_name} (collective #{self.seq}) on rank "
                                  f"{self.rank} timed out waiting for rank {peer}")
        chain, reason = [self.rank, peer], None  # each rank waited for the next
        give_up = time.monotonic() + _STALL_NOTE_WAIT_S
        while True:
            culprit, why = read_note(self._notes.read(chain[-1]))
            if culprit is None:
                if time.monotonic() >= give_up:
                    break  # the last rank never said whom it waited for: it stalled
                time.sleep(0.02)
                continue
            if culprit == chain[-1]:
                break  # it failed because of itself
            if culprit in chain:  # 1 waited for 3 and 3 for 1: neither stalled
                return None, why, chain + [culprit]
            chain.append(culprit)
            reason = why
        return (chain[-1], reason, None) if len(chain) > 2 else (None, None, None)

    # -- the one place transport errors become numcoll errors ---------------------
    def _translate(self, exc: TransportError, peer: int | None, what: str) -> NumcollError:
        where = f"{self.op_name} (collective #{self.seq}) on rank {self.rank}"
        peer = exc.peer if exc.peer is not None else peer
        direction = "from" if what in ("recv", "arena") else "to"
        # What this rank was waiting for, in words.
        waited = (f"rank {peer} did not publish its part of a shared-arena step"
                  if what == "arena" else f"{what} {direction} rank {peer} did not complete")
        if getattr(exc, "unreleased", False):  # the message left; its completion did not
            waited = (f"send to rank {peer} was taken by ZeroMQ, which never reported its "
                      "buffer released (a zero-copy send: the message may well have arrived)")
        if isinstance(exc, StampMismatch):
            remote_seq = getattr(exc, "remote_seq", None)
            mine, theirs = both_calls(self.call, self.seq, exc.remote_stamp,
                                       self.seq if remote_seq is None else remote_seq)
            return CollectiveMismatchError(
                f"Detected mismatch between collectives on ranks. Rank {self.rank} is running "
                f"{mine}, but rank {peer} is running {theirs}; no data was exchanged. "
                f"{AGREE}" + settings_hint(self.call.stamp, exc.remote_stamp), peer=peer)
        if isinstance(exc, TransportTimeout):
            ms = round(self.timeout_s * 1000)
            culprit, reason, path = self._stall_behind(peer)
            if path is not None:  # a loop: naming one of its ranks as stalled would mislead
                loop = sorted(path[path.index(path[-1]):-1])
                return CollectiveTimeoutError(
                    f"Timed out waiting {ms}ms for {where}: {waited}; no rank stalled: ranks "
                    f"{', '.join(map(str, loop[:-1]))} and {loop[-1]} timed out waiting for "
                    f"each other ({' -> '.join(map(str, path))}), for a message lost or never "
                    f"sent (calls in a different order?): {reason}", peer=peer)
            if culprit is not None:
                # The peer timed out too, waiting for someone further along: name
                # the rank at the end of that chain, as the peer's note does.
                err = CollectiveTimeoutError(
                    f"Timed out waiting {ms}ms for {where}: rank {culprit} stalled, and rank "
                    f"{peer}, which this rank waited for ({waited}), timed out waiting for "
                    f"it: {reason}", peer=culprit)
                err.root_reason = reason
                return err
            return CollectiveTimeoutError(
                f"Timed out waiting {ms}ms for {where}: {waited} (the peer may not have "
                f"called {self.op_name}, or called collectives in a different order)",
                peer=peer)
        if isinstance(exc, PeerClosed):
            note = self._notes.read(peer) if self._notes and peer is not None else None
            culprit, reason = read_note(note)
            mismatch = note_mismatch(note)
            if mismatch is not None:
                # Ranks ran different calls: every rank fails with the mismatch,
                # in torch's words, whichever rank saw it first.
                err = CollectiveMismatchError(
                    f"{mismatch} ({where} learned it from rank {peer}, which aborted the "
                    "group)", peer=culprit if culprit not in (None, self.rank) else peer)
                err.root_reason, err.mismatch = reason, mismatch
                return err
            if culprit == self.rank:  # the peer aborted because of this rank
                err = PeerError(f"{where}: rank {peer} aborted the group because of this "
                                f"rank: {reason}", peer=peer)
                err.root_reason = reason
                return err
            if culprit is not None and culprit != peer:
                # Lead with the rank that caused it, not the neighbour that passed it on.
                err = PeerError(f"{where}: rank {culprit} left or failed, and rank {peer} "
                                f"aborted the group because of it: {_hinted(reason)}",
                                peer=culprit)
                err.root_reason = reason  # passed on as it is if this rank aborts too
                return err
            why = f"; rank {peer} had aborted the group: {reason}" if reason else ""
            return PeerError(_hinted(f"{where}: rank {peer} is gone: {exc}{why}"), peer=peer)
        if isinstance(exc, TransportClosed):
            return NumcollError(f"{where}: this rank's process group was shut down or "
                                f"aborted: {exc}")
        if isinstance(exc, MessageSizeError):
            return PeerError(
                f"{where}: message {direction} rank {peer} has the wrong size ({exc}); "
                "ranks passed arrays of different sizes or dtypes", peer=peer)
        return NumcollError(f"{where}: transport error with rank {peer}: {exc}")
