"""The background loops (``phasewatch.app_loops``): the roofline loop and the sweeps of
the joins' waiting rooms count each outcome and time their last success, a failure is
counted and the loop goes on; stop() joins every background thread it started."""

from __future__ import annotations

import time

from conftest import TEST_PORTS, scrape

from phasewatch import app_loops, catalog
from phasewatch.app import Exporter
from phasewatch.config import ServeConfig
from phasewatch.roofline.deployments import ModelOptions

JOINS = ("lifecycle", "otlp", "trace")


def _count(ex: Exporter, outcome: str) -> float:
    return ex.stats.snapshot().get(("phasewatch_roofline_updates_total", (outcome,)), 0.0)


def _sweeps(ex: Exporter, join: str, outcome: str) -> float:
    return ex.stats.snapshot().get((catalog.SWEEPS.name, (join, outcome)), 0.0)


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
    threads = [ex.loops.sweeper, ex.loops.roofline, *ex.loops.scrapers]
    assert all(t.is_alive() for t in threads)
    began = time.monotonic()
    ex.stop(grace=1)
    assert time.monotonic() - began < 5
    assert not any(t.is_alive() for t in threads)


def test_a_long_update_off_the_cpu_is_logged_as_a_pause(caplog):
    """SIGSTOP (a frozen VM, a starved host) that lands during an update: the log says
    the process ran late by the time it had no CPU, as for a late tick; an update that
    was itself slow says so, with its CPU time."""
    from phasewatch.app_loops import log_long_update

    with caplog.at_level("WARNING", logger="phasewatch"):
        log_long_update(3.5, 0.1, 2.0, 0.5)
        log_long_update(3.5, 3.0, 2.0, 0.5)
        log_long_update(1.5, 0.0, 2.0, 0.5)  # under the notice: nothing
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert lines[0].startswith("phasewatch ran 3.4 s late (a 0.5 s roofline tick)")
    assert lines[1].startswith("the roofline update took 3.5 s (3.0 s of CPU")


def _boom():
    raise RuntimeError("sweep broke")


def test_a_sweep_that_raises_is_counted_as_error_and_the_others_still_sweep(monkeypatch):
    ex = Exporter(ServeConfig(**TEST_PORTS), clock=lambda: 1234.5)
    monkeypatch.setattr(ex.otlp, "sweep", _boom)
    swept = []
    real = ex.trace_join.sweep
    monkeypatch.setattr(ex.trace_join, "sweep", lambda: swept.append(1) or real())
    ex.loops.sweep()
    ex.loops.sweep()
    assert _sweeps(ex, "otlp", "error") == 2 and _sweeps(ex, "otlp", "ok") == 0
    assert _sweeps(ex, "lifecycle", "ok") == _sweeps(ex, "trace", "ok") == 2
    assert _sweeps(ex, "lifecycle", "error") == _sweeps(ex, "trace", "error") == 0
    assert swept == [1, 1]  # the one after the failing join too
    assert ex.loops.sweep_ok_at == {"lifecycle": 1234.5, "otlp": 0.0, "trace": 1234.5}


def test_the_sweeper_goes_on_after_a_failure(monkeypatch):
    monkeypatch.setattr(app_loops, "SWEEP_INTERVAL", 0.02)
    ex = Exporter(ServeConfig(**TEST_PORTS))
    good = ex.joiner.sweep
    monkeypatch.setattr(ex.joiner, "sweep", _boom)
    ex.start()
    try:
        _until(lambda: _sweeps(ex, "lifecycle", "error") >= 2)
        assert _sweeps(ex, "otlp", "ok") >= 1 and _sweeps(ex, "trace", "ok") >= 1
        assert ex.loops.sweep_ok_at["lifecycle"] == 0.0
        monkeypatch.setattr(ex.joiner, "sweep", good)
        _until(lambda: _sweeps(ex, "lifecycle", "ok") >= 1)
        assert ex.loops.sweep_ok_at["lifecycle"] > 0
        assert ex.loops.sweeper.is_alive()
    finally:
        ex.stop(grace=1)


def test_the_sweeps_families_are_on_metrics(monkeypatch):
    monkeypatch.setattr(app_loops, "SWEEP_INTERVAL", 0.02)
    ex = Exporter(ServeConfig(**TEST_PORTS)).start()
    try:
        page = scrape(ex.http_port)
        assert "# TYPE phasewatch_sweeps_total counter" in page.text
        assert "# TYPE phasewatch_sweep_last_success_timestamp_seconds gauge" in page.text
        _until(lambda: all(_sweeps(ex, j, "ok") >= 1 for j in JOINS))
        page = scrape(ex.http_port)
        for join in JOINS:
            assert page.value("phasewatch_sweeps_total", join=join, outcome="ok") >= 1
            assert page.value("phasewatch_sweep_last_success_timestamp_seconds",
                              join=join) > time.time() - 60
        assert page.value("phasewatch_sweeps_total", outcome="error") is None
    finally:
        ex.stop(grace=1)


def test_last_sweep_success_is_zero_for_each_join_before_any_sweep():
    ex = Exporter(ServeConfig(**TEST_PORTS))
    body, _ = ex.metrics_page.render("text/plain;version=0.0.4")
    lines = [line for line in body.decode().splitlines()
             if line.startswith("phasewatch_sweep_last_success_timestamp_seconds{")]
    assert lines == [f'phasewatch_sweep_last_success_timestamp_seconds{{join="{j}"}} 0.0'
                     for j in JOINS]


def test_stop_joins_the_engine_scrapers_too():
    config = ServeConfig(roofline_interval=0.05, **TEST_PORTS,
                         model_flags=ModelOptions(engine_metrics_url="http://127.0.0.1:9/metrics"))
    ex = Exporter(config).start()
    threads = ex.loops.threads()
    assert len(ex.loops.scrapers) == 1 and all(t.is_alive() for t in threads)
    ex.stop(grace=1)
    assert not any(t.is_alive() for t in threads)
