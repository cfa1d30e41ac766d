"""Key-value stores: where ranks meet before they have sockets to each other.

A store maps ``str`` keys to ``bytes`` values. Ranks use it to exchange
addresses, count arrivals and wait for each other, with the semantics of
torch's c10d stores:

- :class:`HashStore` lives in one process (ranks that are threads);
- :class:`FileStore` is a file on a shared file system (ranks that are
  processes on one host, or hosts sharing a file system);
- :class:`PrefixStore` gives a sub-namespace of another store;
- :class:`numcoll.bootstrap.tcpstore.TCPStore` is served over TCP by the master rank.

Every blocking call (``get``, ``wait``) has a deadline and raises
:class:`StoreTimeoutError` naming the missing keys when it passes.
"""

from __future__ import annotations

import abc
import datetime
import operator
import threading
from typing import Iterable, Union

from ..errors import CollectiveTimeoutError

__all__ = [
    "DEFAULT_STORE_TIMEOUT",
    "Store",
    "StoreTimeoutError",
    "HashStore",
    "PrefixStore",
]

#: Deadline of blocking store calls unless set otherwise (torch's default).
DEFAULT_STORE_TIMEOUT = datetime.timedelta(seconds=300)
#: FileStore waits by polling the file: first after this many seconds, then
#: twice as long each time up to FILE_POLL_MAX_S. Short first polls keep
#: rendezvous of a few local processes fast; the cap bounds the CPU spent by
#: many waiters on a slow rank.
FILE_POLL_MIN_S = 0.001
FILE_POLL_MAX_S = 0.05

ValueLike = Union[str, bytes, bytearray, memoryview]


class StoreTimeoutError(CollectiveTimeoutError):
    """A store's ``get`` or ``wait`` passed its deadline.

    Attributes
    ----------
    keys : list of str
        The keys that were still missing.
    timeout : datetime.timedelta
        The deadline that passed.
    """

    def __init__(self, message: str, keys: Iterable[str] = (),
                 timeout: datetime.timedelta | None = None):
        super().__init__(message)
        self.keys = list(keys)
        self.timeout = timeout


# -- helpers shared by every store (also used by numcoll.bootstrap.tcpstore) -----------

def _as_timeout(timeout: datetime.timedelta | float) -> datetime.timedelta:
    """A timedelta from a timedelta or a number of seconds; never negative."""
    if isinstance(timeout, bool) or not isinstance(timeout, (datetime.timedelta, int, float)):
        raise TypeError(f"timeout must be a datetime.timedelta or seconds, got {timeout!r}")
    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=timeout)
    if timeout < datetime.timedelta(0):
        raise ValueError(f"timeout must not be negative, got {timeout}")
    return timeout


def _ms(timeout: datetime.timedelta) -> int:
    return int(timeout.total_seconds() * 1000)


def _timeout_error(timeout: datetime.timedelta, missing: list[str], where: str,
                   op: str) -> StoreTimeoutError:
    return StoreTimeoutError(
        f"Timed out waiting {_ms(timeout)}ms for key(s) {missing!r} in {where} ({op})",
        missing, timeout)


def _check_key(key: str) -> str:
    if not isinstance(key, str):
        raise TypeError(f"store keys must be str, got {type(key).__name__}: {key!r}")
    return key


def _to_bytes(value, what: str = "value") -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"store {what} must be str or bytes, got {type(value).__name__}")


def _key_list(keys: Iterable[str] | str) -> list[str]:
    # A lone str would otherwise be iterated as characters.
    if isinstance(keys, str):
        return [keys]
    return [_check_key(k) for k in keys]


def _added(current: bytes | None, amount: int, key: str) -> bytes:
    """The new value of counter ``key``: ASCII decimal, as torch stores it."""
    try:
        base = 0 if current is None else int(current)
    except ValueError:
        raise ValueError(f"add: key {key!r} holds {current[:40]!r}, not an integer") from None
    return str(base + amount).encode("ascii")


def _compare_set(current: bytes | None, expected: bytes,
                 desired: bytes) -> tuple[bytes | None, bytes]:
    """torch's compare_set: ``(value to write or None, value to return)``.

    A missing key counts as matching ``b""``. For a missing key and a
    non-empty ``expected``, torch returns ``expected`` unchanged (and writes
    nothing); we keep that so code written against torch behaves the same.
    """
    if current is None:
        return (desired, desired) if expected == b"" else (None, expected)
    if current == expected:
        return desired, desired
    return None, current


