"""At the in-flight limit, every receiver answers with their protocol's retryable error."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from dataclasses import replace

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from phasewatch.app import Exporter
from phasewatch.config import ServeConfig
from tests.conftest import TEST_PORTS
from tests.ingest.test_otlp import _request_bytes


@pytest.fixture
def held():
    """An exporter whose single OTLP slot is held by an export parked inside ingest."""
    ex = Exporter(replace(ServeConfig(**TEST_PORTS), max_in_flight=1)).start()
    inside, release = threading.Event(), threading.Event()
    real = ex.otlp.export

    def parked(msg, protocol):
        inside.set()
        release.wait(10)
        return real(msg, protocol)

    ex.otlp.export = parked
    yield ex, inside, release
    release.set()
    ex.stop(grace=1)


def _post(ex, body):
    req = urllib.request.Request(f"http://127.0.0.1:{ex.otlp_http_port}/v1/traces", data=body,
                                 headers={"Content-Type": "application/x-protobuf"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def test_http_503_with_retry_after_then_accepts(held):
    ex, inside, release = held
    body = _request_bytes("vllm", [])
    first = threading.Thread(target=_post, args=(ex, body))
    first.start()
    assert inside.wait(5)
    code, headers, payload = _post(ex, body)
    assert code == 503 and headers["Retry-After"] == "1"
    assert status_pb2.Status.FromString(payload).code == 14  # UNAVAILABLE
    release.set()
    first.join(10)
    assert _post(ex, body)[0] == 200


def test_grpc_unavailable_with_retry_info(held):
    ex, inside, release = held
    with grpc.insecure_channel(f"127.0.0.1:{ex.otlp_grpc_port}") as ch:
        call = ch.unary_unary("/opentelemetry.proto.collector.trace.v1.TraceService/Export")
        body = _request_bytes("vllm", [])
        first = call.future(body, timeout=10)
        assert inside.wait(5)
        with pytest.raises(grpc.RpcError) as e:
            call(body, timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        trailers = dict(e.value.trailing_metadata())
        retry = error_details_pb2.RetryInfo.FromString(trailers["google.rpc.retryinfo-bin"])
        assert retry.retry_delay.seconds == 1
        status = status_pb2.Status.FromString(trailers["grpc-status-details-bin"])
        assert status.code == 14 and status.details[0].Is(error_details_pb2.RetryInfo.DESCRIPTOR)
        release.set()
        first.result(10)


def test_the_sdk_exporter_retries_and_nothing_is_lost(held):
    import time

    from opentelemetry.sdk.trace.export import SpanExportResult
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from phasewatch.sim.scenarios import scenario
    from tests.conftest import scrape
    from tests.ingest.test_otlp import _grpc, _send

    ex, inside, release = held
    records = scenario("chat").build(seed=4).run(5.0, epoch=time.time() - 10)
    mem = InMemorySpanExporter()
    _send("vllm", mem, records)
    channel = grpc.insecure_channel(f"127.0.0.1:{ex.otlp_grpc_port}")
    blocker = channel.unary_unary(
        "/opentelemetry.proto.collector.trace.v1.TraceService/Export").future(
        _request_bytes("vllm", []), timeout=15)  # holds the gRPC receiver's only slot
    assert inside.wait(5)
    result = []
    sender = threading.Thread(target=lambda: result.append(
        _grpc(ex).export(mem.get_finished_spans())))
    sender.start()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not scrape(ex.http_port).value(
            "phasewatch_ingest_batches_total", protocol="otlp_grpc", outcome="overloaded"):
        time.sleep(0.05)
    release.set()  # the SDK backs off (RetryInfo: 1 s) and tries again
    sender.join(15)
    blocker.result(5)
    channel.close()
    assert result == [SpanExportResult.SUCCESS]
    s = scrape(ex.http_port)
    assert s.value("phasewatch_ingest_batches_total", protocol="otlp_grpc",
                   outcome="overloaded") >= 1
    assert s.total("gen_ai_server_request_duration_seconds_count") == len(records)
