"""``ProcessGroupNumcoll``: a ``torch.distributed.ProcessGroup`` run by numcoll.

torch.distributed calls a Python process group's methods by name (the
``PyProcessGroup`` trampoline), from ``dist.all_reduce`` and friends and from
C++ (DDP's reducer, ``_broadcast_coalesced``, ``_verify_params_across_processes``).
Each method here turns torch's arguments (tensor lists, a ``*Options`` object)
into a call of numcoll's public :class:`~numcoll.ProcessGroup` API on the same
tensors -- CPU tensors are viewed in place, never copied (bfloat16 and tensors
that require grad included) -- and returns a torch ``Work`` whose future is
completed by the numcoll worker that ran it (:mod:`numcoll.torch.work`).

A call made with ``asyncOp=False`` (what ``dist.all_reduce(t)`` passes) is
run and waited for here, on the calling thread, and returns a completed Work:
that is where numcoll's per-call speed comes from.

Method names: torch 2.13 calls ``all_gather_single``, ``reduce_scatter_single``,
``all_to_all_single`` and their ``*_coalesced`` forms; earlier releases call
``_allgather_base``, ``_reduce_scatter_base``, ``alltoall_base``,
``allgather_into_tensor_coalesced`` and ``reduce_scatter_tensor_coalesced``.
Both sets are here.

CUDA tensors go through numcoll's device path, unless the group was made with
a backend string that names another backend for CUDA (``"cpu:numcoll,cuda:nccl"``):
torch hands every device to a Python process group, so this one passes CUDA
calls on to that backend (created on the first CUDA call; see
:meth:`ProcessGroupNumcoll._device_backend`).
"""

from __future__ import annotations

import datetime
import os
from functools import partial

import numpy as np
import torch
import torch.distributed as dist

from ..bootstrap.launcher_env import local_host_for
from ..bootstrap.torch_store import TorchStore
from ..memory.arrays import as_array
from ..memory.sparse import SparseCOO
from ..ops import ReduceOp
from ..options import (AllgatherOptions, AllreduceCoalescedOptions, AllreduceOptions,
                       AllToAllOptions, BarrierOptions, BroadcastOptions, GatherOptions,
                       ReduceOptions, ReduceScatterOptions, ScatterOptions)
from ..process_group import ProcessGroup

from .errors import to_torch_error
from .work import Work, completed_work

__all__ = ["ProcessGroupNumcoll", "BACKEND_NAME"]

BACKEND_NAME = "numcoll"

_RedOpType = dist.ReduceOp.RedOpType
_OPS = {_RedOpType.SUM: ReduceOp.SUM, _RedOpType.AVG: ReduceOp.AVG,
        _RedOpType.PRODUCT: ReduceOp.PRODUCT, _RedOpType.MIN: ReduceOp.MIN,
        _RedOpType.MAX: ReduceOp.MAX, _RedOpType.BAND: ReduceOp.BAND,
        _RedOpType.BOR: ReduceOp.BOR, _RedOpType.BXOR: ReduceOp.BXOR}


def _reduce_op(torch_op) -> ReduceOp:
    """numcoll's op for torch's ``ReduceOp`` (PREMUL_SUM with its factor)."""
    kind = getattr(torch_op, "op", torch_op)
    op = _OPS.get(kind)
    if op is not None:
        return op
    if kind == _RedOpType.PREMUL_SUM:
        factor = torch_op.factor
        if isinstance(factor, torch.Tensor):
            factor = factor.item()
        return ReduceOp.premul_sum(factor)
    raise ValueError(f"numcoll: unsupported reduction operation {torch_op!r}")


def _timeout(opts) -> datetime.timedelta | None:
    """torch's per-call timeout, or None when unset (torch's kUnsetTimeout is -1 ms)."""
    t = getattr(opts, "timeout", None)
    return t if t is not None and t > datetime.timedelta(0) else None


