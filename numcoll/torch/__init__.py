"""numcoll as a torch.distributed backend.

::

    import torch.distributed as dist
    import numcoll.torch                      # registers the backend "numcoll"

    dist.init_process_group("numcoll")        # env://, tcp://, file:// or store=, as with gloo
    dist.all_reduce(tensor)                   # numcoll runs it, on the tensor's own memory
    group = dist.new_group([0, 1], backend="numcoll")
    dist.init_process_group("cpu:numcoll,cuda:nccl")   # numcoll for CPU tensors, NCCL for CUDA

Importing this module registers the backend with
``torch.distributed.Backend.register_backend`` (for the ``cpu`` and ``cuda``
devices; torch's defaults for each device are left as they are). An installed
numcoll also registers it when torch is imported, through torch's
``torch.backends`` entry point (see docs/guide/torch-backend.md), so the
import is only needed where that is switched off (``TORCH_DEVICE_BACKEND_AUTOLOAD=0``)
or numcoll is not installed.

The group torch gets is :class:`ProcessGroupNumcoll` (a ``dist.ProcessGroup``
subclass); its Works carry real ``torch.futures.Future`` objects, so DDP and
its comm hooks run on it unchanged. ``pg_options`` of ``init_process_group``
and ``new_group`` may be a :class:`numcoll.ProcessGroup.Options`.
"""

from __future__ import annotations

import datetime


def _autoload() -> None:
    """torch's ``torch.backends`` entry point (numcoll's pyproject.toml declares
    it): torch calls it at the end of ``import torch``. It registers the
    backend and never raises: a failure here must not break ``import torch``.

    Defined before this module imports torch: when ``import numcoll.torch``
    comes first, it is this module's own ``import torch`` that calls back here,
    while this module is half-imported; then there is nothing to do yet (the
    import registers the backend once torch is loaded)."""
    if "dist" not in globals():
        return
    try:
        register()
    except Exception as exc:  # noqa: BLE001 - see above
        import warnings

        warnings.warn(f"numcoll could not register its torch.distributed backend: {exc!r}",
                      RuntimeWarning, stacklevel=2)


import torch.distributed as dist  # noqa: E402 - after _autoload (see there)

__all__ = ["BACKEND_NAME", "ProcessGroupNumcoll", "Work", "register", "monitored_barrier",
           "to_torch_error", "shrink_group"]

#: The name torch.distributed knows the backend by: ``dist.init_process_group("numcoll")``.
BACKEND_NAME = "numcoll"


def _create(backend_opts, pg_options):
    """torch's extended backend constructor: a :class:`ProcessGroupNumcoll`."""
    from .backend import ProcessGroupNumcoll

    return ProcessGroupNumcoll(backend_opts.store, backend_opts.group_rank,
                               backend_opts.group_size, backend_opts.timeout, pg_options,
                               group_name=str(backend_opts.group_id))


def register() -> bool:
    """Register the ``"numcoll"`` backend with torch.distributed (idempotent).

    Returns whether it is registered (False where torch was built without
    torch.distributed)."""
    if not dist.is_available():
        return False
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True,
                                      devices=["cpu", "cuda"])
    return True


def monitored_barrier(group=None, timeout: datetime.timedelta | None = None,
                      wait_all_ranks: bool = False) -> None:
    """``dist.monitored_barrier`` for numcoll groups (torch's refuses every
    backend but gloo by name): rank 0 raises naming the ranks that did not
    arrive within ``timeout``."""
    group = group or dist.group.WORLD
    if group is None:
        raise ValueError("monitored_barrier: the default process group has not been "
                         "initialized; call init_process_group first")
    group.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)


def shrink_group(group=None, timeout: datetime.timedelta | None = None):
    """The survivors' group of a numcoll torch group after a rank died.

    A collective of the live ranks of ``group`` (default: the default group):
    it agrees on who is gone and returns a new :class:`ProcessGroupNumcoll`
    of the rest, renumbered in order (``new.old_ranks()[i]`` is the rank of
    its rank ``i`` in ``group``); ``group`` is shut down. The new group is
    not registered with torch.distributed as its default group (torch has no
    public way to replace it): pass it explicitly, ``dist.all_reduce(t,
    group=new)``, ``DistributedDataParallel(model, process_group=new)``.

    Parameters
    ----------
    group : ProcessGroupNumcoll, optional
        Default: ``dist.group.WORLD``.
    timeout : datetime.timedelta, optional
        Bounds the agreement (default 60 s).

    Returns
    -------
    ProcessGroupNumcoll

    Raises
    ------
    RuntimeError
        torch's error classes (``DistBackendError``...) for numcoll's failures.

    Examples
    --------
    >>> try:                                          # doctest: +SKIP
    ...     loss = step(ddp)
    ... except RuntimeError:
    ...     pg = numcoll.torch.shrink_group(pg)
    ...     ddp = DistributedDataParallel(model, process_group=pg)
    """
    from .backend import ProcessGroupNumcoll

    group = group if group is not None else dist.group.WORLD
    if not isinstance(group, ProcessGroupNumcoll):
        raise TypeError(f"shrink_group: the group must be a numcoll group "
                        f"(ProcessGroupNumcoll), got {type(group).__name__}")
    return group.shrink(timeout)


def __getattr__(name: str):
    # The backend's classes are imported on first use: the torch.backends entry
    # point imports this module while torch itself is still being imported.
    if name == "ProcessGroupNumcoll":
        from .backend import ProcessGroupNumcoll
        return ProcessGroupNumcoll
    if name == "Work":
        from .work import Work
        return Work
    if name == "to_torch_error":
        from .errors import to_torch_error
        return to_torch_error
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


register()
