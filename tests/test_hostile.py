"""Hostile and careless neighbours: garbage and forged frames, strangers without
the token, floods, stores that are not stores, and what killed ranks leave behind.

Everything talks to 127.0.0.1 only. Ranks are threads of this process except in
the tests marked slow, which SIGKILL a real rank process.
"""

from __future__ import annotations

import ctypes
import datetime
import gc
import glob
import multiprocessing
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import zmq

import numcoll as nc
from numcoll.bootstrap.store import StoreTimeoutError
from numcoll.bootstrap.tcpstore import StoreAuthError, StoreConnectionError, TCPStore
from numcoll.bootstrap.tcpstore.protocol import OPENING
from test_transports import DictStore, FileStore, connect, deadline, payload
from transports import PeerClosed, TransportTimeout
from transports.zmq import wire as zt
from transports.zmq.slabs import SharedSlabs

HOST = "127.0.0.1"
#: Below the zero-copy threshold (inline), and above it (data frame, or a
#: shared-memory slot on ipc).
SIZES = (40, 100 << 10)
pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=["tcp", "ipc"])
def zkind(request):
    return request.param


def closing(ranks):
    for t in ranks:
        t.close()


def dropped(t) -> int:
    """Frames ``t`` dropped."""
    return t.refusals.counts["bad frame"]


def refused(t) -> int:
    """Connections ``t`` refused (at the door, or hung up on before their handshake)."""
    return t.refusals.count - dropped(t)


def exchange(ranks, rounds: int, first_tag: int = 1000) -> None:
    """Every rank sends every other rank one message per round and size;
    every byte is checked."""
    for r in range(rounds):
        sends = [t.isend(p, first_tag + r * 10 + i, payload(t.rank, p, r, i, nbytes=n))
                 for t in ranks for p in range(len(ranks)) if p != t.rank
                 for i, n in enumerate(SIZES)]
        for t in ranks:
            for p in range(len(ranks)):
                if p == t.rank:
                    continue
                for i, n in enumerate(SIZES):
                    got = t.irecv(p, first_tag + r * 10 + i).wait(deadline())
                    np.testing.assert_array_equal(np.frombuffer(got, np.uint8),
                                                  payload(p, t.rank, r, i, nbytes=n))
        for s in sends:
            s.wait(deadline())


def header(kind, src, tag=0, nbytes=0, stamp=b"", nonce=0):
    return zt.HEADER.pack(nonce, kind, src, tag, nbytes, len(stamp)) + stamp


def stranger(endpoint: str, **options) -> zmq.Socket:
    """A PUSH socket of someone who is not in the group."""
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    for name, value in options.items():
        sock.setsockopt(getattr(zmq, name), value)
    sock.connect(endpoint)
    return sock


def garbage(victim_rank: int, peer: int, tag: int) -> list[list[bytes]]:
    """Messages a stranger might send, one per kind of wrongness (none has the nonce)."""
    rng = np.random.default_rng(7)
    return [
        [b"hello"],
        [b""],
        [rng.integers(0, 256, 100, dtype=np.uint8).tobytes()],
        [rng.integers(0, 256, 5000, dtype=np.uint8).tobytes()],
        [header(zt.KIND_INLINE, peer, tag, 3)[:11]],                  # truncated header
        [header(99, peer, tag)],                                      # unknown kind
        [header(zt.KIND_INLINE, 7, tag, 3) + b"abc"],                 # rank outside the group
        [header(zt.KIND_INLINE, -1, tag, 3) + b"abc"],
        [header(zt.KIND_INLINE, victim_rank, tag, 3) + b"abc"],       # "from" the victim itself
        [header(zt.KIND_INLINE, peer, tag, 1 << 40) + b"abc"],        # oversized claims
        [header(zt.KIND_DATA, peer, tag, 1 << 40), b"x" * 10],
        [header(zt.KIND_INLINE, peer, tag, 0)[:-1] + b"\xff"],        # stamp past the end
        [header(zt.KIND_INLINE, peer, tag, 3) + b"abc", b"more", b"parts"],
        [header(zt.KIND_BYE, peer)],                                  # forged goodbye
        [header(zt.KIND_CREDIT, peer, 0, 0)],                         # forged credit
        [header(zt.KIND_SHM, peer, tag, 10) + struct.pack("<I", 0)],  # forged slot
        [header(zt.KIND_INLINE, peer, tag, 40) + bytes(40)],          # forged data
        [header(zt.KIND_DATA, peer, tag, 100 << 10), bytes(100 << 10)],
    ]


