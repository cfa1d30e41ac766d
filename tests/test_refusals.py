"""The refusal log: every refusal counted, a few logged in full, the rest
summarised per (reason, peer) by a timer and at close; no thread left behind."""

import logging
import threading
import time

import pytest

from transports.refusals import RefusalLog

pytestmark = pytest.mark.timeout(30)


def _lines(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "numcoll.test-refusals"]


def test_a_flood_costs_a_few_lines_and_is_summarised_by_the_timer(caplog):
    caplog.set_level(logging.WARNING, logger="numcoll.test-refusals")
    log = RefusalLog("store :1234", "numcoll.test-refusals", burst=2, interval_s=0.2)
    try:
        for _ in range(50):
            log.refuse("bad handshake", "10.0.0.9:5000")
        log.refuse("wrong token", "10.0.0.7:6000")
        assert log.count == 51 and log.counts["bad handshake"] == 50
        assert len(_lines(caplog)) == 2  # the burst; nothing more until the timer
        deadline = time.monotonic() + 5
        while len(_lines(caplog)) < 4 and time.monotonic() < deadline:
            time.sleep(0.02)  # no further refusal comes: the timer must flush
        lines = _lines(caplog)
        assert "store :1234: refused 48 more from 10.0.0.9:5000: bad handshake" in lines[2]
        assert "refused 1 more from 10.0.0.7:6000: wrong token" in lines[3]
    finally:
        log.close()


def test_close_flushes_and_the_flusher_thread_exits(caplog):
    caplog.set_level(logging.WARNING, logger="numcoll.test-refusals")
    log = RefusalLog("rank 3", "numcoll.test-refusals", burst=1, interval_s=60)
    log.refuse("garbage hello", "pid 77", detail="first bytes 0xdeadbeef")
    log.refuse("garbage hello", "pid 77")
    assert _lines(caplog) == ["rank 3: refused from pid 77: garbage hello "
                              "(first bytes 0xdeadbeef)"]
    log.close()
    log.close()  # idempotent
    assert _lines(caplog)[-1] == ("rank 3: refused 1 more from pid 77: garbage hello "
                                  "(not logged one by one)")
    deadline = time.monotonic() + 5
    while any(t.name == "numcoll-refusal-log" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the flusher thread outlived the last log"
        time.sleep(0.02)
