"""Point-to-point send/recv, and the barriers.

Builders (see :mod:`.context`): ``send(ctx, arrays, dst, tag) -> (Call, run)``.
Sends and receives take no collective sequence number (their Call says
``collective=False``); a barrier's Call says ``after_earlier``: the group runs
it only once every earlier call of this rank has finished.
"""

from __future__ import annotations

from datetime import timedelta

from transports import ANY_SOURCE

from ..algorithms.partition import segments
from ..call import Call, shapes
from ..comm import p2p_tag
from ..errors import CollectiveTimeoutError, NumcollError
from ..memory.arrays import as_array_list, check_writable, memory_of
from ..options import BarrierOptions
from .checks import check_peer, originals, timeout_seconds
from .context import GroupContext

__all__ = ["send", "recv", "barrier", "monitored_barrier", "P2PMethods"]

_BARRIER_DEFAULTS = BarrierOptions()


def _single(arrays, name):
    outs = originals(arrays)
    arrays = as_array_list(arrays, name)
    if len(arrays) != 1:
        raise ValueError(f"{name}: requires a single-element tensor list (got {len(arrays)})")
    return outs, arrays[0], memory_of(name, arrays)


def _p2p_call(ctx, name, arr) -> Call:
    # Sends and receives stamp their messages alike ("p2p", dtype, count),
    # so a receive never takes another dtype's or size's bytes.
    return Call(name, ctx.timeout_s, arr.dtype, arr.size, root=-1,
                input_sizes=shapes([arr]) if name == "send" else (),
                output_sizes=shapes([arr]) if name != "send" else (),
                nbytes=arr.size * arr.dtype.itemsize, collective=False,
                settings=ctx.settings)


def send(ctx: GroupContext, arrays, dst: int, tag: int = 0):
    """Send one array to rank ``dst``; matched by the receiver's (source, tag)."""
    name = "send"
    outs, arr, xp = _single(arrays, name)
    check_peer(dst, ctx.size, ctx.rank, name, "destination")
    full_tag = p2p_tag(_check_tag(tag, name))
    seg = ctx.segment(arr.dtype.itemsize)

    def run(comm, work):
        buf = xp.buffer(xp.flat(arr, copy_in=True))
        comm.wait_all([comm.isend_tagged(dst, full_tag, buf.send_view(s, n))
                       for s, n in segments(0, buf.count, seg)])
        return outs

    return _p2p_call(ctx, name, arr), xp.wrap(run)


def recv(ctx: GroupContext, arrays, src: int, tag: int = 0, *, name: str = "recv"):
    """Receive one array from rank ``src`` (``ANY_SOURCE``: whichever rank
    sends with ``tag`` first; ``work.source_rank()`` tells which)."""
    outs, arr, xp = _single(arrays, name)
    if src != ANY_SOURCE:
        check_peer(src, ctx.size, ctx.rank, name, "source")
    check_writable([arr], name)
    full_tag = p2p_tag(_check_tag(tag, name))
    seg = ctx.segment(arr.dtype.itemsize)

    def run(comm, work):
        flat = xp.flat(arr, copy_in=False)
        buf = xp.buffer(flat)
        pieces = segments(0, buf.count, seg)
        peer = src
        if src == ANY_SOURCE:
            # The first piece fixes the sender; the rest come from it.
            first = pieces[0] if pieces else (0, 0)
            p = comm.irecv_tagged(ANY_SOURCE, full_tag, buf.recv_view(*first))
            comm.wait(p)
            buf.recv_done(*first)
            peer, pieces = p.source, pieces[1:]
        pending = [(s, n, comm.irecv_tagged(peer, full_tag, buf.recv_view(s, n)))
                   for s, n in pieces]
        for s, n, p in pending:
            comm.wait(p)
            buf.recv_done(s, n)
        work._source_rank = peer
        if not xp.contiguous(arr):
            xp.write(arr, flat)
        return outs

    return _p2p_call(ctx, name, arr), xp.wrap(run)


