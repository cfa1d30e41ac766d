"""The ``shm`` transport beyond the conformance suite: the ring itself, chunked
messages, flow control, idling, and real processes that crash.

The conformance suite (tests/test_transports.py) runs it like every other kind.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import numpy as np
import pytest

from transports import ANY_SOURCE, PeerClosed, StampMismatch
from transports.shm import ring as K
from transports.shm.transport import ShmRingTransport, ring_nbytes_for

from shm_leftovers import numcoll_entries
from test_transports import FileStore, our_threads
from test_transports import connect as _connect

pytestmark = pytest.mark.timeout(60)
WAIT_S = 20.0


def deadline(seconds: float = WAIT_S) -> float:
    return time.monotonic() + seconds


def connect(size: int, inline_nbytes: int | None = None) -> list[ShmRingTransport]:
    """A connected shm group; ``inline_nbytes`` is the largest one-record message
    (the factory's ``shm_slot_nbytes``)."""
    options = {} if inline_nbytes is None else {"shm_slot_nbytes": inline_nbytes}
    return _connect("shm", size, **options)


@pytest.fixture
def small_rings():
    """Two ranks whose rings hold two 64 KiB records: anything larger is chunked."""
    ranks = connect(2, inline_nbytes=64 << 10)
    yield ranks
    for t in ranks:
        t.close()


def payload(seed: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


# --- the ring, driven directly ------------------------------------------------------


def test_ring_wraps_pads_and_keeps_every_byte():
    """A producer and a consumer thread push random-sized messages (from empty
    to several times the ring) through a tiny ring: every record boundary,
    PAD and wrap-around is crossed, and nothing is lost or reordered."""
    capacity = 4096
    block = np.zeros(K.CTRL_WORDS + capacity // 8, np.uint64)
    ctrl, data64 = block[:K.CTRL_WORDS], block[K.CTRL_WORDS:]
    data = data64.view(np.uint8)
    rng = np.random.default_rng(7)
    sizes = [int(s) for s in rng.choice([0, 1, 63, 64, 65, 700, 1500, 5000, 12000], 400)]
    stamp = np.frombuffer(b"stamp", np.uint8)
    received: list[bytes] = []

    def consume():
        cursor, current, left = 0, None, 0
        stop = time.monotonic() + WAIT_S
        while len(received) < len(sizes) and time.monotonic() < stop:
            pos, word0, tag, nbytes, chunk, cursor = K.ring_next(ctrl, data64, cursor)
            if pos < 0:
                continue
            if word0 & 0xFF == K.KIND_FIRST:
                assert (word0 >> 8) & 0xFF == stamp.size and tag == len(received)
                start = pos + K.HEADER_NBYTES + stamp.size
                current, left = bytearray(data[start:start + chunk].tobytes()), nbytes - chunk
            else:
                assert word0 & 0xFF == K.KIND_MORE
                current += data[pos + K.HEADER_NBYTES:pos + K.HEADER_NBYTES + chunk].tobytes()
                left -= chunk
            if left == 0:
                received.append(bytes(current))
            cursor += word0 >> 16
            K.ring_free(ctrl, cursor)

    consumer = threading.Thread(target=consume)
    consumer.start()
    for i, n in enumerate(sizes):
        msg = payload(i, n)
        offset, started = 0, False
        while not (started and offset == n):
            offset, started, _ = K.ring_put(ctrl, data, data64, K.KIND_FIRST, np.uint64(i), n,
                                            stamp, msg, offset, started, 1024, 256)
    consumer.join(WAIT_S)
    assert [len(r) for r in received] == sizes
    for i, r in enumerate(received):
        assert r == payload(i, sizes[i]).tobytes()


def test_ring_sizes():
    assert ring_nbytes_for(1 << 20) == 4 << 20  # two 1 MiB records and their headers
    assert ring_nbytes_for(0) == 1 << 16


# --- chunked messages and flow control ------------------------------------------------


@pytest.mark.parametrize("posted_first", [True, False])
def test_chunked_message_with_stamp(small_rings, posted_first):
    a, b = small_rings
    data = payload(1, 1 << 20)  # 16 records of 64 KiB
    out = np.zeros_like(data)
    if posted_first:
        recv = b.irecv(0, 5, out, stamp=b"call#1")
    send = a.isend(1, 5, data, stamp=b"call#1")
    if not posted_first:
        send.wait(deadline())  # completes without the receiver waiting (its helper drains)
        recv = b.irecv(0, 5, out, stamp=b"call#1")
    recv.wait(deadline())
    send.wait(deadline())
    np.testing.assert_array_equal(out, data)
    # a chunked message with the wrong stamp is dropped whole; the stream stays intact
    a.isend(1, 6, data, stamp=b"other")
    a.isend(1, 7, b"next")
    with pytest.raises(StampMismatch):
        b.irecv(0, 6, out, stamp=b"call#2").wait(deadline())
    assert bytes(b.irecv(0, 7).wait(deadline())) == b"next"


def test_both_ranks_send_large_messages_to_each_other_at_once(small_rings):
    """Each rank's send fills its ring long before the peer reads it: no
    deadlock, because whoever waits also drains (and the helpers do when no one waits)."""
    nbytes = 8 << 20
    results = {}

    def rank_main(t):
        peer = 1 - t.rank
        send = t.isend(peer, 1, payload(t.rank, nbytes))
        send.wait(deadline())  # before posting the receive: only draining can free the peer
        results[t.rank] = np.frombuffer(t.irecv(peer, 1).wait(deadline()), np.uint8)

    threads = [threading.Thread(target=rank_main, args=(t,)) for t in small_rings]
    for th in threads:
        th.start()
    for th in threads:
        th.join(WAIT_S * 2)
    for rank in (0, 1):
        np.testing.assert_array_equal(results[rank], payload(1 - rank, nbytes))


def test_small_messages_keep_their_order_behind_a_chunked_one(small_rings):
    a, b = small_rings
    big = payload(3, 300 << 10)
    sends = [a.isend(1, 9, big)] + [a.isend(1, 9, np.full(4, i, np.uint8)) for i in range(20)]
    assert np.array_equal(np.frombuffer(b.irecv(0, 9).wait(deadline()), np.uint8), big)
    for i in range(20):
        assert bytes(b.irecv(ANY_SOURCE, 9).wait(deadline())) == bytes([i]) * 4
    for s in sends:
        s.wait(deadline())


def test_idle_waiter_blocks_instead_of_spinning():
    a, b = connect(2)
    try:
        recv = a.irecv(1, 1)
        cpu = time.process_time()
        wall = time.monotonic()
        threading.Timer(0.6, lambda: b.isend(0, 1, b"late")).start()
        assert bytes(recv.wait(deadline())) == b"late"
        woke_after = time.monotonic() - wall
        used = time.process_time() - cpu
        assert 0.55 < woke_after < 0.9  # the poke woke it promptly ...
        assert used < 0.2  # ... and it did not burn a core meanwhile
    finally:
        a.close()
        b.close()


# --- real processes ---------------------------------------------------------------------


def _ring_exchange(rank: int, size: int, root: str, rounds: int, crash: bool) -> None:
    t = ShmRingTransport(rank, size, FileStore(root))
    right, left = (rank + 1) % size, (rank - 1) % size
    value = np.array([rank], np.int64)
    for i in range(rounds):  # a ring allreduce of one int64, step by step
        got = np.empty(1, np.int64)
        recv = t.irecv(left, i, got)
        t.isend(right, i, value).wait(deadline())
        recv.wait(deadline())
        value = got if i < size - 1 else value
    t.isend(0, 1 << 40, b"done").wait(deadline()) if rank else None
    if crash:
        t.irecv(0, 1 << 41).wait(deadline())  # rank 0 says when to die
        os.kill(os.getpid(), signal.SIGKILL)
    t.close()


@pytest.mark.slow
def test_four_processes_on_two_cores_then_one_is_killed(tmp_path):
    """4 ranks (more than this machine's cores) exchange 300 rounds in a ring,
    then rank 3 is SIGKILLed: the others learn within a second, naming it, and
    nothing is left in /dev/shm."""
    before, threads_before = numcoll_entries(), our_threads()
    ctx = multiprocessing.get_context("spawn")
    size, rounds = 4, 300
    children = [ctx.Process(target=_ring_exchange, args=(r, size, str(tmp_path), rounds, r == 3))
                for r in range(1, size)]
    for c in children:
        c.start()
    t = ShmRingTransport(0, size, FileStore(str(tmp_path)))
    try:
        start = time.monotonic()
        value = np.array([0], np.int64)
        for i in range(rounds):
            got = np.empty(1, np.int64)
            recv = t.irecv(size - 1, i, got)
            t.isend(1, i, value).wait(deadline())
            recv.wait(deadline())
            value = got if i < size - 1 else value
        for peer in range(1, size):
            assert bytes(t.irecv(peer, 1 << 40).wait(deadline())) == b"done"
        assert time.monotonic() - start < 30
        assert numcoll_entries() == before  # memfd regions have no name
        pending = t.irecv(3, 99)
        t.isend(3, 1 << 41, b"die").wait(deadline())
        killed = time.monotonic()
        with pytest.raises(PeerClosed, match="rank 3 lost") as info:
            pending.wait(killed + 30)
        assert time.monotonic() - killed < 10  # noticed, not waited out (30 s)
        assert info.value.peer == 3
    finally:
        t.close()
        for c in children:
            c.join(WAIT_S)
    assert [c.exitcode for c in children] == [0, 0, -signal.SIGKILL]
    assert numcoll_entries() == before
    assert our_threads() == threads_before


def test_receives_without_a_buffer_free_the_ring_in_order(small_rings):
    """Receives without a buffer, between small messages, many times round a
    small ring: every byte of ring space comes back."""
    a, b = small_rings
    nbytes = 64 << 10  # three fill a 256 KiB ring
    for rnd in range(20):
        small = [b.irecv(0, 100 + rnd) for _ in range(2)]
        views = [b.irecv(0, rnd) for _ in range(2)]
        sends = [a.isend(1, 100 + rnd, b"s1"), a.isend(1, rnd, payload(rnd, nbytes)),
                 a.isend(1, 100 + rnd, b"s2"), a.isend(1, rnd, payload(rnd + 1, nbytes))]
        got = [v.wait(deadline()) for v in views]
        assert [bytes(s.wait(deadline())) for s in small] == [b"s1", b"s2"]
        for i, g in enumerate(reversed(got)):
            assert np.array_equal(np.frombuffer(g, np.uint8), payload(rnd + 1 - i, nbytes))
        del got, g
        for s in sends:
            s.wait(deadline())
    # the ring has been reused many times over: nothing leaked its space
    assert b._rings._tail[0] == b._rings._cursor[0]