# --- 1. garbage never kills a rank --------------------------------------------------


def test_garbage_frames_are_dropped_and_logged(zkind, caplog):
    ranks = connect(zkind, 2)
    try:
        victim = ranks[0]
        sock = stranger(victim.endpoint)
        frames = garbage(0, 1, tag=1000)
        for round_ in range(3):
            for parts in frames:
                sock.send_multipart(parts)
            exchange(ranks, 1, first_tag=1000 + round_ * 10)
        sock.close()
        time_limit = deadline(5)
        while dropped(victim) < 3 * len(frames) and time.monotonic() < time_limit:
            time.sleep(0.01)
        assert dropped(victim) == 3 * len(frames)
        assert victim._io._thread.is_alive() and victim._mailbox.gone_reason(1) is None
        assert victim._mailbox.held_nbytes(1) == 0  # nothing forged was kept
        exchange(ranks, 2, first_tag=5000)
        messages = [r.getMessage() for r in caplog.records if r.name == "numcoll.transport"]
        assert len(messages) == 5  # rate-limited: the first few of each interval
        assert "refused: bad frame (5-byte frame, shorter than a header)" in messages[0]
    finally:
        closing(ranks)


def test_raw_socket_garbage_is_survived(zkind):
    """Bytes that are not ZeroMQ: a bad ZMTP greeting is hung up on at once;
    anything else libzmq reads as old ZMTP/1.0 frames, which the checks drop.
    The rank keeps working either way."""
    ranks = connect(zkind, 2)
    try:
        victim = ranks[1]
        address = victim.endpoint.split("://", 1)[1]
        rng = np.random.default_rng(3)
        junks = [b"hello\r\n", b"GET / HTTP/1.1\r\n\r\n",
                 rng.integers(0, 256, 4000, np.uint8).tobytes(),
                 b"\xff" + bytes(8) + b"\x7f" + rng.integers(0, 256, 4000, np.uint8).tobytes()]
        raws = []
        for i, junk in enumerate(junks):
            if zkind == "tcp":
                host, port = address.rsplit(":", 1)
                raw = socket.create_connection((host, int(port)))
            else:
                raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                raw.connect("\0" + address[1:])  # "@name" is the abstract namespace
            raw.sendall(junk)
            raws.append(raw)
            exchange(ranks, 1, first_tag=100 + 10 * i)
        raws[-1].settimeout(5)
        start = time.monotonic()
        with pytest.raises(ConnectionResetError):  # a bad greeting: reset at once
            while raws[-1].recv(4096):
                pass
        assert time.monotonic() - start < 5  # not the socket's own 5 s timeout
        for raw in raws:
            raw.close()
        assert victim._io._thread.is_alive() and victim._mailbox.held_nbytes(0) == 0
        exchange(ranks, 2, first_tag=7000)
    finally:
        closing(ranks)


def test_collectives_stay_right_under_garbage():
    """Three thread ranks over tcp run allreduces while a stranger sprays every
    rank's endpoint: every result is right, no rank fails."""

    def body():
        pg = nc.get_default_group()
        stop = threading.Event()
        if nc.get_rank() == 0:
            def spray():
                sock = stranger(pg._transport.endpoint)
                frames = garbage(0, 1, tag=1 << 32)  # collective #1, step 0
                while not stop.is_set():
                    for parts in frames:
                        sock.send_multipart(parts)
                    time.sleep(0.001)
                sock.close()
            sprayer = threading.Thread(target=spray)
            sprayer.start()
        try:
            for i in range(150):
                x = np.full(64 if i % 2 else 40000, nc.get_rank() + i, np.float32)
                nc.all_reduce(x)
                assert (x == 3 * i + 3).all(), (i, x[:3])
        finally:
            stop.set()
            if nc.get_rank() == 0:
                sprayer.join(10)
        return dropped(pg._transport)

    drops = nc.launch(body, 3, mode="thread", transport="tcp", timeout=60)
    assert drops[0] > 0


# --- 2. forgery ------------------------------------------------------------------


