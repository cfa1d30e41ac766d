"""The staged device path: whole buffers through pinned host memory, host work
constant in the array's size.

Runs under Numba's CUDA simulator unless ``NUMBA_ENABLE_CUDASIM=0`` is set (then
on the GPU); the tests marked ``gpu`` (pinned memory, real asynchrony, sizes the
simulator cannot reduce in reasonable time) skip elsewhere with the reason.
"""


from cuda_env import SIMULATED  # noqa: E402,F401 - first: chooses the simulator

import numpy as np  # noqa: E402
import pytest  # noqa: E402

pytestmark = pytest.mark.timeout(180)


import numcoll as nc  # noqa: E402
import numcoll.cuda  # noqa: E402
from numcoll.cuda import kernels as cuda_kernels  # noqa: E402
from numcoll.cuda import pinned_pool  # noqa: E402

to_device, to_host = numcoll.cuda.to_device, numcoll.cuda.to_host


class _Copies:
    """Counts the staging copies (device -> host, host -> device) of a call."""

    def __init__(self, monkeypatch):
        self.to_host = self.to_device = 0
        real_to_host, real_to_device = cuda_kernels.to_host_async, cuda_kernels.to_device_async

        def to_host(*args, **kwargs):
            self.to_host += 1
            return real_to_host(*args, **kwargs)

        def to_device(*args, **kwargs):
            self.to_device += 1
            return real_to_device(*args, **kwargs)

        monkeypatch.setattr(cuda_kernels, "to_host_async", to_host)
        monkeypatch.setattr(cuda_kernels, "to_device_async", to_device)


@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling"])
def test_one_copy_each_way_whatever_the_size(monkeypatch, algorithm):
    """However many segments the algorithm takes (64-byte segments here), a
    rank's device buffer crosses to the host once and back once."""
    monkeypatch.setenv("NUMCOLL_SEGMENT_NBYTES", "64")
    monkeypatch.setenv("NUMCOLL_ALGORITHM", f"allreduce:{algorithm}")
    copies = _Copies(monkeypatch)
    per_count = {}
    for count in (16, 4096):
        copies.to_host = copies.to_device = 0

        def body():
            rank = nc.get_rank()
            x = to_device(np.full(count, rank + 1.0, np.float32))
            nc.all_reduce(x, op=nc.ReduceOp.SUM)
            return to_host(x)

        for x in nc.launch(body, 3, mode="thread", timeout=150):
            np.testing.assert_array_equal(x, np.full(count, 6.0, np.float32))
        per_count[count] = (copies.to_host, copies.to_device)
    assert per_count[16] == per_count[4096] == (3, 3), per_count


def test_receive_only_buffers_keep_what_they_did_not_receive():
    """Broadcast into a slice of a larger device array: the mirror goes back
    whole, so the bytes around the slice must come through unchanged."""
    def body():
        rank = nc.get_rank()
        whole = to_device(np.arange(20, dtype=np.int32) + 100 * rank)
        nc.broadcast(whole[5:15], src=1)
        return to_host(whole)

    for rank, got in enumerate(nc.launch(body, 3, mode="thread", timeout=150)):
        expect = np.arange(20, dtype=np.int32) + 100 * rank
        expect[5:15] = np.arange(5, 15) + 100
        np.testing.assert_array_equal(got, expect)


def test_a_buffer_used_twice_waits_for_its_flush():
    """The same array allreduced over and over: each call stages what the
    previous one flushed back, never a stale mirror."""
    def body():
        rank = nc.get_rank()
        x = to_device(np.full(6, float(rank), np.float32))
        for _ in range(3):
            nc.all_reduce(x)
        return to_host(x)

    for got in nc.launch(body, 2, mode="thread", timeout=150):
        np.testing.assert_array_equal(got, np.full(6, 4.0, np.float32))   # (0 + 1), then doubled twice


@pytest.mark.gpu
def test_large_allreduce_on_the_gpu(monkeypatch):
    """16 MiB of float32 and of bfloat16 between 2 ranks on a real GPU, staged
    through the pinned pool (real asynchronous copies, real streams; thread
    ranks would read each other's memory instead, so that is switched off)."""
    monkeypatch.setenv("NUMCOLL_CUDA_IPC", "off")
    count = 4 << 20

    def body():
        rank = nc.get_rank()
        x = to_device(np.full(count, rank + 1.0, np.float32))
        h = to_device(np.full(count, rank + 1.0, nc.bfloat16))
        nc.all_reduce(x)
        nc.all_reduce(h, op=nc.ReduceOp.AVG)
        return to_host(x), to_host(h)

    for x, h in nc.launch(body, 2, mode="thread", timeout=150):
        np.testing.assert_array_equal(x, np.full(count, 3.0, np.float32))
        np.testing.assert_array_equal(h.astype(np.float32), np.full(count, 1.5, np.float32))
    assert pinned_pool.POOL.pinned_nbytes >= count * 4


