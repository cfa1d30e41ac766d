"""Raw transports (inproc, ipc, tcp) between two ranks of one process, for
pytest-benchmark: no collectives, no numcoll, just bytes.

Run with ``python -m pytest benchmarks/bench_transports.py``.
``NUMCOLL_BENCH_MAX_NBYTES`` caps the message size (default 16 MiB; quick mode,
``--quick`` or ``NUMCOLL_BENCH_QUICK=1``: 8 B and 1 MiB only). ``gbps`` is shown
after each name in the table.

* ``test_ping_pong``: rank 0 sends ``nbytes`` to rank 1, which sends them back;
  a round is one round trip, so half the median is the one-way latency
  (``extra_info["one_way_us"]``).
* ``test_one_way``: rank 0 streams ``MESSAGES`` messages of ``nbytes`` to
  rank 1 (every receive posted first, into its own buffer); a round ends
  when the last one has landed. ``extra_info["gbps"]`` is the bytes moved
  divided by the median round time.

Both ranks are driven from the benchmark thread (the interface only posts and
waits), so the numbers include the posting overhead a collective pays too.
"""

import itertools
import os
import threading
import time

import numpy as np
import pytest

import numcoll as nc
import transports

pytestmark = pytest.mark.timeout(300)

QUICK = os.environ.get("NUMCOLL_BENCH_QUICK", "0") not in ("", "0")
MAX_NBYTES = int(os.environ.get("NUMCOLL_BENCH_MAX_NBYTES",
                                str(1 << 20 if QUICK else 16 << 20)), 0)
SIZES_NBYTES = sorted({n for n in ((8, 1 << 20) if QUICK else (8, 64 << 10, 1 << 20, 16 << 20))
                       if n <= MAX_NBYTES} | {MAX_NBYTES})
#: Messages per one-way round: enough to keep the pipe full.
MESSAGES = 4
#: Deadline of every wait, in seconds.
WAIT_S = 60.0


def _size_id(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B"


def _connect(kind: str) -> list:
    """Both ranks of a two-rank group (they rendezvous concurrently: threads)."""
    store, made, errors = nc.HashStore(timeout=WAIT_S), [None, None], []

    def make(rank):
        try:
            made[rank] = transports.create(kind, rank, 2, store)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    if errors or None in made:
        for t in made:
            if t is not None:
                t.close()
        raise RuntimeError(f"could not connect two {kind} transports: {errors}")
    return made


@pytest.fixture(scope="module")
def pair():
    """``pair(kind)``: two connected transports, made on first use and closed
    when the module is done."""
    made: dict[str, list] = {}

    def get(kind: str) -> list:
        if kind not in made:
            made[kind] = _connect(kind)
        return made[kind]

    yield get
    for ranks in made.values():
        for t in ranks:
            t.close()


_tags = itertools.count(1)


def _median_s(benchmark) -> float | None:
    stats = getattr(benchmark, "stats", None)  # None with --benchmark-disable
    return getattr(getattr(stats, "stats", None), "median", None)


@pytest.mark.parametrize("nbytes", SIZES_NBYTES, ids=_size_id)
@pytest.mark.parametrize("kind", transports.KINDS)
def test_ping_pong(benchmark, pair, kind, nbytes):
    t0, t1 = pair(kind)
    out = np.ones(nbytes, np.uint8)
    back = np.empty(nbytes, np.uint8)
    mid = np.empty(nbytes, np.uint8)

    def round_trip():
        tag = next(_tags)
        deadline = time.monotonic() + WAIT_S
        there = t1.irecv(0, tag, mid)
        sent = t0.isend(1, tag, out)
        there.wait(deadline)
        home = t0.irecv(1, tag, back)
        reply = t1.isend(0, tag, mid)
        home.wait(deadline)
        sent.wait(deadline)
        reply.wait(deadline)

    benchmark.group = f"ping-pong {_size_id(nbytes)}"
    benchmark.extra_info.update(kind=kind, nbytes=nbytes, pattern="ping-pong",
                                round_nbytes=2 * nbytes)
    round_trip()
    benchmark(round_trip)
    assert back[0] == 1 and back[-1] == 1
    median_s = _median_s(benchmark)
    if median_s:
        benchmark.extra_info.update(one_way_us=median_s / 2 * 1e6,
                                    gbps=2 * nbytes / median_s / 1e9)


@pytest.mark.parametrize("nbytes", SIZES_NBYTES, ids=_size_id)
@pytest.mark.parametrize("kind", transports.KINDS)
def test_one_way(benchmark, pair, kind, nbytes):
    t0, t1 = pair(kind)
    src = np.ones(nbytes, np.uint8)
    dst = [np.empty(nbytes, np.uint8) for _ in range(MESSAGES)]

    def stream():
        tag = next(_tags)
        deadline = time.monotonic() + WAIT_S
        # Same (peer, tag) messages arrive in order, so one tag serves the burst.
        recvs = [t1.irecv(0, tag, d) for d in dst]
        sends = [t0.isend(1, tag, src) for _ in dst]
        for r in recvs:
            r.wait(deadline)
        for s in sends:
            s.wait(deadline)

    benchmark.group = f"one-way {_size_id(nbytes)}"
    benchmark.extra_info.update(kind=kind, nbytes=nbytes, messages=MESSAGES, pattern="one-way",
                                round_nbytes=MESSAGES * nbytes)
    stream()
    benchmark(stream)
    assert all(d[0] == 1 and d[-1] == 1 for d in dst)
    median_s = _median_s(benchmark)
    if median_s:
        benchmark.extra_info.update(gbps=MESSAGES * nbytes / median_s / 1e9)
