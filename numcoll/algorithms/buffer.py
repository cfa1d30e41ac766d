"""The work buffer an algorithm runs on: the interface, not an implementation.

Algorithms never touch arrays directly: they ask a buffer for the bytes of a
range to send, for a place to receive a range into, and to reduce received
bytes into a range. :class:`numcoll.memory.host.HostBuffer` does this for a
flat NumPy array; :class:`numcoll.cuda.buffer.DeviceBuffer` for device memory
through host staging, so every algorithm runs unchanged on both.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["WorkBuffer"]


class WorkBuffer(Protocol):
    #: Elements in the buffer, and bytes per element.
    count: int
    itemsize: int

    def send_view(self, start: int, count: int):
        """Elements ``start:start + count``, to send (valid until the send completes)."""

    def recv_view(self, start: int, count: int):
        """Where elements ``start:start + count`` are received."""

    def recv_done(self, start: int, count: int) -> None:
        """The bytes of ``recv_view(start, count)`` have arrived."""

    def reduce_from(self, start: int, count: int, incoming) -> None:
        """Elements ``start:start + count`` := op(themselves, ``incoming``'s bytes)."""
