"""The Reducer: DDP's gradient synchronisation for arrays whose gradients the caller computes.

There is no autograd here: the caller writes gradient ``i`` into ``r.grads[i]``
and calls ``r.mark_ready(i)`` when it is final; ``r.finalize()`` ends the step.
Gradients are grouped into buckets (``compute_bucket_assignment_by_size`` over
the arrays in reverse order, since a backward pass produces the last layer's
gradients first; the first bucket small so communication starts early). When a
bucket's last gradient is marked, the bucket is packed -- one kernel call that
also multiplies by 1/world_size -- and its allreduce is queued, so it overlaps
the rest of the backward pass. Buckets are launched strictly in index order on
every rank (a bucket that fills early waits for its predecessors), which keeps
the collectives' sequence numbers in step across ranks.

After the first synchronised step the buckets are rebuilt in the order the
gradients actually became ready on rank 0, broadcast so that every rank builds
the same buckets (as DDP does).
"""

from __future__ import annotations

import contextlib
import inspect
import time
from datetime import timedelta

import numpy as np

from ..memory.arrays import as_array_list
from ..memory.overlap import check_overlap
from ..dtypes import dtype_name, is_half
from ..futures import Future, FutureTimeoutError
from ..kernels.cpu import scale_into
from .buckets import compute_bucket_assignment_by_size
from ..kernels.pack_plan import PackPlan

__all__ = ["GradBucket", "Reducer"]

_MB = 1 << 20


class GradBucket:
    """What a comm hook gets: one bucket's flat buffer and the gradients in it."""

    __slots__ = ("_index", "_buffer", "_gradients", "_is_last", "_group")

    def __init__(self, index: int, buffer: np.ndarray, gradients: list, is_last: bool,
                 group=None):
        self._index, self._buffer = index, buffer
        self._gradients, self._is_last = gradients, is_last
        self._group = group          # the Reducer's group: built-in hooks default to it

    def index(self) -> int:
        """The bucket's index (its launch position in the step)."""
        return self._index

    def buffer(self) -> np.ndarray:
        """The flat buffer: every gradient of the bucket, back to back (not averaged)."""
        return self._buffer

    def gradients(self) -> list[np.ndarray]:
        """The gradients, as views into :meth:`buffer` with their own shapes."""
        return list(self._gradients)

    def is_last(self) -> bool:
        """True for the last bucket of the step."""
        return self._is_last

    def set_buffer(self, buffer: np.ndarray) -> None:
        """Replace the buffer's contents with ``buffer`` (same size)."""
        buffer = np.asarray(buffer)
        if buffer.size != self._buffer.size:
            raise ValueError(f"GradBucket.set_buffer: bucket {self._index} holds "
                             f"{self._buffer.size} elements, got {buffer.size}")
        np.copyto(self._buffer, buffer.reshape(-1), casting="same_kind")


class _Bucket:
    __slots__ = ("indices", "buffer", "plan", "views", "pending")

    def __init__(self, indices, buffer, plan, views):
        self.indices, self.buffer, self.plan, self.views = indices, buffer, plan, views
        self.pending = len(indices)


