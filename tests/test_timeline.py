"""numcoll.bench.timeline on flight-recorder dumps shaped as DESIGN.md's contract
(made here, so every number is known): merging dumps, the analysis (straggler,
busy and idle time, gaps), and the Gantt chart's bars and labels."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from numcoll.bench import timeline  # noqa: E402

MS = 1_000_000  # ns
T0 = 1_700_000_000_000_000_000  # a wall-clock time.time_ns()


def entry(rank, seq, *, created, started=None, completed=None, name="all_reduce",
          algorithm="ring", nbytes=4 << 20, state=None, pg_id=0, record_id=None):
    """One entry as nc.flight_recorder.dump() has it (times in ms after T0)."""
    if state is None:
        state = "completed" if completed is not None else (
            "started" if started is not None else "scheduled")
    return {
        "record_id": seq if record_id is None else record_id, "pg_id": pg_id,
        "collective_seq_id": seq, "profiling_name": f"numcoll:{name}",
        "input_sizes": [[nbytes // 4]], "input_dtypes": ["float32"],
        "output_sizes": [[nbytes // 4]], "output_dtypes": ["float32"], "state": state,
        "time_created_ns": T0 + int(created * MS),
        "time_started_ns": None if started is None else T0 + int(started * MS),
        "time_completed_ns": None if completed is None else T0 + int(completed * MS),
        "timeout_ms": 1_800_000, "algorithm": algorithm, "waiting_for": None,
        "rank": rank, "nbytes": nbytes,
    }


def dump(entries):
    config = {str(e["pg_id"]): {"name": "default/0", "desc": "group of 3", "ranks": [0, 1, 2]}
              for e in entries}
    return {"version": "1.0", "pg_config": config, "pg_status": {}, "entries": entries}


def run_with_a_straggler():
    """3 ranks, 3 allreduces; rank 2 calls each one 5 ms after the others, and
    rank 0 has a 2 MiB broadcast in flight beside the second allreduce."""
    entries = []
    for seq, at in ((1, 0.0), (2, 20.0), (3, 40.0)):
        for rank in range(3):
            late = 5.0 if rank == 2 else 0.0
            entries.append(entry(rank, seq, created=at + late, started=at + late + 0.5,
                                 completed=at + 10.0))
    entries.append(entry(0, 4, created=21.0, started=21.0, completed=26.0, name="broadcast",
                         algorithm="chain", nbytes=2 << 20))
    return entries


def test_entries_of_merges_thread_and_process_dumps():
    entries = run_with_a_straggler()
    merged = timeline.entries_of(dump(entries))  # threads: one dump, every rank
    assert [{k: v for k, v in e.items() if k != "pg_name"} for e in merged] == entries
    assert {e["pg_name"] for e in merged} == {"default/0"}
    assert timeline.entries_of(dump(entries), since_ns=T0 + 40 * MS) == \
        [e for e in merged if e["time_created_ns"] >= T0 + 40 * MS] != []
    # processes: one dump per rank; an entry without "rank" takes its dump's index
    per_rank = [dump([{k: v for k, v in e.items() if k != "rank"}
                      for e in entries if e["rank"] == r]) for r in range(3)]
    merged = timeline.entries_of(per_rank)
    assert sorted((e["rank"], e["collective_seq_id"]) for e in merged) == \
        sorted((e["rank"], e["collective_seq_id"]) for e in entries)


def test_spans_are_relative_and_bytes_come_from_sizes_when_missing():
    e = entry(1, 1, created=3.0, started=4.0, completed=6.5, nbytes=1024)
    del e["nbytes"]
    other = entry(0, 1, created=1.0)
    rows = timeline.spans([e, other])
    assert [r["rank"] for r in rows] == [0, 1]
    assert rows[0] == pytest.approx({**rows[0], "queued": 0.0})
    assert rows[0]["started"] is None and rows[0]["state"] == "scheduled"
    assert (rows[1]["queued"], rows[1]["started"], rows[1]["completed"]) == \
        pytest.approx((2e-3, 3e-3, 5.5e-3))
    assert rows[1]["nbytes"] == 1024 and rows[1]["name"] == "all_reduce"


def test_analyze_finds_the_straggler_busy_time_and_gaps():
    result = timeline.analyze(run_with_a_straggler())
    assert result["span"] == pytest.approx(0.050)
    assert result["straggler"] == 2
    colls = result["collectives"]
    assert [c["seq"] for c in colls] == [1, 2, 3]  # the broadcast ran on one rank only
    assert all(c["last_rank"] == 2 for c in colls)
    assert [c["arrival_spread"] for c in colls] == pytest.approx([5e-3] * 3)
    assert [c["duration"] for c in colls] == pytest.approx([9.5e-3] * 3)
    r0, r2 = result["ranks"][0], result["ranks"][2]
    assert (r0["count"], r2["count"], r0["last_count"], r2["last_count"]) == (4, 3, 0, 3)
    # rank 0 runs 20.5-30 and 21-26 at once: busy is their union, not the sum
    assert r0["busy"] == pytest.approx(3 * 9.5e-3)
    assert r2["busy"] == pytest.approx(3 * 4.5e-3)
    assert r0["idle"] == pytest.approx(0.050 - r0["busy"])
    assert r0["largest_gap"] == pytest.approx(10e-3)   # 30 -> 40 ms
    assert r2["largest_gap"] == pytest.approx(15e-3)   # 30 -> 45 ms
    assert (r0["max_in_flight"], r2["max_in_flight"]) == (2, 1)
    text = timeline.describe(result)
    assert "Straggler: rank 2, the last to call 3 of 3 collectives" in text
    assert "waited 15.0 ms in all for it" in text
    assert "rank 0: 4 collectives, busy 28.5 ms (57% of the run)" in text
    assert "up to 2 in flight at once" in text
    assert "rank 2 came 5.00 ms after the first" in text


def test_threads_register_one_group_under_several_pg_ids():
    """Ranks that are threads of one process share a recorder, and each has
    its own pg_id for the same group: collectives still match across ranks."""
    entries = [{**e, "pg_id": e["rank"]} for e in run_with_a_straggler()]
    result = timeline.analyze(timeline.entries_of(dump(entries)))
    assert [c["seq"] for c in result["collectives"]] == [1, 2, 3]
    assert result["straggler"] == 2
    # without the group names, pg_ids alone cannot tell that they are one group
    assert timeline.analyze(entries)["collectives"] == []


def test_analyze_has_no_straggler_when_ranks_arrive_in_turn():
    entries = [entry(seq % 2, seq, created=seq * 10.0, started=seq * 10.0 + 1,
                     completed=seq * 10.0 + 2) for seq in (1, 2)]
    entries += [entry(1 - seq % 2, seq, created=seq * 10.0 - 1, started=seq * 10.0 + 1,
                      completed=seq * 10.0 + 2) for seq in (1, 2)]
    result = timeline.analyze(entries)
    assert [c["last_rank"] for c in result["collectives"]] == [1, 0]
    assert result["ranks"][0]["last_count"] == result["ranks"][1]["last_count"] == 1


def _bars(ax):
    """(x0, width, y0, height, alpha, edge is red) of every bar drawn, in ms."""
    out = []
    for coll in ax.collections:
        for path in coll.get_paths():
            (x0, y0), (x1, y1) = path.get_extents().get_points()
            edge = coll.get_edgecolor()
            red = len(edge) > 0 and tuple(edge[0][:3]) == (1.0, 0.0, 0.0)
            out.append((x0, x1 - x0, y0, y1 - y0, coll.get_alpha(), red))
    return out


def test_plot_timeline_draws_queued_and_running_bars_per_rank():
    entries = run_with_a_straggler()
    entries.append(entry(1, 5, created=42.0, started=43.0, completed=44.0, name="all_gather",
                         algorithm="ring", state="failed", nbytes=64))
    entries.append(entry(2, 6, created=47.0, name="barrier", algorithm=None, nbytes=0))
    fig, ax = plt.subplots()
    timeline.plot_timeline(entries, ax=ax, title="run")
    bars = _bars(ax)
    queued = [b for b in bars if b[4] == 0.25]
    running = [b for b in bars if b[4] != 0.25]
    assert len(queued) == len(entries)                # every call was queued
    assert len(running) == len(entries) - 1          # the barrier never started
    # rank 2's first allreduce: queued 5 -> 5.5 ms, running 5.5 -> 10 ms, in lane 2
    assert any(b[:2] == pytest.approx((5.5, 4.5)) and 1.5 < b[2] < 2.5 for b in running)
    assert any(b[:2] == pytest.approx((5.0, 0.5)) for b in queued)
    # the broadcast overlaps rank 0's second allreduce: they are stacked, not drawn on top
    r0 = sorted((b for b in running if b[2] < 0.5 and 20 <= b[0] <= 22),
                key=lambda b: b[0])
    assert len(r0) == 2 and r0[0][2] != r0[1][2] and r0[0][3] < 0.5
    assert sum(b[5] for b in running) == 1            # the failed one is edged red
    # labels on bars of at least 10% of the span (50 ms): rank 2's 4.5 ms ones go without
    labels = [t.get_text() for t in ax.texts]
    assert labels.count("ring 4 MiB") == 6
    fig2, ax2 = plt.subplots()
    timeline.plot_timeline(entries, ax=ax2, label_min_fraction=0.05)
    labels = [t.get_text() for t in ax2.texts]
    assert labels.count("ring 4 MiB") == 9 and "chain 2 MiB" in labels
    plt.close(fig2)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1", "rank 2"]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert {"all_reduce", "broadcast", "all_gather", "barrier", "failed"} <= set(legend)
    assert ax.get_title() == "run"
    plt.close(fig)


def test_plot_timeline_without_entries_says_so():
    fig, ax = plt.subplots()
    timeline.plot_timeline([], ax=ax)
    assert "no flight-recorder entries" in ax.get_title()
    plt.close(fig)


# -- the real flight recorder ------------------------------------------------------------
# What the late rank sleeps before each round. The check allows the punctual rank 20% of it
# to reach the call: on a 2-core CI machine running two test workers, that rank can be
# descheduled for several milliseconds, which failed a 30 ms delay (spread under 24 ms).
_DELAY_S = 0.15


def _straggling_work(late_rank: int, delay_s: float) -> dict:
    """Three allreduces (two in flight at once), a broadcast and a barrier;
    ``late_rank`` sleeps before each call. Returns this rank's records."""
    import time

    import numpy as np

    import numcoll as nc

    rank = nc.get_rank()
    data = np.ones(1 << 16, np.float32)
    for _ in range(3):
        if rank == late_rank:
            time.sleep(delay_s)
        works = [nc.all_reduce(data, async_op=True), nc.all_reduce(data, async_op=True)]
        nc.broadcast(data[:256], src=0)
        for w in works:
            w.wait()
    nc.barrier()
    return nc.flight_recorder.dump(rank)


