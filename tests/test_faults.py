"""Fault injection on 4 process ranks (issue 9): a rank SIGKILLed in the middle
of 16 MiB allreduces, a rank SIGSTOPped with a 2 s group timeout, a rank that
returns early, strangers that connect and never speak plus 200 store clients at
once, and a soak of 1,000 async + 10,000 back-to-back allreduces.

Each scenario runs once (module fixtures, see :mod:`numcoll.bench.faults`); the tests
assert on its figures: every survivor raises, promptly, nobody hangs, no wrong
result, the error names the culprit, nothing is left behind.
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


def test_strangers_that_never_speak_and_200_store_clients_do_not_disturb_the_ranks():
    f = _faults().run_strangers(silent=2, crowd=200, rounds=10)
    assert f.wrong_results == 0
    assert f.notes["crowd_count"] == 200  # every client's add() was served
    assert f.leftovers == {"shm": [], "files": [], "processes": []}


def test_thousands_of_collectives_stay_correct_without_growing():
    f = _faults().soak(world_size=2, n_async=1000, n_sequential=10_000, threads=8)
    assert f.wrong_results == 0
    for before, after_async, after_sequential in f.notes["rss"]:
        assert after_sequential - before < 32 << 20, f.notes["rss"]
    assert f.leftovers["processes"] == []
