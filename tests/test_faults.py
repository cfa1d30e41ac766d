"""Fault injection on 4 process ranks (issue 9): a rank SIGKILLed in the middle
of 16 MiB allreduces, a rank SIGSTOPped with a 2 s group timeout, a rank that
returns early, mismatched calls, the store's host SIGKILLed, strangers that
connect and never speak plus 200 store clients at once, and a soak of 1,000
async + 10,000 back-to-back allreduces.

Each scenario runs once (module fixtures, see :mod:`numcoll.bench.faults`); the tests
assert on its figures: every survivor raises, promptly, nobody hangs, no wrong
result, the error names the culprit, nothing is left behind. And the fault
table of docs/guide/faults.md is what ``python -m numcoll.faults --markdown`` prints for these
figures (issue 21): numbers masked, since times, sizes and RSS change from run
to run; every word compared.
"""

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180),
              pytest.mark.skipif("not sys.platform.startswith('linux')")]

# Generous bounds for a loaded 2-core machine; the figures themselves are in
# `python -m numcoll.bench.faults` (a dead peer is typically seen in ~0.3 s).
DEAD_PEER_S = 2.0
GROUP_TIMEOUT_S = 2.0
STALL_NAMING = ("a survivor whose own deadline passes first names the peer it waited for "
                "(its ring neighbour), not the stalled rank; whether it does depends on "
                "whether the neighbour's abort note reaches it before its deadline, so this "
                "passes in some runs (comm.py/process_group.py, issue 9)")


def _faults():
    # Imported here, not at collection: test_api checks which submodules are public.
    from numcoll.bench import faults

    return faults


@pytest.fixture(scope="module")
def killed():
    return _faults().run_scenario("kill")


@pytest.fixture(scope="module")
def stopped():
    return _faults().run_scenario("stop", group_timeout_s=GROUP_TIMEOUT_S)


@pytest.fixture(scope="module")
def early():
    return _faults().run_scenario("early")


SCENARIO_BOUNDS = {"killed": DEAD_PEER_S, "stopped": GROUP_TIMEOUT_S + 2.0,
                   "early": DEAD_PEER_S}


@pytest.mark.parametrize("scenario", list(SCENARIO_BOUNDS))
def test_every_survivor_raises_promptly_and_none_hangs(scenario, request):
    f = request.getfixturevalue(scenario)
    assert f.hung == [], f"survivors {f.hung} never raised"
    assert sorted(f.detect_s) == [0, 1, 2]
    assert max(f.detect_s.values()) < SCENARIO_BOUNDS[scenario], f.detect_s
    assert f.wrong_results == 0


def test_a_stalled_rank_is_detected_by_the_group_timeout_not_before(stopped):
    assert min(stopped.detect_s.values()) > GROUP_TIMEOUT_S * 0.9, stopped.detect_s
    assert stopped.errors[0].startswith(
        "CollectiveTimeoutError: Timed out waiting 2000ms for allreduce"), stopped.errors[0]


@pytest.mark.parametrize("scenario", ["killed", "early"])
def test_every_survivor_names_the_rank_that_died_or_left_first(scenario, request):
    f = request.getfixturevalue(scenario)
    assert all(n == f.culprit for n in f.named.values()), f.errors
    assert all(e.startswith("PeerError: ") for e in f.errors.values()), f.errors


def test_the_neighbour_of_a_stalled_rank_names_it(stopped):
    assert stopped.named[0] == stopped.culprit, stopped.errors[0]  # rank 0 receives from 3


def test_every_survivor_names_the_stalled_rank_first(stopped):
    assert all(n == stopped.culprit for n in stopped.named.values()), stopped.errors


@pytest.mark.parametrize("scenario", list(SCENARIO_BOUNDS))
def test_no_process_or_shared_memory_is_left_behind(scenario, request):
    f = request.getfixturevalue(scenario)
    assert f.leftovers["processes"] == []
    assert f.leftovers["shm"] == []


def test_a_rank_that_returns_early_leaves_no_files(early):
    assert early.leftovers["files"] == []


@pytest.mark.parametrize("scenario", ["killed", "stopped"])
def test_a_sigkilled_rank_leaves_no_files(scenario, request):
    assert request.getfixturevalue(scenario).leftovers["files"] == []


