"""The exceptions numcoll raises.

Argument errors are plain ``ValueError`` / ``TypeError`` raised at the call.
Runtime failures travel through the Work and are one of the classes below;
transport-level exceptions are translated into them in exactly one place
(:mod:`numcoll.comm`).
"""

from __future__ import annotations

__all__ = [
    "NumcollError",
    "CollectiveTimeoutError",
    "PeerError",
    "GroupPoisonedError",
    "CollectiveMismatchError",
    "GroupRevokedError",
]


class NumcollError(RuntimeError):
    """Base class of numcoll's runtime failures (a RuntimeError, as torch's are)."""


class CollectiveTimeoutError(NumcollError, TimeoutError):
    """A collective or store operation did not finish within its deadline.

    The message starts ``Timed out waiting {ms}ms`` and names the operation,
    this rank and the peer that was waited for (``peer``, when known).
    """

    def __init__(self, message: str, peer: int | None = None):
        super().__init__(message)
        self.peer = peer


class PeerError(NumcollError):
    """A peer closed, crashed or sent something unexpected; ``peer`` names it."""

    def __init__(self, message: str, peer: int | None = None):
        super().__init__(message)
        self.peer = peer


class GroupPoisonedError(NumcollError):
    """A collective failed earlier on this group; later calls fail fast with this."""


class CollectiveMismatchError(PeerError):
    """Ranks ran different collectives (or the same one with another dtype,
    element count, op or root) at the same sequence number; ``peer`` is the
    rank whose message disagreed. Raised before any of its bytes were used."""


class GroupRevokedError(GroupPoisonedError):
    """The group was revoked (``pg.revoke()``, or a rank began to shrink it):
    every pending and later call on it fails with this, on every rank. The
    way on is ``nc.shrink_group()`` (or ``pg.shrink()``), which the survivors
    call together; ``nc.agree()`` still works on a revoked group."""
