"""pyzmq's zero-copy bookkeeping is made once per process, under a lock
(``transports.zmq.zerocopy``): threads that send their first zero-copy frames
at once all see their sends complete. Without it, pyzmq's lazily made PUSH
socket can be made twice, and the frames made with the dropped one never
complete (13 of 60 fresh processes, run as below)."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(120)

_FIRST_SENDS = textwrap.dedent('''
    import sys, threading
    import zmq
    from transports.zmq import zerocopy

    sys.setswitchinterval(1e-6)  # a thread switch between almost any two bytecodes
    zerocopy.ready()
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    n = 8
    pushes = [ctx.socket(zmq.PUSH) for _ in range(n)]
    for s in pushes:
        s.connect(f"tcp://127.0.0.1:{port}")
    data = [bytearray(200_000) for _ in range(n)]
    start, trackers = threading.Barrier(n), [None] * n

    def send(i):
        start.wait()
        trackers[i] = pushes[i].send(memoryview(data[i]), copy=False, track=True)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for _ in range(n):
        pull.recv()
    stuck = 0
    for t in trackers:
        try:
            t.wait(5)
        except zmq.NotDone:
            stuck += 1
    print(stuck)
    sys.stdout.flush()
    import os
    os._exit(0)
''')


def test_first_zero_copy_sends_of_many_threads_all_complete():
    stuck = []
    for _ in range(20):  # each a fresh process: the window is a process's first frames
        out = subprocess.run([sys.executable, "-c", _FIRST_SENDS], cwd=ROOT, text=True,
                             capture_output=True, timeout=60)
        assert out.returncode == 0, out.stderr
        stuck.append(int(out.stdout.split()[-1]))
    assert stuck == [0] * 20, f"sends that never completed, per process: {stuck}"


def test_ready_is_made_once_per_process():
    from transports.zmq import zerocopy

    zerocopy.ready()
    import os
    assert zerocopy._ready_in == os.getpid()
    zerocopy.ready()  # a second call does nothing


def test_a_send_taken_but_never_released_says_so():
    """A zero-copy send whose bytes ZeroMQ took but whose release never came
    times out saying that, at the transport and in the collective's error,
    rather than as a send that did not leave."""
    import threading

    import numpy as np

    import numcoll as nc
    from numcoll.call import Call
    from numcoll.comm import Comm
    from transports import TransportTimeout
    from transports.pending import PendingRequest

    req = PendingRequest("send", 0, 1, 7)
    req.complete(None, source=1, after=threading.Event())  # taken; never released
    with pytest.raises(TransportTimeout) as info:
        req.wait(deadline=__import__("time").monotonic() + 0.05)
    exc = info.value
    assert exc.unreleased is True and "did not release its buffer" in str(exc)

    class _Rank:
        rank, size = 0, 2

    comm = Comm(_Rank(), 1, Call("allreduce", 30.0, np.dtype(np.float32), 4, root=-1))
    report = str(comm._translate(exc, 1, "send"))
    assert isinstance(comm._translate(exc, 1, "send"), nc.CollectiveTimeoutError)
    assert "send to rank 1 was taken by ZeroMQ, which never reported its buffer released" \
        in report, report