@pytest.fixture(scope="module")
def strangers():
    return _faults().run_strangers(silent=2, crowd=200, rounds=10)


@pytest.fixture(scope="module")
def strangers_alone():
    return _faults().run_strangers(silent=0, crowd=0, rounds=10)


@pytest.fixture(scope="module")
def soaked():
    return _faults().soak(world_size=2, n_async=1000, n_sequential=10_000, threads=8)


@pytest.fixture(scope="module")
def mismatched():
    return _faults().run_mismatches(world_size=4)


@pytest.fixture(scope="module")
def store_gone():
    return _faults().run_store_gone(world_size=4)


def test_strangers_that_never_speak_and_200_store_clients_do_not_disturb_the_ranks(strangers):
    f = strangers
    assert f.wrong_results == 0
    assert f.notes["crowd_count"] == 200  # every client's add() was served
    assert f.leftovers == {"shm": [], "files": [], "processes": []}


def test_thousands_of_collectives_stay_correct_without_growing(soaked):
    f = soaked
    assert f.wrong_results == 0
    for before, after_async, after_sequential in f.notes["rss"]:
        assert after_sequential - before < 32 << 20, f.notes["rss"]
    assert f.leftovers["processes"] == []


def test_every_mismatch_is_raised_on_every_rank_at_the_call(mismatched):
    f = mismatched
    assert f.hung == [] and sorted(f.detect_s) == [0, 1, 2, 3]
    assert max(f.detect_s.values()) < 2.0  # not the 30 s group timeout
    for kind, messages in f.notes["kinds"].items():
        assert sorted(messages) == [0, 1, 2, 3], kind
        for rank, message in messages.items():
            assert message.startswith("CollectiveMismatchError: Detected mismatch"), message
            assert "no data was exchanged" in message
    assert "float32, 4 elements" in f.notes["kinds"]["dtype"][0]
    assert "float64, 4 elements" in f.notes["kinds"]["dtype"][0]
    assert f.leftovers == {"shm": [], "files": [], "processes": []}


def test_a_group_shuts_down_at_once_when_its_store_host_is_gone(store_gone):
    f = store_gone
    assert f.hung == [] and sorted(f.detect_s) == [1, 2, 3]
    assert max(f.detect_s.values()) < 2.0, f.detect_s  # was 29.7 s (issue 9)
    assert f.leftovers["processes"] == [] and f.leftovers["shm"] == []


@pytest.mark.timeout(60)
def test_the_readme_fault_table_is_what_the_code_prints(killed, stopped, early, mismatched,
                                                         store_gone, strangers,
                                                         strangers_alone, soaked):
    import pathlib

    from numcoll.bench import fault_table

    page = pathlib.Path(__file__).resolve().parents[1] / "docs" / "guide" / "faults.md"
    theirs = fault_table.readme_table(page.read_text())
    assert theirs is not None, f"{page}: no {fault_table.BEGIN} ... {fault_table.END}"
    ours = fault_table.markdown(fault_table.rows({
        "kill": killed, "stop": stopped, "early": early, "mismatch": mismatched,
        "store": store_gone, "strangers": strangers, "strangers_alone": strangers_alone,
        "soak": soaked}))
    theirs_lines = fault_table.masked(theirs).splitlines()
    ours_lines = fault_table.masked(ours).splitlines()
    assert len(theirs_lines) == len(ours_lines), (theirs, ours)
    for readme_line, code_line in zip(theirs_lines, ours_lines):
        assert readme_line == code_line, (
            "the fault table of docs/guide/faults.md differs from what the code prints; "
            "rerun python -m numcoll.faults --update-readme docs/guide/faults.md\npage:   "
            + readme_line + "\ncode:   " + code_line)


def test_the_command_line_answers_help_at_once():
    import subprocess
    import sys
    import time

    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "numcoll.faults", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and time.monotonic() - started < 20
    for option in ("--faults", "--world-size", "--transport", "--markdown", "--update-readme"):
        assert option in out.stdout
    bad = subprocess.run([sys.executable, "-m", "numcoll.faults", "--faults", "kil"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown fault 'kil'" in bad.stderr


def test_masking_keeps_the_words_and_drops_the_numbers():
    from numcoll.bench.fault_table import masked

    assert masked("0.02 / 0.31 s, 1,000 async; rank 3 (collective #3)") == \
        "N / N s, N async; rank N (collective #N)"