def _check_recorded_run(dumps, late_rank: int, delay_s: float, since_ns: int) -> None:
    entries = timeline.entries_of(dumps, since_ns=since_ns)
    names = sorted({e["profiling_name"] for e in entries})
    assert names == ["numcoll:all_reduce", "numcoll:barrier", "numcoll:broadcast"], names
    result = timeline.analyze(entries)
    colls = result["collectives"]
    # 3 x (2 allreduces + broadcast) + barrier, each matched across both ranks
    assert len(colls) == 10
    # what the late rank slept before (not the first: the ranks' start-up differs more)
    firsts = [c for c in colls if c["seq"] in (4, 7)]
    assert all(c["last_rank"] == late_rank for c in firsts), colls
    assert all(c["arrival_spread"] >= 0.8 * delay_s for c in firsts), colls
    assert result["straggler"] == late_rank
    assert all(c["duration"] is not None and c["duration"] > 0 for c in colls)
    fig, ax = plt.subplots()
    timeline.plot_timeline(entries, ax=ax)
    assert len(ax.collections) == 2 * len(entries)  # a queued and a running bar each
    plt.close(fig)


@pytest.mark.timeout(60)
def test_timeline_of_ranks_as_threads():
    import time

    import numcoll as nc

    since = time.time_ns()
    dumps = nc.launch(_straggling_work, 2, args=(1, _DELAY_S), mode="thread")
    # threads share one recorder: each rank's dump holds only its own entries
    assert [{e["rank"] for e in d["entries"] if e["time_created_ns"] >= since}
            for d in dumps] == [{0}, {1}]
    _check_recorded_run(dumps, 1, _DELAY_S, since)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_timeline_of_ranks_as_processes():
    import time

    import numcoll as nc

    since = time.time_ns()
    dumps = nc.launch(_straggling_work, 2, args=(0, _DELAY_S), mode="process")
    assert [{e["rank"] for e in d["entries"]} for d in dumps] == [{0}, {1}]
    _check_recorded_run(dumps, 0, _DELAY_S, since)
