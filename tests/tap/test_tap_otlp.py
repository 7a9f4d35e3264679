"""The tap's records as OTLP spans (``phasewatch tap --otlp-endpoint``): what a tap in a
fleet sends through the OpenTelemetry Collector, so that each record reaches the replica
holding the engine's spans of its trace (tests/deploy/test_fleet.py routes them so).

Asserted: the same records sent over phasewatch gRPC and as spans, through the OpenTelemetry
SDK's own OTLP/gRPC and OTLP/HTTP exporters, make the same requests (to 1 us), alone and
joined with vLLM-shaped engine spans; the command in front of a server sends spans whose
child is the engine's span and that join; a further choice (n > 1) joins as its own
sequence; an unreachable endpoint is counted, never felt by the user's traffic; a span
with bad emission times is rejected with its reason.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from dataclasses import replace

import pytest
from opentelemetry import context
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from phasewatch.app import Exporter
from phasewatch.client import PhasewatchClient
from phasewatch.config import ServeConfig
from phasewatch.requests.record import RequestRecord
from phasewatch.sim import otlp_shapes
from phasewatch.sim.scenarios import scenario
from phasewatch.tap import client_recorder, trace_headers
from phasewatch.tap.observed import Observed
from phasewatch.tap.otlp_out import OtlpRecorder, span_exporter, to_span
from tests.conftest import TEST_PORTS, scrape, terminate, wait_for
from tests.tap.test_tap import MODEL, FakeServer, post

CONFIG = ServeConfig(**TEST_PORTS, source_label=True, trace_join_wait=3.0)
FIELDS = ("model", "engine", "finish_reason", "arrival", "preprocess", "queue", "prefill",
          "ttft", "decode", "tpot", "e2e", "prompt_tokens", "cached_prompt_tokens",
          "output_tokens")


def api(ex: Exporter, path: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{ex.http_port}{path}", timeout=10) as r:
        return json.load(r)


def rows(ex: Exporter) -> list[dict]:
    got = api(ex, "/api/v1/requests?limit=500")["requests"]
    return sorted(({k: r[k] for k in FIELDS} for r in got), key=lambda r: r["arrival"])


def same(a: list[dict], b: list[dict]) -> None:
    """The same requests, times to 1 us (both sides convert seconds to ns)."""
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        for k in FIELDS:
            if isinstance(x[k], float) and isinstance(y[k], float):
                assert x[k] == pytest.approx(y[k], abs=1e-6), (k, x, y)
            else:
                assert x[k] == y[k], (k, x, y)


def tapped(n: int, seed: int = 7) -> list[tuple[RequestRecord, dict]]:
    """Simulated requests, each with the headers a tap sent upstream and what the tap saw
    (``PhasewatchClient.record`` keywords): the client's arrival a little before the
    engine's, each chunk a little after the engine emitted it."""
    out = []
    for r in scenario("chat").build(seed=seed).run(6.0, epoch=time.time() - 20)[:n]:
        parent, state = trace_headers(None)
        times = [t + 0.001 for t in r.token_times]
        out.append((r, {"traceparent": parent, "tracestate": state}, dict(
            arrival=r.arrival - 0.002, first_token=times[0], last_token=times[-1],
            finish=times[-1] + 0.001, prompt_tokens=r.prompt_tokens,
            cached_prompt_tokens=r.cached_prompt_tokens, output_tokens=r.output_tokens,
            finish_reason=r.finish_reason, token_times=times,
            token_counts=[1] * len(times), trace_parent=parent[3:-3])))
    return out


def engine_spans(requests, pod: str = "vllm-0") -> list:
    """vLLM's ``llm_request`` span of each request, a child of the tap's traceparent."""
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "vllm",
                                                        "k8s.pod.name": pod}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("vllm.tracing.otel")
    for r, headers, _ in requests:
        token = context.attach(TraceContextTextMapPropagator().extract(headers))
        try:
            otlp_shapes.emit_vllm(tracer, replace(r, model=MODEL))
        finally:
            context.detach(token)
    spans = memory.get_finished_spans()
    provider.shutdown()
    return spans


