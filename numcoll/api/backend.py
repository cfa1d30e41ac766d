"""What torch.distributed says about backends and the environment, for
numcoll: it is a gloo backend, always available; no NCCL, no MPI backend.
"""

from __future__ import annotations

import os

from ..ops import ReduceOp
from ..process_group import ProcessGroup
from .world import BACKENDS, GroupMember, _check_group, _world, get_default_group

__all__ = ["Backend", "is_available", "is_gloo_available", "is_nccl_available",
           "is_mpi_available", "is_backend_available", "supports_complex", "get_pg_count",
           "is_torchelastic_launched", "get_node_local_rank", "get_backend"]

class Backend(str):
    """Backend names, as ``torch.distributed.Backend``: numcoll is gloo."""

    GLOO = "gloo"
    NUMCOLL = "numcoll"
    UNDEFINED = "undefined"

    def __new__(cls, name: str):
        if not isinstance(name, str) or name.lower() not in BACKENDS:
            raise ValueError(f"Backend {name!r} is not supported by numcoll (it implements "
                             "gloo's collectives: use 'gloo' or 'numcoll')")
        return super().__new__(cls, name.lower())


def is_available() -> bool:
    """Always True: numcoll needs nothing beyond its dependencies."""
    return True


def is_gloo_available() -> bool:
    """True: numcoll is a gloo backend."""
    return True


def is_nccl_available() -> bool:
    """False: numcoll has no NCCL backend."""
    return False


def is_mpi_available() -> bool:
    """False: numcoll has no MPI backend (it does run under mpirun)."""
    return False


def is_backend_available(backend: str) -> bool:
    """Whether ``backend`` can be used here: "gloo" and "numcoll" can."""
    return isinstance(backend, str) and backend.lower() in BACKENDS


def supports_complex(reduceOp: ReduceOp) -> bool:  # noqa: N803 - torch's name
    """Whether ``reduceOp`` takes complex arrays (MIN/MAX and bitwise ops do not;
    unlike gloo, numcoll's PRODUCT does)."""
    return reduceOp not in (ReduceOp.MIN, ReduceOp.MAX, ReduceOp.BAND, ReduceOp.BOR,
                            ReduceOp.BXOR)


def get_pg_count() -> int:
    """How many process groups this process made (the default group included)."""
    world = _world()
    return (world.pg is not None) + world.group_count + sum(world.local_counts.values())


def is_torchelastic_launched() -> bool:
    """Whether torchrun (or ``numcoll run``) started this process."""
    return os.environ.get("TORCHELASTIC_RUN_ID") is not None


def get_node_local_rank(fallback_rank: int | None = None) -> int:
    """``LOCAL_RANK`` from the launcher, else ``fallback_rank``."""
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    if fallback_rank is not None:
        return int(fallback_rank)
    raise RuntimeError("LOCAL_RANK is not in the environment. Consider passing fallback_rank "
                       "to allow `get_node_local_rank` to work.")


def get_backend(group: ProcessGroup | None = None) -> str:
    """The backend's name: "gloo" (or "numcoll" if the group was made with it)."""
    _check_group(group)
    if group is GroupMember.NON_GROUP_MEMBER:
        raise ValueError("Invalid process group specified")
    get_default_group()
    return _world().backend


def _make_nccl_premul_sum(factor) -> ReduceOp:
    """torch's spelling of :meth:`ReduceOp.premul_sum`."""
    return ReduceOp.premul_sum(factor)
