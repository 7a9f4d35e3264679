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


def test_a_long_update_off_the_cpu_is_logged_as_a_pause(caplog):
    """SIGSTOP (a frozen VM, a starved host) that lands during an update: the log says
    the process ran late by the time it had no CPU, as for a late tick; an update that
    was itself slow says so, with its CPU time."""
    from phasewatch.app import _log_long_update

    with caplog.at_level("WARNING", logger="phasewatch"):
        _log_long_update(3.5, 0.1, 2.0, 0.5)
        _log_long_update(3.5, 3.0, 2.0, 0.5)
        _log_long_update(1.5, 0.0, 2.0, 0.5)  # under the notice: nothing
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert lines[0].startswith("phasewatch ran 3.4 s late (a 0.5 s roofline tick)")
    assert lines[1].startswith("the roofline update took 3.5 s (3.0 s of CPU")
