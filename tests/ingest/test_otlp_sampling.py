"""Sampled traces end to end: vLLM-shaped spans from the OpenTelemetry SDK, through its own
samplers and OTLP exporter, counted on /metrics by 1/p (exporter/requests/sampling.py).

* The SDK's composite sampler (opentelemetry-sdk 1.45's ``_sampling_experimental``:
  ``composite_sampler(composable_traceid_ratio_based(0.1))``), which keeps a trace when
  its trace id's last 56 bits reach the threshold and writes ``ot=th`` into the kept
  span's tracestate, as OpenTelemetry's probability-sampling spec describes. Trace ids
  are drawn from ``random``, seeded here: the sample is fixed, and lies within 5 sigma of
  N x p as any should.
* A tracestate from upstream (a gateway that sampled the trace and wrote ``ot=th:c``,
  beside a vendor's member), which the SDK's W3C propagator hands to vLLM's span: exact.
* The SDK's classic ``TraceIdRatioBased``, which writes no ``th``, with
  ``--trace-sample-ratio``; a span with its own ``th`` keeps that.
"""

from __future__ import annotations

import json
import math
import random
import time
import urllib.request

import pytest
from opentelemetry import context
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace._sampling_experimental import (
    composable_traceid_ratio_based,
    composite_sampler,
)
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import TraceIdRatioBased
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from phasewatch.app import Exporter
from phasewatch.config import ServeConfig
from phasewatch.dashboard import panels
from phasewatch.dashboard.exporter_source import ExporterSource
from phasewatch.requests.record import RequestRecord
from phasewatch.requests.sampling import ot_threshold, threshold_probability
from phasewatch.sim import otlp_shapes
from tests.conftest import TEST_PORTS, component_text, scrape
from tests.support import ROOT

TTFT_COUNT = "gen_ai_server_time_to_first_token_seconds_count"


def _records(n: int) -> list[RequestRecord]:
    """``n`` finished requests over the last 20 s (inside the JSON API's window)."""
    t0 = time.time() - 20.0
    return [RequestRecord("m", arrival=(t := t0 + i * 15.0 / n), queued=t + 0.001,
                          scheduled=t + 0.01, first_token=t + 0.05, last_token=t + 0.45,
                          finish=t + 0.45, prompt_tokens=100 + i % 50, output_tokens=20 + i % 7,
                          request_id=f"r{i}") for i in range(n)]


def _provider(ex: Exporter, sampler=None) -> tuple[TracerProvider, InMemorySpanExporter]:
    """vLLM's resource, ``sampler`` (the SDK's default: parent-based, always on), the
    SDK's OTLP/gRPC exporter to ``ex``, and a copy of every kept span in memory."""
    kw = {} if sampler is None else {"sampler": sampler}
    tp = TracerProvider(resource=Resource.create({"service.name": "vllm"}), **kw)
    mem = InMemorySpanExporter()
    tp.add_span_processor(SimpleSpanProcessor(mem))
    tp.add_span_processor(BatchSpanProcessor(
        OTLPSpanExporter(endpoint=f"127.0.0.1:{ex.otlp_grpc_port}", insecure=True),
        schedule_delay_millis=50, max_queue_size=1 << 16))
    return tp, mem


def _send(tp: TracerProvider, records, tracestate: str | None = None) -> None:
    """Each record as vLLM's span; with ``tracestate``, under a traceparent and that
    tracestate from upstream (a random trace each)."""
    tracer = otlp_shapes.tracer_for(tp, "vllm")
    for r in records:
        token = None
        if tracestate is not None:
            parent = f"00-{random.getrandbits(128):032x}-{random.getrandbits(64):016x}-01"
            token = context.attach(TraceContextTextMapPropagator().extract(
                {"traceparent": parent, "tracestate": tracestate}))
        try:
            otlp_shapes.emit_vllm(tracer, r)
        finally:
            if token is not None:
                context.detach(token)
    assert tp.force_flush(30_000)


def _scrape_when(ex: Exporter, sampled: int):
    deadline = time.monotonic() + 20
    while True:
        s = scrape(ex.http_port)
        if s.total("phasewatch_sampled_requests_total") >= sampled or time.monotonic() > deadline:
            return s
        time.sleep(0.1)


@pytest.fixture
def sampled_exporter():
    ex = Exporter(ServeConfig(**TEST_PORTS, trace_sample_ratio=0.25)).start()
    yield ex
    ex.stop(grace=1)