def startup_spans() -> list:
    """A span an engine exports as it starts (vLLM's weight loading): no request."""
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    provider.get_tracer("vllm").start_span("Load weights").end()
    provider.shutdown()
    return memory.get_finished_spans()


def send_engine(ex: Exporter, spans) -> None:
    exporter = OTLPSpanExporter(endpoint=f"127.0.0.1:{ex.otlp_grpc_port}", insecure=True)
    try:
        assert exporter.export(spans).name == "SUCCESS"
    finally:
        exporter.shutdown()


def settled(ex: Exporter, n: int) -> list[dict]:
    got = wait_for(lambda: (lambda r: r if len(r) == n else None)(rows(ex)), timeout=20)
    assert got, rows(ex)
    return got


@pytest.fixture
def pair():
    """Two exporters: one gets the tap's records over phasewatch gRPC, one as spans."""
    a, b = Exporter(CONFIG).start(), Exporter(CONFIG).start()
    yield a, b
    a.stop(grace=1)
    b.stop(grace=1)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_records_as_spans_make_the_same_requests_as_over_grpc(pair, protocol):
    """Alone (no engine tracing: counted at once), then joined with the engine's spans:
    the exporter fed spans holds the same requests as the one fed the gRPC client."""
    by_grpc, by_otlp = pair
    endpoint = (f"127.0.0.1:{by_otlp.otlp_grpc_port}" if protocol == "grpc" else
                f"http://127.0.0.1:{by_otlp.otlp_http_port}/v1/traces")
    client = PhasewatchClient(f"127.0.0.1:{by_grpc.grpc_port}", engine="tap", source="tap")
    spans = OtlpRecorder(span_exporter(endpoint), "tap", interval=0.05)
    alone, joined = tapped(8, seed=1), tapped(12, seed=2)
    try:
        for record in (client_recorder(client), spans):
            for _, _, kwargs in alone:
                record(MODEL, kwargs, Observed(path="/v1/chat/completions"))
        assert client.flush(10)
        spans.flush()
        same(settled(by_grpc, 8), settled(by_otlp, 8))
        for ex in pair:  # an engine now traces: the taps' records wait for its spans
            send_engine(ex, engine_spans(alone[:1]))  # late: their requests are counted
        for record in (client_recorder(client), spans):
            for _, _, kwargs in joined:
                record(MODEL, kwargs, Observed(path="/v1/chat/completions"))
        assert client.flush(10)
        spans.flush()
        for ex in pair:
            send_engine(ex, engine_spans(joined))
        same(settled(by_grpc, 20), settled(by_otlp, 20))
    finally:
        client.close()
        spans.close()
    assert spans.stats == {"sent": 20, "accepted": 20}
    for ex in pair:
        s = scrape(ex.http_port)
        assert s.value("phasewatch_trace_join_requests_total", outcome="joined") == 12
        assert s.value("phasewatch_requests_total", source="joined", model=MODEL) == 12
        assert s.value("phasewatch_requests_total", source="tap", model=MODEL) == 8
    # the tap's spans are not requests of an engine of their own, nor rejected
    s = scrape(by_otlp.http_port)
    assert not [x for x in s.samples if x.name == "phasewatch_ingest_rejected_total"
                and x.value]


