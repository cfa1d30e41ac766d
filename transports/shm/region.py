"""A ``shm`` rank's memory file: what it holds, how large it is, and the
seals that make it safe to map.

Every rank owns one anonymous memory file (``memfd_create``: no name, so
nothing can be left in ``/dev/shm``, even after SIGKILL): its inbound rings,
one per peer (:mod:`transports.shm.ring`), and on rank 0, page-aligned after
them, the shared arena (:mod:`transports.shm.arena`).

A process that can change the size of a file another process maps can kill
that process: a read or write past the new end is a SIGBUS. So a file is
sealed (``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``) before it is passed to
anyone -- from then on no process, its creator included, can change its
size or its seals -- and a peer's file is mapped only if it carries those
seals and has exactly the size the group's settings give it.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat

from . import ring as K
from .arena import arena_nbytes

__all__ = ["create_region", "check_region", "region_nbytes", "arena_offset", "SEALS"]

#: The seals every memory file carries before it is passed.
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
#: Seals that would forbid mapping a file writable (F_SEAL_FUTURE_WRITE is 0x10).
WRITE_SEALS = fcntl.F_SEAL_WRITE | 0x10


def arena_offset(size: int, capacity: int) -> int:
    """Where the arena starts in rank 0's file: after its rings, page-aligned."""
    rings = (size - 1) * (K.CTRL_NBYTES + capacity)
    return (rings + mmap.PAGESIZE - 1) & ~(mmap.PAGESIZE - 1)


def region_nbytes(owner: int, size: int, capacity: int, arena_slot_nbytes: int) -> int:
    """Bytes of ``owner``'s file in a group of ``size`` with rings of
    ``capacity`` bytes: its inbound rings, and on rank 0 the arena."""
    if owner != 0 or not arena_slot_nbytes:
        return (size - 1) * (K.CTRL_NBYTES + capacity)
    return arena_offset(size, capacity) + arena_nbytes(size, arena_slot_nbytes)


def create_region(rank: int, nbytes: int) -> tuple[int, mmap.mmap]:
    """A new anonymous memory file of ``nbytes``, sealed against any change of
    size, and this rank's mapping of it. The caller closes the fd."""
    fd = os.memfd_create(f"numcoll-shm-rank{rank}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        return fd, mmap.mmap(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise


def check_region(fd: int, nbytes: int) -> str | None:
    """Why the memory file ``fd`` may not be mapped as a peer's region of
    ``nbytes``, or None: it must be a regular file of exactly that size whose
    size no one can change any more, and which may be mapped writable."""
    try:
        st = os.fstat(fd)
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as exc:  # EINVAL: not a file that takes seals
        return f"not a sealed memory file ({exc.strerror})"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if seals & SEALS != SEALS:
        return f"not sealed against shrinking and growing (seals {seals:#x})"
    if seals & WRITE_SEALS:
        return f"sealed against writing (seals {seals:#x})"
    if st.st_size != nbytes:
        return f"{st.st_size} bytes, expected {nbytes}"
    return None
