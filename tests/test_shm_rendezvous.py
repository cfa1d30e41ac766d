"""The ``shm`` rendezvous against bad connections, in one process: garbage and
silent connections are dropped without stalling set-up, unsealed or resized
memory files are refused, ranks that disagree on the token or the settings
fail fast, and every refusal is counted and logged.

Attacks from another process and another user run in tests/test_hostile_users.py.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from transports import TransportError
from transports.shm import region as R
from transports.shm import ring as K
from transports.shm import rendezvous as rv
from transports.shm.transport import ShmRingTransport

from test_transports import DictStore, our_threads

pytestmark = pytest.mark.timeout(60)


class LateStore(DictStore):
    """Rank 1 publishes its card at once but looks up rank 0's only after
    ``delay_s``: rank 0 serves its listener meanwhile, rank 1 is late."""

    def __init__(self, delay_s: float):
        super().__init__(timeout_s=20)
        self.delay_s = delay_s

    def get(self, key):
        if key == "shm/0":
            time.sleep(self.delay_s)
        return super().get(key)


def start_rank(store, rank, size=2, results=None, **kwargs):
    """Create rank ``rank``'s transport on a thread; ``results[rank]`` gets it (or the error)."""
    results = {} if results is None else results

    def run():
        try:
            results[rank] = ShmRingTransport(rank, size, store, timeout_s=20, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            results[rank] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, results


def listener_of(store, rank) -> str:
    name, _pid, _ns = DictStore.get(store, f"shm/{rank}").decode().split(" ")
    return "\0" + name


def dial(name: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(name)
    return sock


def exchange(a, b):
    x = np.arange(1000, dtype=np.float64)
    s = a.isend(1, 7, x)
    got = np.frombuffer(b.irecv(0, 7).wait(time.monotonic() + 10), np.float64)
    s.wait(time.monotonic() + 10)
    np.testing.assert_array_equal(got, x)


def closing(results):
    for t in results.values():
        if isinstance(t, ShmRingTransport):
            t.close()


def formed_after_refusing(threads, results, reason: str) -> None:
    """The group formed, refused one connection for ``reason``, and works; closed after."""
    for t in threads:
        t.join(20)
    try:
        assert results[0].refusals.counts[reason] == 1, results[0].refusals.counts
        exchange(results[0], results[1])
    finally:
        closing(results)


def test_garbage_and_silent_connections_do_not_stall_set_up(monkeypatch, caplog):
    """Connections that pass the credential checks (they come from this very
    process) but send garbage, hang up, or say nothing, while rank 1 is
    late: each is dropped and logged, and the group forms as soon as rank 1
    comes, long before the silent one's handshake deadline."""
    caplog.set_level(logging.WARNING, logger="numcoll.transport")
    monkeypatch.setattr(rv, "HANDSHAKE_S", 5.0)
    store = LateStore(delay_s=1.0)
    t0, results = start_rank(store, 0)
    t1, _ = start_rank(store, 1, results=results)
    name = listener_of(store, 0)
    silent = dial(name)
    junk = [dial(name) for _ in range(3)]
    for sock, data in zip(junk, (b"hello", b"\x00" * rv.HELLO.size, b"")):
        assert sock.recv(rv.GREETING.size).startswith(rv.MAGIC)
        if data:
            sock.sendall(data)
        sock.close()
    start = time.monotonic()
    t0.join(20)
    t1.join(20)
    try:
        assert time.monotonic() - start < 3, "set-up waited for the silent connection"
        a, b = results[0], results[1]
        assert isinstance(a, ShmRingTransport), a
        exchange(a, b)
        assert a.refusals.counts["bad hello"] == 1  # a whole hello of zeros
        assert a.refusals.counts["hung up during the handshake"] == 2  # 5 bytes, and none
        assert a.refusals.counts["set-up ended before its handshake"] == 1  # the silent one
        assert "refused from pid" in caplog.text and "bad hello" in caplog.text
    finally:
        silent.close()
        closing(results)


def test_a_silent_connection_is_dropped_at_its_deadline(monkeypatch):
    monkeypatch.setattr(rv, "HANDSHAKE_S", 0.3)
    store = LateStore(delay_s=2.0)
    t0, results = start_rank(store, 0)
    t1, _ = start_rank(store, 1, results=results)
    silent = dial(listener_of(store, 0))
    assert silent.recv(rv.GREETING.size).startswith(rv.MAGIC)
    silent.settimeout(3)
    start = time.monotonic()
    assert silent.recv(10) == b""  # hung up on
    assert time.monotonic() - start < 1.5
    try:
        formed_after_refusing((t0, t1), results, "no handshake within 0.3s")
    finally:
        silent.close()


def _hello(rank, settings, nbytes, proof=bytes(32)):
    capacity, size, slot = settings
    return rv.HELLO.pack(rv.MAGIC, rank, capacity, size, slot, nbytes, os.urandom(32), proof)


@pytest.mark.parametrize("trick", ["unsealed", "shrinkable", "too small", "write-sealed",
                                   "no file"])
def test_a_memory_file_that_could_be_resized_is_refused(trick):
    """A connection claiming rank 1 with the right settings hands over a file
    whose size could change under the mapping (or the wrong size): refused,
    and the real rank 1 is still let in."""
    store = LateStore(delay_s=2.0)
    t0, results = start_rank(store, 0)
    t1, _ = start_rank(store, 1, results=results)
    name = listener_of(store, 0)
    capacity = K.ring_nbytes_for(1 << 20)  # the settings the real ranks use
    nbytes = R.region_nbytes(1, 2, capacity, 0)
    settings = (capacity, 2, 0)
    sock = dial(name)
    assert sock.recv(rv.GREETING.size).startswith(rv.MAGIC)
    sock.sendall(_hello(1, settings, nbytes))
    status, _ = rv.ANSWER.unpack(sock.recv(rv.ANSWER.size))
    assert status == rv.OK
    fd = os.memfd_create("impostor", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, nbytes // 2 if trick == "too small" else nbytes)
    if trick == "shrinkable":
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    elif trick in ("too small", "write-sealed"):
        extra = fcntl.F_SEAL_WRITE if trick == "write-sealed" else 0
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, R.SEALS | extra)
    if trick == "no file":
        sock.sendall(rv.FD_BYTE)
    else:
        socket.send_fds(sock, [rv.FD_BYTE], [fd])
    sock.settimeout(5)
    assert sock.recv(10) == b""  # dropped
    os.close(fd)
    sock.close()
    formed_after_refusing((t0, t1), results,
                          "bad hello" if trick == "no file" else "memory file refused")


def test_our_memory_files_cannot_be_resized():
    fd, region = R.create_region(0, 1 << 16)
    try:
        assert R.check_region(fd, 1 << 16) is None
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 1 << 20)
        with pytest.raises(PermissionError):  # nor can the seals be taken off or added to
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
        assert "expected" in R.check_region(fd, 1 << 17)
    finally:
        region.close()
        os.close(fd)


def test_a_process_no_rank_published_is_dropped_at_once():
    """Another process of this user: its credentials match no peer's pid, so
    it is dropped before a byte is exchanged."""
    store = LateStore(delay_s=1.5)
    t0, results = start_rank(store, 0)
    t1, _ = start_rank(store, 1, results=results)
    name = listener_of(store, 0)
    code = ("import socket, sys; s = socket.socket(socket.AF_UNIX); s.settimeout(5); "
            "s.connect('\\0' + sys.argv[1]); print(len(s.recv(100)))")
    out = subprocess.run([sys.executable, "-c", code, name[1:]], capture_output=True,
                         text=True, timeout=30)
    assert out.stdout.strip() == "0", out  # not even the greeting
    formed_after_refusing((t0, t1), results, "not a process of this group")


@pytest.mark.parametrize("tokens", [(b"a", b"b"), (b"a", None), (None, b"b")])
def test_ranks_that_disagree_on_the_token_fail_fast(tokens):
    before = our_threads()
    store = DictStore(timeout_s=20)
    results: dict = {}
    start = time.monotonic()
    threads = [start_rank(store, r, results=results, token=tokens[r])[0] for r in range(2)]
    for t in threads:
        t.join(25)
    assert time.monotonic() - start < 10
    errors = [results[r] for r in range(2)]
    assert all(isinstance(e, TransportError) for e in errors), errors
    assert any("token" in str(e) for e in errors)
    assert our_threads() == before


def test_a_shared_token_lets_the_group_form():
    store = DictStore(timeout_s=20)
    results: dict = {}
    threads = [start_rank(store, r, results=results, token=b"s3cret")[0] for r in range(2)]
    for t in threads:
        t.join(20)
    try:
        exchange(results[0], results[1])
        assert results[0].refusals.count == 0
    finally:
        closing(results)


def test_ranks_that_disagree_on_the_settings_fail_fast():
    store = DictStore(timeout_s=20)
    results: dict = {}
    threads = [start_rank(store, 0, results=results, inline_nbytes=1 << 20)[0],
               start_rank(store, 1, results=results, inline_nbytes=1 << 16)[0]]
    for t in threads:
        t.join(25)
    assert all(isinstance(results[r], TransportError) for r in range(2)), results
    assert any("same settings" in str(results[r]) for r in range(2))


def test_a_socket_that_is_not_the_published_process_gets_nothing(monkeypatch):
    """The connecting side checks the listener too: a card pointing at another
    process's socket is refused before this rank's memory is handed over."""
    srv = subprocess.Popen([sys.executable, "-c",
                            "import socket, sys, time; s = socket.socket(socket.AF_UNIX); "
                            "s.bind('\\0numcoll-test-squatter-%d' % int(sys.argv[1])); "
                            "s.listen(); print('up', flush=True); time.sleep(30)",
                            str(os.getpid())], stdout=subprocess.PIPE, text=True)
    try:
        assert srv.stdout.readline().strip() == "up"
        store = DictStore(timeout_s=20)
        ns = os.stat("/proc/self/ns/pid").st_ino
        store.set("shm/1", f"numcoll-test-squatter-{os.getpid()} {os.getpid()} {ns}".encode())
        with pytest.raises(TransportError, match="refusing to hand it this rank's memory"):
            ShmRingTransport(0, 2, store, timeout_s=10)
    finally:
        srv.kill()
        srv.wait()
