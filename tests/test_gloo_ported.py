"""torch's ProcessGroupGlooTest, ported: world size 4, ranks as processes over
ZeroMQ (ipc:// between processes of one host). All scenarios run in one launch;
each test reports its own scenario's outcome on every rank."""

import pytest

import numcoll as nc
from gloo_scenarios import SCENARIOS, run_all

WORLD_SIZE = 4
pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


@pytest.fixture(scope="module")
def outcomes():
    per_rank = nc.launch(run_all, WORLD_SIZE, args=(list(SCENARIOS),), mode="process",
                         timeout=540)
    return per_rank


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_ported(outcomes, name):
    failures = [o[name] for o in outcomes if o[name] is not None]
    assert not failures, "\n".join(failures)