class Store(abc.ABC):
    """Base class of the key-value stores (abstract).

    The public methods validate and convert their arguments, then call the
    underscore hooks that a concrete store implements. Keys are ``str``;
    values are given as ``str`` (encoded as UTF-8) or bytes and returned as
    ``bytes``. All stores are thread-safe.

    Parameters
    ----------
    timeout : datetime.timedelta or float
        Deadline of ``get`` and of ``wait`` without an explicit timeout
        (a timedelta, or seconds). Default 300 s.
    """

    def __init__(self, timeout: datetime.timedelta | float = DEFAULT_STORE_TIMEOUT):
        self._timeout = _as_timeout(timeout)

    @property
    def timeout(self) -> datetime.timedelta:
        """The default deadline of ``get`` and ``wait``."""
        return self._timeout

    def set_timeout(self, timeout: datetime.timedelta | float) -> None:
        """Set the default deadline of ``get`` and ``wait`` (timedelta or seconds)."""
        self._timeout = _as_timeout(timeout)

    def set(self, key: str, value: ValueLike,
            timeout: datetime.timedelta | float | None = None) -> None:
        """Store ``value`` under ``key``, replacing any previous value.

        ``timeout`` (timedelta or seconds) bounds the whole call, reconnecting
        included: a best-effort write (e.g. publishing why a group aborted)
        that must not wait on a dead store. It raises :class:`StoreTimeoutError`
        or ``StoreConnectionError`` when it passes; the write may or may not
        have happened. Default: the store's own deadlines.
        """
        if timeout is None:
            self._set(_check_key(key), _to_bytes(value))
        else:
            self._set_within(_check_key(key), _to_bytes(value), _as_timeout(timeout))

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting up to :attr:`timeout` for it to be set.

        Raises
        ------
        StoreTimeoutError
            If the key is still missing when the timeout passes.
        """
        return self._get(_check_key(key), self.timeout)

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the counter ``key`` (missing = 0); return the sum."""
        return int(self._add(_check_key(key), operator.index(amount)))

    def compare_set(self, key: str, expected: ValueLike, desired: ValueLike) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected``; return its value after.

        A missing key matches ``expected == b""``. As in torch, a missing key
        with a non-empty ``expected`` is left missing and ``expected`` is
        returned.
        """
        return self._compare_set(_check_key(key), _to_bytes(expected, "expected value"),
                                 _to_bytes(desired, "desired value"))

    def wait(self, keys: Iterable[str] | str,
             timeout: datetime.timedelta | float | None = None) -> None:
        """Block until every key in ``keys`` is set.

        Parameters
        ----------
        keys : iterable of str
            The keys to wait for (a lone str is one key).
        timeout : datetime.timedelta or float, optional
            Deadline (timedelta or seconds); default :attr:`timeout`.

        Raises
        ------
        StoreTimeoutError
            Naming the keys still missing when the deadline passes.
        """
        timeout = self.timeout if timeout is None else _as_timeout(timeout)
        self._wait(_key_list(keys), timeout)

    def check(self, keys: Iterable[str] | str) -> bool:
        """Whether every key in ``keys`` is set, without waiting."""
        return self._check(_key_list(keys))

    def delete_key(self, key: str) -> bool:
        """Remove ``key``; return whether it existed."""
        return self._delete_key(_check_key(key))

    def num_keys(self) -> int:
        """The number of keys set (internal bookkeeping keys are not counted)."""
        return self._num_keys()

    def close(self) -> None:
        """Release the store's resources; the base class has none."""

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- hooks: keys are str, values bytes, timeouts timedelta ----------------
    @abc.abstractmethod
    def _set(self, key: str, value: bytes) -> None: ...

    def _set_within(self, key: str, value: bytes, timeout: datetime.timedelta) -> None:
        """``_set`` bounded by ``timeout``; stores whose ``_set`` cannot block
        (in memory, a local file) need not override it."""
        self._set(key, value)

    @abc.abstractmethod
    def _get(self, key: str, timeout: datetime.timedelta) -> bytes: ...

    @abc.abstractmethod
    def _add(self, key: str, amount: int) -> int: ...

    @abc.abstractmethod
    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes: ...

    @abc.abstractmethod
    def _wait(self, keys: list[str], timeout: datetime.timedelta) -> None: ...

    @abc.abstractmethod
    def _check(self, keys: list[str]) -> bool: ...

    @abc.abstractmethod
    def _delete_key(self, key: str) -> bool: ...

    @abc.abstractmethod
    def _num_keys(self) -> int: ...


