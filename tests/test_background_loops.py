"""The roofline loop counts each update's outcome and times its last success; stop()
joins every background thread it started."""

from __future__ import annotations

import time

from conftest import TEST_PORTS

from phasewatch.app import Exporter
from phasewatch.config import ServeConfig


def _count(ex: Exporter, outcome: str) -> float:
    return ex.stats.snapshot().get(("phasewatch_roofline_updates_total", (outcome,)), 0.0)


def _until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_failing_update_counts_error_and_recovers(monkeypatch):
    ex = Exporter(ServeConfig(roofline_interval=0.05, **TEST_PORTS))
    good = ex.monitor.update

    def boom():
        raise RuntimeError("update broke")

    monkeypatch.setattr(ex.monitor, "update", boom)
    ex.start()
    try:
        _until(lambda: _count(ex, "error") >= 2)
        assert ex.roofline_ok_at == 0.0 and _count(ex, "ok") == 0
        monkeypatch.setattr(ex.monitor, "update", good)
        _until(lambda: _count(ex, "ok") >= 1)
        assert ex.roofline_ok_at > 0
    finally:
        ex.stop(grace=1)


def test_stop_joins_every_background_thread():
    ex = Exporter(ServeConfig(roofline_interval=0.05, **TEST_PORTS)).start()
    threads = [ex._sweeper, ex._roofline, *ex._scrapers]
    assert all(t.is_alive() for t in threads)
    began = time.monotonic()
    ex.stop(grace=1)
    assert time.monotonic() - began < 5
    assert not any(t.is_alive() for t in threads)