class Reducer:
    """Average gradients across the ranks of ``group``, bucket by bucket, as they are marked.

    Parameters
    ----------
    grads : list of C-contiguous floating-point NumPy arrays, one per parameter.
    bucket_cap_mb, first_bucket_mb : bucket byte caps in MiB (torch's 25 and 1).
    group : the ProcessGroup (default: the default group).
    bucket_indices : explicit buckets (lists of gradient indices, one dtype each);
        launched in the order given and never rebuilt.
    gradient_as_bucket_view : if True, ``r.grads[i]`` are views into the bucket
        buffers (no copies in or out); write gradients into them.
    find_unused_parameters : if True, gradients left unmarked at ``finalize`` are
        allowed: unmarked on every rank, they are left untouched; unmarked on some
        ranks, they count as zero there.

    ``mark_ready`` and ``finalize`` are called from one thread (the one running the
    backward pass); the bucket allreduces run on the group's worker threads.
    """

    def __init__(self, grads, bucket_cap_mb: float = 25, first_bucket_mb: float = 1,
                 group=None, bucket_indices=None, gradient_as_bucket_view: bool = False,
                 find_unused_parameters: bool = False):
        name = "Reducer"
        if group is None:
            from ..api.world import get_default_group

            group = get_default_group()
        self._pg = group
        arrays = as_array_list(grads, name, allow_single=False)
        if not arrays:
            raise ValueError(f"{name}: requires non-empty tensor list (got no gradients)")
        for i, a in enumerate(arrays):
            if not isinstance(a, np.ndarray):
                raise TypeError(f"{name}: gradient {i} is not a host (NumPy) array")
            if a.dtype.kind not in "fc" and not is_half(a.dtype):
                raise TypeError(f"{name}: gradient {i} has dtype {dtype_name(a.dtype)}; "
                                "gradients must be floating point or complex")
            if not a.flags.c_contiguous or not a.flags.writeable:
                raise ValueError(f"{name}: gradient {i} must be C-contiguous and writable")
        for what, mb in (("bucket_cap_mb", bucket_cap_mb), ("first_bucket_mb", first_bucket_mb)):
            if not mb > 0:
                raise ValueError(f"{name}: {what} must be positive, got {mb}")
        self._n = len(arrays)
        self._caller_arrays = arrays
        self._limits = [int(first_bucket_mb * _MB), int(bucket_cap_mb * _MB)]
        self._as_view = bool(gradient_as_bucket_view)
        self._find_unused = bool(find_unused_parameters)
        if bucket_indices is None:
            order = list(range(self._n - 1, -1, -1))
            buckets, _ = compute_bucket_assignment_by_size(
                [arrays[i] for i in order], self._limits, tensor_indices=order)
            self._rebuild_pending = True
        else:
            buckets = _check_bucket_indices(bucket_indices, arrays)
            self._rebuild_pending = False
        # Results are unpacked into every gradient: two that share memory would
        # overwrite each other's average.
        check_overlap(name, arrays, what="gradient")
        self._hook = None
        self._hook_state = None
        self._sync = True
        self.grads: list[np.ndarray] = list(arrays)
        self._build(buckets)
        self._reset_step()
        self.stats: dict = {}

    # -- buckets -----------------------------------------------------------------------
    def _build(self, bucket_indices) -> None:
        old = list(self.grads)
        self._buckets: list[_Bucket] = []
        for indices in bucket_indices:
            dtype = self._caller_arrays[indices[0]].dtype
            count = sum(self._caller_arrays[i].size for i in indices)
            buffer = np.zeros(count, dtype)
            plan = PackPlan([self._caller_arrays[i] for i in indices], "Reducer")
            views = plan.views(buffer)
            # With bucket views nothing is packed: the caller writes into the buffer.
            self._buckets.append(_Bucket(list(indices), buffer, None if self._as_view else plan,
                                         views))
            if self._as_view:
                for i, v in zip(indices, views):
                    np.copyto(v, old[i])     # keep what the caller had written
                    self.grads[i] = v
        self._bucket_of = [None] * self._n
        for bucket in self._buckets:
            for pos, i in enumerate(bucket.indices):
                self._bucket_of[i] = (bucket, pos)

    @property
    def bucket_indices(self) -> list[list[int]]:
        """The gradient indices of each bucket, in launch order."""
        return [list(b.indices) for b in self._buckets]

    def _reset_step(self) -> None:
        self._marked = np.zeros(self._n, bool)
        self._ready_order: list[int] = []
        for b in self._buckets:
            b.pending = len(b.indices)
        self._next_bucket = 0
        self._futures: list = [None] * len(self._buckets)
        self._intervals: list = [None] * len(self._buckets)
        self._first_mark_time = None

    # -- the step ----------------------------------------------------------------------
    def mark_ready(self, index: int) -> None:
        """Gradient ``index`` is final for this step; a bucket whose gradients are all
        ready is launched (with every ready bucket after it, in index order)."""
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            raise TypeError(f"Reducer.mark_ready: index must be an int, got "
                            f"{type(index).__name__}")
        index = int(index)
        if not 0 <= index < self._n:
            raise ValueError(f"Reducer.mark_ready: invalid index {index}: out of range for "
                             f"{self._n} gradients")
        if self._marked[index]:
            raise RuntimeError(
                "Expected to mark a variable ready only once. Parameter at index "
                f"{index} has been marked as ready twice in this step (call finalize() "
                "once per step; under no_sync() too). This happens when a gradient is "
                "marked again after being accumulated a second time.")
        self._marked[index] = True
        if self._first_mark_time is None:
            self._first_mark_time = time.perf_counter()
        self._ready_order.append(index)
        if not self._sync:
            return
        bucket, _ = self._bucket_of[index]
        bucket.pending -= 1
        self._launch_ready()

    def _launch_ready(self, unused=None) -> None:
        while self._next_bucket < len(self._buckets) and (
                unused is not None or self._buckets[self._next_bucket].pending == 0):
            self._launch(self._next_bucket, unused)
            self._next_bucket += 1

    def _launch(self, b: int, unused=None) -> None:
        bucket = self._buckets[b]
        size = self._pg.size()
        averaging = self._hook is None
        if not self._as_view:
            bucket.plan.pack(bucket.buffer, scale=1.0 / size if averaging and size > 1
                             else None)
        elif averaging and size > 1:
            scale_into(bucket.buffer, size)
        if unused:
            for pos, i in enumerate(bucket.indices):
                if i in unused:
                    bucket.views[pos][...] = 0
        start = time.perf_counter()
        if self._hook is None:
            fut = self._pg.allreduce([bucket.buffer]).get_future()
        else:
            grad_bucket = GradBucket(b, bucket.buffer, bucket.views,
                                     b == len(self._buckets) - 1, self._pg)
            fut = self._hook(self._hook_state, grad_bucket)
            if not isinstance(fut, Future):
                raise RuntimeError("callback must return a numcoll.Future object, but got "
                                   f"{type(fut).__name__} (from comm hook {self._hook!r} "
                                   f"on bucket {b})")
        self._futures[b] = fut
        # The callback holds this step's interval itself: a step that fails resets
        # the list before its buckets' futures (failing late) call back.
        interval = self._intervals[b] = [start, None]
        fut.add_done_callback(lambda _f, iv=interval: iv.__setitem__(1, time.perf_counter()))

    def finalize(self) -> None:
        """End the step: wait for every bucket; the grads hold the average (or the
        hook's result). Raises if a gradient was not marked (without
        ``find_unused_parameters``), naming it."""
        end_of_backward = time.perf_counter()
        if not self._sync:
            self._reset_step()
            return
        unmarked = np.flatnonzero(~self._marked).tolist()
        unused = set(unmarked)
        # Gradients unmarked on every rank are left as they were: keep a copy before
        # their places in the buckets are zeroed.
        saved = {i: self.grads[i].copy() for i in unmarked} if self._find_unused else {}
        used_counts = None
        try:
            # Launch what is left, unmarked gradients as zeros: the peers' collectives
            # then complete even when this rank is about to raise, so no rank hangs.
            self._launch_ready(unused)
            if self._find_unused:
                used_counts = self._marked.astype(np.int32)
                used_work = self._pg.allreduce([used_counts])
            timeout_s = self._pg.options.timeout.total_seconds()
            values = [_wait(f, timeout_s, b) for b, f in enumerate(self._futures)]
            if self._find_unused:
                used_work.wait(timedelta(seconds=timeout_s))
        except BaseException:
            self._reset_step()
            raise
        order = self._ready_order + [i for i in range(self._n - 1, -1, -1)
                                     if not self._marked[i]]
        failed = bool(unmarked) and not self._find_unused
        if not failed:
            self._store_results(values, saved, used_counts, end_of_backward)
        self._reset_step()
        if self._rebuild_pending:
            # Even on a failing rank: every rank must run the same collectives.
            self._rebuild(order)
        if failed:
            raise RuntimeError(
                f"Reducer.finalize: gradient(s) at index {unmarked} were not marked ready "
                "in this step. Mark every gradient with mark_ready(i) before finalize(), or "
                "construct the Reducer with find_unused_parameters=True if some parameters "
                "do not get gradients in some steps. This rank's buckets were still "
                "reduced (with zeros for those gradients) so that no rank waits forever; "
                "this step's gradients are not valid.")

    def _store_results(self, values, saved, used_counts, end_of_backward) -> None:
        untouched = set() if used_counts is None else \
            set(np.flatnonzero(used_counts == 0).tolist())
        for b, value in enumerate(values):
            bucket = self._buckets[b]
            if value is not bucket.buffer:
                _store_result(bucket.buffer, value, b)
            if not self._as_view:
                bucket.plan.unpack(bucket.buffer)
        for i, a in saved.items():
            if i in untouched:
                np.copyto(self.grads[i], a)
        self._record_stats(end_of_backward)

    def _rebuild(self, order: list[int]) -> None:
        """Rebuild the buckets in rank 0's ready order (broadcast, so all ranks agree)."""
        self._rebuild_pending = False
        order_arr = np.array(order, np.int64)
        self._pg.broadcast([order_arr], root=0).wait(
            timedelta(seconds=self._pg.options.timeout.total_seconds()))
        order = order_arr.tolist()
        buckets, _ = compute_bucket_assignment_by_size(
            [self._caller_arrays[i] for i in order], self._limits, tensor_indices=order)
        self._build(buckets)
        self._reset_step()

    def _record_stats(self, end_of_backward: float) -> None:
        """How much of this step's communication ran before finalize() was called."""
        spans = sorted(tuple(iv) for iv in self._intervals if iv and iv[1] is not None)
        busy = overlapped = 0.0
        cur_start = cur_end = None
        for s, e in spans + [(None, None)]:
            if cur_start is not None and (s is None or s > cur_end):
                busy += cur_end - cur_start
                overlapped += max(0.0, min(cur_end, end_of_backward) - cur_start)
                cur_start = None
            if s is None:
                break
            if cur_start is None:
                cur_start, cur_end = s, e
            else:
                cur_end = max(cur_end, e)
        backward = end_of_backward - (self._first_mark_time or end_of_backward)
        self.stats = {"buckets": len(self._buckets), "backward_s": backward,
                      "comm_s": busy, "overlapped_s": overlapped,
                      "overlap_fraction": overlapped / busy if busy else 0.0}

    @contextlib.contextmanager
    def no_sync(self):
        """Steps inside do not communicate: gradients accumulate in ``r.grads`` (the
        caller adds into them) and are averaged at the next synchronised step."""
        if self._marked.any():
            raise RuntimeError("Reducer.no_sync: a step is in progress (gradients were "
                               "marked); call finalize() first")
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    # -- comm hooks ----------------------------------------------------------------------
    def register_comm_hook(self, state, hook) -> None:
        """Run ``hook(state, bucket: GradBucket) -> Future`` instead of the allreduce.

        The hook sees the bucket before averaging (it divides, as torch's hooks do);
        the future's value (the reduced flat array) becomes the bucket's result.
        """
        if not callable(hook):
            raise TypeError("Communication hook must be callable.")
        try:
            sig = inspect.signature(hook)
        except (TypeError, ValueError):
            sig = None
        if sig is not None:
            params = list(sig.parameters.values())
            bucket_param = sig.parameters.get("bucket", params[1] if len(params) > 1 else None)
            if bucket_param is not None and bucket_param.annotation not in (
                    inspect.Parameter.empty, GradBucket, "GradBucket", "nc.GradBucket"):
                raise ValueError("Communication hook: bucket annotation should be "
                                 "nc.GradBucket.")
            ret = sig.return_annotation
            if ret is not inspect.Signature.empty and ret not in (Future, "Future",
                                                                  "nc.Future"):
                raise ValueError("Communication hook: return annotation should be nc.Future.")
        if self._hook is not None:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be "
                               "called once.")
        if self._marked.any():
            raise RuntimeError("register_comm_hook: a step is in progress; register the "
                               "hook between steps")
        self._hook, self._hook_state = hook, state

    register_builtin_comm_hook = register_comm_hook


