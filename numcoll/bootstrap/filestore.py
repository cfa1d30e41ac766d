"""FileStore: a store in a file on a shared file system, locked with ``flock``
(ranks that are processes on one host, or hosts sharing a file system).
``numcoll.bootstrap.store`` exports it too."""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import os
import struct
import threading
import time
from typing import Iterator

from ..errors import NumcollError
from .store import (DEFAULT_STORE_TIMEOUT, FILE_POLL_MAX_S, FILE_POLL_MIN_S, Store,
                    _added, _compare_set, _timeout_error)

__all__ = ["FileStore"]


# FileStore record: kind (u8), key length (u32), value length (u32), key, value.
_RECORD_HEADER = struct.Struct("<BII")
_RECORD_SET = 1
_RECORD_DELETE = 2
# User keys get a prefix so that they never collide with the bookkeeping keys.
_USER_PREFIX = "/"
_REFCOUNT_KEY = "refcount"
_FINISHED_KEY = "cleanup"


class FileStore(Store):
    """A store in a file, shared by processes that can lock it (``flock``).

    The file is an append-only log of records (a set, or a delete as a
    tombstone); each instance keeps a dictionary up to date by reading the
    log from where it last stopped. Writers hold an exclusive ``flock``,
    readers a shared one; ``get`` and ``wait`` poll the file with short,
    growing sleeps.

    Parameters
    ----------
    path : str or os.PathLike
        The file; created if missing. Its directory must exist.
    world_size : int
        How many instances (over all processes) will use the file. When the
        last of them closes, the file is removed. ``-1``: unknown, the file
        is left behind (as torch does).
    timeout : datetime.timedelta or float
        Default deadline of ``get`` and ``wait``.
    """

    def __init__(self, path: str | os.PathLike, world_size: int = -1,
                 timeout: datetime.timedelta | float = DEFAULT_STORE_TIMEOUT):
        super().__init__(timeout)
        self._fd: int | None = None
        self._path = os.fspath(path)
        self._world_size = int(world_size)
        if self._world_size == 0 or self._world_size < -1:
            raise ValueError(f"FileStore world_size must be positive or -1, got {world_size}")
        directory = os.path.dirname(os.path.abspath(self._path))
        if not os.path.isdir(directory):
            raise FileNotFoundError(
                f"FileStore: directory {directory!r} of {self._path!r} does not exist")
        self._lock = threading.Lock()  # flock does not exclude threads sharing our fd
        self._cache: dict[str, bytes] = {}
        self._offset = 0
        self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        with self._locked(exclusive=True):
            self._add_locked(_REFCOUNT_KEY, 1)

    @property
    def path(self) -> str:
        """The file's path."""
        return self._path

    def __repr__(self) -> str:
        return f"FileStore({self._path!r}, world_size={self._world_size})"

    @contextlib.contextmanager
    def _locked(self, exclusive: bool) -> Iterator[None]:
        with self._lock:
            if self._fd is None:
                raise NumcollError(f"{self!r} is closed")
            with self._flocked(exclusive):
                yield

    @contextlib.contextmanager
    def _flocked(self, exclusive: bool) -> Iterator[None]:
        """Hold the file lock (the caller holds the thread lock) and catch up."""
        fcntl.flock(self._fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            self._refresh()
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _refresh(self) -> None:
        """Apply the records appended since the last read."""
        size = os.fstat(self._fd).st_size
        if size <= self._offset:
            return
        data = os.pread(self._fd, size - self._offset, self._offset)
        pos = 0
        while pos + _RECORD_HEADER.size <= len(data):
            kind, key_nbytes, value_nbytes = _RECORD_HEADER.unpack_from(data, pos)
            start = pos + _RECORD_HEADER.size
            end = start + key_nbytes + value_nbytes
            if end > len(data):
                break  # a writer died mid-record; the next writer truncates it
            key = data[start:start + key_nbytes].decode("utf-8")
            if kind == _RECORD_SET:
                self._cache[key] = data[start + key_nbytes:end]
            elif kind == _RECORD_DELETE:
                self._cache.pop(key, None)
            else:
                raise NumcollError(f"{self!r}: corrupt record at byte {self._offset + pos}")
            pos = end
        self._offset += pos

    def _append(self, kind: int, key: str, value: bytes = b"") -> None:
        """Append one record; the caller holds the exclusive lock and has refreshed."""
        if os.fstat(self._fd).st_size != self._offset:
            # Only a partial record from a crashed writer can be left after a
            # refresh under the exclusive lock: drop it so the log stays parseable.
            os.ftruncate(self._fd, self._offset)
        key_bytes = key.encode("utf-8")
        record = _RECORD_HEADER.pack(kind, len(key_bytes), len(value)) + key_bytes + value
        view = memoryview(record)
        while view:
            view = view[os.write(self._fd, view):]
        self._offset += len(record)
        if kind == _RECORD_SET:
            self._cache[key] = value
        else:
            self._cache.pop(key, None)

    def _add_locked(self, key: str, amount: int) -> int:
        value = _added(self._cache.get(key), amount, key)
        self._append(_RECORD_SET, key, value)
        return int(value)

    def _poll(self, keys: list[str], timeout: datetime.timedelta, op: str) -> bytes:
        """Wait for ``keys``; return the first one's value."""
        names = [_USER_PREFIX + k for k in keys]
        deadline = time.monotonic() + timeout.total_seconds()
        delay = FILE_POLL_MIN_S
        while True:
            with self._locked(exclusive=False):
                missing = [k for k, n in zip(keys, names) if n not in self._cache]
                if not missing:
                    return self._cache[names[0]]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _timeout_error(timeout, missing, repr(self), op)
            time.sleep(min(delay, remaining))
            delay = min(2 * delay, FILE_POLL_MAX_S)

    def _set(self, key, value):
        with self._locked(exclusive=True):
            self._append(_RECORD_SET, _USER_PREFIX + key, value)

    def _get(self, key, timeout):
        return self._poll([key], timeout, "get")

    def _add(self, key, amount):
        with self._locked(exclusive=True):
            return self._add_locked(_USER_PREFIX + key, amount)

    def _compare_set(self, key, expected, desired):
        name = _USER_PREFIX + key
        with self._locked(exclusive=True):
            write, result = _compare_set(self._cache.get(name), expected, desired)
            if write is not None:
                self._append(_RECORD_SET, name, write)
            return result

    def _wait(self, keys, timeout):
        if keys:
            self._poll(keys, timeout, "wait")

    def _check(self, keys):
        with self._locked(exclusive=False):
            return all(_USER_PREFIX + k in self._cache for k in keys)

    def _delete_key(self, key):
        name = _USER_PREFIX + key
        with self._locked(exclusive=True):
            if name not in self._cache:
                return False
            self._append(_RECORD_DELETE, name)
            return True

    def _num_keys(self):
        with self._locked(exclusive=False):
            return sum(1 for k in self._cache if k.startswith(_USER_PREFIX))

    def close(self) -> None:
        """Stop using the file; the last of ``world_size`` users removes it."""
        with self._lock:
            if self._fd is None:
                return
            try:
                if self._still_on_disk():
                    with self._flocked(exclusive=True):
                        finished = self._add_locked(_FINISHED_KEY, 1)
                        users = self._add_locked(_REFCOUNT_KEY, -1)
                        if users == 0 and 0 <= self._world_size <= finished:
                            os.unlink(self._path)
            finally:
                os.close(self._fd)
                self._fd = None

    def _still_on_disk(self) -> bool:
        """Whether our path still names the file we have open."""
        try:
            on_disk = os.stat(self._path)
        except FileNotFoundError:
            return False  # removed already (e.g. its temporary directory was cleaned up)
        own = os.fstat(self._fd)
        return (own.st_ino, own.st_dev) == (on_disk.st_ino, on_disk.st_dev)

    def __del__(self):
        if getattr(self, "_fd", None) is not None:
            try:
                self.close()
            except Exception:  # best effort: never raise from a finalizer
                pass
