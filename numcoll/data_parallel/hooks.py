"""Built-in communication hooks, as torch's ``ddp_comm_hooks.default_hooks``.

A hook is ``hook(state, bucket: GradBucket) -> Future`` whose value is the
bucket's reduced flat array. It sees the bucket before any averaging and does
its own division. ``state`` is the process group to use, as for torch's default
hooks; None means the Reducer's group (torch: the default group, which is the
Reducer's unless it was given another).
"""

from __future__ import annotations

import numpy as np

from ..dtypes import bfloat16
from ..futures import Future
from ..kernels.cpu import narrow_into, scale_into, widen_into

__all__ = ["allreduce_hook", "fp16_compress_hook", "bf16_compress_hook"]


def _group(state, bucket):
    if state is not None:
        return state
    if bucket._group is not None:
        return bucket._group
    from ..api.world import get_default_group

    return get_default_group()


def allreduce_hook(state, bucket) -> Future:
    """Divide by the world size, then allreduce the bucket (what the Reducer does
    without a hook)."""
    pg = _group(state, bucket)
    buffer = bucket.buffer()
    scale_into(buffer, pg.size())
    return pg.allreduce([buffer]).get_future().then(lambda fut: fut.value()[0])


def _compress_hook(state, bucket, half: np.dtype) -> Future:
    pg = _group(state, bucket)
    buffer = bucket.buffer()
    compressed = np.empty(buffer.size, half)
    if buffer.dtype == np.float32:
        # Divide in float32 first, then round to 16 bits once (Numba kernels).
        scale_into(buffer, pg.size())
        narrow_into(buffer, compressed)
    else:
        compressed[...] = buffer / pg.size()

    def decompress(fut):
        value = fut.value()[0]
        if buffer.dtype == np.float32:
            widen_into(value, buffer)     # in place: no second float32 buffer
        else:
            buffer[...] = value
        return buffer

    return pg.allreduce([compressed]).get_future().then(decompress)


def fp16_compress_hook(state, bucket) -> Future:
    """Allreduce the bucket as float16 (half the bytes); the result is float32 again.

    numcoll sums float16 in float32 and rounds once, so the only loss is the
    rounding of each rank's (averaged) contribution and of the sum.
    """
    return _compress_hook(state, bucket, np.dtype(np.float16))


def bf16_compress_hook(state, bucket) -> Future:
    """As :func:`fp16_compress_hook` with bfloat16 (float32's range, 8 bits of mantissa)."""
    return _compress_hook(state, bucket, bfloat16)
