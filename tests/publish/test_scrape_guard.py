"""/metrics survives a failing collector: only its families drop, in every format, and
phasewatch_scrape_collector_success/duration say which part failed."""

from __future__ import annotations

import logging
import urllib.request

import pytest
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as parse_openmetrics,
)
from prometheus_client.parser import text_string_to_metric_families as parse_text

from phasewatch.publish import exposition
from phasewatch.publish.guard import GuardedRegistry, ScrapeBoard, collector_name
from phasewatch.publish.metrics import HotText
from phasewatch.publish.roofline_metrics import RooflineCollector

FORMATS = {"text": "text/plain;version=0.0.4",
           "openmetrics": "application/openmetrics-text;version=1.0.0",
           "protobuf": exposition.PROMETHEUS_NATIVE_ACCEPT}


def _page(exporter, accept: str) -> tuple[set[str], dict[tuple[str, str], float]]:
    """The page's family names and its scrape_collector_* samples by (name, collector)."""
    req = urllib.request.Request(f"http://127.0.0.1:{exporter.http_port}/metrics",
                                 headers={"Accept": accept})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200
        ctype, body = r.headers["Content-Type"], r.read()
    scrape = {}
    if ctype == exposition.CONTENT_TYPE:
        fams = exposition.read_delimited(body)
        for f in fams:
            if f.name.startswith("phasewatch_scrape_collector"):
                for m in f.metric:
                    scrape[f.name, m.label[0].value] = m.gauge.value
        return {f.name for f in fams}, scrape
    parse = parse_openmetrics if ctype.startswith("application/openmetrics") else parse_text
    fams = list(parse(body.decode()))
    for f in fams:
        for s in f.samples:
            if s.name.startswith("phasewatch_scrape_collector"):
                scrape[s.name, s.labels["collector"]] = s.value
    return {f.name for f in fams}, scrape


def _boom(self):
    raise RuntimeError("collector broke")


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_failing_collector_drops_only_its_families(exporter, monkeypatch, caplog, fmt):
    accept = FORMATS[fmt]
    healthy, scrape = _page(exporter, accept)
    for name in ("requests", "self", "roofline", "slo", "process"):
        assert scrape["phasewatch_scrape_collector_success", name] == 1.0, name
        assert scrape["phasewatch_scrape_collector_duration_seconds", name] >= 0.0
    roofline = set()
    for f in RooflineCollector(exporter.monitor, exporter.aggregator).collect():
        roofline |= {f.name, f.name + "_total"}
    monkeypatch.setattr(RooflineCollector, "collect", _boom)
    with caplog.at_level(logging.ERROR, logger="phasewatch.publish.guard"):
        failing, scrape = _page(exporter, accept)
        again, _ = _page(exporter, accept)
    assert failing == again == healthy - roofline
    assert scrape["phasewatch_scrape_collector_success", "roofline"] == 0.0
    assert scrape["phasewatch_scrape_collector_success", "self"] == 1.0
    logged = [r for r in caplog.records if "roofline failed" in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info  # once per streak, with the traceback
    monkeypatch.undo()
    assert _page(exporter, accept)[0] == healthy


def test_the_hot_families_fail_alone(exporter, monkeypatch):
    healthy, _ = _page(exporter, FORMATS["text"])
    monkeypatch.setattr(HotText, "render", _boom)
    failing, scrape = _page(exporter, FORMATS["text"])
    assert scrape["phasewatch_scrape_collector_success", "requests"] == 0.0
    assert "phasewatch_build_info" in failing and "process_resident_memory_bytes" in failing
    assert failing < healthy


def test_board_and_registry():
    class FooCollector:
        def collect(self):
            raise ValueError("x")

    assert collector_name(FooCollector()) == "foo"
    board = ScrapeBoard()
    reg = GuardedRegistry(board)
    foo = FooCollector()
    reg.register(foo)
    names = [f.name for f in reg.collect()]
    assert names == ["phasewatch_scrape_collector_success",
                     "phasewatch_scrape_collector_duration_seconds"]
    reg.unregister(foo)
    assert board.run("x", lambda: 3, 0) == 3
