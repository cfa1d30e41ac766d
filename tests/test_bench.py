"""The benchmark tooling works end to end: ``numcoll-bench`` (thread and
process ranks, table and JSON, progress, the ``#wrong`` check) and the
pytest-benchmark suites (quick mode, busbw in the tables).

The command line runs in subprocesses (as a user runs it); the checks that
need a collective to go wrong patch it in this process, with ranks as threads.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import threading
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
ROW_FIELDS = {"backend", "op", "placement", "algorithm", "world_size", "size", "count", "dtype",
              "iters", "warmup", "time_us", "time_us_min", "time_us_p10", "time_us_p90",
              "time_us_max", "rank_time_us", "algbw_gbps", "busbw_gbps", "wrong"}
META_FIELDS = {"op", "world_size", "mode", "transport", "transport_used", "dtype",
               "numcoll_version", "torch_version", "host_cpu_count", "timing"}
TABLE_HEADER = ["size(B)", "count", "type", "place", "algo", "time(us)", "min(us)", "max(us)",
                "algbw(GB/s)", "busbw(GB/s)", "#wrong"]


def bench(*args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "numcoll.bench", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **env})


def table_rows(stdout: str) -> list[list[str]]:
    """The data lines of the printed table, split into cells (header checked)."""
    lines = [ln for ln in stdout.splitlines() if ln.strip() and not ln.startswith("#")]
    assert lines[0].split()[:len(TABLE_HEADER)] == TABLE_HEADER, stdout
    return [ln.split() for ln in lines[1:]]


def check_rows(rows: list[dict], *, op: str, sizes: list[int], counts: list[int],
               factor: float, world_size: int = 2) -> None:
    assert [r["size"] for r in rows] == sizes
    assert [r["count"] for r in rows] == counts
    for r in rows:
        assert ROW_FIELDS <= set(r), sorted(ROW_FIELDS - set(r))
        assert r["op"] == op and r["dtype"] == "float32" and r["backend"] == "numcoll"
        assert r["iters"] == 3 and r["warmup"] == 1
        assert 0 < r["time_us_min"] <= r["time_us_p10"] <= r["time_us"] <= r["time_us_p90"] \
            <= r["time_us_max"]
        # the iteration time is the slowest rank's, so no rank's median exceeds the max
        assert len(r["rank_time_us"]) == world_size
        assert all(0 < t <= r["time_us_max"] for t in r["rank_time_us"])
        assert r["algbw_gbps"] == pytest.approx(r["size"] / r["time_us"] / 1e3)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * factor)
        assert r["wrong"] == 0


# -- numcoll-bench -----------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(90)
def test_cli_thread_mode_json_to_stdout():
    out = bench("--op", "allreduce", "--world-size", "2", "--mode", "thread",
                "--sizes", "8,4K", "--iters", "3", "--warmup", "1", "--json", "-")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)  # with --json -, stdout is only the JSON document
    meta = doc["metadata"]
    assert META_FIELDS <= set(meta), sorted(META_FIELDS - set(meta))
    assert (meta["world_size"], meta["mode"], meta["transport_used"]) == (2, "thread", "inproc")
    assert meta["host_cpu_count"] >= 1
    check_rows(doc["rows"], op="allreduce", sizes=[8, 4096], counts=[2, 1024], factor=1.0)
    assert {r["algorithm"] for r in doc["rows"]} <= {"ring", "recursive_doubling"}
    # stderr is not a terminal here: one plain progress line per size, no bar
    assert "[numcoll allreduce] 8 B (1/2)" in out.stderr
    assert "[numcoll allreduce] 4 KiB (2/2)" in out.stderr
    assert "\r" not in out.stderr


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_cli_process_mode_table_and_json_file(tmp_path):
    path = tmp_path / "out.json"
    out = bench("--op", "allgather", "--world-size", "2", "--sizes", "8,4K", "--iters", "3",
                "--warmup", "1", "--json", str(path), "--quiet")
    assert out.returncode == 0, out.stderr
    assert "[numcoll" not in out.stderr  # --quiet: no progress lines
    cells = table_rows(out.stdout)
    doc = json.loads(path.read_text())
    # the algorithm the group ran: the shared arena's on shm, the ring elsewhere
    algo = "shared" if doc["metadata"]["transport_used"] == "shm" else "ring"
    # both placements of each size, out-of-place first, as nccl-tests prints them
    assert [(int(c[0]), int(c[1]), c[2], c[3], c[4], c[-1]) for c in cells] == [
        (8, 2, "float32", "out", algo, "0"), (8, 2, "float32", "in", algo, "0"),
        (4096, 1024, "float32", "out", algo, "0"), (4096, 1024, "float32", "in", algo, "0")]
    assert doc["metadata"]["mode"] == "process"
    assert doc["metadata"]["transport_used"] in ("shm", "ipc", "tcp")
    assert doc["metadata"]["placements"] == ["out-of-place", "in-place"]
    assert [r["placement"] for r in doc["rows"]] == ["out-of-place", "in-place"] * 2
    # allgather: size is the output (n x input); busbw = algbw x (n-1)/n
    check_rows(doc["rows"], op="allgather", sizes=[8, 8, 4096, 4096], counts=[2, 2, 1024, 1024],
               factor=0.5)
    for c, r in zip(cells, doc["rows"]):
        assert float(c[5]) == pytest.approx(r["time_us"], abs=0.06)
        assert float(c[6]) == pytest.approx(r["time_us_min"], abs=0.06)
        assert float(c[7]) == pytest.approx(r["time_us_max"], abs=0.06)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, message", [
    (["--op", "sendrecv"], "invalid choice: 'sendrecv'"),
    (["--min-bytes", "1M", "--max-bytes", "8"], "max size (8 B) is smaller than min size"),
    (["--world-size", "0"], "--world-size must be at least 1"),
    (["--sizes", "8,12Q"], "invalid size '12Q'"),
    (["--op", "allgather", "--algorithm", "tree"],
     "unknown allgather algorithm 'tree'; choose one of cma, cma_measured, ipc, ring"),
    (["--algorithm", "tree"], "unknown allreduce algorithm 'tree'"),
    (["--compare", "torch,nccl"], "unknown anchor 'nccl'"),
    (["--op", "alltoall", "--placement", "in-place"], "alltoall has no in-place form"),
], ids=["op", "max-lt-min", "world-size", "size", "algorithm-op", "algorithm-name", "compare", "placement"])
@pytest.mark.slow
def test_cli_rejects_bad_arguments(args, message):
    out = bench(*args)
    assert out.returncode == 2
    assert message in out.stderr, out.stderr


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_cli_compare_torch_without_torch_says_so():
    # sys.modules["torch"] = None makes torch unimportable for this process.
    code = ("import sys; sys.modules['torch'] = None; from numcoll.bench import main; "
            "sys.exit(main(['--compare', 'torch', '--sizes', '8', '--iters', '1']))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2
    assert "--compare torch needs PyTorch" in out.stderr


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_cli_draws_a_bar_on_a_terminal():
    """On a terminal (a pseudo-terminal here) the progress is a tqdm bar that
    redraws in place and ends at 100%."""
    pytest.importorskip("tqdm")
    import pty

    leader, follower = pty.openpty()
    chunks = []

    def read_terminal():  # concurrently: a full terminal buffer would block the bench
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the terminal closes once the process has gone
                return
            if not chunk:
                return
            chunks.append(chunk)

    reader = threading.Thread(target=read_terminal, daemon=True)
    reader.start()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "numcoll.bench", "--mode", "thread", "--sizes", "8,4K,64K",
             "--iters", "3", "--warmup", "1"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=follower, text=True)
        os.close(follower)
        stdout, _ = proc.communicate(timeout=55)
        reader.join(5)
    finally:
        os.close(leader)
    err = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 0, err
    assert "\r" in err and "100%" in err and "3.0/3 sizes" in err, err
    assert "(1/3)" not in err  # no plain lines on a terminal
    assert len(table_rows(stdout)) == 3


# -- the #wrong check --------------------------------------------------------------------
def _run_thread_mode(op: str, world_size: int = 3, placement: str = "both", dtype="float32"):
    from numcoll import bench

    plans = [bench.make_plan(op, [8, 1000, 12 << 10], world_size=world_size, dtype=dtype,
                             iters=2, warmup=1, in_place=(p == "in-place"))
             for p in bench.PLACEMENTS[op] if placement in ("both", p)]
    per_plan, _ = bench.run_plans(plans, mode="thread", progress=False)
    return [row for rows in per_plan for row in rows]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("op", ["allreduce", "allgather", "reduce_scatter", "broadcast",
                                "reduce", "alltoall"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "bool"])
def test_every_op_checks_out_right(op, dtype):
    rows = _run_thread_mode(op, dtype=dtype)
    from numcoll.bench import PLACEMENTS

    assert {r["placement"] for r in rows} == set(PLACEMENTS[op])
    assert [r["wrong"] for r in rows] == [0] * len(rows)


@pytest.mark.timeout(60)
def test_wrong_counts_a_corrupted_allreduce(monkeypatch, tmp_path, capsys):
    """Rank 1 adds 1 to the first three elements of every allreduce result:
    the table says 3 wrong elements per size and the exit status is 1."""
    import numcoll as nc
    from numcoll import bench

    real = nc.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        done = real(tensor, *args, **kwargs)
        if nc.get_rank() == 1:
            tensor.reshape(-1)[:3] += 1
        return done

    monkeypatch.setattr(nc, "all_reduce", all_reduce)
    path = tmp_path / "out.json"
    status = bench.main(["--mode", "thread", "-n", "3", "--sizes", "64,4K", "--iters", "2",
                         "--warmup", "1", "--json", str(path), "--quiet"])
    out = capsys.readouterr()
    assert status == 1
    assert "6 wrong result elements" in out.err
    assert [int(c[-1]) for c in table_rows(out.out)] == [3, 3]
    assert [r["wrong"] for r in json.loads(path.read_text())["rows"]] == [3, 3]


@pytest.mark.timeout(90)
def test_save_and_baseline_add_a_delta_column_and_nccl_tests_closing_lines(tmp_path, capsys):
    from numcoll import bench

    common = ["--mode", "thread", "-n", "2", "--iters", "3", "--warmup", "1", "--quiet",
              "--storage", str(tmp_path)]
    assert bench.main(["--sizes", "64,4K", "--save", "main", *common]) == 0
    first = capsys.readouterr().out
    saved = json.loads((tmp_path / "main.json").read_text())
    assert [r["size"] for r in saved["rows"]] == [64, 4096]
    avg = sum(r["busbw_gbps"] for r in saved["rows"]) / 2
    assert "# Out of bounds values : 0 OK" in first
    assert f"# Avg bus bandwidth    : {avg:g}" in first.splitlines()

    assert bench.main(["--sizes", "64,4K,16K", "--baseline", "main", *common]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].endswith("baseline=main")
    header, *rows = [ln.split() for ln in out.splitlines()[1:] if not ln.startswith("#")]
    assert header[-2:] == ["base(us)", "delta"]
    for row, base in zip(rows, saved["rows"]):
        assert float(row[-2]) == pytest.approx(base["time_us"], abs=0.06)
        change = (float(row[5]) / base["time_us"] - 1) * 100
        assert float(row[-1].rstrip("%")) == pytest.approx(change, abs=0.2)
    assert rows[2][-2:] == ["-", "-"]  # 16 KiB is not in the baseline
    closing = [ln for ln in out.splitlines() if ln.startswith("# Avg bus bandwidth")][0]
    assert "(baseline main over the 2 rows both have: " in closing


@pytest.mark.parametrize("args, message", [
    (["--baseline", "nope"], "no saved run 'nope'"),
    (["--op", "broadcast", "--baseline", "main"], "measured op 'allreduce', this run 'broadcast'"),
    (["-n", "3", "--baseline", "main"], "measured world_size 2, this run 3"),
])
@pytest.mark.timeout(60)
def test_a_baseline_that_does_not_fit_is_refused_before_measuring(tmp_path, capsys, args,
                                                                    message):
    from numcoll.bench import saved

    saved.save_run("main", {"op": "allreduce", "world_size": 2, "dtype": "float32"}, [],
                   str(tmp_path))
    status = bench_main(["--mode", "thread", "--sizes", "8", "--storage", str(tmp_path),
                         *args])
    assert status == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("numcoll-bench: error: --baseline: ")


def bench_main(argv):
    from numcoll import bench

    return bench.main(argv)


@pytest.mark.timeout(60)
def test_wrong_counts_blocks_in_the_wrong_place(monkeypatch):
    """An allgather that delivers every block, but rotated by one rank, is
    wrong everywhere: the check looks at offsets, not only at values."""
    import numpy as np

    import numcoll as nc

    real = nc.all_gather_into_tensor

    def all_gather_into_tensor(out, inp, *args, **kwargs):
        done = real(out, inp, *args, **kwargs)
        out[...] = np.roll(out, inp.size)
        return done

    monkeypatch.setattr(nc, "all_gather_into_tensor", all_gather_into_tensor)
    rows = _run_thread_mode("allgather", world_size=2)
    assert [r["wrong"] for r in rows] == [r["count"] * 2 for r in rows]


# -- benchmark suites --------------------------------------------------------------------
def _pytest(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", *args, "-q", "-p", "no:cacheprovider"],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _table_line(stdout: str, name: str, source: str = "") -> str:
    lines = [ln for ln in stdout.splitlines() if ln.startswith(name + " ") and source in ln]
    assert len(lines) == 1, (name, source, lines)
    return lines[0]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_exploration_suites_quick_mode_and_bandwidth_in_tables(tmp_path):
    """An exploration suite named with --quick runs in seconds (timing on), and
    the tables show each case's bandwidth computed from its own median, in a
    run and in a --benchmark-compare against a saved run. (The gate's own
    suite: tests/test_bench_gate.py.)"""
    storage = f"--benchmark-storage=file://{tmp_path / 'storage'}"
    started = time.monotonic()
    out = _pytest("benchmarks/bench_collectives.py", "benchmarks/bench_kernels.py", "--quick",
                  f"--benchmark-json={tmp_path / 'run.json'}",
                  "--benchmark-columns=median", "--benchmark-autosave", storage, timeout=190)
    elapsed = time.monotonic() - started
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    # under 15 s on an idle 2-core machine; the bound leaves room for a busy one
    assert elapsed < 60, f"quick benchmarks took {elapsed:.0f} s"
    doc = json.loads((tmp_path / "run.json").read_text())
    runs = doc["benchmarks"]
    collectives = [b for b in runs if b["name"].startswith("test_collective")]
    assert {b["params"]["transport"] for b in collectives} == {"inproc", "ipc"}
    assert {b["params"]["world_size"] for b in collectives} == {2}
    assert {b["params"]["nbytes"] for b in collectives} == {8, 1 << 20}
    assert all(b["options"]["max_time"] == 0.02 for b in runs)
    for b in collectives:
        info, median = b["extra_info"], b["stats"]["median"]
        assert info["busbw_gbps"] == pytest.approx(info["nbytes"] * info["bus_factor"]
                                                   / median / 1e9)
        busbw = info["nbytes"] * info["bus_factor"] / median / 1e9
        _table_line(out.stdout, f"{b['name']} busbw {busbw:.3g} GB/s")
    kernel = next(b for b in runs if b["name"].startswith("test_reduce_into")
                  and b["extra_info"]["nbytes"] == 1 << 20)
    _table_line(out.stdout, f"{kernel['name']} "
                f"{(1 << 20) / kernel['stats']['median'] / 1e9:.3g} GB/s")

    again = _pytest("benchmarks/bench_kernels.py", "--quick", "-k", kernel["param"],
                    "--benchmark-compare", "--benchmark-columns=median", storage,
                    f"--benchmark-json={tmp_path / 'again.json'}", timeout=120)
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-2000:]
    now = json.loads((tmp_path / "again.json").read_text())["benchmarks"][0]
    saved = f"{kernel['name']} {(1 << 20) / kernel['stats']['median'] / 1e9:.3g} GB/s"
    current = f"{now['name']} {(1 << 20) / now['stats']['median'] / 1e9:.3g} GB/s"
    _table_line(again.stdout, saved, "(0001_")
    _table_line(again.stdout, current, "(NOW)")


def test_the_algo_column_asks_for_the_bytes_each_collective_chooses_by():
    """(gather and scatter choose by a rank's block: the bench named single
    copy for a 4-rank scatter of 1 MiB that ran through the arena; its
    alltoall is all_to_all_single, chosen as one whose ranks may send each
    other different amounts.)"""
    from types import SimpleNamespace

    from numcoll.bench.sweep import algorithm_name, make_plan
    from numcoll.config import current

    asked = []

    class Context:
        cfg = current()

        def choose(self, op, requested, nbytes, uneven=False):
            asked.append((op, nbytes, uneven))
            return SimpleNamespace(name="shared")

    for op in ("gather", "scatter", "alltoall", "allgather", "broadcast"):
        plan = make_plan(op, [4 << 20], world_size=4)
        assert algorithm_name(plan, plan.cases[0], context=Context()) == "shared"
    assert asked == [("gather", 1 << 20, False), ("scatter", 1 << 20, False),
                     ("alltoall", 4 << 20, True), ("allgather", 4 << 20, False),
                     ("broadcast", 4 << 20, False)]
