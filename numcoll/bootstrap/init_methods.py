"""Rendezvous: turn an ``init_method`` URL into ``(store, rank, world_size)``.

As in torch, :func:`rendezvous` returns an iterator yielding one tuple, and
handlers are looked up by URL scheme:

- ``tcp://host:port?rank=R&world_size=W`` — a :class:`~numcoll.bootstrap.tcpstore.TCPStore`;
  rank 0 is the master and runs the server;
- ``env://`` — the same, from ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK`` and
  ``WORLD_SIZE`` (torchrun's contract), or from Open MPI's, MPICH's or SLURM's
  variables (:mod:`numcoll.bootstrap.launcher_env`);
- ``file:///path?rank=R&world_size=W`` — a :class:`~numcoll.bootstrap.filestore.FileStore`.

``rank`` and ``world_size`` given as arguments are added to the URL's query
before the handler sees it (as torch does), so custom handlers registered
with :func:`register_rendezvous_handler` read them from one place.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
import urllib.parse
from typing import Callable, Iterator

from .. import config as _config
from . import launcher_env as launchers
from .launcher_env import detect_environment
from ..logs import get_logger
from .filestore import FileStore
from .store import DEFAULT_STORE_TIMEOUT, Store, StoreTimeoutError, _as_timeout, _ms
from .tcpstore import StoreAuthError, StoreConnectionError, TCPStore

__all__ = ["rendezvous", "register_rendezvous_handler", "join"]

_log = get_logger("rendezvous")
_JOIN_PREFIX = "numcoll/rendezvous"
_PROBE_KEY = "numcoll/rendezvous/probe"

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
               timeout: datetime.timedelta, scheme: str,
               is_master: bool | None = None) -> RendezvousResult:
    """Validate now, connect when iterated (as torch's handlers do).

    Connecting logs while the store host is not reachable yet; then a short
    request checks that the port is a numcoll store (a wrong port fails in
    seconds, not at the deadline); then every rank announces itself and
    waits for the others, logging who is missing (see :func:`join`).
    """
    if is_master is None:
        is_master = rank == 0
    if port == 0 and (rank != 0 or not is_master):
        raise ValueError(
            f"{scheme}:// rendezvous: port 0 (let the OS pick) is only valid for rank 0, "
            f"which runs the server; rank {rank} needs the port it reports as store.port")

    def connect():
        store = _connect_store(host, port, is_master, timeout)
        try:
            # With port 0 nobody else knows the port until this store is
            # returned, so the master only announces itself here.
            join(store, rank, world_size, timeout, where=f"TCPStore at {host}:{port}",
                 wait=port != 0)
        except BaseException:
            store.close()
            raise
        yield store, rank, world_size

    return connect()


def _connect_store(host: str, port: int, is_master: bool,
                   timeout: datetime.timedelta) -> TCPStore:
    """A TCPStore client (and server, for the master) that has answered a request."""
    cfg = _config.current()
    deadline = time.monotonic() + timeout.total_seconds()
    started = time.monotonic()
    while True:
        remaining = deadline - time.monotonic()
        attempt = min(remaining, cfg.rendezvous_log_s)
        try:
            store = TCPStore(host, port, None, is_master=is_master,
                             timeout=datetime.timedelta(seconds=max(attempt, 0.001)))
            break
        except StoreAuthError:
            raise  # it answered, and not as a store (or refused the token): waiting won't help
        except StoreConnectionError as exc:
            if time.monotonic() >= deadline:
                raise StoreConnectionError(
                    f"rendezvous: could not connect to the TCPStore at {host}:{port} within "
                    f"{_ms(timeout)}ms; is MASTER_ADDR/MASTER_PORT right, and is rank 0 "
                    f"(or the launcher) running? (last error: {exc})") from None
            _log.warning("rendezvous: still waiting for the TCPStore at %s:%d to accept "
                         "connections (%.0f s so far)", host, port, time.monotonic() - started)
    # A port that accepts connections but is not a numcoll store (a web server,
    # another program) would otherwise leave this rank silent until the deadline.
    store.set_timeout(datetime.timedelta(seconds=cfg.store_probe_s))
    try:
        store.check([_PROBE_KEY])
    except Exception as exc:  # noqa: BLE001 - any failure here means "not a store"
        store.close()
        raise StoreConnectionError(
            f"rendezvous: {host}:{port} accepted a connection but did not answer like a "
            f"numcoll TCPStore within {cfg.store_probe_s:g} s ({type(exc).__name__}: {exc}); "
            "is MASTER_PORT the port of the numcoll store, and is another program using "
            "it?") from None
    store.set_timeout(timeout)
    _log.debug("rendezvous: connected to the TCPStore at %s:%d (master=%s)", host, port,
               is_master)
    return store


def join(store: Store, rank: int, world_size: int, timeout: datetime.timedelta,
         where: str = "the store", wait: bool = True) -> None:
    """Announce ``rank`` in ``store`` and (``wait``) wait until all ``world_size`` ranks have.

    While waiting, logs at intervals (``NUMCOLL_RENDEZVOUS_LOG_S``, default
    10 s) how many ranks joined and which are missing; the timeout error says
    the same. A generation number keeps a second rendezvous on the same store
    (init, destroy, init) from seeing the first one's announcements.

    Raises
    ------
    StoreTimeoutError
        ``Timed out waiting ...ms for rendezvous at ...: 2 of 3 ranks joined;
        waiting for rank 2``.
    """
    cfg = _config.current()
    generation = (store.add(f"{_JOIN_PREFIX}/arrivals", 1) - 1) // world_size
    prefix = f"{_JOIN_PREFIX}/{generation}"
    store.set(f"{prefix}/{rank}", b"1")
    if not wait:
        return
    keys = [f"{prefix}/{r}" for r in range(world_size)]
    started = time.monotonic()
    deadline = started + timeout.total_seconds()
    status = f"rank {rank} joined; the others not yet seen"
    while True:
        remaining = deadline - time.monotonic()
        try:
            store.wait(keys, datetime.timedelta(seconds=max(0.001, min(remaining,
                                                                     cfg.rendezvous_log_s))))
            _log.info("rendezvous: all %d ranks joined %s (rank %d, %.1f s)", world_size,
                      where, rank, time.monotonic() - started)
            return
        except StoreConnectionError as exc:
            # The store's host gave up (or died) first: say where the rendezvous stood.
            raise StoreConnectionError(f"rendezvous: lost {where} while waiting for the "
                                       f"other ranks; last seen: {status} ({exc})") from None
        except StoreTimeoutError:
            missing = [r for r, k in enumerate(keys) if _missing(store, k, where, status)]
            if not missing:
                continue
            status = (f"{world_size - len(missing)} of {world_size} ranks joined; waiting for "
                      f"{_ranks_text(missing)}")
            if time.monotonic() >= deadline:
                raise StoreTimeoutError(
                    f"Timed out waiting {_ms(timeout)}ms for rendezvous at {where} (rank "
                    f"{rank}): {status}", keys, timeout) from None
            _log.warning("rendezvous at %s (rank %d, %.0f s): %s", where, rank,
                         time.monotonic() - started, status)


def _missing(store: Store, key: str, where: str, status: str) -> bool:
    try:
        return not store.check([key])
    except StoreConnectionError as exc:
        # The store's host gave up (or died) first: say where the rendezvous stood.
        raise StoreConnectionError(f"rendezvous: lost {where} while waiting for the other "
                                   f"ranks; last seen: {status} ({exc})") from None


def _ranks_text(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    shown = ", ".join(map(str, ranks[:16])) + (", ..." if len(ranks) > 16 else "")
    return f"ranks {shown}"


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
    """``env://``: torchrun's variables, or another launcher's (see
    :mod:`numcoll.bootstrap.launcher_env`). Arguments (folded into the URL's query by
    :func:`rendezvous`) win over the environment."""
    query = _query(url)
    found = detect_environment()
    for name in ("rank", "world_size"):
        if name not in query:
            value = getattr(found, name, None) if found is not None else None
            if value is None:
                variable = name.upper()
                raise ValueError(
                    f"env:// rendezvous: environment variable {variable} expected, but not "
                    f"set (nor any launcher's: {launchers.KNOWN})")
            query[name] = str(value)
    rank, world_size = _rank_and_world_size(query, "env")
    host, port = launchers.master_address(found)
    # Under torchrun (and numcoll run) the launcher hosts the store, and every
    # rank is a client of it; torchrun's speaks torch's protocol.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    if agent_store and os.environ.get("NUMCOLL_AGENT_STORE") != "1":
        return _torch_agent_store(host, port, rank, world_size, timeout)
    return _tcp_store(host, port, rank, world_size, timeout, "env",
                      is_master=rank == 0 and not agent_store)


def _torch_agent_store(host: str, port: int, rank: int, world_size: int,
                       timeout: datetime.timedelta) -> RendezvousResult:
    def connect():
        from .torch_store import TorchAgentStore

        store = TorchAgentStore(host, port, timeout)
        join(store, rank, world_size, timeout, where=f"torchrun's TCPStore at {host}:{port}")
        yield store, rank, world_size

    return connect()


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
