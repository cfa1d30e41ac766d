"""numba.cuda behind one door: its import, the simulator, and device-array checks.

Every CUDA module of numcoll (``numcoll/cuda/*.py``) reaches ``numba.cuda``
through this one, so that a missing CUDA target fails with one clear
ImportError and the simulator's quirks are handled in one place. Like the rest
of the CUDA side, import it lazily: ``import numcoll`` must not load
``numba.cuda``.

The device-array helpers accept anything with ``__cuda_array_interface__``
(Numba device arrays, CuPy arrays, torch CUDA tensors) and check what a kernel
launch or a copy relies on: writability, C-contiguity and alignment.
"""

from __future__ import annotations

import re

import numpy as np

try:
    from numba import cuda
    from numba.cuda.cudadrv import devicearray as _devicearray
    from numba.cuda.cudadrv import error as _cuda_errors
except Exception as exc:  # pragma: no cover - depends on the installation
    raise ImportError(
        "numcoll.cuda needs Numba's CUDA target (numba.cuda); "
        f"it failed to import: {exc}. Install it with `pip install numba-cuda`."
    ) from exc

#: True when numba.cuda is the simulator (decided when numba.cuda was imported).
_SIMULATED = cuda.jit.__module__.startswith("numba.cuda.simulator")
# Host code calls numba.cuda only through these names, never through the
# module: while a simulated kernel runs, the simulator swaps every module-level
# reference to numba.cuda in the kernel's module (loops) for its
# per-launch fake, which would break a host call made at that moment on
# another thread.
_jit = cuda.jit
_to_device = cuda.to_device
_pinned_array = cuda.pinned_array
_as_cuda_array = getattr(cuda, "as_cuda_array", None)   # absent from the simulator
_cuda_is_available = cuda.is_available
# Events only order streams and tell the host when a stream has passed a point
# (no timing); the simulator's take no arguments.
_new_event = cuda.event if _SIMULATED else (lambda: cuda.event(timing=False))
_DRIVER_ERRORS = tuple(
    getattr(_cuda_errors, name)
    for name in ("CudaSupportError", "CudaDriverError", "CudaRuntimeError")
    if hasattr(_cuda_errors, name)
)


def is_available() -> bool:
    """True if kernels can be launched here: a usable CUDA GPU, or the simulator."""
    try:
        return bool(_cuda_is_available())
    except Exception:  # a broken driver installation means "no"
        return False


def _reason(exc: Exception) -> str:
    """The telling line of a Numba typing error (it opens with "Failed in ... pipeline")."""
    lines = [line.strip() for line in re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).splitlines()]
    lines = [line for line in lines if line and not line.startswith("Failed in")]
    if not lines:
        return type(exc).__name__
    if lines[0].endswith(":") and len(lines) > 1:    # "... found for signature:" + the call
        return f"{lines[0]} {lines[1]}"
    return lines[0]


# --------------------------------------------------------------------------
# Device-array views
# --------------------------------------------------------------------------

class _SimulatedForeign:
    """Exposes a foreign ``__cuda_array_interface__`` to NumPy (simulator only)."""

    def __init__(self, owner, desc):
        self._owner = owner                      # keeps the memory alive
        self.__array_interface__ = {
            "data": tuple(desc["data"]), "shape": tuple(desc["shape"]),
            "strides": desc.get("strides"), "typestr": desc["typestr"], "version": 3,
        }


def view(obj):
    """``obj`` as a Numba device array: itself, or a view of a foreign
    ``__cuda_array_interface__`` (never a copy); None if it is not CUDA memory.

    The one place a foreign array is viewed: converting it synchronises the
    stream its producer exported (the interface's v3 rule).
    """
    if _devicearray.is_cuda_ndarray(obj):
        return obj                               # Numba's own: never read-only
    desc = getattr(obj, "__cuda_array_interface__", None)
    if desc is None:
        return None
    if not _SIMULATED:
        return _as_cuda_array(obj)
    # The simulator has no as_cuda_array; its "device" memory is host memory,
    # so a foreign interface there can only point at host memory too.
    return _devicearray.FakeCUDAArray(np.asarray(_SimulatedForeign(obj, desc)))


def is_read_only(obj) -> bool:
    """True if ``obj``'s CUDA array interface says its memory is read-only."""
    desc = getattr(obj, "__cuda_array_interface__", None)
    return bool(desc is not None and not _devicearray.is_cuda_ndarray(obj) and desc["data"][1])


def _as_device(where: str, name: str, obj, writable: bool = False):
    """``obj`` as a Numba device array (a view, never a copy), checked."""
    if writable and is_read_only(obj):
        raise ValueError(f"{where}: {name} is read-only")
    dev = view(obj)
    if dev is None:
        raise TypeError(
            f"{where}: {name} must be a CUDA device array (an object with "
            f"__cuda_array_interface__: Numba device array, CuPy, torch CUDA tensor), got "
            f"{type(obj).__name__}; host arrays go to numcoll.kernels.cpu"
        )
    return dev


def _device_pointer(dev) -> int:
    if _SIMULATED:
        return dev._ary.__array_interface__["data"][0]
    return dev.__cuda_array_interface__["data"][0]


def _flat(where: str, name: str, dev):
    """Check a device array's layout; return it as a 1-D view."""
    if not dev.is_c_contiguous():
        raise ValueError(
            f"{where}: {name} must be C-contiguous, got shape {tuple(dev.shape)} with "
            f"strides {tuple(dev.strides)}; copy it to a contiguous device array first"
        )
    # A view at an odd offset into a byte buffer would fault on the GPU
    # ("misaligned address"), which poisons the whole CUDA context.
    itemsize = dev.dtype.itemsize
    if dev.size and _device_pointer(dev) % itemsize:
        raise ValueError(
            f"{where}: {name} is not aligned to its {itemsize}-byte items "
            f"(device address {_device_pointer(dev):#x})"
        )
    return dev if dev.ndim == 1 else dev.reshape(dev.size)
