"""The group's shared secret (``NUMCOLL_AUTH_TOKEN``) and the proofs made of it.

The token never travels. What travels is an HMAC-SHA256 of it over a label
naming the protocol and the side (so a proof made for one purpose is worth
nothing in another) and over fresh nonces from both sides (so a recorded
proof cannot be replayed): the challenge–response the TCPStore, the ``shm``
rendezvous and, as a fixed derived password, ZeroMQ's PLAIN mechanism use.
"""

from __future__ import annotations

import hashlib
import hmac
import os

__all__ = ["resolve", "proof", "NONCE_NBYTES", "PROOF_NBYTES", "matches"]

#: Bytes of a challenge or nonce, and of a proof.
NONCE_NBYTES = 32
PROOF_NBYTES = 32


def resolve(token=None) -> bytes | None:
    """``token`` as bytes; ``None`` means ``NUMCOLL_AUTH_TOKEN`` (unset or
    empty: no token). ``TypeError`` for anything but str or bytes."""
    if token is None:
        token = os.environ.get("NUMCOLL_AUTH_TOKEN") or None
    if isinstance(token, str):
        token = token.encode()
    if token is not None and not isinstance(token, bytes):
        raise TypeError(f"token must be str or bytes, got {type(token).__name__}")
    return token or None


def proof(token: bytes, label: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of ``token`` over ``label`` and ``parts`` (each length-prefixed,
    so no two different sequences of parts give the same message)."""
    mac = hmac.new(token, b"numcoll/" + label, hashlib.sha256)
    for part in parts:
        mac.update(len(part).to_bytes(4, "little"))
        mac.update(part)
    return mac.digest()


def matches(token: bytes, got: bytes, label: bytes, *parts: bytes) -> bool:
    """Whether ``got`` is :func:`proof` ``(token, label, *parts)``, compared in
    constant time."""
    return hmac.compare_digest(got, proof(token, label, *parts))
