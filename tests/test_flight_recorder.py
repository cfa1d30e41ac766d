"""The flight recorder: what each rank did, for timelines and post-mortems; and
errors that name the rank that caused a failure, not the neighbour that passed
it on."""

import json
import subprocess
import sys
import time
from datetime import timedelta

import numpy as np
import pytest

import numcoll as nc
from numcoll.diagnostics import flight_recorder as fr
from numcoll.diagnostics import fr_trace

from test_process_group import groups, on_ranks

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def fresh_recorder():
    fr._reset_for_tests(100)
    yield
    fr._reset_for_tests()


def test_records_every_collective_with_its_state_and_times(fresh_recorder):
    pgs = groups(2)
    try:
        def body(pg):
            x = np.ones(6, np.float32).reshape(2, 3)
            pg.allreduce(x).wait()
            pg.broadcast(np.zeros(5, np.int64), root=1).wait()
            pg.barrier().wait()
            if pg.rank() == 0:
                pg.send([np.ones(2, np.float64)], 1).wait()
            else:
                pg.recv([np.zeros(2, np.float64)], 0).wait()

        on_ranks(pgs, body)
    finally:
        for pg in pgs:
            pg.shutdown()
    dump = nc.flight_recorder.dump()
    assert set(dump) >= {"version", "pg_config", "pg_status", "entries"}
    mine = [e for e in dump["entries"] if e["rank"] == 0]
    assert [e["profiling_name"] for e in mine] == [
        "numcoll:all_reduce", "numcoll:broadcast", "numcoll:barrier", "numcoll:send"]
    assert [e["collective_seq_id"] for e in mine] == [1, 2, 3, None]
    ar = mine[0]
    assert ar["input_sizes"] == [[2, 3]] and ar["input_dtypes"] == ["float32"]
    assert ar["output_sizes"] == [[2, 3]] and ar["op"] == "SUM"
    assert ar["algorithm"] == "recursive_doubling" and ar["nbytes"] == 24
    assert mine[1]["root"] == 1 and mine[1]["algorithm"] == "binomial"
    for e in mine:
        assert e["state"] == "completed" and e["waiting_for"] is None
        assert e["time_created_ns"] <= e["time_started_ns"] <= e["time_completed_ns"]
        assert e["timeout_ms"] == 30 * 60 * 1000
    pg_id = str(ar["pg_id"])
    assert dump["pg_config"][pg_id]["ranks"] == [0, 1]
    assert dump["pg_status"][pg_id]["last_completed_collective"] == 3
    assert json.loads(nc.flight_recorder.dump_json())["entries"] == dump["entries"]
    assert [e["rank"] for e in nc.flight_recorder.dump(rank=1)["entries"]] == [1] * 4


def test_buffer_keeps_the_last_n(fresh_recorder):
    fr._reset_for_tests(3)
    pgs = groups(1)
    try:
        for _ in range(5):
            pgs[0].allreduce(np.ones(1)).wait()
    finally:
        pgs[0].shutdown()
    assert [e["collective_seq_id"] for e in nc.flight_recorder.dump()["entries"]] == [3, 4, 5]


@pytest.mark.slow
def test_a_timeout_dumps_each_rank_and_the_analyser_names_the_missing_rank(
        fresh_recorder, tmp_path, monkeypatch):
    monkeypatch.setenv("NUMCOLL_FR_DUMP_DIR", str(tmp_path))
    pgs = groups(3, timeout=timedelta(seconds=1))
    try:
        def body(pg):
            pg.allreduce(np.ones(4)).wait()
            if pg.rank() == 2:
                return  # rank 2 skips the second allreduce
            with pytest.raises(nc.NumcollError):
                pg.allreduce(np.ones(4)).wait()

        on_ranks(pgs, body)
    finally:
        for pg in pgs:
            pg.shutdown()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert "numcoll_fr_rank0.json" in files and "numcoll_fr_rank1.json" in files
    # rank 2 did not fail, so it wrote nothing; give the analyser its view too
    (tmp_path / "numcoll_fr_rank2.json").write_text(json.dumps(nc.flight_recorder.dump(rank=2)))
    findings = fr_trace.analyse(fr_trace.load(str(tmp_path)))
    assert any("collective #2" in f and "rank 2 never called it" in f for f in findings), findings
    out = subprocess.run([sys.executable, "-m", "numcoll.fr", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "rank 2 never called it" in out.stdout, out


def test_waiting_for_names_the_peer_while_blocked(fresh_recorder):
    pgs = groups(2, timeout=timedelta(seconds=5))
    try:
        work = pgs[0].allreduce(np.ones(4))
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            entry = nc.flight_recorder.dump(rank=0)["entries"][-1]
            if entry["state"] == "started" and entry["waiting_for"] == 1:
                break
            time.sleep(0.01)
        assert entry["state"] == "started" and entry["waiting_for"] == 1, entry
        pgs[1].allreduce(np.ones(4)).wait()
        work.wait()
    finally:
        for pg in pgs:
            pg.shutdown()


def test_ranks_far_from_a_dead_rank_name_it_not_their_neighbour():
    # Ring allreduce on 4 ranks: rank 3 leaves. Only rank 0 receives from it; ranks
    # 1 and 2 learn of it through rank 0's (and 1's) abort. Every error leads with rank 3.
    pgs = groups(4, timeout=timedelta(seconds=20), algorithm="allreduce:ring")
    errors = {}

    def body(pg):
        if pg.rank() == 3:
            pg.shutdown()
            return
        try:
            for _ in range(50):
                pg.allreduce(np.ones(1 << 16, np.float32)).wait()
        except nc.NumcollError as exc:
            errors[pg.rank()] = exc

    try:
        start = time.monotonic()
        on_ranks(pgs, body)
        assert time.monotonic() - start < 10
    finally:
        for pg in pgs:
            pg.shutdown()
    assert sorted(errors) == [0, 1, 2], errors
    for rank, exc in errors.items():
        assert isinstance(exc, nc.PeerError) and exc.peer == 3, (rank, exc)
        assert "rank 3" in str(exc).split(":", 1)[1][:80] or "rank 3 " in str(exc), (rank, exc)


def test_subgroup_records_carry_global_ranks(fresh_recorder):
    def body():
        sub = nc.new_group([1, 2])
        if nc.get_rank() in (1, 2):
            nc.all_reduce(np.ones(2), group=sub)
        return True

    nc.launch(body, 3, mode="thread")
    dump = nc.flight_recorder.dump()
    subs = {pg_id for pg_id, cfg in dump["pg_config"].items() if cfg["ranks"] == [1, 2]}
    assert subs, dump["pg_config"]
    ranks = {e["rank"] for e in dump["entries"] if str(e["pg_id"]) in subs
             and e["profiling_name"] == "numcoll:all_reduce"}
    assert ranks == {1, 2}
