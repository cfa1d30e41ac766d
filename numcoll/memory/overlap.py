"""Arrays that share memory: the one rule every call that writes arrays applies.

A call that reads some arrays and writes others is only well defined when what
it writes cannot change what it still has to read, and when no two written
elements are one memory location. Algorithms read their inputs at different
moments -- some copy them into a buffer first, the shared-arena ones read them
in place while writing this rank's share, peers read a shared array in place --
so the rule is made here, once, at the call, and not argued per algorithm:

1. **Refused: an output that overlaps itself** (a zero stride, strides that
   fold back): torch's ``assert_no_internal_overlap``, with its words
   (:data:`INTERNAL_OVERLAP`). Such an output cannot hold a result, and a
   flat copy of it can be absurdly large (``as_strided(np.zeros(1),
   shape=(2**40,), strides=(0,))`` is 8 TiB).
2. **Refused: two outputs that overlap**, unless they are the very same view
   of memory and the call writes the same values into both (allreduce and
   broadcast of a list holding one array twice): whichever is written last
   would win, so no answer is right.
3. **Handled: an input that overlaps an output.** :func:`check_overlap`
   says so, and the collective reads its inputs from a copy taken before
   anything is written or sent -- the result is what it would be had the
   inputs been separate arrays. The forms a collective handles in place
   without a copy are named by the collective and exempt: torch's in-place
   forms, ``reduce_scatter_tensor(inp[r*n:(r+1)*n], inp)`` and
   ``all_gather_into_tensor(out, out[r*n:(r+1)*n])``, and an input that is
   exactly the output its own data goes to (gather's and scatter's own
   slot). A collective that cannot copy (other ranks read the
   input in place, as with shared arrays) passes ``copy=False`` and the
   overlap is refused instead.

Overlap is decided exactly (:func:`numpy.shares_memory`, bounded work; a
layout too hard to decide counts as overlapping), for host and CUDA arrays
alike (a device array is analysed through a NumPy view of its addresses that
is never read). Contiguous arrays, the usual case, cost a flag test.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["INTERNAL_OVERLAP", "check_overlap", "check_no_internal_overlap",
           "has_internal_overlap", "shares_memory", "same_view"]

#: torch's message for a written-to tensor with internal overlap (ATen's
#: ``assert_no_internal_overlap``).
INTERNAL_OVERLAP = ("unsupported operation: more than one element of the written-to tensor "
                    "refers to a single memory location. Please clone() the tensor before "
                    "performing the operation.")
#: Work bound for :func:`numpy.shares_memory` (exact for every ordinary layout;
#: beyond it a pair counts as overlapping).
_MAX_WORK = 1 << 16
#: The largest array whose folded layout is checked element by element; a
#: larger one that the stride test cannot clear counts as overlapping.
_EXACT_ELEMENTS = 1 << 20
#: From this many arrays on, pairs are found by sorting byte ranges, not all tested.
_SORT_FROM = 8


def check_overlap(op: str, outputs: Sequence, inputs: Sequence = (), *,
                  same_result: bool = False, in_place: Sequence = (),
                  copy: bool = True, what: str = "output") -> bool:
    """Apply the rule of this module to one call; return whether it must copy its inputs.

    Parameters
    ----------
    op : the call's name, for the messages.
    outputs : every array the call writes (on this rank).
    inputs : every array it reads that is not also one of ``outputs``.
    same_result : the call writes the same values into every output (allreduce,
        broadcast): the same view passed twice is then allowed.
    in_place : ``(input, output)`` pairs (the very objects passed in ``inputs``
        and ``outputs``) whose overlap the collective handles without a copy:
        the caller has checked that they are in its in-place form (e.g. with
        :func:`same_view`: the output is exactly this rank's chunk of the input,
        or the input is exactly the output this rank's own data goes to).
    copy : False when the collective cannot read its inputs from a copy (peers
        read them in place): an input overlapping an output is then refused.
    what : what the messages call an output ("gradient" for the Reducer).

    Returns
    -------
    True when some input shares memory with some output (beyond ``in_place``):
    the collective must read the inputs from copies made before anything is
    written or sent. Raises ``ValueError`` (torch's words) for what cannot be
    made right.
    """
    for i, a in enumerate(outputs):
        check_no_internal_overlap(a, op, f"{what} {i}" if len(outputs) > 1 else what)
    for i, j in _overlapping_pairs(outputs):
        if not (same_result and same_view(outputs[i], outputs[j])):
            raise ValueError(
                f"{op}: unsupported operation: {what}s {i} and {j} refer to the same memory "
                "location (they overlap), so whichever is written last would win. Please "
                "clone() one of them before performing the operation.")
    if not inputs or not outputs:
        return False
    for i, a in enumerate(inputs):
        for j, b in enumerate(outputs):
            if not shares_memory(a, b) or any(a is x and b is y for x, y in in_place):
                continue
            if not copy:
                raise ValueError(
                    f"{op}: unsupported operation: some elements of input {i} and output {j} "
                    "refer to a single memory location, and this call cannot read its input "
                    "from a copy. Please clone() the tensor before performing the operation.")
            return True
    return False


def check_no_internal_overlap(a, op: str, what: str = "output") -> None:
    """``ValueError`` with torch's words if ``a`` (written by ``op``) overlaps itself."""
    if has_internal_overlap(a):
        raise ValueError(f"{op}: {what}: {INTERNAL_OVERLAP}")


def has_internal_overlap(a) -> bool:
    """True if two elements of ``a`` share a byte (host or CUDA array)."""
    if isinstance(a, np.ndarray) and (a.flags.c_contiguous or a.flags.f_contiguous):
        return False
    shape, strides, itemsize = _layout(a)
    dims = sorted((abs(s), n) for s, n in zip(strides, shape) if n > 1)
    if not dims or 0 in shape:
        return False
    if dims[0][0] == 0:
        return True  # torch's MemOverlap::Yes: a zero stride over more than one element
    reach = itemsize  # bytes spanned by the dimensions checked so far
    for stride, n in dims:
        if stride < reach:
            break
        reach += stride * (n - 1)
    else:
        return False  # every stride clears the dimensions below it: no two elements meet
    # Strides that interleave: decide element by element (rare layouts).
    count = int(np.prod([n for _, n in dims], dtype=np.int64))
    if count > _EXACT_ELEMENTS:
        return True
    offsets = np.zeros(1, np.int64)
    for stride, n in dims:
        offsets = (offsets[:, None] + stride * np.arange(n, dtype=np.int64)).reshape(-1)
    offsets.sort()
    return bool((np.diff(offsets) < itemsize).any())


def shares_memory(a, b) -> bool:
    """True if ``a`` and ``b`` have a byte in common (exactly, within a work
    bound; beyond it, True)."""
    if not a.size or not b.size:
        return False
    try:
        return bool(np.shares_memory(_host_view(a), _host_view(b), max_work=_MAX_WORK))
    except np.exceptions.TooHardError:
        return True


def same_view(a, b) -> bool:
    """True if ``a`` and ``b`` are the same elements of memory in the same
    order: same first address, shape, strides and item size."""
    if a is b:
        return True
    if a.size != b.size or a.dtype.itemsize != b.dtype.itemsize or _address(a) != _address(b):
        return False
    return (_contiguous(a) and _contiguous(b)) or _flat_layout(a) == _flat_layout(b)


# -- internals ------------------------------------------------------------------------------
def _overlapping_pairs(arrays: Sequence) -> list[tuple[int, int]]:
    """The pairs ``(i, j)``, ``i < j``, of ``arrays`` that share memory."""
    n = len(arrays)
    if n < 2:
        return []
    if n < _SORT_FROM:
        return [(i, j) for i in range(n) for j in range(i + 1, n)
                if shares_memory(arrays[i], arrays[j])]
    # Sweep byte ranges in order of their first byte: only ranges that meet
    # can share memory, and disjoint arrays (the usual case) cost a sort.
    spans = sorted((lo, hi, i) for i, (lo, hi) in enumerate(map(_byte_range, arrays)) if hi > lo)
    pairs, open_spans = [], []
    for lo, hi, i in spans:
        open_spans = [s for s in open_spans if s[1] > lo]
        for _, _, j in open_spans:
            if shares_memory(arrays[i], arrays[j]):
                pairs.append((min(i, j), max(i, j)))
        open_spans.append((lo, hi, i))
    return sorted(pairs)


def _layout(a) -> tuple[tuple, tuple, int]:
    """Shape, byte strides and item size of a host or device array."""
    return tuple(a.shape), tuple(a.strides), a.dtype.itemsize


def _address(a) -> int:
    if isinstance(a, np.ndarray):
        return a.__array_interface__["data"][0]
    from ..cuda.device import _device_pointer  # lazy: loads numba.cuda

    return _device_pointer(a)


def _contiguous(a) -> bool:
    return a.flags.c_contiguous if isinstance(a, np.ndarray) else a.is_c_contiguous()


def _flat_layout(a) -> tuple:
    """Shape and strides with the dimensions of one element dropped: views that
    reach the same elements in the same order compare equal."""
    return tuple((n, s) for n, s in zip(a.shape, a.strides) if n != 1)


def _byte_range(a) -> tuple[int, int]:
    """First byte and one past the last byte that ``a`` can reach."""
    if not a.size:
        return 0, 0
    lo = hi = _address(a)
    for n, s in zip(a.shape, a.strides):
        if s < 0:
            lo += s * (n - 1)
        else:
            hi += s * (n - 1)
    return lo, hi + a.dtype.itemsize


class _Addresses:
    """A NumPy view of a device array's addresses, for :func:`numpy.shares_memory`
    (which only does arithmetic on them: the memory is never read)."""

    def __init__(self, a):
        shape, strides, itemsize = _layout(a)
        self.__array_interface__ = {"version": 3, "shape": shape, "strides": strides,
                                    "typestr": f"|V{itemsize}", "data": (_address(a), False)}


def _host_view(a):
    return a if isinstance(a, np.ndarray) else np.asarray(_Addresses(a))