class HashStore(Store):
    """An in-memory store for ranks that are threads of one process.

    Waiters sleep on a condition variable and wake when a key is written
    (no polling).

    Parameters
    ----------
    timeout : datetime.timedelta or float
        Default deadline of ``get`` and ``wait``.
    """

    def __init__(self, timeout: datetime.timedelta | float = DEFAULT_STORE_TIMEOUT):
        super().__init__(timeout)
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()

    def __repr__(self) -> str:
        return f"HashStore(<{len(self._data)} keys>)"

    def _set(self, key, value):
        with self._cond:
            self._data[key] = value
            self._cond.notify_all()

    def _wait_locked(self, keys: list[str], timeout: datetime.timedelta, op: str) -> None:
        data = self._data
        if not self._cond.wait_for(lambda: all(k in data for k in keys),
                                   timeout.total_seconds()):
            missing = [k for k in keys if k not in data]
            raise _timeout_error(timeout, missing, "HashStore", op)

    def _get(self, key, timeout):
        with self._cond:
            self._wait_locked([key], timeout, "get")
            return self._data[key]

    def _add(self, key, amount):
        with self._cond:
            value = self._data[key] = _added(self._data.get(key), amount, key)
            self._cond.notify_all()
            return int(value)

    def _compare_set(self, key, expected, desired):
        with self._cond:
            write, result = _compare_set(self._data.get(key), expected, desired)
            if write is not None:
                self._data[key] = write
                self._cond.notify_all()
            return result

    def _wait(self, keys, timeout):
        with self._cond:
            self._wait_locked(keys, timeout, "wait")

    def _check(self, keys):
        with self._cond:
            return all(k in self._data for k in keys)

    def _delete_key(self, key):
        with self._cond:
            return self._data.pop(key, None) is not None

    def _num_keys(self):
        with self._cond:
            return len(self._data)


class PrefixStore(Store):
    """A view of ``store`` in which every key ``k`` is ``f"{prefix}/{k}"``.

    The timeout is the underlying store's. ``num_keys`` counts *all* keys of
    the underlying store, with or without the prefix, as torch's does.

    Parameters
    ----------
    prefix : str
        The namespace.
    store : Store
        The store that holds the keys.
    """

    def __init__(self, prefix: str, store: Store):
        if not isinstance(prefix, str):
            raise TypeError(f"PrefixStore prefix must be str, got {type(prefix).__name__}")
        if not isinstance(store, Store):
            raise TypeError(f"PrefixStore needs a numcoll Store, got {type(store).__name__}")
        # No Store.__init__: the timeout lives in the underlying store.
        self._prefix = prefix
        self._store = store

    @property
    def underlying_store(self) -> Store:
        """The store this one writes to."""
        return self._store

    @property
    def prefix(self) -> str:
        return self._prefix

    @property
    def timeout(self) -> datetime.timedelta:
        return self._store.timeout

    def set_timeout(self, timeout: datetime.timedelta | float) -> None:
        self._store.set_timeout(timeout)

    def __repr__(self) -> str:
        return f"PrefixStore({self._prefix!r}, {self._store!r})"

    def _k(self, key: str) -> str:
        return f"{self._prefix}/{key}"

    def _set(self, key, value):
        self._store._set(self._k(key), value)

    def _set_within(self, key, value, timeout):
        self._store._set_within(self._k(key), value, timeout)

    def _get(self, key, timeout):
        return self._store._get(self._k(key), timeout)

    def _add(self, key, amount):
        return self._store._add(self._k(key), amount)

    def _compare_set(self, key, expected, desired):
        return self._store._compare_set(self._k(key), expected, desired)

    def _wait(self, keys, timeout):
        self._store._wait([self._k(k) for k in keys], timeout)

    def _check(self, keys):
        return self._store._check([self._k(k) for k in keys])

    def _delete_key(self, key):
        return self._store._delete_key(self._k(key))

    def _num_keys(self):
        return self._store._num_keys()