def test_forged_bye_and_data_need_the_nonce(zkind):
    ranks = connect(zkind, 2)
    try:
        victim = ranks[0]
        sock = stranger(victim.endpoint)
        pending = victim.irecv(1, 42)
        sock.send(header(zt.KIND_BYE, 1))
        sock.send(header(zt.KIND_INLINE, 1, 42, 5) + b"forge")
        with pytest.raises(TransportTimeout):
            pending.wait(time.monotonic() + 0.3)
        assert victim._mailbox.gone_reason(1) is None
        ranks[1].isend(0, 42, b"real!").wait(deadline())
        assert bytes(pending.wait(deadline())) == b"real!"
        # The nonce is what stopped them: with it, the same frames are believed.
        nonce = victim._sockets.peer_nonces[1]
        sock.send(header(zt.KIND_INLINE, 1, 43, 5, nonce=nonce) + b"forge")
        assert bytes(victim.irecv(1, 43).wait(deadline())) == b"forge"
        sock.close()
    finally:
        closing(ranks)


def test_forged_credit_cannot_double_free_a_slot():
    ranks = connect("ipc", 2, shm_slots=2)
    try:
        a, b = ranks
        slabs = a._shm
        slot = slabs.acquire(1)
        assert slabs.release(1, slot) is True
        assert slabs.release(1, slot) is False  # a second credit for the same slot
        assert slabs.release(1, 99) is False
        assert len(slabs._free[1]) == 2
        exchange(ranks, 3)
    finally:
        closing(ranks)


@pytest.mark.parametrize("options", [{"token": "s3cret"}, {"curve": True},
                                     {"token": "s3cret", "curve": True}])
def test_strangers_are_refused_at_the_door(zkind, options):
    """With a token or CURVE, a stranger's connection is refused (and logged):
    even a frame with the right nonce is never delivered."""
    ranks = connect(zkind, 2, **options)
    try:
        victim = ranks[0]
        exchange(ranks, 1)
        nonce = victim._sockets.peer_nonces[1]
        forged = header(zt.KIND_INLINE, 1, 77, 5, nonce=nonce) + b"forge"
        public, secret = zmq.curve_keypair()
        attempts = [{}, {"PLAIN_USERNAME": b"numcoll", "PLAIN_PASSWORD": b"guess"}]
        if options.get("curve"):
            attempts.append({"CURVE_SERVERKEY": victim._security.public_key,
                             "CURVE_PUBLICKEY": public, "CURVE_SECRETKEY": secret})
        socks = [stranger(victim.endpoint, **a) for a in attempts]
        for sock in socks:
            try:
                sock.send(forged, zmq.NOBLOCK)
            except zmq.Again:  # never admitted, so nothing to queue on
                pass
        with pytest.raises(TransportTimeout):
            victim.irecv(1, 77).wait(time.monotonic() + 0.5)
        limit = deadline(5)
        while refused(victim) < len(attempts) and time.monotonic() < limit:
            time.sleep(0.01)
        assert refused(victim) >= len(attempts)
        for sock in socks:
            sock.close()
        exchange(ranks, 1, first_tag=3000)
    finally:
        closing(ranks)


