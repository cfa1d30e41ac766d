"""Collectives on CUDA arrays: staging through pinned host memory, one stream per call.

Every collective accepts CUDA arrays -- anything with
``__cuda_array_interface__`` (Numba device arrays, CuPy arrays, torch CUDA
tensors) -- in place of NumPy arrays; one call takes host arrays only or
device arrays only. Reductions run in numba.cuda kernels on the device
(:mod:`.kernels`); the bytes cross ZeroMQ through pinned host
staging memory (:mod:`.pinned_pool`, pooled per process), segment by segment, so
device <-> host copies overlap the network (:mod:`.buffer`).

Everything about CUDA lives in this package:

- :mod:`.arrays`: is an object CUDA memory, and its Numba device-array view
  (no numba.cuda import until a device array is seen);
- :mod:`.device`: numba.cuda behind one door (its import, the simulator flag,
  the one view of a foreign ``__cuda_array_interface__``, layout checks);
- :mod:`.loops` and :mod:`.kernels`: the reduction and conversion kernels and
  their validating wrappers (the GPU twins of :mod:`numcoll.kernels.cpu`);
- :mod:`.copies`: asynchronous host <-> device staging copies;
- :mod:`.pinned_pool`: the process's pool of pinned host memory;
- :mod:`.buffer` and :mod:`.memory`: the work buffer and the memory kind the
  collectives use for device arrays.

Streams and completion -- what numcoll does, exactly:

1. At the call, on the caller's thread, each foreign CUDA argument is viewed
   with ``numba.cuda.as_cuda_array``, which synchronises the stream the
   producer exported in its ``__cuda_array_interface__`` (version 3's
   ``stream``; CuPy and torch export their current stream).
2. Also at the call, for every stream a Numba device array of the call is
   bound to (``arr.bind(s)``, ``cuda.to_device(x, stream=s)``), an event is
   recorded on that stream; the collective's stream waits for those events
   before its first copy, so the host does not wait.
3. The collective runs on a worker thread, on a stream of its own, created
   with ``numba.cuda.stream()``: a blocking stream, so its first copy also
   waits for everything queued before it on the legacy default stream
   (stream 0, where Numba launches kernels that name no stream).
4. Before the Work completes, numcoll synchronises that stream: when
   ``work.wait()`` returns, or the future's callbacks run, the results are in
   the device memory and any stream may read them.

So the caller must have finished (synchronised) the writes to the arrays
that it queued on any stream that 1-3 do not cover -- a stream the array is
neither bound to nor exports, a per-thread default stream -- before calling,
and must neither write the arrays nor read the outputs before the Work
completes.

Costs: the first collective of a process on a dtype compiles its reduction
kernel (cached on disk for the built-in ops; a custom op compiles in every
process), strided (non-contiguous) arrays compile Numba's copy kernel once
per number of dimensions, and device temporaries come from Numba's
allocator (plug in a pooling one, e.g. RMM, for many small calls).

Importing this package does not import numba.cuda; its modules do, and
they are imported only once device arrays are seen.
"""

__all__ = ["release_idle"]


def release_idle() -> int:
    """Free the idle pinned staging memory of this process; returns the bytes freed."""
    from .pinned_pool import release_idle as release

    return release()