def _wait(fut, timeout_s: float, b: int):
    try:
        value = fut.wait(timeout_s)
    except FutureTimeoutError as exc:  # the wait's own deadline, not the bucket's error
        raise TimeoutError(f"Timed out waiting {int(timeout_s * 1000)}ms for bucket {b}'s "
                           "result (a comm hook's future that never completed?)") from exc
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    return value


def _store_result(buffer: np.ndarray, value, b: int) -> None:
    value = np.asarray(value)
    if value.size != buffer.size:
        raise RuntimeError(f"Reducer: the comm hook's result for bucket {b} has "
                           f"{value.size} elements, the bucket {buffer.size}")
    np.copyto(buffer, value.reshape(-1), casting="same_kind")


def _check_bucket_indices(bucket_indices, arrays) -> list[list[int]]:
    n = len(arrays)
    seen = []
    buckets = []
    for b, indices in enumerate(bucket_indices):
        indices = [int(i) for i in indices]
        if not indices:
            raise ValueError(f"Reducer: bucket {b} is empty")
        for i in indices:
            if not 0 <= i < n:
                raise ValueError(f"Reducer: bucket {b} names gradient {i}, but there are {n}")
        dtypes = {arrays[i].dtype for i in indices}
        if len(dtypes) > 1:
            detail = ", ".join(f"{i}: {dtype_name(arrays[i].dtype)}" for i in indices)
            raise TypeError(f"Reducer: bucket {b} mixes dtypes ({detail}); all gradients in "
                            "a bucket must have the same dtype")
        seen.extend(indices)
        buckets.append(indices)
    if sorted(seen) != list(range(n)):
        missing = sorted(set(range(n)) - set(seen))
        twice = sorted({i for i in seen if seen.count(i) > 1})
        raise ValueError(f"Reducer: bucket_indices must name every gradient exactly once "
                         f"(missing {missing}, repeated {twice})")
    return buckets

