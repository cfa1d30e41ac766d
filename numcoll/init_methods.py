"""Rendezvous: turn an ``init_method`` URL into ``(store, rank, world_size)``.

As in torch, :func:`rendezvous` returns an iterator yielding one tuple, and
handlers are looked up by URL scheme:

- ``tcp://host:port?rank=R&world_size=W`` — a :class:`~numcoll.tcpstore.TCPStore`;
  rank 0 is the master and runs the server;
- ``env://`` — the same, from ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK`` and
  ``WORLD_SIZE``;
- ``file:///path?rank=R&world_size=W`` — a :class:`~numcoll.store.FileStore`.

``rank`` and ``world_size`` given as arguments are added to the URL's query
before the handler sees it (as torch does), so custom handlers registered
with :func:`register_rendezvous_handler` read them from one place.
"""

from __future__ import annotations

import datetime
import os
import threading
import urllib.parse
from typing import Callable, Iterator

from .store import DEFAULT_STORE_TIMEOUT, FileStore, Store, _as_timeout
from .tcpstore import TCPStore

__all__ = ["rendezvous", "register_rendezvous_handler"]

RendezvousResult = Iterator["tuple[Store, int, int]"]
Handler = Callable[..., RendezvousResult]

_handlers: dict[str, Handler] = {}
_handlers_lock = threading.Lock()


def register_rendezvous_handler(scheme: str, handler: Handler) -> None:
    """Serve ``scheme://`` URLs with ``handler(url, timeout=timedelta)``.

    The handler returns an iterator of ``(store, rank, world_size)``; the
    URL's query holds ``rank`` and ``world_size`` when they are known.

    Raises
    ------
    RuntimeError
        If ``scheme`` already has a handler.
    """
    with _handlers_lock:
        if scheme in _handlers:
            raise RuntimeError(f"Rendezvous handler for {scheme}:// already registered")
        _handlers[scheme] = handler


def rendezvous(url: str, rank: int = -1, world_size: int = -1,
               timeout: datetime.timedelta | float | None = None) -> RendezvousResult:
    """An iterator yielding one ``(store, rank, world_size)`` for ``url``.

    Parameters
    ----------
    url : str
        ``tcp://host:port``, ``env://`` or ``file:///path``, optionally with
        ``?rank=..&world_size=..``.
    rank, world_size : int
        -1 = take them from the URL (or, for ``env://``, the environment).
    timeout : datetime.timedelta or float, optional
        Deadline of the store (connecting, joining, get/wait); default 300 s.

    Raises
    ------
    ValueError
        For an unknown scheme, a malformed URL, missing or inconsistent rank
        and world_size, or (``env://``) a missing environment variable.
    """
    if not isinstance(url, str):
        raise TypeError(f"rendezvous url must be str, got {type(url).__name__}")
    parsed = urllib.parse.urlparse(url)
    with _handlers_lock:
        handler = _handlers.get(parsed.scheme)
        supported = ", ".join(f"{s}://" for s in sorted(_handlers))
    if handler is None:
        raise ValueError(f"No rendezvous handler for {parsed.scheme or '(no scheme)'}:// "
                         f"in {url!r}; supported: {supported}")
    query = dict(urllib.parse.parse_qsl(parsed.query))
    for name, value in (("rank", rank), ("world_size", world_size)):
        if value == -1:
            continue
        if name in query and query[name] != str(value):
            raise ValueError(f"rendezvous: {name}={value} conflicts with "
                             f"{name}={query[name]} in {url!r}")
        query[name] = str(value)
    url = urllib.parse.urlunparse(parsed._replace(query=urllib.parse.urlencode(query)))
    timeout = DEFAULT_STORE_TIMEOUT if timeout is None else _as_timeout(timeout)
    return handler(url, timeout=timeout)


def _int_param(query: dict[str, str], name: str, scheme: str) -> int:
    try:
        return int(query[name])
    except ValueError:
        raise ValueError(f"{scheme}:// rendezvous: {name} must be an integer, "
                         f"got {query[name]!r}") from None


