"""Point-to-point send/recv, and the barriers."""

from __future__ import annotations

import time
from datetime import timedelta

from transports import ANY_SOURCE

from ..algorithms.partition import segments
from ..memory.arrays import as_array_list, check_writable
from ..call import Call, shapes
from ..comm import p2p_tag
from ..errors import CollectiveTimeoutError, NumcollError
from ..options import BarrierOptions
from .checks import check_peer, originals, timeout_seconds
from .choice import choose, segment_count
from ..memory.host import memory_of

__all__ = ["PointToPoint"]


class PointToPoint:
    """Mixin of :class:`~numcoll.ProcessGroup`: send, recv, barrier, monitored_barrier."""

    def _single(self, arrays, name):
        outs = originals(arrays)
        arrays = as_array_list(arrays, name)
        if len(arrays) != 1:
            raise ValueError(f"{name}: requires a single-element tensor list (got {len(arrays)})")
        return outs, arrays[0], memory_of(name, arrays)

    def _p2p_call(self, name, arr, peer) -> Call:
        # Sends and receives stamp their messages alike ("p2p", dtype, count),
        # so a receive never takes another dtype's or size's bytes.
        return Call(name, self._timeout_s, arr.dtype, arr.size, root=-1,
                    input_sizes=shapes([arr]) if name == "send" else (),
                    output_sizes=shapes([arr]) if name != "send" else (),
                    nbytes=arr.size * arr.dtype.itemsize)

    def send(self, arrays, dst: int, tag: int = 0):
        """Send one array to rank ``dst``; matched by the receiver's (source, tag).
        Sends and receives take no collective sequence number."""
        name = "send"
        outs, arr, xp = self._single(arrays, name)
        check_peer(dst, self._size, self._rank, name, "destination")
        full_tag = p2p_tag(_check_tag(tag, name))
        seg = segment_count(self._cfg, arr.dtype.itemsize)
        call = self._p2p_call(name, arr, dst)

        def run(comm, work):
            buf = xp.buffer(xp.flat(arr, copy_in=True))
            comm.wait_all([comm.isend_tagged(dst, full_tag, buf.send_view(s, n))
                           for s, n in segments(0, buf.count, seg)])
            return outs

        return self._enqueue(call, xp.wrap(run), collective=False)

    def recv(self, arrays, src: int, tag: int = 0):
        """Receive one array from rank ``src`` into ``arrays``."""
        name = "recv"
        outs, arr, xp = self._single(arrays, name)
        check_peer(src, self._size, self._rank, name, "source")
        return self._recv(name, outs, arr, xp, src, tag)

    def recv_anysource(self, arrays, tag: int = 0):
        """Receive one array from whichever rank sends with ``tag`` first;
        ``work.source_rank()`` tells which."""
        name = "recv_anysource"
        outs, arr, xp = self._single(arrays, name)
        return self._recv(name, outs, arr, xp, ANY_SOURCE, tag)

    def _recv(self, name, outs, arr, xp, src, tag):
        check_writable([arr], name)
        full_tag = p2p_tag(_check_tag(tag, name))
        seg = segment_count(self._cfg, arr.dtype.itemsize)
        call = self._p2p_call(name, arr, src)

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

        return self._enqueue(call, xp.wrap(run), collective=False)

    # -- barriers -----------------------------------------------------------------
    def barrier(self, opts: BarrierOptions | None = None):
        """Complete once every rank has entered the barrier and every collective
        this rank queued before it has completed. The future's value is ``[]``."""
        opts = opts or BarrierOptions()
        algorithm = choose(self._cfg, "barrier", opts.algorithm, 0, self._size)
        call = Call("barrier", self._timeout_for(opts, "barrier"), algorithm=algorithm.name)

        def run(comm, work):
            for earlier in self._earlier_work(work):
                # Earlier work has its own deadline; its failure is its own.
                try:
                    earlier.get_future().wait(max(0.0, comm.deadline - time.monotonic()))
                except TimeoutError:
                    raise CollectiveTimeoutError(
                        f"Timed out waiting {round(comm.timeout_s * 1000)}ms for barrier on "
                        f"rank {self._rank}: {earlier.op_name} (queued before it) did not "
                        "finish") from None
                except Exception:  # noqa: BLE001 - reported by that op's own Work
                    pass
            algorithm.run(comm)
            return []

        return self._enqueue(call, run)

    def monitored_barrier(self, timeout: timedelta | None = None, wait_all_ranks: bool = False):
        """A barrier that names the ranks that did not arrive.

        Rank 0 waits for every other rank (up to ``timeout``, default the
        group's); a rank that does not arrive makes it raise naming that rank
        (with ``wait_all_ranks``, every missing rank). Then rank 0 releases the
        others.
        """
        name = "monitored_barrier"
        timeout_s = self._timeout_s if timeout is None else timeout_seconds(timeout, name)
        call = Call(name, timeout_s, algorithm="gather_release")
        arrive, release = 0, 1

        def run(comm, work):
            comm.follow_stalls = False
            if self._size == 1:
                return []
            if self._rank != 0:
                comm.wait(comm.isend(0, arrive, b""))
                comm.wait(comm.irecv(0, release))
                return []
            pending = {r: comm.irecv(r, arrive) for r in range(1, self._size)}
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
            comm.wait_all([comm.isend(r, release, b"") for r in range(1, self._size)])
            return []

        return self._enqueue(call, run)


def _check_tag(tag, op: str) -> int:
    if isinstance(tag, bool) or not isinstance(tag, int):
        raise TypeError(f"{op}: tag must be an int, got {type(tag).__name__} ({tag!r})")
    return tag

