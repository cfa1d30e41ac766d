"""Groups created and destroyed without end: what they leave behind.

The flight recorder keeps a destroyed group's configuration only while its
records are in the ring; transports remove the store keys they published once
every peer read them; 10,000 create/destroy cycles grow the process by at
most 2 MiB. And the recorder's dumps, written into a directory other users
may share, never follow what is planted there.
"""

from __future__ import annotations

import json
import os
import stat
import threading

import numpy as np
import pytest

import numcoll as nc
from numcoll.diagnostics import flight_recorder as fr

from test_hostile import _rss_nbytes

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def small_recorder():
    fr._reset_for_tests(50)
    yield fr.recorder()
    fr._reset_for_tests()


def _cycle(store, i: int, transport: str | None = None, size: int = 1) -> None:
    opts = dict(group_name=f"cycle{i}")
    if transport:
        opts["transport"] = transport
    pgs = [None] * size

    def make(r):
        pgs[r] = nc.ProcessGroup(store, r, size, nc.ProcessGroup.Options(**opts))

    threads = [threading.Thread(target=make, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    works = [pg.allreduce(np.ones(4, np.float32)) for pg in pgs]
    for w in works:
        w.wait()
    for pg in pgs:
        pg.shutdown()


def test_a_destroyed_groups_table_entry_leaves_with_its_records(small_recorder):
    store = nc.HashStore()
    live = nc.ProcessGroup(store, 0, 1, nc.ProcessGroup.Options(group_name="live"))
    try:
        live.allreduce(np.ones(2)).wait()
        for i in range(300):
            _cycle(store, i)
        dump = fr.dump()
        named = {e["pg_id"] for e in dump["entries"]}
        # The live group, and destroyed ones only while the ring names them.
        assert set(map(int, dump["pg_config"])) == named | {live._pg_id}
        assert len(dump["pg_config"]) <= 51
        assert set(dump["pg_status"]) == set(dump["pg_config"])
    finally:
        live.shutdown()
    for i in range(300, 400):  # push the live group's record out of the ring
        _cycle(store, i)
    assert str(live._pg_id) not in fr.dump()["pg_config"]


@pytest.mark.parametrize("transport,size", [("inproc", 2), ("shm", 2), ("ipc", 2),
                                            ("tcp", 2), ("tcp", 3)])
def test_transports_take_their_keys_back(transport, size):
    """Only what a named group keeps (its generation counter) stays in a store
    shared by many groups: the last rank of a group to close deletes the zmq
    endpoints."""
    store = nc.HashStore()
    _cycle(store, 0, transport, size)
    keys = store.num_keys()
    for i in range(1, 4):
        _cycle(store, i, transport, size)
    grown = (store.num_keys() - keys) / 3
    assert grown <= 1, grown


@pytest.mark.parametrize("transport", ["inproc", "shm", "tcp"])
def test_destroyed_sub_groups_leave_no_key(transport):
    from numcoll.api import world

    def churn():
        store = world._world().store
        nc.barrier()
        before = store.num_keys()
        for _ in range(20):
            g = nc.new_group([0, 1])
            nc.all_reduce(np.ones(2), group=g)
            nc.destroy_process_group(g)
        nc.barrier()
        after = store.num_keys()
        nc.barrier()  # neither rank leaves the default group (a key) before both counted
        return before, after

    for before, after in nc.launch(churn, 2, mode="thread", transport=transport, timeout=60):
        assert after <= before, (before, after)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
def test_ten_thousand_groups_grow_the_process_by_at_most_2_mib(small_recorder):
    """Each cycle gets a store of its own, so what is measured is numcoll's
    memory, not the keys a shared store keeps (the caller's)."""
    for i in range(300):  # fill the ring, warm the caches
        _cycle(nc.HashStore(), i)
    before = _rss_nbytes()
    threads = threading.active_count()
    for i in range(300, 10_300):
        _cycle(nc.HashStore(), i)
    grown = _rss_nbytes() - before
    assert grown <= 2 << 20, f"RSS grew {grown / 2**20:.2f} MiB"
    assert threading.active_count() == threads
    assert len(small_recorder.dump()["pg_config"]) <= 51


# --- dump files in a shared directory ---------------------------------------------------


def test_a_dump_is_private_and_never_follows_a_planted_link(tmp_path):
    rec = fr.FlightRecorder(10)
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (shared / "numcoll_fr_rank0.json").symlink_to(victim)
    path = rec.dump_to_dir(str(shared), 0)
    assert victim.read_text() == "precious"  # the link was replaced, not written through
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert json.loads(open(path).read())["entries"] == []
    assert sorted(os.listdir(shared)) == ["numcoll_fr_rank0.json"]  # no temp file left


def test_a_dump_directory_that_is_a_link_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(OSError):
        fr.FlightRecorder(10).dump_to_dir(str(tmp_path / "link"), 0)
    assert os.listdir(real) == []


def test_a_new_dump_directory_is_private(tmp_path):
    path = fr.FlightRecorder(10).dump_to_dir(str(tmp_path / "new" / "dir"), 3)
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    assert path.endswith("numcoll_fr_rank3.json")
