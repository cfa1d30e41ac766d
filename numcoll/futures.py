"""Futures: the value of a collective, available when its Work completes.

A small, thread-safe future in the style of ``torch.futures.Future``:
``wait()`` returns the value or raises the error, ``then(fn)`` chains,
``add_done_callback(fn)`` runs ``fn(fut)`` on completion.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterable

__all__ = ["Future", "FutureTimeoutError", "wait_all"]


class FutureTimeoutError(TimeoutError):
    """A wait given a timeout ended before the future completed. Only the wait
    failed: the operation goes on, and the future may still complete."""

class Future:
    """The eventual value (or error) of an asynchronous operation."""

    __slots__ = ("_state_lock", "_done_lock", "_completed", "_value", "_error", "_callbacks")

    def __init__(self):
        self._state_lock = threading.Lock()
        # Made by the first wait() that finds the future pending, held until
        # completion (the pattern Thread.join uses); most futures complete
        # before anyone waits (a blocking call runs its work at once), and
        # then none is made.
        self._done_lock: threading.Lock | None = None
        self._completed = False
        self._value: Any = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[Future], None]] | None = None  # made when one is added

    # -- completion (called by the thread that ran the operation) --------------
    def set_result(self, value: Any) -> None:
        """Complete the future with ``value`` (for futures you made, e.g. in hooks)."""
        self._complete(value, None)

    def set_exception(self, error: BaseException) -> None:
        """Complete the future with ``error``; ``wait()`` raises it."""
        self._complete(None, error)

    def _complete(self, value, error) -> None:
        with self._state_lock:
            if self._completed:
                raise RuntimeError("Future already completed")
            self._value, self._error = value, error
            self._completed = True
            callbacks, self._callbacks = self._callbacks, None
            waiters = self._done_lock  # made under this lock: none can appear after
        if waiters is not None:
            waiters.release()
        if callbacks:
            for cb in callbacks:
                _run_callback(cb, self)

    # -- observation ------------------------------------------------------------
    def done(self) -> bool:
        """Whether the future has completed (with a value or an error)."""
        return self._completed

    def wait(self, timeout: float | None = None) -> Any:
        """Block until done (at most ``timeout`` seconds), then return the value
        or raise the operation's error. Raises :class:`FutureTimeoutError` if
        ``timeout`` passes first (the operation itself goes on)."""
        if not self._completed:
            with self._state_lock:
                done = self._done_lock
                if done is None and not self._completed:
                    done = self._done_lock = threading.Lock()
                    done.acquire()  # released by _complete
            if done is not None:
                if not done.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
                    raise FutureTimeoutError(
                        f"Timed out waiting {int(timeout * 1000)}ms for a future")
                done.release()  # let every other waiter through too
        if self._error is not None:
            raise self._error
        return self._value

    def value(self) -> Any:
        """The value of a completed future (raises its error; ValueError if not done)."""
        if not self._completed:
            raise ValueError("Future.value() called before the future completed")
        return self.wait()

    def exception(self) -> BaseException | None:
        """The error the future completed with; None if none or not done yet."""
        return self._error if self._completed else None

    def add_done_callback(self, fn: Callable[[Future], None]) -> None:
        """Run ``fn(self)`` when done (immediately, on this thread, if already done)."""
        with self._state_lock:
            if not self._completed:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(fn)
                return
        _run_callback(fn, self)

    def then(self, fn: Callable[[Future], Any]) -> Future:
        """A new future holding ``fn(self)``'s return value (or its exception)."""
        chained = Future()

        def run(fut: Future) -> None:
            try:
                chained.set_result(fn(fut))
            except BaseException as exc:  # noqa: BLE001 - forwarded, not swallowed
                chained.set_exception(exc)

        self.add_done_callback(run)
        return chained

    def __repr__(self):
        state = "pending" if not self._completed else ("failed" if self._error else "done")
        return f"<numcoll.Future {state}>"


def _run_callback(cb: Callable[[Future], None], fut: Future) -> None:
    try:
        cb(fut)
    except Exception:  # a user's callback must not kill the worker thread
        import logging

        logging.getLogger("numcoll").exception("future callback %r raised", cb)


def wait_all(futures: Iterable) -> list:
    """Wait for every future (or Work) and return their values in order; the
    first error encountered is raised."""
    values = []
    for fut in futures:
        if hasattr(fut, "get_future"):
            fut = fut.get_future()
        values.append(fut.wait())
    return values
