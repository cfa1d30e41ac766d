"""Stores (HashStore, FileStore, PrefixStore, TCPStore) and rendezvous.

The shared semantics run against every store kind; each kind then gets the
tests of what only it does (processes sharing a file, a server thread).
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import socket
import struct
import threading
import time

import pytest

import numcoll.bootstrap.init_methods as rdzv
from numcoll.errors import CollectiveTimeoutError, NumcollError
from numcoll.bootstrap.filestore import FileStore
from numcoll.bootstrap.store import (
    DEFAULT_STORE_TIMEOUT,
    HashStore,
    PrefixStore,
    Store,
    StoreTimeoutError,
)
from numcoll.bootstrap.tcpstore import StoreConnectionError, TCPStore
from numcoll.bootstrap.tcpstore.protocol import OPENING

pytestmark = pytest.mark.timeout(60)

HOST = "127.0.0.1"
ONE_SECOND = datetime.timedelta(seconds=1)
STORE_KINDS = ["hash", "file", "tcp", "prefix"]


@pytest.fixture(params=STORE_KINDS)
def stores(request, tmp_path):
    """``(store, peer)``: two handles on one keyspace (the same object for HashStore).

    Waiting tests block on ``store`` and write through ``peer``; a TCPStore
    serves one request at a time per connection, so ``peer`` is the master.
    """
    kind = request.param
    if kind == "hash":
        store = HashStore()
        pair = (store, store)
    elif kind == "file":
        path = tmp_path / "store"
        pair = (FileStore(path, world_size=2), FileStore(path, world_size=2))
    elif kind == "tcp":
        master = TCPStore(HOST, 0, is_master=True)
        pair = (TCPStore(HOST, master.port), master)
    else:
        base = HashStore()
        pair = (PrefixStore("pre", base), PrefixStore("pre", base))
    yield pair
    for handle in pair:
        handle.close()


@pytest.fixture
def store(stores):
    return stores[0]


def _elapsed(fn, *args):
    start = time.monotonic()
    try:
        fn(*args)
    finally:
        _elapsed.last = time.monotonic() - start


# -- semantics shared by every store ------------------------------------------

def test_set_get_round_trip(stores):
    store, peer = stores
    store.set("text", "héllo")
    store.set("raw", b"\x00\xff")
    store.set("empty", b"")
    assert peer.get("text") == "héllo".encode()
    assert peer.get("raw") == b"\x00\xff"
    assert peer.get("empty") == b""
    peer.set("text", bytearray(b"new"))
    assert store.get("text") == b"new"


def test_large_value(stores):
    store, peer = stores
    value = os.urandom(4 << 20)  # many TCP segments, partial sends on the server
    store.set("big", value)
    assert peer.get("big") == value
    assert store.get("big") == value


def test_bad_key_and_value_types(store):
    with pytest.raises(TypeError, match="keys must be str"):
        store.set(1, b"x")
    with pytest.raises(TypeError, match="must be str or bytes"):
        store.set("k", 5)


def test_get_missing_key_times_out(store):
    store.set_timeout(ONE_SECOND)
    with pytest.raises(StoreTimeoutError) as info:
        _elapsed(store.get, "missing_key")
    assert 0.9 < _elapsed.last < 10  # the 1 s deadline: kept, and far below the default's 300 s
    assert isinstance(info.value, CollectiveTimeoutError)
    assert isinstance(info.value, TimeoutError)
    message = str(info.value)
    assert message.startswith("Timed out waiting 1000ms for key(s) [")
    assert "missing_key" in message and "(get)" in message
    # The store is still usable after a timeout (TCP: replies stay in step).
    store.set("after", b"1")
    assert store.get("after") == b"1"


def test_get_waits_for_a_later_set(stores):
    store, peer = stores
    timer = threading.Timer(0.2, peer.set, ("late", b"v"))
    timer.start()
    try:
        assert store.get("late") == b"v"
    finally:
        timer.join()


def test_add_counts_in_ascii(stores):
    store, peer = stores
    assert store.add("n", 5) == 5
    assert peer.add("n", -2) == 3
    assert store.add("n", 0) == 3
    assert store.get("n") == b"3"
    store.set("text", b"abc")
    with pytest.raises(ValueError, match="not an integer"):
        store.add("text", 1)


def test_add_from_threads_is_atomic(store):
    def bump():
        for _ in range(100):
            store.add("counter", 1)

    threads = [threading.Thread(target=bump) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.add("counter", 0) == 400


def test_compare_set(store):
    # Missing key, expected "": set.
    assert store.compare_set("a", "", "first") == b"first"
    assert store.get("a") == b"first"
    # Missing key, expected non-empty: torch returns expected and sets nothing.
    assert store.compare_set("b", "x", "y") == b"x"
    assert not store.check(["b"])
    # Match: swapped.
    assert store.compare_set("a", "first", b"second") == b"second"
    assert store.get("a") == b"second"
    # Mismatch: unchanged, current value returned.
    assert store.compare_set("a", "wrong", "third") == b"second"
    assert store.get("a") == b"second"


def test_wait_and_check(stores):
    store, peer = stores
    assert store.check([]) and store.check(["nothing"]) is False
    peer.set("k1", b"1")
    assert store.check(["k1"]) and store.check("k1")
    assert not store.check(["k1", "k2"])
    with pytest.raises(StoreTimeoutError) as info:
        _elapsed(store.wait, ["k1", "k2"], datetime.timedelta(milliseconds=300))
    assert 0.25 < _elapsed.last < 10  # the 300 ms deadline, not the store's own
    assert "k2" in str(info.value) and "k1" not in str(info.value)
    assert [k.rsplit("/", 1)[-1] for k in info.value.keys] == ["k2"]
    timer = threading.Timer(0.1, peer.set, ("k2", b"2"))
    timer.start()
    try:
        store.wait(["k1", "k2"])
    finally:
        timer.join()
    store.wait([], timeout=0)
    store.wait(["k1"], timeout=0.5)  # seconds are accepted too


def test_delete_key_and_num_keys(stores):
    store, peer = stores
    assert store.num_keys() == 0
    store.set("a", b"1")
    store.add("b", 1)
    store.compare_set("c", "", "x")
    assert peer.num_keys() == 3
    assert store.delete_key("a") is True
    assert peer.delete_key("a") is False
    assert not peer.check(["a"])
    assert store.num_keys() == 2
    store.set("a", b"again")
    assert peer.get("a") == b"again"


def test_timeout_property(store):
    assert store.timeout == DEFAULT_STORE_TIMEOUT == datetime.timedelta(seconds=300)
    store.set_timeout(datetime.timedelta(seconds=7))
    assert store.timeout == datetime.timedelta(seconds=7)
    with pytest.raises(ValueError, match="negative"):
        store.set_timeout(datetime.timedelta(seconds=-1))


def test_store_is_abstract():
    with pytest.raises(TypeError):
        Store()


# -- PrefixStore ---------------------------------------------------------------

def test_prefix_store_namespaces_keys():
    base = HashStore()
    a, b = PrefixStore("a", base), PrefixStore("b", base)
    a.set("k", b"1")
    b.set("k", b"2")
    assert base.get("a/k") == b"1" and base.get("b/k") == b"2"
    assert PrefixStore("x", a).add("n", 3) == 3 and base.get("a/x/n") == b"3"
    assert a.underlying_store is base
    assert a.num_keys() == base.num_keys() == 3  # counts every key, as torch does
    a.set_timeout(ONE_SECOND)
    assert base.timeout == ONE_SECOND


# -- FileStore -----------------------------------------------------------------

def _file_store_worker(path: str, increments: int) -> None:
    store = FileStore(path, world_size=3)
    for _ in range(increments):
        store.add("counter", 1)
    store.close()


@pytest.mark.slow
def test_file_store_shared_by_processes(tmp_path):
    path = str(tmp_path / "shared")
    store = FileStore(path, world_size=3)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_file_store_worker, args=(path, 100)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(45)
        assert p.exitcode == 0
    assert store.add("counter", 0) == 200
    assert os.path.exists(path)
    store.close()  # the third and last user removes the file
    assert not os.path.exists(path)


def test_file_store_removed_by_last_user_only(tmp_path):
    path = tmp_path / "ws2"
    first, second = FileStore(path, 2), FileStore(path, 2)
    first.close()
    assert path.exists()
    second.close()
    assert not path.exists()
    kept = FileStore(tmp_path / "unknown")  # world_size -1: left behind, as torch
    kept.close()
    assert (tmp_path / "unknown").exists()


def test_file_store_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        FileStore(tmp_path / "no" / "such" / "dir")
    store = FileStore(tmp_path / "closed")
    store.close()
    store.close()  # idempotent
    with pytest.raises(NumcollError, match="closed"):
        store.set("k", b"v")


def test_file_store_ignores_a_torn_record(tmp_path):
    path = tmp_path / "torn"
    store = FileStore(path)
    store.set("good", b"1")
    with open(path, "ab") as f:  # a writer that died mid-record
        f.write(struct.pack("<BII", 1, 4, 100) + b"half")
    other = FileStore(path)
    assert other.get("good") == b"1"
    other.set("next", b"2")  # truncates the torn record, then appends
    assert store.get("next") == b"2" and store.num_keys() == 2
    store.close()
    other.close()


# -- TCPStore ------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _server_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("numcoll-tcpstore")]


def test_tcp_store_port_zero_client_thread_and_clean_close():
    before = set(threading.enumerate())
    master = TCPStore(HOST, 0, is_master=True, timeout=ONE_SECOND * 10)
    assert master.port != 0 and master.host == HOST
    result = {}

    def client():
        with TCPStore(HOST, master.port, timeout=ONE_SECOND * 10) as store:
            store.set("from_client", b"hi")
            result["value"] = store.get("from_master")

    thread = threading.Thread(target=client)
    thread.start()
    master.set("from_master", b"hello")
    assert master.get("from_client") == b"hi"
    thread.join(10)
    assert result["value"] == b"hello"
    master.close()
    assert not _server_threads()
    assert set(threading.enumerate()) <= before
    with pytest.raises(NumcollError, match="closed"):
        master.get("from_client")


def test_tcp_store_dead_port_fails_clearly():
    port = _free_port()
    with pytest.raises(StoreConnectionError) as info:
        _elapsed(TCPStore, HOST, port, None, False, ONE_SECOND)
    # The 1 s deadline is kept: waited for (it never passes early), and far below
    # the 300 s default (a tight upper bound fails on a loaded machine instead).
    assert 0.9 < _elapsed.last < 10
    assert f"could not connect to TCPStore at {HOST}:{port} within 1000ms" in str(info.value)


def test_tcp_store_waits_for_workers():
    port = _free_port()
    worker = threading.Thread(
        target=lambda: TCPStore(HOST, port, world_size=2, timeout=ONE_SECOND * 10).close())
    worker.start()
    with TCPStore(HOST, port, world_size=2, is_master=True, timeout=ONE_SECOND * 10) as master:
        assert master.num_keys() == 0  # the join counter is not a user key
        worker.join(10)
    with pytest.raises(StoreTimeoutError, match="for 2 workers to join .* 1 joined"):
        TCPStore(HOST, 0, world_size=2, is_master=True, timeout=0.3)
    assert not _server_threads()


def test_tcp_store_rejects_port_zero_for_clients():
    with pytest.raises(ValueError, match="only valid for the master"):
        TCPStore(HOST, 0)


def test_tcp_server_survives_clients_vanishing_mid_request():
    with TCPStore(HOST, 0, is_master=True) as master:
        def frame(op, *fields):
            body = bytes([op]) + b"".join(struct.pack("!I", len(f)) + f for f in fields)
            return struct.pack("!I", len(body)) + body

        with socket.create_connection((HOST, master.port)) as s:  # half a frame
            s.sendall(OPENING + frame(1, b"key", b"value")[:7])
        with socket.create_connection((HOST, master.port)) as s:  # a parked get
            s.sendall(OPENING + frame(2, b"never", b"60000"))
            time.sleep(0.05)
        with socket.create_connection((HOST, master.port)) as s:  # absurd frame size
            s.sendall(OPENING + struct.pack("!I", 0xFFFFFFFF))
        with socket.create_connection((HOST, master.port)) as s:  # unknown op
            s.sendall(OPENING + frame(99))
            greeting = _recv_frame(s)
            assert greeting.startswith(b"numcoll-store/2")
            assert _recv_frame(s)[0] == 2  # an error reply, connection kept
        master.set("never", b"now")  # wakes no one: the parked client is gone
        assert master.get("never") == b"now"
        with TCPStore(HOST, master.port) as client:
            assert client.get("never") == b"now"


def _recv_frame(sock) -> bytes:
    def exact(n):
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            assert chunk, "connection closed"
            data += chunk
        return data

    (n,) = struct.unpack("!I", exact(4))
    return exact(n)


def test_tcp_client_fails_fast_when_master_closes():
    master = TCPStore(HOST, 0, is_master=True)
    client = TCPStore(HOST, master.port, timeout=ONE_SECOND)
    errors = []

    def blocked_get():
        try:
            client.get("never")
        except Exception as exc:  # noqa: BLE001 - recorded for the assert
            errors.append(exc)

    client.set_timeout(datetime.timedelta(seconds=30))
    thread = threading.Thread(target=blocked_get)
    thread.start()
    time.sleep(0.1)
    start = time.monotonic()
    master.close()
    thread.join(10)
    assert time.monotonic() - start < 5
    assert len(errors) == 1 and isinstance(errors[0], StoreConnectionError)
    client.set_timeout(ONE_SECOND)
    with pytest.raises(StoreConnectionError, match="could not connect"):
        client.set("k", b"v")
    client.close()


# -- rendezvous ----------------------------------------------------------------

def test_rendezvous_tcp_port_zero_single_rank():
    store, rank, world_size = next(rdzv.rendezvous(f"tcp://{HOST}:0?rank=0&world_size=1"))
    with store:
        assert (rank, world_size) == (0, 1)
        assert isinstance(store, TCPStore) and store.port != 0
        store.set("k", b"v")
        assert store.get("k") == b"v"


def test_rendezvous_tcp_two_ranks():
    master, rank, world_size = next(rdzv.rendezvous(f"tcp://{HOST}:0", rank=0, world_size=2))
    found = {}

    def worker():
        it = rdzv.rendezvous(f"tcp://{HOST}:{master.port}?rank=1&world_size=2", timeout=10)
        store, found["rank"], found["world_size"] = next(it)
        store.set("hello", b"from 1")
        store.close()

    thread = threading.Thread(target=worker)
    thread.start()
    assert master.get("hello") == b"from 1"
    thread.join(10)
    assert found == {"rank": 1, "world_size": 2}
    master.close()


def test_rendezvous_env(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", HOST)
    monkeypatch.setenv("MASTER_PORT", "0")
    monkeypatch.setenv("RANK", "3")  # overridden by the arguments
    monkeypatch.setenv("WORLD_SIZE", "4")
    store, rank, world_size = next(rdzv.rendezvous("env://", rank=0, world_size=1))
    with store:
        assert (rank, world_size) == (0, 1) and store.port != 0
    monkeypatch.delenv("MASTER_ADDR")
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        rdzv.rendezvous("env://")
    monkeypatch.setenv("MASTER_ADDR", HOST)
    monkeypatch.setenv("MASTER_PORT", "http")
    with pytest.raises(ValueError, match="MASTER_PORT"):
        rdzv.rendezvous("env://")


def test_rendezvous_file(tmp_path):
    path = tmp_path / "rdzv"
    store, rank, world_size = next(rdzv.rendezvous(f"file://{path}?rank=0&world_size=1"))
    assert isinstance(store, FileStore) and (rank, world_size) == (0, 1)
    store.set("k", b"v")
    assert store.get("k") == b"v"
    store.close()
    assert not path.exists()


@pytest.mark.parametrize("url, kwargs, match", [
    ("foo://x", {}, r"foo://.*supported: env://, file://, tcp://"),
    ("127.0.0.1:5", {}, "supported"),
    (f"tcp://{HOST}:5", {}, "rank and world_size must be given"),
    (f"tcp://{HOST}:5?rank=0", {}, "missing: world_size"),
    (f"tcp://{HOST}", {"rank": 0, "world_size": 1}, "port number missing"),
    (f"tcp://{HOST}:0", {"rank": 1, "world_size": 2}, "only valid for rank 0"),
    (f"tcp://{HOST}:5?rank=1", {"rank": 0, "world_size": 2}, "conflicts"),
    (f"tcp://{HOST}:5", {"rank": 2, "world_size": 2}, r"rank 2 is not in \[0, 2\)"),
    (f"tcp://{HOST}:5?rank=a&world_size=2", {}, "rank must be an integer"),
    ("file://relative/path?rank=0&world_size=1", {}, "absolute path"),
    ("file:///tmp/x", {}, "rank and world_size must be given"),
])
def test_rendezvous_bad_urls(url, kwargs, match):
    with pytest.raises(ValueError, match=match):
        rdzv.rendezvous(url, **kwargs)


def test_register_rendezvous_handler(monkeypatch):
    monkeypatch.setattr(rdzv, "_handlers", dict(rdzv._handlers))
    seen = {}

    def handler(url, **kwargs):
        seen.update(url=url, **kwargs)
        yield HashStore(), 0, 1

    rdzv.register_rendezvous_handler("mine", handler)
    store, rank, world_size = next(rdzv.rendezvous("mine://x", rank=0, world_size=1, timeout=5))
    assert isinstance(store, HashStore) and (rank, world_size) == (0, 1)
    assert "rank=0" in seen["url"] and seen["timeout"] == datetime.timedelta(seconds=5)
    with pytest.raises(RuntimeError, match="already registered"):
        rdzv.register_rendezvous_handler("mine", handler)


def test_public_names():
    import numcoll.bootstrap.store as store_module
    import numcoll.bootstrap.tcpstore as tcp_module

    for module in (store_module, tcp_module, rdzv):
        for name in module.__all__:
            assert hasattr(module, name), (module.__name__, name)
