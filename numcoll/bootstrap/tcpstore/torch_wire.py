"""torch.distributed's TCPStore protocol, served by numcoll's TCPStore server.

So that a torch ``TCPStore`` client -- ``init_process_group("gloo")`` under
``numcoll run``, torchrun-style code that makes its own client -- meets in
numcoll's store. The format is torch's (``TCPStore.cpp``'s ``SendBuffer``
and ``TCPStoreLibUvBackend.cpp``'s parser; checked byte for byte against
torch 2.13's client): a query is a u8 code and its arguments, little-endian;
a string or byte vector is a u64 length and its bytes; some queries have no
reply. The semantics are the libuv server's: a missing key reads as empty, a
``WAIT`` is parked until every key is there (the client cancels it with
``CANCEL_WAIT`` at its own deadline), ``queue_push`` wakes one waiter.

torch's keys carry its own ``/`` prefix, so they never collide with numcoll's.
torch's client cannot present numcoll's token: a store that requires one
answers its ``PING`` (so the client does not retry until its timeout) and
drops it, with a log line, at its first query.
"""

from __future__ import annotations

import enum
import struct
from collections import deque

from ..store import _added, _compare_set
from .protocol import RESERVED_PREFIX

__all__ = ["serve", "Query"]

#: torch's limits (TCPStoreLibUvBackend.cpp): key length, keys per query.
MAX_KEY_NBYTES = 8 * 1024
MAX_KEY_COUNT = 128 * 1024

_U8, _U32, _U64, _I64 = (struct.Struct(f) for f in ("<B", "<I", "<Q", "<q"))
READY, NOT_READY = b"\x00", b"\x01"            # CheckResponseType
STOP_WAITING, WAIT_CANCELED = b"\x00", b"\x01"  # WaitResponseType


class Query(enum.IntEnum):
    """torch's ``QueryType`` codes."""

    VALIDATE = 0
    SET = 1
    COMPARE_SET = 2
    GET = 3
    ADD = 4
    CHECK = 5
    WAIT = 6
    GETNUMKEYS = 7
    DELETE_KEY = 8
    APPEND = 9
    MULTI_GET = 10
    MULTI_SET = 11
    CANCEL_WAIT = 12
    PING = 13
    QUEUE_PUSH = 14
    QUEUE_POP = 15
    QUEUE_LEN = 16
    LIST_KEYS = 17


class _Incomplete(Exception):
    """The query's bytes have not all arrived yet."""


class _Malformed(Exception):
    """Bytes no torch client sends."""


class _Reader:
    def __init__(self, buf: bytearray, max_value_nbytes: int):
        self.buf, self.pos, self.max_value = buf, 0, max_value_nbytes

    def _take(self, n: int) -> bytes:
        if self.pos + n > len(self.buf):
            raise _Incomplete
        data = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return data

    def unpack(self, st: struct.Struct):
        return st.unpack(self._take(st.size))[0]

    def key(self) -> bytes:
        n = self.unpack(_U64)
        if n > MAX_KEY_NBYTES:
            raise _Malformed(f"a {n}-byte key (torch's limit: {MAX_KEY_NBYTES})")
        return self._take(n)

    def value(self) -> bytes:
        n = self.unpack(_U64)
        if n > self.max_value:
            raise _Malformed(f"a {n}-byte value (limit {self.max_value})")
        return self._take(n)

    def count(self) -> int:
        n = self.unpack(_U64)
        if n > MAX_KEY_COUNT:
            raise _Malformed(f"{n} keys in one query (torch's limit: {MAX_KEY_COUNT})")
        return n


def _vec(data: bytes) -> bytes:
    return _U64.pack(len(data)) + data


def _args(query: int, r: _Reader) -> tuple:
    """The arguments of one query (raises _Incomplete or _Malformed)."""
    if query in (Query.SET, Query.APPEND, Query.QUEUE_PUSH):
        return r.key(), r.value()
    if query == Query.COMPARE_SET:
        return r.key(), r.value(), r.value()
    if query in (Query.GET, Query.DELETE_KEY, Query.QUEUE_POP, Query.QUEUE_LEN):
        return (r.key(),)
    if query == Query.ADD:
        return r.key(), r.unpack(_I64)
    if query in (Query.CHECK, Query.WAIT, Query.MULTI_GET):
        return tuple(r.key() for _ in range(r.count()))
    if query == Query.MULTI_SET:
        return tuple((r.key(), r.value()) for _ in range(r.count()))
    if query == Query.PING:
        return (r.unpack(_U32),)
    if query in (Query.GETNUMKEYS, Query.CANCEL_WAIT, Query.LIST_KEYS):
        return ()
    raise _Malformed(f"query code {query}")