def test_a_toolchain_that_cannot_compile_raises_one_clear_error(monkeypatch):
    """numba-cuda 0.30 with numpy 2.5 fails inside numba at the first compile
    (np.row_stack is gone); numcoll says what to install instead."""
    from numcoll.cuda import kernels as K

    def broken(*args, **kwargs):
        raise AttributeError("module 'numpy' has no attribute 'row_stack'")

    monkeypatch.setattr(K, "_trial_launch", broken)
    monkeypatch.setattr(K, "_compiled", {})
    with pytest.raises(nc.NumcollError, match=r'row_stack.*pip install "numcoll\[cuda\]"'):
        K.compile_op(nc.ReduceOp.SUM, np.float32)


def test_device_temporaries_are_pooled_and_reused():
    """A bfloat16 allreduce widens into a float32 temporary every call: after the
    first call, the temporaries come back from the pool (no new allocation, and
    on a GPU the same allocation, which peers keep open for CUDA IPC)."""
    from numcoll.cuda.memory import DEVICE_POOL

    allocated = []

    def body():
        rank = nc.get_rank()
        for i in range(4):
            x = to_device(np.full(50, rank + 1.0, nc.bfloat16))
            nc.all_reduce(x)
            assert float(to_host(x)[0]) == 3.0
            nc.barrier()
            if i == 0 and rank == 0:
                allocated.append(DEVICE_POOL.pinned_nbytes)
            nc.barrier()
        return True

    assert all(nc.launch(body, 2, mode="thread", timeout=150))
    assert DEVICE_POOL.pinned_nbytes == allocated[0]
    assert numcoll.cuda.release_idle() >= 0
    assert DEVICE_POOL._idle_nbytes == 0


# -- the copy into the mirror, in pieces ---------------------------------------------
@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling"])
def test_pieces_a_fixed_number_of_copies_whatever_the_segments(monkeypatch, algorithm):
    """With 4 pieces of at least 16 bytes, a rank's buffer comes over in 4
    copies (fewer when it is small) and goes back in one, however many 64-byte
    segments the algorithm takes; the results are exact at every count,
    including counts the pieces do not divide."""
    monkeypatch.setenv("NUMCOLL_SEGMENT_NBYTES", "64")
    monkeypatch.setenv("NUMCOLL_ALGORITHM", f"allreduce:{algorithm}")
    monkeypatch.setenv("NUMCOLL_CUDA_STAGING_PIECES", "4")
    monkeypatch.setenv("NUMCOLL_CUDA_STAGING_PIECE_MIN_NBYTES", "16")
    copies = _Copies(monkeypatch)
    for count, pieces in ((3, 1), (9, 2), (1001, 4), (4096, 4)):
        copies.to_host = copies.to_device = 0

        def body():
            rank = nc.get_rank()
            x = to_device(np.arange(count, dtype=np.float32) * (rank + 1))
            nc.all_reduce(x)
            return to_host(x)

        for x in nc.launch(body, 3, mode="thread", timeout=150):
            np.testing.assert_array_equal(x, np.arange(count, dtype=np.float32) * 6)
        assert (copies.to_host, copies.to_device) == (3 * pieces, 3), count


class _Events:
    """Stands in for the buffer's events: records which piece the host waited for."""

    def __init__(self):
        self.made, self.waited = 0, []

    def __call__(self):
        events, index = self, self.made
        self.made += 1

        class Event:
            def record(self, stream):
                pass

            def synchronize(self):
                events.waited.append(index)

        return Event()


def test_a_protocol_call_waits_only_for_the_pieces_it_touches(monkeypatch):
    from numcoll.cuda import buffer as staged

    events = _Events()
    monkeypatch.setattr(staged, "_new_event", events)
    monkeypatch.setenv("NUMCOLL_CUDA_STAGING_PIECES", "4")
    monkeypatch.setenv("NUMCOLL_CUDA_STAGING_PIECE_MIN_NBYTES", "8")
    host = np.arange(40, dtype=np.float64)
    stream = numcoll.cuda.device.cuda.stream()
    buf = staged.DeviceBuffer(to_device(host), stream, lambda n: np.empty(n, np.uint8))
    np.testing.assert_array_equal(buf.send_view(12, 5), host[12:17])
    assert events.made == 4 and events.waited == [1]
    buf.send_view(19, 2)                            # pieces 1 and 2: 1 is here already
    assert events.waited == [1, 2]
    buf.recv_view(0, 40)[:] = 0                     # writing waits for what may still land
    assert sorted(events.waited) == [0, 1, 2, 3]
    buf.send_view(30, 10)
    assert len(events.waited) == 4                  # nothing left to wait for


@pytest.mark.gpu
def test_the_first_piece_is_used_while_the_last_is_still_copying():
    """On a GPU, 256 MiB from device to pinned host in 4 pieces: once the first
    piece is in, the last one's copy has not finished (the copies run while the
    host works), and every piece arrives intact."""
    from numcoll.cuda import buffer as staged

    count = 64 << 20
    stream = numcoll.cuda.device.cuda.stream()
    dev = to_device(np.arange(count, dtype=np.float32))
    stream.synchronize()
    buf = staged.DeviceBuffer(dev, stream, pinned_pool.POOL.take)
    assert buf.send_view(0, 16)[15] == 15.0
    assert buf._arrivals[-1] is not None and not buf._arrivals[-1].query()
    np.testing.assert_array_equal(buf.send_view(0, count), np.arange(count, dtype=np.float32))
