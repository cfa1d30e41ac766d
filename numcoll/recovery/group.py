"""What a group does to survive a dead rank: ``revoke``, ``agree``, ``shrink``
and ``old_ranks`` -- the ProcessGroup's part of Open MPI ULFM's verbs.

:class:`Recoverable` is a base of :class:`numcoll.ProcessGroup`; the group
calls three hooks (:meth:`Recoverable._recovery_init` when it is made,
:meth:`Recoverable._revoked_error` on its first failures,
:meth:`Recoverable._leave` when it shuts down). Everything here goes through
the group's store, never its transport: a failure has closed it.

Policy -- when to shrink, how to re-shard -- stays with the caller (see
``numcoll/examples/elastic_training.py``).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from datetime import timedelta

from ..bootstrap.store import PrefixStore
from ..errors import GroupPoisonedError, GroupRevokedError, NumcollError
from ..fast.step import update_blocked
from .agreement import agree_in_store
from .liveness import Liveness

__all__ = ["Recoverable", "REVOKED", "SHRINK_HINT"]

#: Store key (in the group's keys) that says the group was revoked, and why.
REVOKED = "ft/revoked"
#: What an error says when the group lost a rank.
SHRINK_HINT = ("the survivors can continue without it: call nc.shrink_group() (or "
               "pg.shrink()) on every surviving rank")
#: How long a failing call waits for the store to say whether the group was
#: revoked (the store may have died with its host).
_STORE_LOOK_S = 0.25


def _bounded(fn, wait_s: float):
    """``fn()`` on a daemon thread, waiting at most ``wait_s``: its value, or
    None if it raised or did not finish (a dead store must not hold up an error)."""
    out: list = []

    def run():
        try:
            out.append(fn())
        except Exception:  # noqa: BLE001 - only an explanation; never mask the error
            pass

    thread = threading.Thread(target=run, name="numcoll-recovery-look", daemon=True)
    thread.start()
    thread.join(wait_s)
    return out[0] if out else None


def _deadline(timeout, default_s: float) -> float:
    if timeout is None:
        seconds = default_s
    elif isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"timeout must be a datetime.timedelta, seconds or None, got "
                        f"{type(timeout).__name__}")
    if seconds <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    return time.monotonic() + seconds


class Recoverable:
    """ULFM's verbs for :class:`numcoll.ProcessGroup` (see the module docstring)."""

    #: What a call on this group raises once it is unusable.
    _poison_class = GroupPoisonedError
    _old_ranks: list[int] | None = None
    _failed: list[int] = []  # the ranks the last shrink found gone

    def _recovery_init(self, store, generation: int) -> None:
        """Hook: the group is being made, its transport not yet (``store``: the
        one it was given; ``generation``: its number among groups of its name)."""
        self._root_store, self._generation = store, generation
        self._agreements: dict[str, int] = {}
        self._liveness = Liveness(self._store, self._rank, self._size, self)
        self._liveness.publish()

    # -- the verbs --------------------------------------------------------------------
    def old_ranks(self) -> list[int]:
        """The ranks this group's ranks had in the group it was shrunk from:
        rank ``i`` here was rank ``old_ranks()[i]`` there (``range(size)`` for
        a group not made by :meth:`shrink`).

        Examples
        --------
        >>> new = pg.shrink()          # doctest: +SKIP
        >>> new.old_ranks()            # rank 1 of 4 died  # doctest: +SKIP
        [0, 2, 3]
        """
        return list(self._old_ranks if self._old_ranks is not None else range(self._size))

    def revoke(self, reason: str | None = None) -> None:
        """Revoke the group: every pending and later call on it fails at once
        with :class:`~numcoll.GroupRevokedError`, on every rank.

        This rank's pending calls fail now; its transport closes, so a peer
        waiting on it fails at once too, and finds (in the store) that the
        group was revoked; a peer that calls later fails as soon as it
        reaches a rank whose transport is closed. :meth:`agree` and
        :meth:`shrink` still work on a revoked group. Idempotent.

        Parameters
        ----------
        reason : str, optional
            Said in every rank's error.
        """
        why = f"rank {self._rank} revoked the group" + (f": {reason}" if reason else "")
        with self._lock:
            if self._closed or self._poison_class is GroupRevokedError:
                return
            self._poison_class = GroupRevokedError
            earlier, self._poisoned = self._poisoned, (
                why if self._poisoned is None else f"{self._poisoned}, then {why}")
            update_blocked(self)
        _bounded(lambda: self._store.set(REVOKED, why.encode()), _STORE_LOOK_S)
        if earlier is None:  # else a failure closed the transport already
            self._abort(why, self._rank)

    def agree(self, flag: int | bool, timeout: timedelta | float | None = None):
        """Agree with the group's live ranks (ULFM's ``MPIX_Comm_agree``).

        Every live rank returns the same ``(flag, failed)``: the bitwise AND
        of the flags of the ranks still alive, and the sorted ranks found
        gone -- even when ranks die during the agreement. Works on a
        poisoned or revoked group (it uses only the group's store).

        Parameters
        ----------
        flag : int or bool
            This rank's flag.
        timeout : timedelta or seconds, optional
            Default: ``NUMCOLL_RECOVERY_TIMEOUT_S`` (60 s).

        Returns
        -------
        (flag, failed) : (same type as ``flag``, list[int])

        Raises
        ------
        CollectiveTimeoutError
            A rank neither took part nor was found gone in time.
        NumcollError
            The other ranks found this rank gone and decided without it.

        Examples
        --------
        >>> ok, failed = pg.agree(epoch_finished)   # doctest: +SKIP
        """
        if not isinstance(flag, int):
            raise TypeError(f"agree: flag must be an int or bool, got {type(flag).__name__}")
        value, failed = self._agreement("agree", flag, timeout)
        return (bool(value) if isinstance(flag, bool) else value), failed

    def shrink(self, timeout: timedelta | float | None = None):
        """The survivors' group: a collective of the live ranks that returns a
        new group of them, renumbered in order (ULFM's ``MPIX_Comm_shrink``).

        Revokes this group first (so ranks still waiting in it stop), agrees
        with the others on who is gone, makes the new group over a fresh part
        of the same store with the same kind of transport, then shuts this
        one down (its arena, rings, sockets and threads are freed).
        ``new.old_ranks()[i]`` is the rank here of the new group's rank ``i``.

        Parameters
        ----------
        timeout : timedelta or seconds, optional
            Bounds the agreement (default ``NUMCOLL_RECOVERY_TIMEOUT_S``,
            60 s); the new group's set-up has the store's and the
            transport's own deadlines, as any group's.

        Returns
        -------
        ProcessGroup

        Raises
        ------
        CollectiveTimeoutError
            A rank neither took part nor was found gone in time, or the new
            group could not be made (a rank died meanwhile: shrink again).
        NumcollError
            The store is unreachable (its host may be the rank that died:
            only a store served by the launcher survives any rank), or the
            others found this rank gone.

        Examples
        --------
        >>> try:                                    # doctest: +SKIP
        ...     pg.allreduce(grad).wait()
        ... except nc.NumcollError:
        ...     pg = pg.shrink()
        """
        deadline = _deadline(timeout, self.context.cfg.recovery_timeout_s)
        if self._closed:
            raise NumcollError(f"shrink on rank {self._rank}: the process group was shut down")
        self.revoke("it is shrinking the group")
        _, failed = self._agreement("shrink", 1, max(deadline - time.monotonic(), 1e-3))
        survivors = [q for q in range(self._size) if q not in failed]
        kind = self.options.transport or self.transport_kind
        opts = dataclasses.replace(
            self.options, transport=kind,
            group_name=f"{self.options.group_name}/{self._generation}/shrink"
                       f"{self._agreements['shrink']}")
        new = type(self)(self._root_store, survivors.index(self._rank), len(survivors), opts)
        new._old_ranks = survivors
        self._failed = failed
        self.shutdown()
        return new

    # -- the hooks --------------------------------------------------------------------
    def _agreement(self, kind: str, flag: int, timeout) -> tuple[int, list[int]]:
        deadline = _deadline(timeout, self.context.cfg.recovery_timeout_s)
        with self._lock:
            n = self._agreements[kind] = self._agreements.get(kind, 0) + 1
        try:
            return agree_in_store(PrefixStore(f"ft/{kind}/{n}", self._store), self._rank,
                                  self._size, flag, self._liveness, deadline,
                                  self.context.cfg.recovery_poll_s, f"{kind} #{n}")
        except OSError as exc:
            if isinstance(exc, NumcollError):  # a timeout of the agreement itself
                raise
            raise NumcollError(
                f"{kind} on rank {self._rank}: the group's store is unreachable ({exc}); if "
                "its host was the rank that died, the survivors cannot agree: serve the store "
                "from the launcher (numcoll run, nc.launch) so that it outlives any rank"
            ) from exc

    def _revoked_error(self, work, exc: BaseException) -> BaseException:
        """Hook: a call failed. If the group was revoked (here, or by a peer,
        as the store says), the error to deliver is a GroupRevokedError."""
        if self._poison_class is not GroupRevokedError:
            why = _bounded(lambda: self._store.check([REVOKED]) and self._store.get(REVOKED),
                           _STORE_LOOK_S)
            if not why:
                return exc
            self._poison_class = GroupRevokedError
        text = f"{work.op_name} (collective #{work.seq}) on rank {self._rank} did not " \
               f"complete: the group was revoked ({exc})"
        err = GroupRevokedError(text if "shrink_group()" in text else f"{text}; {SHRINK_HINT}")
        err.peer, err.root_reason = getattr(exc, "peer", None), getattr(exc, "root_reason", None)
        err.__cause__ = exc
        return err

    def _leave(self) -> None:
        """Hook: the group shuts down. The rank's key goes: the store keeps
        nothing of a group that is gone, and the others' agreements count
        this rank as gone without waiting for it."""
        decisions = [f"ft/{kind}/{n}/decision" for kind, count in self._agreements.items()
                     for n in range(1, count + 1)]
        self._liveness.leave(self._failed, also=(REVOKED, *decisions))

