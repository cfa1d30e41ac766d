"""Peers' device memory: the one module that asks the CUDA driver to share it (CUDA IPC).

Ranks on one host read each other's device buffers directly, as NCCL's
intra-node transport does. What a rank publishes about its buffer
(:func:`describe`) is a few hundred bytes, sent to the peers through the
group's ordinary (host) transport; what a peer makes of it
(:func:`PeerMemory.view`) is a Numba device array over the publisher's memory:

- a peer in the same process (ranks as threads) uses the address as it is:
  one process has one CUDA context per device, where every allocation is
  addressable (under the simulator, where device memory is host memory, this
  is the only way, and what the tests exercise);
- a peer in another process opens the publisher's CUDA IPC handle
  (``cuIpcGetMemHandle`` / ``cuIpcOpenMemHandle``, through numba-cuda's
  ``Context.get_ipc_handle`` and ``IpcHandle.open``). The handle names the
  whole allocation the buffer lies in (for torch's caching allocator, a
  segment holding many tensors), with the buffer's offset in it, so a peer
  opens each allocation once and views any buffer in it; opened allocations
  are kept (:class:`PeerMemory`, at most ``cuda_ipc_open_max`` of them, least
  recently used closed first) and closed when the process exits
  (:func:`close_all`).

Exporting is done at every call (``cuIpcGetMemHandle`` costs microseconds),
never cached by address: an address freed and allocated again is another
allocation with another handle, so a peer can never take a stale mapping for
a new buffer.

Import lazily (it loads ``numba.cuda``).
"""

from __future__ import annotations

import atexit
import functools
import os
import pickle
import sys
import threading
from collections import OrderedDict

import numpy as np

from .. import config
from .device import _SIMULATED, _device_pointer, _devicearray, _reason, cuda, view

__all__ = ["PEERS", "PeerMemory", "close_all", "describe", "supported"]

_DeviceNDArray = getattr(_devicearray, "DeviceNDArray", None)   # the simulator has none
_current_context = None if _SIMULATED else cuda.current_context


@functools.lru_cache(maxsize=1)
def supported() -> str | None:
    """None if this process can share device memory with other processes
    through CUDA IPC, else why not (the simulator, another OS, no GPU)."""
    if _SIMULATED:
        return "the CUDA simulator has no IPC"
    if not sys.platform.startswith("linux"):
        return f"CUDA IPC needs Linux, this is {sys.platform}"
    if _DeviceNDArray is None or not hasattr(_DeviceNDArray, "get_ipc_handle"):
        return "this numba.cuda has no IPC support"
    try:
        if not cuda.is_available():
            return "no usable CUDA GPU"
    except Exception as exc:  # noqa: BLE001 - a broken driver means no IPC
        return f"the CUDA driver fails ({_reason(exc)})"
    return None


class _Address:
    """A same-process peer's buffer, seen through ``__cuda_array_interface__``."""

    def __init__(self, ptr: int, count: int, dtype: np.dtype):
        self.__cuda_array_interface__ = {
            "data": (ptr, False), "shape": (count,), "strides": None,
            "typestr": dtype.str, "version": 3, "stream": None}


def describe(dev) -> bytes:
    """What a peer needs to read the flat device array ``dev``: its process, its
    address, and (on a GPU) the IPC handle of its allocation and its offset
    there. The bytes to send to the peers; :meth:`PeerMemory.view` reads them."""
    nbytes = dev.size * dev.dtype.itemsize
    desc = {"pid": os.getpid(), "ptr": _device_pointer(dev) if nbytes else 0,
            "nbytes": nbytes, "handle": None, "offset": 0, "why": supported()}
    if desc["why"] is None and nbytes:
        try:
            memory = dev.gpu_data
            handle = _current_context().get_ipc_handle(memory)
            base, end = _extents(memory)
            # The whole allocation, from its base: a peer opens it once and
            # views every buffer in it at its offset.
            whole = type(handle)(None, handle.handle, int(end) - int(base),
                                 handle.source_info, offset=0)
            desc["handle"] = pickle.dumps(whole)
            desc["offset"] = int(handle.offset)
        except Exception as exc:  # noqa: BLE001 - e.g. memory from a stream-ordered pool
            desc["why"] = f"cuIpcGetMemHandle refused this memory ({_reason(exc)})"
    return pickle.dumps(desc)


