import threading

import pytest

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
