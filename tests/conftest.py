import os
import threading

import pytest

#: The one command that runs the tests needing a real GPU (marked ``gpu``).
GPU_COMMAND = "NUMBA_ENABLE_CUDASIM=0 python -m pytest -m gpu"

# pytest-xdist (``pytest -n 2``) marks its workers' environment; the pytest runs a
# test starts itself (the regression gate's, the notebooks' saved runs) are not its
# workers, and pytest-benchmark would switch itself off in them if they inherited it.
for _name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID"):
    os.environ.pop(_name, None)

# Every wait in the library has a deadline; this is the test-side backstop.
DEFAULT_TEST_TIMEOUT_S = 120


@pytest.fixture
def no_leaked_threads():
    """Fail if the test leaves numcoll threads running."""
    before = {t.ident for t in threading.enumerate()}
    yield
    import time

    deadline = time.monotonic() + 5
    while True:
        leaked = [t for t in threading.enumerate()
                  if t.ident not in before and t.is_alive() and "numcoll" in t.name.lower()]
        if not leaked or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not leaked, f"threads left running: {[t.name for t in leaked]}"


@pytest.fixture
def tiny_segments(monkeypatch):
    """Force the multi-segment paths with tiny arrays."""
    monkeypatch.setenv("NUMCOLL_SEGMENT_NBYTES", "64")
    yield 64


# --- the collectives matrix: which world sizes, over which transports ------------------

DEFAULT_WORLD_SIZES = (1, 2, 3, 4, 7)
#: The transports between processes run a slice of the matrix: one odd world size.
SOCKET_SLICE = (("tcp", 3), ("ipc", 3), ("shm", 3))


def pytest_addoption(parser):
    parser.addoption("--world-sizes", default=None,
                     help="comma-separated world sizes for the collectives matrix "
                          "(default 1,2,3,4,7; also NUMCOLL_TEST_WORLD_SIZES)")


def matrix_world_sizes(config) -> list[int]:
    raw = config.getoption("--world-sizes") or os.environ.get("NUMCOLL_TEST_WORLD_SIZES")
    if not raw:
        return list(DEFAULT_WORLD_SIZES)
    try:
        sizes = [int(s) for s in raw.split(",") if s.strip()]
    except ValueError:
        raise pytest.UsageError(f"--world-sizes: expected integers like 1,2,5, got {raw!r}")
    if not sizes or min(sizes) < 1:
        raise pytest.UsageError(f"--world-sizes: world sizes must be >= 1, got {raw!r}")
    return sizes


def pytest_generate_tests(metafunc):
    """``placement`` = (transport, world size): every requested world size over
    inproc, and the socket slice over tcp and ipc."""
    if "placement" in metafunc.fixturenames:
        params = [("inproc", n) for n in matrix_world_sizes(metafunc.config)]
        params += list(SOCKET_SLICE)
        metafunc.parametrize("placement", params, ids=[f"{t}-{n}" for t, n in params])


# --- a test that runs out of time says what every rank was waiting for ----------------
#
# pytest-timeout interrupts the test, whose cleanup (finally:, fixtures) then ends the
# collectives it was stuck in; so what every rank waited for is read just before the
# deadline, by a timer, and added to the failure's report if the test ran out of time.

_SNAPSHOT_LEAD_S = 0.5


def _timeout_s(item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    try:
        return float(item.config.getoption("timeout") or item.config.getini("timeout") or 0)
    except (ValueError, TypeError):
        return 0.0


def _waits(since_ns: int) -> str:
    from numcoll.diagnostics import flight_recorder

    recorder = flight_recorder.recorder()
    lines = [] if recorder is None else recorder.in_progress(since_ns)
    threads = sorted(t.name for t in threading.enumerate() if "numcoll" in t.name.lower())
    return "\n".join(lines or ["no collective of this process was in progress (ranks in "
                               "other processes report through their launcher)"]) + \
        f"\nnumcoll threads alive: {threads}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    import time

    started = time.time_ns()
    item._numcoll_started = started
    item._numcoll_waits = None
    timeout_s = _timeout_s(item)
    timer = None
    if timeout_s > 2 * _SNAPSHOT_LEAD_S:
        def snapshot():
            item._numcoll_waits = _waits(started)

        timer = threading.Timer(timeout_s - _SNAPSHOT_LEAD_S, snapshot)
        timer.name = "test-deadline-snapshot"
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()
            timer.join()


def _history(since_ns: int) -> str:
    from numcoll.diagnostics import flight_recorder

    recorder = flight_recorder.recorder()
    lines = [] if recorder is None else recorder.history(since_ns)
    return "\n".join(lines or ["no collective ran in this process (ranks in other processes "
                               "report through their launcher)"])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.when != "call" or not report.failed:
        return
    text = str(report.longrepr)
    if "Timeout" in text:  # pytest-timeout's, or numcoll's CollectiveTimeoutError
        report.sections.append((
            "numcoll: what every rank was waiting for when the test ran out of time",
            getattr(item, "_numcoll_waits", None) or _waits(0)))
    if "Timeout" in text or "Timed out" in text:
        # Every call of the test on every rank of this process, finished or
        # not: a rank that completed a call a peer timed out waiting for tells
        # a lost message from a stalled rank.
        report.sections.append(("numcoll: every collective this test ran, per rank",
                                _history(getattr(item, "_numcoll_started", 0))))


# --- tests that need a real GPU ----------------------------------------------------

def _real_gpu() -> str | None:
    """None if a real CUDA GPU is usable here, else why not. Asked only when a
    ``gpu`` test is about to run, so numba.cuda is imported after the CUDA test
    modules have chosen the simulator or not."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
        return "the CUDA simulator is on (NUMBA_ENABLE_CUDASIM=1)"
    try:
        from numba import cuda
    except Exception as exc:  # noqa: BLE001 - any import failure means no GPU here
        return f"numba.cuda cannot be imported ({exc})"
    if cuda.jit.__module__.startswith("numba.cuda.simulator"):
        return "numba.cuda was imported with the simulator on"
    try:
        if not cuda.is_available():
            return "no CUDA GPU is available"
    except Exception as exc:  # noqa: BLE001 - a broken driver means no GPU
        return f"the CUDA driver fails ({exc})"
    return None


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is not None:
        why = _real_gpu()
        if why is not None:
            pytest.skip(f"needs a real GPU: {why}; on a GPU machine run {GPU_COMMAND}")
