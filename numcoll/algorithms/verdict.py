"""The *done* step of a call whose ranks read (or write) each other's memory:
every rank publishes whether its copies succeeded, and every rank learns, in
the same step, whether all did (:mod:`.single_copy`, and the single-copy rest
of the arena's alltoall, :func:`.shared_alltoall.alltoall_shared`).

A rank publishes *done* only after its last copy returned, so once the step
is complete no peer reads or writes this rank's buffers any more: the call
may return. Where some rank's copy was refused, every rank marks its copies
failed for the first refusal's reason -- the same text on every rank
(:meth:`numcoll.comm.Comm.refuse_single_copy`) -- and finishes the call
another way, through the arena.
"""

from __future__ import annotations

import numpy as np

__all__ = ["REASON_NBYTES", "done_step", "verdict"]

#: A *done* step carries a refusal's text, at most this many bytes.
REASON_NBYTES = 256


def done_step(comm, refused: str | None) -> bool:
    """Publish this rank's verdict (``refused``: a refusal's text, or None:
    every copy made) as one arena step; then :func:`verdict`."""
    text = np.zeros(REASON_NBYTES, np.uint8)
    if refused is not None:
        raw = refused.encode()[:REASON_NBYTES - 1] or b"?"
        text[:len(raw)] = np.frombuffer(raw, np.uint8)
        step = comm.shared_step(text)
    else:
        step = comm.shared_step(text[:0])
    return verdict(comm, step, refused)


def verdict(comm, step: int, refused: str | None) -> bool:
    """True if every rank's *done* (``step``) says its copies succeeded.
    Otherwise every rank marks its copies failed, for the first refusal's
    reason (the same text on every rank), and returns False."""
    reasons = []
    for q in range(comm.size):
        if q == comm.rank:
            reasons.append(refused)
            continue
        n = comm.published_nbytes(step, q)
        if n:
            reasons.append(bytes(comm.shared_view(step, q, 0, n)).rstrip(b"\0").decode(
                errors="replace"))
    first = next((r for r in reasons if r), None)
    if first is None:
        return True
    comm.refuse_single_copy(first)
    return False