def test_the_sdks_probability_sampler_th_weighs_requests_not_latencies(exporter):
    random.seed(20261124)  # the SDK's RandomIdGenerator draws trace ids from ``random``
    n = 4000
    records = _records(n)
    tp, mem = _provider(exporter, composite_sampler(composable_traceid_ratio_based(0.1)))
    _send(tp, records)
    tp.shutdown()
    kept = mem.get_finished_spans()
    states = {s.context.trace_state.to_header() for s in kept}
    assert len(states) == 1 and states.pop().startswith("ot=th:")  # the sampler wrote th
    p = threshold_probability(ot_threshold(kept[0].context.trace_state.to_header()))
    assert p == pytest.approx(0.1, rel=1e-9)
    k = len(kept)
    assert abs(k - n * p) < 5 * math.sqrt(n * p * (1 - p))
    s = _scrape_when(exporter, k)
    assert s.total("phasewatch_sampled_requests_total") == k
    assert s.total(TTFT_COUNT) == k  # latency: each kept request one sample
    assert s.total("phasewatch_phase_duration_seconds_count", phase="decode") == k
    requests = s.total("phasewatch_requests_total")
    assert requests == pytest.approx(k / p, rel=1e-9)
    assert abs(requests - n) < 5 * math.sqrt(n * (1 - p) / p)  # N within sampling noise
    outputs = {r.request_id: r.output_tokens for r in records}
    kept_out = sum(outputs[sp.attributes["gen_ai.request.id"]] for sp in kept)
    assert s.total("phasewatch_tokens_total", kind="output") == pytest.approx(kept_out / p)
    # the JSON API's rates agree with /metrics
    with urllib.request.urlopen(f"http://127.0.0.1:{exporter.http_port}/api/v1/summary",
                                timeout=10) as r:
        [m] = json.load(r)["models"]
    assert m["requests_in_window"] == pytest.approx(k / p)
    assert m["request_rate"] == pytest.approx(k / p / m["covered_seconds"])
    assert m["trace_sampling"] == {"received_requests": k, "sampled_share": pytest.approx(p)}
    # the dashboard says the counts stand for more requests than it saw
    snap = ExporterSource(f"http://127.0.0.1:{exporter.http_port}").fetch()
    assert snap.kpis["sampled_share"].iloc[0] == pytest.approx(p)
    cards = {c.id: " ".join(component_text(c).split()) for c in panels.kpi_cards(snap.kpis)}
    assert cards["kpi-sampled_share"] == "sampled traces 10%", cards


def test_a_tracestate_from_upstream_weighs_exactly_and_a_bad_th_is_counted(exporter):
    random.seed(7)
    tp, mem = _provider(exporter)
    records = _records(60)
    _send(tp, records[:40], "congo=t61rcWkgMzE,ot=rv:0123456789abcd;th:c")  # 25 %
    _send(tp, records[40:50], "ot=th:0")  # 100 %: sampled, weight 1
    _send(tp, records[50:], "ot=th:e668e668e668e668")  # 16 digits: ignored, weight 1
    tp.shutdown()
    assert len(mem.get_finished_spans()) == 60
    s = _scrape_when(exporter, 60)
    assert s.total("phasewatch_sampled_requests_total") == s.total(TTFT_COUNT) == 60
    assert s.total("phasewatch_requests_total") == 40 * 4 + 10 + 10
    assert s.value("phasewatch_trace_sampling_ignored_total", reason="bad_threshold") == 10
    prompts = sum(r.prompt_tokens * (4 if i < 40 else 1) for i, r in enumerate(records))
    assert s.total("phasewatch_tokens_total", kind="prompt") == prompts


def test_a_configured_ratio_for_a_sampler_that_writes_no_th(sampled_exporter):
    random.seed(3)
    tp, mem = _provider(sampled_exporter, TraceIdRatioBased(0.25))
    records = _records(400)
    _send(tp, records)
    tp.shutdown()
    kept = mem.get_finished_spans()
    assert 50 < len(kept) < 150 and all(not sp.context.trace_state for sp in kept)
    own, _ = _provider(sampled_exporter)  # a span's own th wins over the ratio
    _send(own, _records(5), "ot=th:8")
    own.shutdown()
    k = len(kept)
    s = _scrape_when(sampled_exporter, k + 5)
    assert s.total("phasewatch_sampled_requests_total") == s.total(TTFT_COUNT) == k + 5
    assert s.total("phasewatch_requests_total") == 4 * k + 2 * 5


def test_the_sampled_share_through_prometheus_on_the_dashboard_and_grafanas_panel(
        exporter, tmp_path):
    """A real Prometheus scraping the exporter while sampled traces (p = 0.1, the SDK's
    sampler) arrive in two halves: the Dash dashboard's Prometheus source and Grafana's
    "Sampled traces" panel (its expression as generated, variables filled as Grafana
    would) both read the share received, 10 %: received over the weighted requests."""
    import sys

    from phasewatch.dashboard.prometheus_source import PrometheusSource
    from tests.support.prom import PrometheusServer

    sys.path.insert(0, str(ROOT / "grafana"))
    import generate as grafana

    doc = json.loads(grafana.OUT.read_text())
    (expr,) = [e for title, e in grafana.expressions(doc) if title == "Sampled traces"]
    filled = grafana.substitute(expr, {"$__rate_interval": "1m", "$__range": "5m",
                                       "$model": ".*", "$engine": ".*", "$source": ".*",
                                       "$pod": ".*", "$job": ".*"})
    random.seed(20261125)
    records = _records(2000)
    with PrometheusServer(tmp_path, [f"127.0.0.1:{exporter.http_port}"]) as prom:
        tp, mem = _provider(exporter, composite_sampler(composable_traceid_ratio_based(0.1)))
        _send(tp, records[:1000])
        # the first half scraped, then the second: the counters grow between scrapes
        assert _wait(lambda: prom.query("phasewatch_sampled_requests_total"))
        _send(tp, records[1000:])
        tp.shutdown()
        kept = len(mem.get_finished_spans())
        assert _wait(lambda: prom.query(f"sum(phasewatch_sampled_requests_total) == {kept}"))
        rows = _wait(lambda: prom.query(filled))
        assert rows and len(rows) == 1, (filled, rows)
        assert float(rows[0]["value"][1]) == pytest.approx(0.1, rel=1e-6), rows
        snap = PrometheusSource(prom.url, rate_range="1m").fetch()
        assert snap.kpis["sampled_share"].iloc[0] == pytest.approx(0.1, rel=1e-6)


def _wait(probe, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while not (got := probe()) and time.monotonic() < deadline:
        time.sleep(0.25)
    return got