def _scatter_options(opts) -> ReduceScatterOptions:
    """numcoll's options for torch's ``ReduceScatterOptions`` (``None``: the defaults)."""
    op = _reduce_op(opts.reduceOp) if opts is not None else ReduceOp.SUM
    return ReduceScatterOptions(reduce_op=op, timeout=_timeout(opts))


def _peer_host(store) -> str | None:
    """The host of the TCPStore under ``store`` (PrefixStores unwrapped), else MASTER_ADDR:
    the address this rank listens on must route to the other ranks' hosts."""
    seen = 0
    while store is not None and seen < 16:
        host = getattr(store, "host", None)
        if isinstance(host, str) and host:
            return host
        store, seen = getattr(store, "underlying_store", None), seen + 1
    return os.environ.get("MASTER_ADDR")


class ProcessGroupNumcoll(dist.ProcessGroup):
    """A torch ``ProcessGroup`` whose collectives numcoll runs.

    Made by torch through the registered backend (``dist.init_process_group("numcoll")``,
    ``dist.new_group(..., backend="numcoll")``); can also be made directly.

    Parameters
    ----------
    store : torch.distributed.Store
        Where the ranks meet (torch hands the group a ``PrefixStore`` of its own).
    rank, size : int
        This rank and the group's size.
    timeout : datetime.timedelta
        Default deadline of every collective.
    options : numcoll.ProcessGroup.Options, optional
        numcoll's group options (threads, transport, algorithm...), e.g. through
        ``init_process_group("numcoll", pg_options=nc.ProcessGroup.Options(threads=4))``;
        ``timeout`` overrides theirs.
    group_name : str
        Separates groups in numcoll's flight recorder.
    """

    def __init__(self, store, rank: int, size: int,
                 timeout: datetime.timedelta = datetime.timedelta(minutes=30),
                 options: ProcessGroup.Options | None = None, *, group_name: str = "",
                 numcoll_group: ProcessGroup | None = None):
        try:
            super().__init__(store, rank, size)
        except TypeError:  # torch before the (store, rank, size) constructor
            super().__init__(rank, size)
        if options is not None and not isinstance(options, ProcessGroup.Options):
            raise TypeError(f"numcoll backend: pg_options must be numcoll.ProcessGroup.Options, "
                            f"got {type(options).__name__}")
        if options is None:
            options = ProcessGroup.Options(host=local_host_for(_peer_host(store)))
        options = ProcessGroup.Options(**{**vars(options), "timeout": timeout})
        if group_name:
            options.group_name = f"torch/{group_name}"
        self._store = store
        self._timeout = timeout
        self._group_name, self._group_desc = group_name, ""
        self._others: dict[str, object] = {}   # device type -> torch backend (see _device_backend)
        if numcoll_group is not None:  # made by shrink(): the numcoll group exists
            self._pg = numcoll_group
            return
        try:
            self._pg = ProcessGroup(TorchStore(store, timeout), rank, size, options)
        except BaseException as exc:  # noqa: BLE001 - a store failure, as torch reports it
            raise to_torch_error(exc) from None

    @property
    def numcoll_group(self) -> ProcessGroup:
        """The numcoll :class:`~numcoll.ProcessGroup` doing the work."""
        return self._pg

    def getBackendName(self) -> str:  # noqa: N802 - torch's virtual
        """The backend's name as torch reports it (``dist.get_backend()``): ``"numcoll"``."""
        return BACKEND_NAME

    # torch keeps a group's name and description on its C++ backends, which a
    # Python group has none of: they live here (torch sets them after creating
    # the group, and destroy_process_group reads the name back).
    def setGroupName(self, name: str) -> None:  # noqa: N802 - torch's virtual
        """torch sets the group's name here when it registers the group."""
        self._group_name = name

    def getGroupName(self) -> str:  # noqa: N802 - torch's virtual
        """The group's name, as torch set it."""
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802 - torch's virtual
        """torch sets the group's description (``group_desc=``) here."""
        self._group_desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802 - torch's virtual
        """The group's description, as torch set it."""
        return self._group_desc

    def __repr__(self) -> str:
        return f"<ProcessGroupNumcoll rank={self.rank()} size={self.size()}>"

    # -- running calls ---------------------------------------------------------------
    def _finish(self, call, opts, value, after=None):
        """Run ``call`` (a numcoll collective with its arguments); the torch
        Work's future holds ``value`` (what gloo's would: the tensors or lists
        the caller passed). With ``opts.asyncOp`` False the caller waits at
        once: numcoll runs the collective right here, on this thread, when the
        group has nothing else in flight, and a completed Work comes back."""
        if getattr(opts, "asyncOp", True):
            return Work(call(), value, after)
        try:
            call(blocking=True)
            if after is not None:
                after()
        except BaseException as exc:  # noqa: BLE001 - raised as torch's
            raise to_torch_error(exc) from None
        return completed_work(value)

    def _device_backend(self, tensor):
        """The torch backend to pass a call on ``tensor`` to, or None for numcoll.

        CPU tensors are always numcoll's. A CUDA tensor is too, unless the
        group's backend string names another backend for its device
        (``"cpu:numcoll,cuda:nccl"``): torch gives a Python process group every
        device, so the named backend is made here, on the first call, over a
        store prefix of its own (every rank makes its first such call in the
        same order, as collectives are).
        """
        device = tensor.device.type
        if device == "cpu":
            return None
        if device in self._others:
            return self._others[device]
        name = self._configured(device)
        backend = None
        if name and name != BACKEND_NAME:
            backend = _make_backend(name, dist.PrefixStore(f"numcoll-{device}/", self._store),
                                    self.rank(), self.size(), self._timeout)
        self._others[device] = backend
        return backend

    def _configured(self, device: str) -> str | None:
        try:
            config = dist.get_backend_config(self)
        except (RuntimeError, ValueError, AttributeError):  # not registered with torch
            return None
        for pair in str(config).split(","):
            dev, _, name = pair.partition(":")
            if dev.strip() == device:
                return name.strip().lower()
        return None

    # -- collectives: torch's names and arguments -----------------------------------
    def allreduce(self, tensors, opts=None, op=None):
        """torch's ``allreduce``: numcoll reduces the tensors in their own memory (sparse COO
        tensors too); returns a Work."""
        if isinstance(tensors, torch.Tensor):   # torch's pg.allreduce(tensor, op=...) form
            tensors = [tensors]
        if opts is None and op is not None:
            opts = dist.AllreduceOptions()
            opts.reduceOp = op
        other = self._device_backend(tensors[0]) if tensors else None
        if other is not None:
            return other.allreduce(tensors, opts or dist.AllreduceOptions())
        if any(t.is_sparse for t in tensors):
            return self._sparse_allreduce(tensors, opts)
        timeout = _timeout(opts)
        op = _reduce_op(opts.reduceOp) if opts is not None else ReduceOp.SUM
        if timeout is None:
            call = partial(self._pg.allreduce, tensors, op=op)
        else:
            call = partial(self._pg.allreduce, tensors,
                           AllreduceOptions(reduce_op=op, timeout=timeout))
        return self._finish(call, opts, tensors)

    def _sparse_allreduce(self, tensors, opts):
        """Sparse COO tensors: numcoll's sparse allreduce on views of their
        indices and values; the coalesced sum then replaces each tensor's
        contents (as gloo does)."""
        for i, t in enumerate(tensors):
            if not t.is_sparse:
                raise ValueError(f"allreduce: invalid tensor layout at index {i} (a dense "
                                 "tensor among sparse ones)")
        coos = [SparseCOO(as_array(t._indices(), "allreduce"), as_array(t._values(), "allreduce"),
                          tuple(t.shape)) for t in tensors]
        op = _reduce_op(opts.reduceOp) if opts is not None else ReduceOp.SUM
        call = partial(self._pg.allreduce, coos,
                       AllreduceOptions(reduce_op=op, timeout=_timeout(opts)))

        def write_back():
            for t, coo in zip(tensors, coos):
                if t.dtype == torch.bfloat16:   # torch has no NumPy bfloat16: by its bits
                    values = torch.from_numpy(coo.values.view(np.int16)).view(torch.bfloat16)
                else:
                    values = torch.from_numpy(coo.values)
                total = torch.sparse_coo_tensor(torch.from_numpy(coo.indices), values,
                                                t.shape, is_coalesced=True)
                with torch.no_grad():
                    t.copy_(total)

        return self._finish(call, opts, tensors, write_back)

    def allreduce_coalesced(self, tensors, opts=None):
        """torch's ``allreduce_coalesced``: several tensors reduced in one call; returns a Work."""
        op = _reduce_op(opts.reduceOp) if opts is not None else ReduceOp.SUM
        call = partial(
            self._pg.allreduce_coalesced,
            tensors, AllreduceCoalescedOptions(reduce_op=op, timeout=_timeout(opts)))
        return self._finish(call, opts, tensors)

    def reduce(self, tensors, opts=None):
        """torch's ``reduce``: the result lands in the root's tensor; returns a Work."""
        opts = opts or dist.ReduceOptions()
        other = self._device_backend(tensors[0]) if tensors else None
        if other is not None:
            return other.reduce(tensors, opts)
        call = partial(self._pg.reduce, tensors, ReduceOptions(
            reduce_op=_reduce_op(opts.reduceOp), root_rank=opts.rootRank,
            root_tensor=opts.rootTensor, timeout=_timeout(opts)))
        return self._finish(call, opts, tensors)

    def broadcast(self, tensors, opts=None, root=None):
        """torch's ``broadcast``: the root's tensor is copied into every rank's; returns a Work."""
        if isinstance(tensors, torch.Tensor):   # torch's pg.broadcast(tensor, root=...) form
            tensors = [tensors]
        if opts is None:
            opts = dist.BroadcastOptions()
            opts.rootRank = root or 0
        other = self._device_backend(tensors[0]) if tensors else None
        if other is not None:
            return other.broadcast(tensors, opts)
        call = partial(self._pg.broadcast, tensors, BroadcastOptions(
            root_rank=opts.rootRank, root_tensor=opts.rootTensor, timeout=_timeout(opts)))
        return self._finish(call, opts, tensors)

    def allgather(self, output_lists, input_list, opts=None):
        """torch's ``allgather``: every rank's tensor into each rank's output list; returns a
        Work."""
        other = self._device_backend(input_list[0]) if input_list else None
        if other is not None:
            return other.allgather(output_lists, input_list, opts or dist.AllgatherOptions())
        call = partial(self._pg.allgather, output_lists, input_list,
                                  AllgatherOptions(timeout=_timeout(opts)))
        return self._finish(call, opts, output_lists)

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        """torch's ``allgather_coalesced``: several allgathers in one call; returns a Work."""
        call = partial(self._pg.allgather_coalesced, output_lists, input_list,
                                            AllgatherOptions(timeout=_timeout(opts)))
        return self._finish(call, opts, output_lists)

    def all_gather_single(self, output, input, opts=None):
        """torch's ``_allgather_base``: every rank's tensor into one flat output; returns a Work."""
        other = self._device_backend(input)
        if other is not None:
            return other._allgather_base(output, input, opts or dist.AllgatherOptions())
        call = partial(self._pg.allgather_into_tensor, output, input,
                                              AllgatherOptions(timeout=_timeout(opts)))
        return self._finish(call, opts, [output])

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        """The coalesced form of :meth:`all_gather_single`; returns a Work."""
        call = partial(
            self._pg.allgather_into_tensor_coalesced,
            outputs, inputs, AllgatherOptions(timeout=_timeout(opts)))
        return self._finish(call, opts, outputs)

    def reduce_scatter(self, output_list, input_lists, opts=None):
        """torch's ``reduce_scatter``: reduce lists of tensors, each rank keeping its share;
        returns a Work."""
        call = partial(self._pg.reduce_scatter, output_list, input_lists, _scatter_options(opts))
        return self._finish(call, opts, output_list)

    def reduce_scatter_single(self, output, input, opts=None):
        """torch's ``_reduce_scatter_base``: reduce one flat input, each rank keeping its share;
        returns a Work."""
        other = self._device_backend(input)
        if other is not None:
            return other._reduce_scatter_base(output, input, opts or dist.ReduceScatterOptions())
        call = partial(self._pg.reduce_scatter_tensor, output, input, _scatter_options(opts))
        return self._finish(call, opts, [output])

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        """The coalesced form of :meth:`reduce_scatter_single`; returns a Work."""
        call = partial(self._pg.reduce_scatter_tensor_coalesced, outputs, inputs, _scatter_options(opts))
        return self._finish(call, opts, outputs)

    def alltoall(self, output_list, input_list, opts=None):
        """torch's ``alltoall``: tensor *i* of each rank goes to rank *i*; returns a Work."""
        call = partial(self._pg.alltoall, output_list, input_list,
                       AllToAllOptions(timeout=_timeout(opts)))
        return self._finish(call, opts, output_list)

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None,
                          opts=None):
        """torch's ``alltoall_base``: one flat input and output, with optional split sizes;
        returns a Work."""
        other = self._device_backend(input)
        if other is not None:
            return other.alltoall_base(output, input, output_split_sizes or [],
                                       input_split_sizes or [], opts or dist.AllToAllOptions())
        call = partial(self._pg.alltoall_base, output, input,
                       list(output_split_sizes or []) or None,
                       list(input_split_sizes or []) or None,
                       AllToAllOptions(timeout=_timeout(opts)))
        return self._finish(call, opts, [output])

    def gather(self, output_lists, input_list, opts=None):
        """torch's ``gather``: every rank's tensor into the root's output list; returns a Work."""
        opts = opts or dist.GatherOptions()
        call = partial(self._pg.gather, output_lists, input_list,
                               GatherOptions(root_rank=opts.rootRank, timeout=_timeout(opts)))
        return self._finish(call, opts, output_lists)

    def scatter(self, output_list, input_lists, opts=None):
        """torch's ``scatter``: the root's list of tensors, one to each rank; returns a Work."""
        opts = opts or dist.ScatterOptions()
        call = partial(self._pg.scatter, output_list, input_lists,
                                ScatterOptions(root_rank=opts.rootRank, timeout=_timeout(opts)))
        return self._finish(call, opts, output_list)

    def send(self, tensors, dst: int, tag: int = 0):
        """torch's ``send``: the tensor to rank ``dst`` (a rank of this group) with ``tag``;
        returns a Work."""
        other = self._device_backend(tensors[0]) if tensors else None
        if other is not None:
            return other.send(tensors, dst, tag)
        return Work(self._pg.send(tensors, dst, tag), tensors)

    def recv(self, tensors, src: int, tag: int = 0):
        """torch's ``recv``: into the tensor from rank ``src`` with ``tag``; returns a Work."""
        other = self._device_backend(tensors[0]) if tensors else None
        if other is not None:
            return other.recv(tensors, src, tag)
        return Work(self._pg.recv(tensors, src, tag), tensors)

    def recv_anysource(self, tensors, tag: int = 0):
        """torch's ``recv_anysource``: into the tensor from any rank; the Work's
        ``source_rank()`` says which."""
        return Work(self._pg.recv_anysource(tensors, tag), tensors)

    def barrier(self, opts=None):
        """torch's ``barrier``: returns a Work that completes when every rank has arrived."""
        call = partial(self._pg.barrier, BarrierOptions(timeout=_timeout(opts)))
        return self._finish(call, opts, [])

    def monitored_barrier(self, timeout: datetime.timedelta | None = None,
                          wait_all_ranks: bool = False) -> None:
        """gloo's monitored barrier: rank 0 names the ranks that did not arrive
        within ``timeout``. Blocking, as gloo's. (``dist.monitored_barrier``
        itself refuses every backend but gloo by name; call this, or
        :func:`numcoll.torch.monitored_barrier`.)"""
        if timeout is not None and not isinstance(timeout, datetime.timedelta):
            timeout = datetime.timedelta(seconds=timeout)
        try:
            self._pg.monitored_barrier(timeout, wait_all_ranks).wait()
        except BaseException as exc:  # noqa: BLE001 - raised as torch's
            raise to_torch_error(exc) from None

    # -- lifecycle -------------------------------------------------------------------
    def _get_sequence_number_for_group(self) -> int:
        return self._pg.sequence_number()

    def shutdown(self) -> None:
        """Release numcoll's threads and transport (``dist.destroy_process_group`` calls it)."""
        self._pg.shutdown()
        for backend in self._others.values():
            if backend is not None and hasattr(backend, "shutdown"):
                backend.shutdown()

    def abort(self) -> None:
        """Abort the group: pending and later calls fail at once, on every rank."""
        self._pg.abort("aborted through torch (ProcessGroup.abort)")

    # -- surviving a dead rank (numcoll.recovery) ------------------------------------------
    def shrink(self, timeout: datetime.timedelta | None = None) -> ProcessGroupNumcoll:
        """The group of the live ranks, renumbered in order (see
        :meth:`numcoll.ProcessGroup.shrink`); this group is shut down. Use it
        with ``group=`` and ``DistributedDataParallel(process_group=...)``."""
        try:
            new = self._pg.shrink(timeout)
        except BaseException as exc:  # noqa: BLE001 - raised as torch's
            raise to_torch_error(exc) from None
        group = type(self)(self._store, new.rank(), new.size(), self._timeout,
                           numcoll_group=new)
        group._group_name = f"{self._group_name}/shrunk" if self._group_name else ""
        return group

    def old_ranks(self) -> list[int]:
        """Rank ``i`` of this group was rank ``old_ranks()[i]`` of the group it was shrunk from."""
        return self._pg.old_ranks()

    def revoke(self) -> None:
        """Every pending and later call on the group fails, on every rank."""
        self._pg.revoke("revoked through torch")


