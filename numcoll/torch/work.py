"""The Work a torch call gets back: a numcoll Work behind torch's ``Work`` API.

``get_future()`` is a real ``torch.futures.Future``, completed (on the numcoll
worker that ran the collective) with the collective's value -- the caller's
own tensors -- or with its error as a torch exception
(:func:`numcoll.torch.errors.to_torch_error`). So DDP's reducer, comm hooks
(``fut.then(...)``) and ``torch.futures.wait_all`` work unchanged.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from .errors import to_torch_error

__all__ = ["Work", "completed_work"]


class Work(dist._Work):
    """A torch ``Work`` for a numcoll :class:`~numcoll.work.Work`.

    ``value`` is what the torch future holds on success: what gloo's would
    (the input tensors, or the output lists, as the caller passed them).
    ``after`` runs first (e.g. writing a sparse result back), on the
    completing thread; an error it raises fails the Work.
    """

    def __init__(self, work, value, after=None):
        super().__init__()
        self._work = work
        self._value = value
        self._after = after
        self._future = torch.futures.Future()
        work.get_future().add_done_callback(self._complete)

    def _complete(self, nc_future) -> None:
        error = nc_future.exception()
        if error is None and self._after is not None:
            try:
                self._after()
            except BaseException as exc:  # noqa: BLE001 - delivered through the future
                error = exc
        if error is not None:
            self._future.set_exception(to_torch_error(error))
        else:
            self._future.set_result(self._value)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Block until the collective completes; raise its error. With a
        positive ``timeout``, a wait that passes it raises ``DistBackendError``
        (the collective itself keeps its own deadline)."""
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
        try:
            # No timeout: a numcoll Work that no worker has started runs right
            # here, on the thread that would block anyway.
            self._work.wait(seconds if seconds and seconds > 0 else None)
        except TimeoutError as exc:
            if self._work.is_completed():
                raise to_torch_error(exc) from None
            raise dist.DistBackendError(
                f"Timed out waiting {int(seconds * 1000)}ms for {self._work.op_name} "
                f"(collective #{self._work.seq}) in Work.wait()") from None
        except BaseException as exc:  # noqa: BLE001 - re-raised as torch's
            raise to_torch_error(exc) from None
        # The numcoll future wakes its waiters before it runs its callbacks:
        # make sure the torch future is complete too when wait() returns.
        self._future.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        """The ``torch.futures.Future`` of the collective's value."""
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        return self._future.done() and self._work.is_success() and self.exception() is None

    def exception(self):
        if not self._future.done():
            return None
        try:
            self._future.value()
        except BaseException as exc:  # noqa: BLE001 - the stored error is the answer
            return exc
        return None

    def result(self) -> list:
        self.wait()
        value = self._future.value()
        return value if isinstance(value, list) else [value]

    def source_rank(self) -> int:
        """For ``recv_anysource``: the group rank the message came from."""
        return self._work.source_rank()

    _source_rank = source_rank   # the name torch.distributed.recv calls

    def synchronize(self) -> None:
        """Nothing to do: numcoll's results are in memory when the Work completes."""

    def __repr__(self) -> str:
        return f"<numcoll.torch.Work {self._work!r}>"


class _Completed(dist._Work):
    """The Work of a call that has already run (``async_op=False``)."""

    def __init__(self, value):
        super().__init__()
        self._future = torch.futures.Future()
        self._future.set_result(value)
        self._value = value

    def wait(self, timeout=None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self):
        return None

    def result(self) -> list:
        return self._value if isinstance(self._value, list) else [self._value]

    def synchronize(self) -> None:
        pass


def completed_work(value) -> dist._Work:
    """A Work that is already complete with ``value``."""
    return _Completed(value)
