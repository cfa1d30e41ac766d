"""A rank dies with the process that launched it: the one way numcoll asks for it.

On Linux a process can ask the kernel for a signal when its parent dies
(``prctl(PR_SET_PDEATHSIG)``); it must then check that its parent is still the
launcher, because the launcher may have died before the request took effect
(the process would then have been re-parented, and no signal would come).
Both launchers use it: ``nc.launch``'s ranks call :func:`die_with_parent` as
their first step; ``numcoll run`` passes :func:`preexec_for` to ``Popen`` so
it runs in the child before the script starts. Elsewhere it does nothing
(``nc.launch``'s ranks also watch their socket pair to the launcher).
"""

from __future__ import annotations

import os
import signal
import sys

__all__ = ["die_with_parent", "preexec_for"]

_PR_SET_PDEATHSIG = 1


def _prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        return getattr(libc, "prctl", None)
    except OSError:
        return None


def die_with_parent(parent_pid: int, prctl=None) -> None:
    """Ask for SIGKILL when the parent dies; exit at once (status 1) if the
    parent ``parent_pid`` is already gone."""
    prctl = prctl or _prctl()
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


def preexec_for(parent_pid: int):
    """A ``Popen(preexec_fn=...)`` that makes the child die with ``parent_pid``.
    ``prctl`` is looked up here, in the parent: the child between fork and exec
    should do as little as possible."""
    prctl = _prctl()

    def in_child() -> None:
        die_with_parent(parent_pid, prctl)

    return in_child
