"""``broadcast_coalesced``: many arrays from one rank, a few large messages.

torch's ``dist._broadcast_coalesced(pg, tensors, buffer_size, src)``: arrays are
grouped by dtype into buffers that close once they reach ``buffer_size`` bytes
(the rule of ``compute_bucket_assignment_by_size``), each buffer is packed on
the root with one kernel call, broadcast, and unpacked on the other ranks with
another. Every group's broadcast is queued before the first is waited for.
"""

from __future__ import annotations

import numpy as np

from ..memory.arrays import as_array_list, check_writable
from ..memory.overlap import check_overlap
from .buckets import compute_bucket_assignment_by_size
from ..kernels.pack_plan import PackPlan

__all__ = ["broadcast_coalesced"]


def broadcast_coalesced(arrays, src: int = 0, buffer_size: int = 256 * 2**20,
                        group=None) -> None:
    """Copy rank ``src``'s ``arrays`` into every rank's ``arrays`` (same dtypes and shapes
    on every rank), packing same-dtype arrays into buffers of about ``buffer_size`` bytes.

    ``src`` is a global rank, as in torch. Non-contiguous host arrays go through
    contiguous copies. CUDA arrays (all of them, contiguous) are packed by one
    kernel launch per buffer.
    """
    from ..api import groups, world  # the module layer's group resolution

    name = "broadcast_coalesced"
    pg = world._resolve(group)
    if pg is None:
        return None
    if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size < 1:
        raise ValueError(f"{name}: buffer_size must be a positive number of bytes, got "
                         f"{buffer_size!r}")
    root = groups._group_rank(pg, src, "src")
    if not 0 <= root < pg.size():
        raise ValueError(f"{name}: invalid root rank: {src} (world size {pg.size()})")
    arrays = as_array_list(arrays, name, allow_single=False)
    if not arrays:
        return None
    on_device = [not isinstance(a, np.ndarray) for a in arrays]
    if any(on_device) and not all(on_device):
        raise TypeError(f"{name}: cannot mix host (NumPy) and device (CUDA) arrays in one call")
    is_root = pg.rank() == root
    if not is_root:
        check_writable(arrays, name)
    # Checked on every rank (the root only reads them), so that every rank refuses alike.
    check_overlap(name, arrays, same_result=True)
    groups, _ = compute_bucket_assignment_by_size(arrays, [buffer_size])
    if all(on_device):
        from ..cuda.pack import DevicePackPlan as Plan  # lazy: loads numba.cuda
    else:
        Plan = PackPlan
    pending = []
    for indices in groups:
        targets = [arrays[i] for i in indices]
        staged = [a if a.flags.c_contiguous else np.ascontiguousarray(a) for a in targets] \
            if Plan is PackPlan else targets     # device arrays must be contiguous
        plan = Plan(staged, name)
        buf = plan.pack() if is_root else plan.empty()
        pending.append((pg.broadcast([buf], root=root), plan, buf, targets, staged))
    for work, plan, buf, targets, staged in pending:
        work.wait()
        if not is_root:
            plan.unpack(buf)
            for a, s in zip(targets, staged):
                if a is not s:
                    np.copyto(a, s)
    return None