def test_token_mismatch_between_ranks_moves_nothing():
    store = DictStore()
    made = [None, None]

    def make(rank, token):
        made[rank] = nc_create("tcp", rank, store, token)

    threads = [threading.Thread(target=make, args=(r, t)) for r, t in ((0, "a"), (1, "b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    try:
        made[1].isend(0, 5, b"hi")
        with pytest.raises(PeerClosed, match="refused this rank's connection"):
            made[0].irecv(1, 5).wait(deadline())
        assert refused(made[0]) >= 1  # and rank 0 refused rank 1's
    finally:
        closing([t for t in made if t is not None])


def nc_create(kind, rank, store, token):
    import transports

    return transports.create(kind, rank, 2, store, transports.TransportOptions(token=token))


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_ipc_refuses_other_users():
    ranks = connect("ipc", 2)
    try:
        victim = ranks[0]
        frame = header(zt.KIND_INLINE, 1, 9, 5, nonce=victim._sockets.peer_nonces[1]) + b"other"
        code = ("import os, sys, time, zmq; os.setgid(65534); os.setuid(65534); "
                "s = zmq.Context().socket(zmq.PUSH); s.connect(sys.argv[1]); "
                "s.send(bytes.fromhex(sys.argv[2])); time.sleep(0.5); s.close(linger=0)")
        subprocess.run([sys.executable, "-c", code, victim.endpoint, frame.hex()],
                       check=True, timeout=30, cwd="/")
        with pytest.raises(TransportTimeout):
            victim.irecv(1, 9).wait(time.monotonic() + 0.3)
        assert refused(victim) >= 1
        exchange(ranks, 1)
    finally:
        closing(ranks)


# --- 4. bounded memory --------------------------------------------------------------


def test_a_peer_over_the_unexpected_cap_is_cut_off(zkind):
    cap = 1 << 20
    ranks = connect(zkind, 2, max_unexpected_nbytes=cap)
    try:
        a, b = ranks
        # Within the cap, out-of-order arrival is fine.
        sends = [a.isend(1, 100 + i, payload(i, nbytes=100 << 10)) for i in range(5)]
        for i in reversed(range(5)):
            got = b.irecv(0, 100 + i).wait(deadline())
            np.testing.assert_array_equal(np.frombuffer(got, np.uint8),
                                          payload(i, nbytes=100 << 10))
        for s in sends:
            s.wait(deadline())
        assert b._mailbox.held_nbytes(0) == 0
        # Beyond it: cut off, saying why, and nothing more is kept.
        for i in range(30):
            a.isend(1, 200 + i, payload(i, nbytes=100 << 10))
        with pytest.raises(PeerClosed, match="sent more than 1048576 bytes"):
            b.irecv(0, 999).wait(deadline())
        assert b._mailbox.held_nbytes(0) <= cap
    finally:
        closing(ranks)


def _rss_nbytes() -> int:
    # Freed frames can stay in malloc's arenas (more so late in a long test
    # session): hand them back first, so RSS counts what is still kept.
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
def test_a_flood_of_forged_frames_is_not_kept():
    ranks = connect("tcp", 2)
    try:
        victim = ranks[0]
        sock = stranger(victim.endpoint)
        blob = bytes(1 << 20)
        before = _rss_nbytes()
        for i in range(150):  # 150 MiB claiming to be rank 1, and from rank 5
            sock.send_multipart([header(zt.KIND_DATA, 1 + 4 * (i % 2), i, len(blob)), blob])
        limit = deadline(30)
        while dropped(victim) < 150 and time.monotonic() < limit:
            time.sleep(0.02)
        grown = _rss_nbytes() - before
        assert dropped(victim) == 150
        assert grown < 40 << 20, f"RSS grew {grown >> 20} MiB"
        sock.close()
        exchange(ranks, 1)
    finally:
        closing(ranks)


# --- TCPStore: strangers, garbage, caps, deadlines -----------------------------------


def test_store_token_both_ways(caplog):
    with TCPStore(HOST, 0, is_master=True, token="s3cret", timeout=5) as master:
        with TCPStore(HOST, master.port, token=b"s3cret", timeout=5) as client:
            client.set("k", b"v")
            assert master.get("k") == b"v"
        start = time.monotonic()
        with pytest.raises(StoreAuthError, match="requires a token"):
            TCPStore(HOST, master.port, timeout=5)
        with pytest.raises(StoreAuthError, match="refused this client's token"):
            TCPStore(HOST, master.port, token="wrong", timeout=5)
        assert time.monotonic() - start < 5  # refused at once: not after a 5 s timeout
        assert "failed authentication" in caplog.text
        # A raw client skipping the handshake is dropped before any request is
        # served, and before the server buffers a big frame for it.
        for first in (_frame(1, b"k", b"forged"), struct.pack("!I", 60 << 20) + bytes(1000)):
            with socket.create_connection((HOST, master.port), timeout=5) as raw:
                raw.sendall(OPENING + first)
                _drain(raw)
        assert caplog.text.count("instead of the authentication answer") == 2
        assert master.get("k") == b"v"
    with TCPStore(HOST, 0, is_master=True, timeout=5) as open_master:
        with pytest.raises(StoreAuthError, match="does not ask for the token"):
            TCPStore(HOST, open_master.port, token="s3cret", timeout=5)


def test_store_env_token(monkeypatch):
    monkeypatch.setenv("NUMCOLL_AUTH_TOKEN", "from-env")
    with TCPStore(HOST, 0, is_master=True, timeout=5) as master:
        with TCPStore(HOST, master.port, token="from-env", timeout=5) as client:
            client.set("a", b"1")
        monkeypatch.delenv("NUMCOLL_AUTH_TOKEN")
        with pytest.raises(StoreAuthError):
            TCPStore(HOST, master.port, timeout=5)


def _frame(op, *fields):
    body = bytes([op]) + b"".join(struct.pack("!I", len(f)) + f for f in fields)
    return struct.pack("!I", len(body)) + body


def _drain(sock) -> None:
    """Read until the server hangs up (bounded by the socket's timeout)."""
    try:
        while sock.recv(1 << 16):
            pass
    except ConnectionResetError:
        pass


def _serve(answer: bytes | None):
    """A TCP listener that is not a store: answers ``answer`` (or never accepts)."""
    listener = socket.create_server((HOST, 0))
    stop = threading.Event()

    def run():
        listener.settimeout(0.05)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            conn.sendall(answer)
            conn.close()

    thread = threading.Thread(target=run, daemon=True)
    if answer is not None:
        thread.start()
    return listener, stop, thread


@pytest.mark.parametrize("answer", [b"HTTP/1.1 400 Bad Request\r\n\r\n", b"\x00\x00\x00\x01x",
                                    b"", None])
def test_a_port_that_is_not_a_store_fails_fast(answer, monkeypatch):
    monkeypatch.setenv("NUMCOLL_STORE_PROBE_S", "0.5")
    listener, stop, thread = _serve(answer)
    try:
        start = time.monotonic()
        with pytest.raises(StoreAuthError, match="did not answer like a numcoll TCPStore"):
            TCPStore(HOST, listener.getsockname()[1], timeout=30)
        assert time.monotonic() - start < 10  # the 0.5 s probe, far from the 30 s timeout
    finally:
        stop.set()
        if answer is not None:
            thread.join(5)
        listener.close()


def test_store_rejects_malformed_requests_and_oversized_frames():
    with TCPStore(HOST, 0, is_master=True, timeout=5, max_frame_nbytes=4096) as master:
        with socket.create_connection((HOST, master.port), timeout=5) as raw:
            raw.sendall(OPENING)  # what every client says first
            _read_frame(raw)  # the greeting
            for bad in (_frame(2, b"k", b"9" * 400),   # a timeout no clock holds
                        _frame(3, b"k", b"not a number"),
                        _frame(1, b"only-a-key"),
                        bytes([0, 0, 0, 9, 1, 0, 0, 0, 200]) + b"abcd",  # field past the end
                        _frame(200)):
                raw.sendall(bad)
                assert _read_frame(raw)[0] == 2  # an error reply; the connection lives on
            raw.sendall(_frame(1, b"ok", b"1"))
            assert _read_frame(raw)[0] == 0
        with TCPStore(HOST, master.port, timeout=5) as client:
            with pytest.raises(StoreConnectionError):
                client.set("big", bytes(5000))  # over the frame cap: dropped
            client.set("small", b"1")  # a fresh connection works
        with socket.create_connection((HOST, master.port), timeout=5) as raw:
            raw.sendall(OPENING + struct.pack("!I", 1 << 30) + b"x" * 1000)  # an unfinished giant
            _drain(raw)
        assert master.get("ok") == b"1"


def test_store_frame_cap_from_the_environment(monkeypatch):
    monkeypatch.setenv("NUMCOLL_STORE_MAX_FRAME_NBYTES", "2048")
    with TCPStore(HOST, 0, is_master=True, timeout=5) as master:
        master.set("fits", bytes(1500))
        with pytest.raises(StoreConnectionError):
            master.set("too big", bytes(3000))
        assert master.get("fits") == bytes(1500)
    monkeypatch.setenv("NUMCOLL_STORE_MAX_FRAME_NBYTES", "100")
    with pytest.raises(ValueError, match="STORE_MAX_FRAME_NBYTES"):
        TCPStore(HOST, 0, is_master=True, timeout=5)


def _read_frame(sock) -> bytes:
    def exact(n):
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            assert chunk, "connection closed"
            data += chunk
        return data

    (n,) = struct.unpack("!I", exact(4))
    return exact(n)


def test_store_drops_a_client_that_never_reads():
    with TCPStore(HOST, 0, is_master=True, timeout=5, max_frame_nbytes=1 << 20) as master:
        master.set("value", bytes(256 << 10))
        raw = socket.create_connection((HOST, master.port), timeout=5)
        raw.sendall(OPENING)
        request = _frame(2, b"value", b"1000")
        sent = 0
        try:
            for _ in range(400):  # 100 MiB of replies asked for, none read
                raw.sendall(request)
                sent += 1
        except OSError:
            pass
        time.sleep(0.2)
        # The server hung up on it: what is readable ends well short of 400 replies.
        total = 0
        try:  # ends (b"", or a reset: it closed with requests unread) rather than timing out
            while chunk := raw.recv(1 << 20):
                total += len(chunk)
        except ConnectionResetError:
            pass
        raw.close()
        assert total < 100 * (256 << 10), total
        assert master.get("value") == bytes(256 << 10)


def test_store_serves_clients_past_200_idle_connections(monkeypatch):
    import numcoll.bootstrap.tcpstore.server as tcp_server

    monkeypatch.setattr(tcp_server, "HANDSHAKE_TIMEOUT_S", 0.5)
    for token in (None, "s3cret"):
        with TCPStore(HOST, 0, is_master=True, timeout=5, token=token) as master:
            idle = [socket.create_connection((HOST, master.port), timeout=5) for _ in range(200)]
            try:
                with TCPStore(HOST, master.port, timeout=5, token=token) as client:
                    start = time.monotonic()
                    for i in range(100):
                        client.set(f"k{i}", b"v")
                        assert client.get(f"k{i}") == b"v"
                    # not held up by the idle ones (200 x the 0.5 s handshake timeout)
                    assert time.monotonic() - start < 20
                # strangers that never say which protocol they speak are hung up on
                time.sleep(0.8)
                idle[0].settimeout(2)
                assert idle[0].recv(10) == b""
            finally:
                for s in idle:
                    s.close()


def test_a_short_deadline_is_kept_while_another_thread_is_stuck():
    master = TCPStore(HOST, 0, is_master=True, timeout=30)
    client = TCPStore(HOST, master.port, timeout=30)
    stuck = threading.Thread(target=lambda: _swallow(client.get, "never"), daemon=True)
    stuck.start()
    time.sleep(0.1)
    try:
        start = time.monotonic()
        with pytest.raises(StoreTimeoutError, match="busy"):
            client.set("abort/0", b"why", timeout=0.3)
        # The short deadline is kept: waited for (a deadline never passes early),
        # and far from the stuck thread's 30 s (an upper bound near 0.3 s would
        # fail on a loaded machine, not on a wrong deadline).
        elapsed = time.monotonic() - start
        assert 0.25 < elapsed < 10, elapsed
        master.close()  # the store host is gone
        stuck.join(5)
        start = time.monotonic()
        with pytest.raises((StoreConnectionError, StoreTimeoutError)):
            client.set("abort/0", b"why", timeout=0.3)
        assert time.monotonic() - start < 10  # far from the client's 30 s
        start = time.monotonic()
        with pytest.raises(StoreConnectionError):  # even without one: not 30 s
            client.set("abort/0", b"why")
        assert time.monotonic() - start < 10
    finally:
        client.close()
        master.close()


def _swallow(fn, *args):
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - this thread only holds the client busy
        pass


def test_bounded_set_through_prefix_and_hash_stores():
    store = nc.PrefixStore("p", nc.HashStore())
    store.set("k", b"v", timeout=datetime.timedelta(seconds=1))
    assert store.get("k") == b"v"
    with TCPStore(HOST, 0, is_master=True, timeout=5) as master:
        nc.PrefixStore("q", master).set("k", b"w", timeout=0.5)
        assert master.get("q/k") == b"w"


# --- 3. nothing left behind -----------------------------------------------------------


def _ours(pid: int) -> list[str]:
    return glob.glob(f"/dev/shm/numcoll-slab-{pid}-*")


def test_ipc_endpoints_have_no_file(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    ranks = connect("ipc", 2)
    try:
        assert all(t.endpoint.startswith("ipc://@numcoll-") for t in ranks)
        assert os.listdir(tmp_path) == []
        assert _ours(os.getpid()) == []
        exchange(ranks, 1)
    finally:
        closing(ranks)
    assert os.listdir(tmp_path) == []


class SlowStore(DictStore):
    """Rank 1 is slow to look up rank 0's slab: the start-up race, made certain."""

    def get(self, key):
        if key == "shm/0/1":
            time.sleep(0.3)
        return super().get(key)


def test_a_rank_that_finishes_at_once_cannot_unlink_its_peers_slab():
    store = SlowStore()
    errors, made = [], [None, None]

    def rank(r):
        try:
            made[r] = SharedSlabs(r, 2, store, 1 << 16, 2)
            if r == 0:
                made[r].close()  # done with the group before its peer even looked
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors, errors
    assert made[1].has_slab(0) and 0 in made[1]._in  # it mapped rank 0's slab in time
    made[1].close()
    assert _ours(os.getpid()) == []


def _ipc_rank_then_wait(root: str) -> None:
    t = nc_create_process("ipc", 1, FileStore(root))
    t.isend(0, 1, b"x" * (200 << 10)).wait(deadline())
    t.irecv(0, 2).wait(deadline())
    time.sleep(60)  # killed here


def nc_create_process(kind, rank, store):
    import transports

    return transports.create(kind, rank, 2, store)


def _slab_then_hang(root: str) -> None:
    SharedSlabs(0, 2, FileStore(root, timeout_s=60), 1 << 16, 2)  # rank 1 never comes


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_sigkilled_rank_leaves_nothing(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    store_root = tmp_path / "store"
    store_root.mkdir()
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    os.environ["TMPDIR"] = str(tmp)  # the child's temp dir (spawn reads the environment)
    try:
        child = ctx.Process(target=_ipc_rank_then_wait, args=(str(store_root),))
        child.start()
    finally:
        del os.environ["TMPDIR"]
    t = nc_create_process("ipc", 0, FileStore(str(store_root)))
    try:
        assert len(bytes(t.irecv(1, 1).wait(deadline(30)))) == 200 << 10
        t.isend(1, 2, b"go").wait(deadline())
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
        with pytest.raises(PeerClosed):
            t.irecv(1, 3).wait(deadline(10))
    finally:
        t.close()
    assert os.listdir(tmp) == []
    assert _ours(child.pid) == [] and _ours(os.getpid()) == []


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_kill_during_group_creation_is_reaped_by_the_next_group(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    child = ctx.Process(target=_slab_then_hang, args=(str(tmp_path),))
    child.start()
    limit = deadline(30)
    while not _ours(child.pid) and time.monotonic() < limit:
        time.sleep(0.05)
    left = _ours(child.pid)
    assert left, "the child should have created its slab"
    os.kill(child.pid, signal.SIGKILL)
    child.join(10)
    assert _ours(child.pid) == left  # killed mid-handshake: the file is still there
    ranks = connect("ipc", 2)  # any later group on this host reaps it
    closing(ranks)
    assert _ours(child.pid) == []


def _return_zero():
    return 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_ranks_launch_repeatedly():
    """The issue's reproducer (a rank that returns at once), a few times."""
    for _ in range(4):
        assert nc.launch(_return_zero, 2, timeout=60) == [0, 0]


def _sum_of_ranks():
    x = np.full(70000, nc.get_rank() + 1.0, np.float32)  # through data frames or slots
    nc.all_reduce(x)
    y = np.full(3, nc.get_rank() + 1, np.int64)
    nc.all_reduce(y)
    return float(x[0]), int(y[0])


@pytest.mark.parametrize("curve", ["0", "1"])
def test_groups_work_with_the_token_from_the_environment(monkeypatch, curve):
    monkeypatch.setenv("NUMCOLL_AUTH_TOKEN", "group-secret")
    monkeypatch.setenv("NUMCOLL_CURVE", curve)
    assert nc.launch(_sum_of_ranks, 3, mode="thread", transport="tcp", timeout=60) == \
        [(6.0, 6)] * 3


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_process_ranks_with_token_and_curve(monkeypatch):
    """The launcher's store and the ranks' ipc transport all authenticate."""
    monkeypatch.setenv("NUMCOLL_AUTH_TOKEN", "launch-secret")
    monkeypatch.setenv("NUMCOLL_CURVE", "1")
    assert nc.launch(_sum_of_ranks, 2, timeout=60) == [(3.0, 3)] * 2