def _rank_and_world_size(query: dict[str, str], scheme: str) -> tuple[int, int]:
    missing = [n for n in ("rank", "world_size") if n not in query]
    if missing:
        raise ValueError(
            f"rank and world_size must be given for {scheme}:// rendezvous, as arguments "
            f"or in the URL (?rank=0&world_size=2); missing: {', '.join(missing)}")
    rank = _int_param(query, "rank", scheme)
    world_size = _int_param(query, "world_size", scheme)
    if world_size < 1:
        raise ValueError(f"{scheme}:// rendezvous: world_size must be positive, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"{scheme}:// rendezvous: rank {rank} is not in [0, {world_size})")
    return rank, world_size


def _query(url: str) -> dict[str, str]:
    return dict(urllib.parse.parse_qsl(urllib.parse.urlparse(url).query))


def _tcp_store(host: str, port: int, rank: int, world_size: int,
               timeout: datetime.timedelta, scheme: str) -> RendezvousResult:
    """Validate now, connect when iterated (as torch's handlers do)."""
    if port == 0 and rank != 0:
        raise ValueError(
            f"{scheme}:// rendezvous: port 0 (let the OS pick) is only valid for rank 0, "
            f"which runs the server; rank {rank} needs the port it reports as store.port")

    def connect():
        # With port 0 nobody else knows the port until this store is returned,
        # so the master cannot wait for the workers to join here.
        store = TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout,
                         wait_for_workers=port != 0)
        yield store, rank, world_size

    return connect()


def _tcp_handler(url: str, timeout: datetime.timedelta = DEFAULT_STORE_TIMEOUT,
                 **kwargs) -> RendezvousResult:
    parsed = urllib.parse.urlparse(url)
    try:
        port = parsed.port
    except ValueError as exc:
        raise ValueError(f"tcp:// rendezvous: bad port in {url!r}: {exc}") from None
    if not parsed.hostname:
        raise ValueError(f"tcp:// rendezvous: host missing in {url!r}")
    if port is None:
        raise ValueError(f"tcp:// rendezvous: port number missing in {url!r}")
    rank, world_size = _rank_and_world_size(_query(url), "tcp")
    return _tcp_store(parsed.hostname, port, rank, world_size, timeout, "tcp")


def _env_handler(url: str, timeout: datetime.timedelta = DEFAULT_STORE_TIMEOUT,
                 **kwargs) -> RendezvousResult:
    def env(name: str) -> str:
        value = os.environ.get(name)
        if not value:
            raise ValueError(f"env:// rendezvous: environment variable {name} expected, "
                             f"but not set")
        return value

    query = _query(url)
    # Arguments (folded into the query by rendezvous()) win over the environment.
    for name, variable in (("rank", "RANK"), ("world_size", "WORLD_SIZE")):
        if name not in query:
            query[name] = env(variable)
    rank, world_size = _rank_and_world_size(query, "env")
    host = env("MASTER_ADDR")
    try:
        port = int(env("MASTER_PORT"))
    except ValueError:
        raise ValueError(f"env:// rendezvous: MASTER_PORT must be an integer, "
                         f"got {os.environ['MASTER_PORT']!r}") from None
    return _tcp_store(host, port, rank, world_size, timeout, "env")


def _file_handler(url: str, timeout: datetime.timedelta = DEFAULT_STORE_TIMEOUT,
                  **kwargs) -> RendezvousResult:
    parsed = urllib.parse.urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise ValueError(f"file:// rendezvous needs an absolute path, file:///abs/path; "
                         f"{url!r} names host {parsed.netloc!r}")
    path = urllib.parse.unquote(parsed.path)
    if not path:
        raise ValueError(f"file:// rendezvous: path missing in {url!r}")
    rank, world_size = _rank_and_world_size(_query(url), "file")

    def open_store():
        yield FileStore(path, world_size, timeout=timeout), rank, world_size

    return open_store()


register_rendezvous_handler("tcp", _tcp_handler)
register_rendezvous_handler("env", _env_handler)
register_rendezvous_handler("file", _file_handler)
