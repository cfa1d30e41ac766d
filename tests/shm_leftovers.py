"""numcoll's entries in /dev/shm, for the tests that check a run left none.

The suite's workers run side by side (``pytest -n 2``), so while a test looks,
another test's ranks, an MPI job or a multiprocessing queue may have entries of
their own in /dev/shm: a listing of the whole directory before and after would
blame the wrong test. numcoll's only entries there are the ipc transport's
slabs, named ``numcoll-slab-<creator pid>-...``; one whose creator is another
live process belongs to a run still going, not to a test whose processes have
all ended when it looks.
"""

from __future__ import annotations

import os
import re

SHM_DIR = "/dev/shm"
_SLAB = re.compile(r"numcoll-slab-(\d+)-")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        return True
    return True


def numcoll_entries() -> set[str]:
    """numcoll's entries in /dev/shm made by this process or by one that has exited."""
    if not os.path.isdir(SHM_DIR):
        return set()
    me = os.getpid()
    found = set()
    for name in os.listdir(SHM_DIR):
        match = _SLAB.match(name)
        if match and (int(match[1]) == me or not _alive(int(match[1]))):
            found.add(name)
    return found