def _torch_errors(method):
    """Argument errors raised at the call, as gloo raises them (see ``to_torch_error``)."""
    def call(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except (ValueError, TypeError) as exc:
            raise to_torch_error(exc) from None

    call.__name__, call.__doc__, call.__wrapped__ = method.__name__, method.__doc__, method
    return call


for _name in ("allreduce", "allreduce_coalesced", "reduce", "broadcast", "allgather",
              "allgather_coalesced", "all_gather_single", "all_gather_single_coalesced",
              "reduce_scatter", "reduce_scatter_single", "reduce_scatter_single_coalesced",
              "alltoall", "all_to_all_single", "gather", "scatter", "send", "recv",
              "recv_anysource", "barrier"):
    setattr(ProcessGroupNumcoll, _name, _torch_errors(getattr(ProcessGroupNumcoll, _name)))
for _alias, _name in (("_allgather_base", "all_gather_single"),
                      ("allgather_into_tensor_coalesced", "all_gather_single_coalesced"),
                      ("_reduce_scatter_base", "reduce_scatter_single"),
                      ("reduce_scatter_tensor_coalesced", "reduce_scatter_single_coalesced"),
                      ("alltoall_base", "all_to_all_single")):
    setattr(ProcessGroupNumcoll, _alias, getattr(ProcessGroupNumcoll, _name))


def _make_backend(name: str, store, rank: int, size: int, timeout: datetime.timedelta):
    """torch's own backend ``name`` for one device (see ``_device_backend``)."""
    if name == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if name == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    plugin = dist.Backend._plugins.get(name.upper())
    if plugin is None:
        raise ValueError(f"numcoll backend: cannot make backend {name!r} for another device")
    if plugin.extended_api:
        raise ValueError(f"numcoll backend: backend {name!r} uses the extended API; "
                         "give numcoll every device or none")
    return plugin.creator_fn(store, rank, size, timeout)
