"""The TCPStore's wire formats, shared by its server and its client.

**Opening.** Every client speaks first, and every client -- numcoll's and
torch's -- begins the same way, with torch's own opening: a ``VALIDATE`` query
(a 0 byte and the little-endian u32 ``0x3C85F7CE``) and a ``PING`` query (the
byte 13 and a u32 nonce that the server echoes). torch's client uses its
process id as the nonce; numcoll's uses :data:`NUMCOLL_NONCE` (the bytes
``ncs2``, above any process id), which is how the server tells them apart:

- a numcoll client gets numcoll's greeting frame, then the numcoll protocol;
- a torch.distributed ``TCPStore`` client gets its nonce back, then torch's
  protocol (:mod:`.torch_wire`), so torch code run under ``numcoll run``
  meets in the launcher's store;
- anything else gets one line of text saying what this port is, and is hung up on.

And a numcoll client that reaches torch's own TCPStore server gets its nonce
echoed: it says so at once, instead of waiting for a greeting.

**numcoll's protocol.** A frame is a big-endian u32 payload length and the
payload. The server's greeting is :data:`GREETING_MAGIC`, a flags byte
(:data:`AUTH_REQUIRED`) and a 32-byte challenge. With a token, the client
answers with its own 32 random bytes and an HMAC-SHA256 over both, and the
server proves the same back (:func:`mac`). A request's payload is an op code
(u8) and fields; a reply's is a status (u8) and fields; each field is a u32
length and its bytes.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import socket
import struct

from transports import tokens

from ...errors import NumcollError

__all__ = ["StoreConnectionError", "StoreAuthError", "Op", "OPENING", "NUMCOLL_NONCE",
           "GREETING_MAGIC"]

#: torch's ``validationMagicNumber`` and query codes (TCPStoreBackend.hpp).
TORCH_VALIDATE_MAGIC = 0x3C85F7CE
TORCH_VALIDATE, TORCH_PING = 0, 13
#: The ping nonce numcoll's clients send: the bytes "ncs2", never a process id.
NUMCOLL_NONCE = int.from_bytes(b"ncs2", "little")
OPENING = struct.pack("<BIBI", TORCH_VALIDATE, TORCH_VALIDATE_MAGIC, TORCH_PING, NUMCOLL_NONCE)
VALIDATE_NBYTES = 5
OPENING_NBYTES = len(OPENING)
#: What the server tells a connection that is not a store client, before hanging up.
NOT_A_STORE = (b"numcoll TCPStore: this port serves numcoll's and torch.distributed's "
               b"TCPStore protocols only\n")

GREETING_MAGIC = b"numcoll-store/2"
CHALLENGE_NBYTES = 32
MAC_NBYTES = 32
AUTH_REQUIRED = 1
GREETING_NBYTES = len(GREETING_MAGIC) + 1 + CHALLENGE_NBYTES

LENGTH = struct.Struct("!I")

#: Keys of the world_size handshake start with this; num_keys does not count them.
RESERVED_PREFIX = b"\0numcoll/"

OK, TIMEOUT, ERROR = 0, 1, 2


class Op(enum.IntEnum):
    """numcoll's request codes."""

    SET = 1
    GET = 2
    ADD = 3
    COMPARE_SET = 4
    WAIT = 5
    CHECK = 6
    DELETE = 7
    NUM_KEYS = 8


class StoreConnectionError(NumcollError, ConnectionError):
    """The TCPStore server could not be reached, or the connection was lost."""


class StoreAuthError(StoreConnectionError):
    """The other end of a TCPStore connection is not a numcoll store, or one
    side could not prove it knows the token."""


def mac(token: bytes, side: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """The handshake's proof: HMAC-SHA256 of both sides' random bytes, per side."""
    return hmac.new(token, b"numcoll-store/" + side + server_nonce + client_nonce,
                    hashlib.sha256).digest()


def token_from(token) -> bytes | None:
    """The shared secret: ``token`` (str or bytes), else ``NUMCOLL_AUTH_TOKEN``, else None."""
    try:
        return tokens.resolve(token)
    except TypeError as exc:
        raise TypeError(f"TCPStore {exc}") from None


def frame(code: int, fields) -> bytes:
    """One frame: an op code or status and length-prefixed fields."""
    parts = [bytes([code])]
    for field in fields:
        parts += (LENGTH.pack(len(field)), field)
    payload = b"".join(parts)
    return LENGTH.pack(len(payload)) + payload


def parse(payload: bytes) -> tuple[int, list[bytes]]:
    """A frame's payload -> ``(code, fields)``; ``ValueError`` if malformed."""
    fields, pos = [], 1
    while pos < len(payload):
        (n,) = LENGTH.unpack_from(payload, pos)
        pos += LENGTH.size
        if pos + n > len(payload):
            raise ValueError("malformed frame: field runs past the end")
        fields.append(payload[pos:pos + n])
        pos += n
    return payload[0], fields


def recv_exact(sock: socket.socket, nbytes: int) -> bytes:
    """Exactly ``nbytes`` from ``sock`` (``ConnectionResetError`` if it closes first)."""
    buf = bytearray(nbytes)
    view = memoryview(buf)
    while view:
        got = sock.recv_into(view)
        if got == 0:
            raise ConnectionResetError("the server closed the connection")
        view = view[got:]
    return bytes(buf)
