"""What a timeout says about the ranks it waited for: a rank that stalled is
named; ranks that timed out waiting for each other (a lost message between
them) are not called stalled -- that report once sent a hang hunt after a
rank that had only been waiting, as its peer was."""

from datetime import timedelta

import numpy as np
import pytest

import numcoll as nc
from numcoll.call import Call
from numcoll.comm import AbortNotes, Comm
from transports import TransportTimeout
from transports.inproc import InprocTransport

from test_process_group import groups, on_ranks

pytestmark = pytest.mark.timeout(60)


class _Rank:
    """The transport a Comm asks for its rank and size (nothing is sent)."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size


def _report(notes: dict[int, int], rank: int = 0, peer: int = 1) -> str:
    """What ``rank``'s timeout waiting for ``peer`` says, where each rank of
    ``notes`` published that it timed out waiting for ``notes[rank]``."""
    store = nc.HashStore()
    for r, waited_for in notes.items():
        AbortNotes(store, r).publish(waited_for, f"rank {r} timed out waiting for "
                                                 f"rank {waited_for}")
    call = Call("allreduce", 30.0, np.dtype(np.float32), 4, root=-1)
    comm = Comm(_Rank(rank, 6), 1, call, AbortNotes(store, rank))
    return str(comm._translate(TransportTimeout("late", peer, 0, "recv", 30.0), peer, "recv"))


def test_the_rank_at_the_end_of_a_chain_of_waits_is_named_as_stalled():
    report = _report({1: 3})  # 0 waited for 1, 1 for 3, and 3 says nothing
    assert "rank 3 stalled, and rank 1, which this rank waited for" in report, report


@pytest.mark.parametrize("notes, loop, waits", [
    ({1: 3, 3: 1}, "ranks 1 and 3", "0 -> 1 -> 3 -> 1"),
    ({1: 3, 3: 5, 5: 3}, "ranks 3 and 5", "0 -> 1 -> 3 -> 5 -> 3"),
    ({1: 0}, "ranks 0 and 1", "0 -> 1 -> 0"),
    ({1: 3, 3: 0}, "ranks 0, 1 and 3", "0 -> 1 -> 3 -> 0"),
])
def test_ranks_that_waited_for_each_other_are_not_called_stalled(notes, loop, waits):
    report = _report(notes)
    assert "stalled, and" not in report, report
    assert f"no rank stalled: {loop} timed out waiting for each other ({waits})" in report, \
        report


class _Lossy(InprocTransport):
    """Every message between ranks 1 and 3 is lost (the sender sees it go)."""

    def _send(self, req, peer, tag, data, stamp):
        if {self.rank, peer} == {1, 3}:
            return True
        return super()._send(req, peer, tag, data, stamp)


def test_a_message_lost_both_ways_is_reported_as_such_by_every_rank_behind_it():
    """The hang's shape: 6 ranks, recursive doubling; ranks 1 and 3 exchange
    at its first doubling step and both messages are lost. Ranks 0 and 4
    (which wait for 1) and 2 and 5 (which wait for 3) time out first; 1 and
    3 say they waited for each other soon after."""
    pgs = groups(6, transport=lambda rank, size, store, options: _Lossy(rank, size, store))
    try:
        def body(pg):
            seconds = 1.4 if pg.rank() in (1, 3) else 1.0
            x = np.ones(1000, np.float32)
            with pytest.raises(nc.CollectiveTimeoutError) as info:
                pg.allreduce(x, nc.AllreduceOptions(algorithm="recursive_doubling",
                                                    timeout=timedelta(seconds=seconds))).wait()
            return str(info.value)

        reports = dict(enumerate(on_ranks(pgs, body)))
        for rank in (0, 2, 4, 5):
            assert "stalled, and" not in reports[rank], reports[rank]
            assert "no rank stalled: ranks 1 and 3 timed out waiting for each other" in \
                reports[rank], (rank, reports[rank])
    finally:
        for pg in pgs:
            pg.shutdown()
