"""pyzmq's zero-copy bookkeeping, made once per process before any I/O thread needs it.

A zero-copy send (``zmq.Frame(buf, copy=False, track=True)``) completes when
libzmq releases the buffer: its I/O thread then reports the frame on an inproc
PUSH socket to pyzmq's garbage-collector thread, which sets the frame's tracker
event. pyzmq makes that thread and that socket lazily, on the first zero-copy
frame of the process, and makes the socket without a lock: two threads making
their first frames at once can each make a socket, one of which is dropped
and closed, and the frames made with it are never reported. Their sends never
complete, and the collectives waiting on them fail at their deadline naming a
peer that did nothing wrong.

Every transport's I/O thread makes frames on its own, so thread ranks (or
several groups of one process) that send their first large messages together
hit that window. Reproduced with eight threads each sending one 200 KB frame
from a fresh process, the switch interval at 1 us: 13 of 60 processes had
sends that never completed; with :func:`ready` called first, 0 of 60.
"""

from __future__ import annotations

import os
import threading

import zmq

__all__ = ["ready"]

_lock = threading.Lock()
_ready_in: int | None = None  # the pid whose bookkeeping is made (a forked child remakes it)


def ready() -> None:
    """Make pyzmq's zero-copy bookkeeping for this process, under a lock, if
    it is not made yet. Cheap after the first call; call it before starting a
    thread that sends zero-copy frames."""
    global _ready_in
    pid = os.getpid()
    if _ready_in == pid:
        return
    with _lock:
        if _ready_in != pid:
            # The first zero-copy frame starts the gc thread and makes its socket;
            # released at once, it goes through that same path.
            zmq.Frame(b"\0", copy=False, track=True)
            _ready_in = pid