# -- barriers -----------------------------------------------------------------
def barrier(ctx: GroupContext, opts: BarrierOptions | None = None):
    """Complete once every rank has entered the barrier and every collective
    this rank queued before it has completed (``after_earlier``). The
    future's value is ``[]``."""
    opts = opts or _BARRIER_DEFAULTS
    algorithm = ctx.choose("barrier", opts.algorithm, 0)
    call = Call("barrier", ctx.timeout_for(opts, "barrier"), algorithm=algorithm.name,
                after_earlier=True, settings=ctx.settings)

    def run(comm, work):
        algorithm.run(comm)
        return []

    return call, run


def monitored_barrier(ctx: GroupContext, timeout: timedelta | None = None,
                      wait_all_ranks: bool = False):
    """A barrier that names the ranks that did not arrive.

    Rank 0 waits for every other rank (up to ``timeout``, default the
    group's); a rank that does not arrive makes it raise naming that rank
    (with ``wait_all_ranks``, every missing rank). Then rank 0 releases the
    others.
    """
    name = "monitored_barrier"
    size, rank = ctx.size, ctx.rank
    timeout_s = ctx.timeout_s if timeout is None else timeout_seconds(timeout, name)
    call = Call(name, timeout_s, algorithm="gather_release", settings=ctx.settings)
    arrive, release = 0, 1

    def run(comm, work):
        comm.follow_stalls = False
        if size == 1:
            return []
        if rank != 0:
            comm.wait(comm.isend(0, arrive, b""))
            comm.wait(comm.irecv(0, release))
            return []
        pending = {r: comm.irecv(r, arrive) for r in range(1, size)}
        missing = []
        for r, p in pending.items():
            try:
                comm.wait(p)
            except (CollectiveTimeoutError, NumcollError) as exc:
                missing.append((r, exc))
                if not wait_all_ranks:
                    break
        if missing:
            ms = round(timeout_s * 1000)
            ranks = ", ".join(str(r) for r, _ in missing)
            label = "Rank" if len(missing) == 1 else "Ranks"
            raise CollectiveTimeoutError(
                f"Timed out waiting {ms}ms: {label} {ranks} failed to pass "
                f"monitoredBarrier in {ms} ms (rank 0 waited; first cause: "
                f"{missing[0][1]})")
        comm.wait_all([comm.isend(r, release, b"") for r in range(1, size)])
        return []

    return call, run


def _check_tag(tag, op: str) -> int:
    if isinstance(tag, bool) or not isinstance(tag, int):
        raise TypeError(f"{op}: tag must be an int, got {type(tag).__name__} ({tag!r})")
    return tag


class P2PMethods:
    """The point-to-point calls and barriers of :class:`~numcoll.ProcessGroup`
    (which inherits them; they use only its ``submit`` and ``context``). Inside
    a method, ``send``/``recv``/``barrier`` name this module's builders."""

    __slots__ = ()

    def send(self, arrays, dst: int, tag: int = 0, *, blocking: bool = False):
        """Send one array to rank ``dst``, matched by the receiver's (source, tag)."""
        call, run = send(self.context, arrays, dst, tag)
        return self.submit(call, run, blocking)

    def recv(self, arrays, src: int, tag: int = 0, *, blocking: bool = False):
        """Receive one array from rank ``src`` into ``arrays``."""
        call, run = recv(self.context, arrays, src, tag)
        return self.submit(call, run, blocking)

    def recv_anysource(self, arrays, tag: int = 0, *, blocking: bool = False):
        """Receive one array from whichever rank sends with ``tag`` first;
        ``work.source_rank()`` tells which."""
        call, run = recv(self.context, arrays, ANY_SOURCE, tag, name="recv_anysource")
        return self.submit(call, run, blocking)

    def barrier(self, opts=None, *, blocking: bool = False):
        """Complete once every rank has entered the barrier and every call this
        rank submitted before it has completed. The future's value is ``[]``."""
        call, run = barrier(self.context, opts)
        return self.submit(call, run, blocking)

    def monitored_barrier(self, timeout: timedelta | None = None,
                          wait_all_ranks: bool = False, *, blocking: bool = False):
        """A barrier where rank 0 names the ranks that did not arrive within
        ``timeout`` (all of them with ``wait_all_ranks``)."""
        call, run = monitored_barrier(self.context, timeout, wait_all_ranks)
        return self.submit(call, run, blocking)