def test_a_further_choice_is_a_child_span_and_joins_its_own_sequence(pair):
    _, ex = pair
    (r, headers, kwargs), = tapped(1, seed=3)
    resource = Resource.create({})
    first = to_span(MODEL, kwargs, "tap", resource)
    second = to_span(MODEL, {**kwargs, "choice": 1}, "tap", resource)
    tap_span = int(headers["traceparent"].split("-")[2], 16)
    assert first.context.span_id == tap_span and first.parent is None
    assert second.parent.span_id == tap_span and second.context.span_id != tap_span
    assert first.name == "chat " + MODEL and first.attributes["phasewatch.source"] == "tap"
    # the engine's two sequences first: they inherited the tap's tracestate, so they wait
    send_engine(ex, engine_spans([(r, headers, kwargs), (r, headers, kwargs)]))
    send_engine(ex, [first, second])
    got = settled(ex, 2)
    assert [g["prompt_tokens"] for g in got].count(r.prompt_tokens) == 2
    s = scrape(ex.http_port)
    assert s.value("phasewatch_trace_join_requests_total", outcome="joined") == 2


def test_the_command_sends_spans_the_engines_span_is_a_child_of(tmp_path):
    """``phasewatch tap --otlp-endpoint`` in front of a server whose engine traces, its
    spans kept on the way (``OtlpCapture``): the tap's span continues the caller's trace
    under the caller's span, the engine's span (from the traceparent the server got) is
    its child, the two join, and the tap logs what was accepted."""
    from tests.engines.otlp_capture import OtlpCapture

    fake = FakeServer().start()
    ex = Exporter(CONFIG).start()
    cap = OtlpCapture(forward_to=f"127.0.0.1:{ex.otlp_grpc_port}").start()
    log = tmp_path / "tap.log"
    caller = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    try:
        with open(log, "w") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "phasewatch.cli", "tap", "--upstream",
                 f"http://127.0.0.1:{fake.port}", "--port", "0", "--otlp-endpoint",
                 cap.endpoint], stdout=out, stderr=subprocess.STDOUT,
                env={"PATH": "/usr/bin:/bin", "OTEL_SERVICE_NAME": "tap-under-test",
                     "OTEL_RESOURCE_ATTRIBUTES": "k8s.pod.name=vllm-0"})
        try:
            found = wait_for(lambda: re.search(r"tap on http://127.0.0.1:(\d+)",
                                               log.read_text()), timeout=30)
            assert found, log.read_text()
            assert f"records to {cap.endpoint} (OTLP spans)" in log.read_text()
            send_engine(ex, startup_spans())  # vLLM traces as it loads: an engine traces
            t0 = time.time()
            status, _, _ = post(int(found[1]), {"model": MODEL, "stream": True,
                                                "max_tokens": 4},
                                headers={"traceparent": caller})
            assert status == 200
            sent = fake.seen_headers[-1]
            assert wait_for(lambda: cap.raw, timeout=10)  # the tap's span, 0.25 s on
            # the engine, tracing from the headers it got: its span comes after, its
            # first token before the client saw it (the fake answers 0.30 s on)
            first = t0 + 0.25
            engine = RequestRecord(MODEL, arrival=t0 + 0.005, queued=t0 + 0.01,
                                   scheduled=t0 + 0.02, first_token=first,
                                   last_token=first + 0.15, finish=first + 0.15,
                                   prompt_tokens=12, output_tokens=4, request_id="cmpl-1")
            headers = {"traceparent": sent["traceparent"], "tracestate": sent["tracestate"]}
            send_engine(ex, engine_spans([(engine, headers, {})]))
            got = settled(ex, 1)
            assert got[0]["engine"] == "vllm" and got[0]["output_tokens"] == 4, got
            s = scrape(ex.http_port)
            assert s.value("phasewatch_trace_join_requests_total", outcome="joined") == 1
        finally:
            terminate(proc)
        assert proc.returncode == 0, log.read_text()
        assert "records_accepted 1" in log.read_text(), log.read_text()
    finally:
        cap.stop()
        ex.stop(grace=1)
        fake.stop()
    (export,) = cap.requests()
    (rs,) = export.resource_spans
    resource = {kv.key: kv.value.string_value for kv in rs.resource.attributes}
    assert resource["service.name"] == "tap-under-test"
    assert resource["k8s.pod.name"] == "vllm-0"
    (span,) = rs.scope_spans[0].spans
    _, trace, own, _ = sent["traceparent"].split("-")
    assert span.trace_id.hex() == trace == "0af7651916cd43dd8448eb211c80319c"
    assert span.span_id.hex() == own  # the engine's span is its child
    assert span.parent_span_id.hex() == "b7ad6b7169203331"  # the caller's span
    assert span.name == f"chat {MODEL}" and span.kind == 3  # SPAN_KIND_CLIENT
    attrs = {kv.key: kv.value for kv in span.attributes}
    assert attrs["gen_ai.usage.output_tokens"].int_value == 4
    assert len(attrs["phasewatch.emission_offsets_ns"].array_value.values) == 4


