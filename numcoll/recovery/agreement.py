"""A fault-tolerant agreement through the group's store (ULFM's ``MPIX_Comm_agree``).

Every survivor ends with the same answer -- the bitwise AND of the flags of
the ranks still alive, and the sorted list of the ranks found gone -- even
when ranks die during the agreement. It needs nothing of the group's
transport (a failure has closed it), only the store every group was made
with (``numcoll run`` and ``nc.launch`` serve it from the launcher, so it
outlives any rank) and :class:`~.liveness.Liveness`.

Protocol, for agreement number ``n`` of a group (every survivor numbers its
agreements alike), under the keys of ``ft/<kind>/<n>/``:

1. each rank writes its vote, ``vote/<rank>``: its flag, and the ranks it
   knows to be gone;
2. it reads the others' votes until every rank has either voted or is found
   gone -- by its own liveness checks, or because a vote names it (a rank
   on another host is seen lost only by the transports that talked to it);
3. it proposes the AND of the flags of the voters not found gone and the
   sorted gone ranks, writing them to ``decision`` with ``compare_set``
   against "absent". The store applies one write first; every later
   proposal finds it there and is dropped, so every rank -- whoever
   proposed, whenever it arrives -- returns the one decision.

A rank that finds ``decision`` written stops at once and takes it (also one
that arrives late, or was thought gone: it then learns it was excluded).
Cost: one store write and about ``P`` reads per rank, then a poll every
``poll_s`` (doubling to 50 ms) while it waits; the last rank to read the
decision deletes the votes (the decision itself goes with the group).
"""

from __future__ import annotations

import json
import time

from ..errors import CollectiveTimeoutError, NumcollError

__all__ = ["agree_in_store", "ExcludedError"]

_MAX_POLL_S = 0.05


class ExcludedError(NumcollError):
    """The survivors decided without this rank (they found it gone)."""


def agree_in_store(store, rank: int, size: int, flag: int, liveness, deadline: float,
                   poll_s: float, what: str) -> tuple[int, list[int]]:
    """Agree with the live ranks of a group (see the module docstring).

    Parameters
    ----------
    store : the keys of this one agreement (a prefixed store).
    rank, size : this rank and the group's size.
    flag : this rank's flag (an int; ANDed bitwise).
    liveness : a :class:`~.liveness.Liveness` of the group.
    deadline : ``time.monotonic()`` value to give up at.
    poll_s : the first pause between looks at the store.
    what : the operation's name, for errors.

    Returns
    -------
    (flag, failed) : the AND of the live ranks' flags, and the sorted ranks found gone.

    Raises
    ------
    ExcludedError
        If the decision counts this rank among the failed.
    CollectiveTimeoutError
        If some rank neither voted nor was found gone by ``deadline``.
    """
    dead = set(liveness.check(range(size)))
    dead.discard(rank)
    store.set(f"vote/{rank}", json.dumps({"flag": int(flag), "dead": sorted(dead)}))
    votes: dict[int, dict] = {}
    pause = poll_s
    start = time.monotonic()
    while True:
        if store.check(["decision"]):
            decision = store.get("decision")
            break
        for q in range(size):
            if q in votes or q in dead:
                continue
            key = f"vote/{q}"
            if store.check([key]):
                votes[q] = json.loads(store.get(key))
                dead.update(d for d in votes[q]["dead"] if d != rank)
        missing = [q for q in range(size) if q not in votes and q not in dead]
        if missing:
            dead.update(d for d in liveness.check(missing) if d != rank)
            missing = [q for q in missing if q not in dead]
        if not missing:
            result = -1
            for q, vote in votes.items():
                if q not in dead:
                    result &= vote["flag"]
            proposal = json.dumps({"flag": result, "failed": sorted(dead)}).encode()
            decision = store.compare_set("decision", b"", proposal)
            break
        now = time.monotonic()
        if now >= deadline:
            raise CollectiveTimeoutError(
                f"Timed out waiting {round((now - start) * 1000)}ms for {what} on rank {rank}: "
                f"rank(s) {missing} neither took part nor were found gone (a rank on another "
                "host that died after this rank's transport closed is not seen; pass a longer "
                "timeout if they are only slow)", peer=missing[0])
        time.sleep(min(pause, max(deadline - now, 0)))
        pause = min(pause * 2, _MAX_POLL_S)
    answer = json.loads(decision)
    failed = [int(q) for q in answer["failed"]]
    # Only the ranks the decision counts alive count themselves: once all of
    # them have read it, the votes can go. The decision stays (the group's
    # last rank to leave deletes it): a rank found gone that is alive after
    # all may come late, and must find it to learn it was excluded.
    if rank not in failed and store.add("read", 1) == size - len(failed):
        for key in [f"vote/{q}" for q in range(size)] + ["read"]:
            store.delete_key(key)
    if rank in failed:
        store.delete_key(f"vote/{rank}")  # it may have voted after the votes were taken back
        raise ExcludedError(f"{what} on rank {rank}: the other ranks found this rank gone "
                            f"and went on without it (failed ranks: {failed})")
    return int(answer["flag"]), failed