def _extents(memory):
    from numba.cuda.cudadrv.driver import device_extents

    return device_extents(memory)


class PeerMemory:
    """The peers' allocations this process has opened, by IPC handle (an LRU).

    One per process (:data:`PEERS`): an allocation opened twice in one
    process would be mapped twice, which CUDA refuses.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._opened: OrderedDict[bytes, tuple] = OrderedDict()   # handle -> (IpcHandle, bytes)

    def view(self, data: bytes, dtype: np.dtype, op: str, peer: int):
        """The peer's flat device array of ``dtype`` that :func:`describe` gave
        ``data`` for. ``NumcollError`` naming the op and the peer where this
        process cannot reach it."""
        from ..errors import NumcollError

        desc = pickle.loads(data)
        count = desc["nbytes"] // dtype.itemsize
        if not count:       # nothing to read (an empty block of alltoall's, say)
            return None
        if desc["pid"] == os.getpid():
            # bfloat16 has no interface type string of its own ("<V2"): by its bits.
            bits = dtype if dtype.kind != "V" else np.dtype(f"u{dtype.itemsize}")
            return view(_Address(desc["ptr"], count, bits)).view(dtype)
        why = desc["why"] or supported()
        if why is not None or desc["handle"] is None:
            raise NumcollError(f"{op}: rank {peer}'s device memory cannot be opened here: "
                               f"{why or 'it published no IPC handle'}; set "
                               "NUMCOLL_CUDA_IPC=off to stage device data through host memory")
        whole = self._open(desc["handle"], op, peer)
        start = desc["offset"]
        return whole[start:start + desc["nbytes"]].view(dtype)

    def _open(self, handle: bytes, op: str, peer: int):
        with self._lock:
            found = self._opened.get(handle)
            if found is not None:
                self._opened.move_to_end(handle)
                return found[1]
        ipc = pickle.loads(handle)
        context = _current_context()
        try:
            if not ipc.can_access_peer(context):
                # (numba would stage through host memory, behind our back: the
                # staged path does that better, with every rank agreeing.)
                raise RuntimeError("its GPU is not peer-accessible from this one")
            memory = ipc.open_direct(context)
        except Exception as exc:  # noqa: BLE001 - the driver's reasons are many
            from ..errors import NumcollError

            raise NumcollError(f"{op}: cannot open rank {peer}'s device memory with CUDA IPC "
                               f"({_reason(exc)}); set NUMCOLL_CUDA_IPC=off to stage device "
                               "data through host memory") from exc
        whole = _DeviceNDArray(shape=(ipc.size,), strides=(1,), dtype=np.uint8,
                               gpu_data=memory)
        closing = []
        with self._lock:
            self._opened[handle] = (ipc, whole)
            while len(self._opened) > config.get("cuda_ipc_open_max"):
                closing.append(self._opened.popitem(last=False)[1][0])
        for old in closing:
            _close(old)
        return whole

    def close_all(self) -> int:
        """Close every opened allocation; how many were open."""
        with self._lock:
            opened, self._opened = self._opened, OrderedDict()
        for ipc, _ in opened.values():
            _close(ipc)
        return len(opened)


def _close(ipc) -> None:
    try:
        ipc.close()
    except Exception:  # noqa: BLE001 - at exit the context may be gone already
        pass


#: The process's opened peer allocations.
PEERS = PeerMemory()


def close_all() -> int:
    """Close every peer allocation this process opened; returns how many."""
    return PEERS.close_all()


atexit.register(close_all)