def test_an_unreachable_endpoint_is_counted_and_the_traffic_is_untouched(tmp_path):
    fake = FakeServer().start()
    from phasewatch import tap as tapmod
    from tests.support.prom import free_port

    recorder = OtlpRecorder(span_exporter(f"127.0.0.1:{free_port()}", timeout=1.0), "tap",
                            interval=0.05)
    server = tapmod.TapServer(tapmod.Tap(f"http://127.0.0.1:{fake.port}", recorder),
                              client=recorder).start()
    try:
        status, data, _ = post(server.port, {"model": MODEL, "stream": True, "max_tokens": 3})
        assert status == 200 and data.endswith(b"data: [DONE]\n\n")
        assert wait_for(lambda: recorder.stats.get("dropped_export_failed") == 1, timeout=20)
    finally:
        server.stop()
        recorder.close()
        fake.stop()
    assert recorder.stats.get("sent", 0) == 0


@pytest.mark.parametrize("attributes, reason", [
    ({"phasewatch.emission_offsets_ns": [5, -1]}, "bad_emission_times"),
    ({"phasewatch.emission_offsets_ns": [10 ** 12]}, "bad_emission_times"),
    ({"phasewatch.emission_offsets_ns": "1,2"}, "bad_emission_times"),
    ({"phasewatch.emission_tokens": [-1]}, "bad_emission_tokens"),
    ({"phasewatch.choice": -1}, "bad_choice"),
])
def test_a_hostile_tap_span_is_rejected_with_its_reason(attributes, reason):
    ex = Exporter(CONFIG).start()
    try:
        (_, _, kwargs), = tapped(1, seed=4)
        span = to_span(MODEL, kwargs, "tap", Resource.create({}))
        span._attributes = {**span.attributes, **attributes}
        send_engine(ex, [span])
        s = wait_for(lambda: (lambda sc: sc if sc.value("phasewatch_ingest_rejected_total",
                                                        reason=reason) else None)(
            scrape(ex.http_port)), timeout=10)
        assert s and s.value("phasewatch_ingest_rejected_total", reason=reason) == 1
        assert rows(ex) == []
    finally:
        ex.stop(grace=1)


def test_a_tap_span_stands_for_one_request_whatever_ratio_is_configured():
    """--trace-sample-ratio 0.25 weighs an engine's span 4 (its trace was sampled); the
    tap's span of another request, sent the same way, is one request: the tap records
    every request it passes."""
    ex = Exporter(replace(CONFIG, trace_sample_ratio=0.25)).start()
    try:
        (_, _, kwargs), (r2, _, _) = tapped(2, seed=6)
        send_engine(ex, [to_span(MODEL, kwargs, "tap", Resource.create({}))])
        send_engine(ex, engine_spans([(r2, {}, {})]))  # no traceparent: alone at once
        def by_source() -> dict:
            out: dict = {}
            for x in scrape(ex.http_port).samples:
                if x.name == "phasewatch_requests_total":
                    out[x.labels["source"]] = out.get(x.labels["source"], 0.0) + x.value
            return out

        total = wait_for(lambda: (lambda t: t if len(t) == 2 else None)(by_source()),
                         timeout=15)
        assert total == {"tap": 1.0, "engine": 4.0}, by_source()
    finally:
        ex.stop(grace=1)
