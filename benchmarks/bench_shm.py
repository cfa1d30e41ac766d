"""The ``shm`` transport between two *processes*, beside ``ipc``, for pytest-benchmark.

Run with ``python -m pytest benchmarks/bench_shm.py``; ``NUMCOLL_BENCH_MAX_NBYTES``
caps the message size (default 16 MiB; ``NUMCOLL_BENCH_MAX_NBYTES=4096`` is
the quick setting CI can afford).

* ``test_ping_pong``: this process (rank 0) sends ``nbytes`` to an echo
  process (rank 1), which sends them back; half the median is the one-way
  latency (``extra_info["one_way_us"]``). Unlike ``bench_transports.py``,
  whose two ranks share one process and its GIL, this is what ranks that are
  processes see: both sides poll at once.
* ``test_ring_loopback``: one thread writes a message into a ring and reads
  it back through the Numba kernels (``ring_put``/``ring_next`` and the copy
  out): the engine's own cost per message, without any peer.
"""

import itertools
import multiprocessing
import os
import shutil
import tempfile
import time

import numpy as np
import pytest

import transports
from transports.shm import ring as K

pytestmark = pytest.mark.timeout(300)

MAX_NBYTES = int(os.environ.get("NUMCOLL_BENCH_MAX_NBYTES", str(16 << 20)), 0)
SIZES_NBYTES = sorted({n for n in (8, 64 << 10, 1 << 20, 16 << 20) if n <= MAX_NBYTES}
                      | {MAX_NBYTES})
KINDS = ["shm", "ipc"]
WAIT_S = 60.0
_PING, _PONG = 1, 2


class _FileStore:
    """set/get through files: enough for two processes to rendezvous."""

    def __init__(self, root: str):
        self._root = root

    def _path(self, key: str) -> str:
        return os.path.join(self._root, key.encode().hex())

    def set(self, key: str, value: bytes) -> None:
        with open(self._path(key) + ".tmp", "wb") as f:
            f.write(value)
        os.replace(self._path(key) + ".tmp", self._path(key))

    def get(self, key: str) -> bytes:
        deadline = time.monotonic() + WAIT_S
        while not os.path.exists(self._path(key)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no key {key!r}")
            time.sleep(0.005)
        with open(self._path(key), "rb") as f:
            return f.read()


def _echo(kind: str, root: str) -> None:
    """Rank 1: send every message back until an empty one arrives."""
    t = transports.create(kind, 1, 2, _FileStore(root))
    try:
        while True:
            msg = t.irecv(0, _PING).wait(time.monotonic() + 600)
            t.isend(0, _PONG, msg).wait(time.monotonic() + WAIT_S)
            if msg.nbytes == 0:
                return
    finally:
        t.close()


@pytest.fixture(scope="module")
def peer():
    """``peer(kind)``: rank 0's transport, with an echo process as rank 1."""
    made = {}
    ctx = multiprocessing.get_context("spawn")

    def get(kind: str):
        if kind not in made:
            root = tempfile.mkdtemp(prefix="numcoll-bench-shm-")
            child = ctx.Process(target=_echo, args=(kind, root), daemon=True)
            child.start()
            made[kind] = (transports.create(kind, 0, 2, _FileStore(root)), child, root)
        return made[kind][0]

    yield get
    for t, child, root in made.values():
        try:  # an empty message ends the echo
            t.isend(1, _PING, b"").wait(time.monotonic() + WAIT_S)
            t.irecv(1, _PONG).wait(time.monotonic() + WAIT_S)
        finally:  # and whatever happened, nothing is left behind
            t.close()
            child.join(WAIT_S)
            if child.is_alive():
                child.kill()
                child.join(WAIT_S)
            shutil.rmtree(root, ignore_errors=True)


def _size_id(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B"


def _median_s(benchmark) -> float | None:
    stats = getattr(benchmark, "stats", None)  # None with --benchmark-disable
    return getattr(getattr(stats, "stats", None), "median", None)


@pytest.mark.slow
@pytest.mark.parametrize("nbytes", SIZES_NBYTES, ids=_size_id)
@pytest.mark.parametrize("kind", KINDS)
def test_ping_pong(benchmark, peer, kind, nbytes):
    t = peer(kind)
    out = np.ones(nbytes, np.uint8)
    back = np.empty(nbytes, np.uint8)

    def round_trip():
        deadline = time.monotonic() + WAIT_S
        home = t.irecv(1, _PONG, back)
        t.isend(1, _PING, out).wait(deadline)
        home.wait(deadline)

    benchmark.group = f"process ping-pong {_size_id(nbytes)}"
    benchmark.extra_info.update(kind=kind, nbytes=nbytes, pattern="ping-pong", ranks="processes")
    round_trip()
    benchmark(round_trip)
    assert back[0] == 1 and back[-1] == 1
    median_s = _median_s(benchmark)
    if median_s:
        benchmark.extra_info.update(one_way_us=median_s / 2 * 1e6,
                                    gbps=2 * nbytes / median_s / 1e9)


_tags = itertools.count()


@pytest.mark.parametrize("nbytes", [n for n in SIZES_NBYTES if n <= 1 << 20], ids=_size_id)
def test_ring_loopback(benchmark, nbytes):
    capacity = 4 << 20
    block = np.zeros(K.CTRL_WORDS + capacity // 8, np.uint64)
    ctrl, data64 = block[:K.CTRL_WORDS], block[K.CTRL_WORDS:]
    data = data64.view(np.uint8)
    src, dst = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    stamp = np.frombuffer(b"allreduce#1", np.uint8)

    def loop():
        tag = np.uint64(next(_tags))
        K.ring_put(ctrl, data, data64, K.KIND_FIRST, tag, nbytes, stamp, src, 0, False,
                   capacity // 2 - 512, 1 << 16)
        pos, word0, _, _, _, cursor = K.ring_next(ctrl, data64, int(ctrl[K.TAIL]))
        K.copy_bytes(dst, 0, data, pos + K.HEADER_NBYTES + stamp.size, nbytes)
        K.ring_free(ctrl, cursor + (word0 >> 16))

    benchmark.group = f"ring loopback {_size_id(nbytes)}"
    benchmark.extra_info.update(nbytes=nbytes, pattern="loopback")
    loop()
    benchmark(loop)
    assert dst[0] == 1 and dst[-1] == 1