def serve(server, conn) -> None:
    """Run every complete torch query waiting in ``conn.inbuf``.

    A parked ``WAIT`` does not hold back what follows: its client's next
    query may be the ``CANCEL_WAIT`` that ends it."""
    buf = conn.inbuf
    while conn.open and buf:
        reader = _Reader(buf, server.max_frame_nbytes)
        try:
            query = reader.unpack(_U8)
            args = _args(query, reader)
        except _Incomplete:
            return
        except _Malformed as exc:
            server.drop(conn, "malformed torch.distributed request", str(exc))
            return
        del buf[:reader.pos]
        if not conn.authed and query != Query.PING:
            server.drop(conn, "torch.distributed client without the token",
                        "this store requires NUMCOLL_AUTH_TOKEN, which torch's TCPStore "
                        "client cannot present")
            return
        try:
            _HANDLERS[query](server, conn, *args)
        except Exception as exc:  # noqa: BLE001 - torch's server hangs up on these too
            server.drop(conn, "malformed torch.distributed request", repr(exc))
            return


def _set(server, conn, key, value):
    server.data[key] = value
    server.notify(key)


def _compare(server, conn, key, expected, desired):
    write, result = _compare_set(server.data.get(key), expected, desired)
    if write is not None:
        server.data[key] = write
        server.notify(key)
    server.send(conn, _vec(result))


def _get(server, conn, key):
    server.send(conn, _vec(server.data.get(key, b"")))


def _add(server, conn, key, amount):
    value = server.data[key] = _added(server.data.get(key), amount,
                                      key.decode(errors="replace"))
    server.notify(key)
    server.send(conn, _I64.pack(int(value)))


def _check(server, conn, *keys):
    server.send(conn, READY if all(server.present(k) for k in keys) else NOT_READY)


def _wait(server, conn, *keys):
    if conn.waiter is not None:
        raise ValueError("WAIT while another WAIT is parked")
    if all(server.present(k) for k in keys):
        server.send(conn, STOP_WAITING)
    else:
        server.park(conn, list(keys), lambda: server.send(conn, STOP_WAITING))


def _cancel_wait(server, conn):
    if conn.waiter is not None:
        server.unpark(conn.waiter)
    server.send(conn, WAIT_CANCELED)


def _num_keys(server, conn):
    server.send(conn, _I64.pack(server.num_user_keys()))


def _delete(server, conn, key):
    server.send(conn, _I64.pack(1 if server.data.pop(key, None) is not None else 0))


def _append(server, conn, key, value):
    server.data[key] = server.data.get(key, b"") + value
    server.notify(key)


def _multi_get(server, conn, *keys):
    server.send(conn, b"".join(_vec(server.data.get(k, b"")) for k in keys))


def _multi_set(server, conn, *pairs):
    for key, value in pairs:
        _set(server, conn, key, value)


def _ping(server, conn, nonce):
    server.send(conn, _U32.pack(nonce))


def _queue_push(server, conn, key, value):
    server.queues.setdefault(key, deque()).append(value)
    server.notify(key, one=True)


def _queue_pop(server, conn, key):
    queue = server.queues.get(key) or deque()
    reply = _I64.pack(len(queue))
    if queue:
        reply += _vec(queue.popleft())
    server.send(conn, reply)


def _queue_len(server, conn, key):
    server.send(conn, _I64.pack(len(server.queues.get(key) or ())))


def _list_keys(server, conn):
    keys = [k for k in server.data if not k.startswith(RESERVED_PREFIX)]
    server.send(conn, _I64.pack(len(keys)) + b"".join(_vec(k) for k in keys))


_HANDLERS = {
    Query.SET: _set, Query.COMPARE_SET: _compare,
    Query.GET: _get, Query.ADD: _add, Query.CHECK: _check, Query.WAIT: _wait,
    Query.GETNUMKEYS: _num_keys, Query.DELETE_KEY: _delete, Query.APPEND: _append,
    Query.MULTI_GET: _multi_get, Query.MULTI_SET: _multi_set,
    Query.CANCEL_WAIT: _cancel_wait, Query.PING: _ping, Query.QUEUE_PUSH: _queue_push,
    Query.QUEUE_POP: _queue_pop, Query.QUEUE_LEN: _queue_len, Query.LIST_KEYS: _list_keys,
}
