"""Collectives on CUDA arrays: straight from the peers' device memory, or staged
through pinned host memory; one stream per call.

Every collective accepts CUDA arrays -- anything with
``__cuda_array_interface__`` (Numba device arrays, CuPy arrays, torch CUDA
tensors, and torch bfloat16 CUDA tensors through their int16 view) -- in place
of NumPy arrays; one call takes host arrays only or device arrays only. Local
steps (several arrays reduced into one, float16/bfloat16 widened to float32
and rounded once at the end, AVG's division) run in numba.cuda kernels on the
device (:mod:`.kernels`). Between ranks, a device allreduce on one host reads
the peers' device memory directly (:mod:`.ipc`, the ``ipc`` algorithm of
:mod:`numcoll.algorithms.peers`); everything else moves whole buffers
through pinned host memory (:mod:`.pinned_pool`, pooled per process) and runs
the host algorithms there (:mod:`.buffer`).

Everything about CUDA lives in this package:

- :mod:`.arrays`: is an object CUDA memory, and its Numba device-array view
  (no numba.cuda import until a device array is seen);
- :mod:`.device`: numba.cuda behind one door (its import, the simulator flag,
  the one view of a foreign ``__cuda_array_interface__``, layout checks);
- :mod:`.loops` and :mod:`.kernels`: the reduction and conversion kernels and
  their validating wrappers (the GPU twins of :mod:`numcoll.kernels.cpu`);
- :mod:`.copies`: asynchronous host <-> device staging copies, and
  :func:`to_device` / :func:`to_host` for every dtype numcoll takes;
- :mod:`.ipc`: the one module that asks the CUDA driver to share device
  memory between processes (CUDA IPC handles, opened once per allocation);
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

__all__ = ["release_idle", "to_device", "to_host"]


def release_idle() -> int:
    """Free the idle pinned staging memory and the idle device temporaries of
    this process; returns the bytes freed.

    Examples
    --------
    >>> import numcoll.cuda                                   # doctest: +SKIP
    >>> numcoll.cuda.release_idle()                             # doctest: +SKIP
    0
    """
    from .memory import DEVICE_POOL
    from .pinned_pool import release_idle as release

    return release() + DEVICE_POOL.release_idle()


def to_device(host, stream=0):
    """A device copy of the host array ``host``, of any dtype numcoll takes (bfloat16 too).

    ``numba.cuda.to_device`` refuses ml_dtypes' bfloat16 ("cannot include
    dtype 'E' in a buffer"); this copies its bits. See
    :func:`numcoll.cuda.copies.to_device`.

    Examples
    --------
    >>> import numpy as np, numcoll as nc, numcoll.cuda       # doctest: +SKIP
    >>> d = numcoll.cuda.to_device(np.ones(3, nc.bfloat16))     # doctest: +SKIP
    """
    from .copies import to_device as copy

    return copy(host, stream)


def to_host(dev, stream=0):
    """A host copy of the device array ``dev``, of any dtype numcoll takes (bfloat16 too).

    See :func:`numcoll.cuda.copies.to_host`.

    Examples
    --------
    >>> numcoll.cuda.to_host(d)                                 # doctest: +SKIP
    array([1, 1, 1], dtype=bfloat16)
    """
    from .copies import to_host as copy

    return copy(dev, stream)
