"""--otlp-export-endpoint: every OTLP request comes back out as queue/prefill/decode spans."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import replace

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from phasewatch.app import Exporter
from phasewatch.config import ServeConfig
from phasewatch.sim.scenarios import scenario
from tests.conftest import TEST_PORTS
from tests.ingest.test_otlp import _grpc, _send


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """A second, in-test OTLP receiver: keeps every span it is sent."""

    def __init__(self):
        self.spans = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for rs in request.resource_spans:
                for ss in rs.scope_spans:
                    self.spans.extend(ss.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
def collector():
    c = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(c, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield c, port
    server.stop(1).wait(1)


def test_each_request_becomes_a_trace_of_its_phases(collector):
    sink, port = collector
    records = scenario("chat").build(seed=9).run(15.0, epoch=time.time() - 20.0)
    config = replace(ServeConfig(**TEST_PORTS), otlp_export_endpoint=f"127.0.0.1:{port}")
    with Exporter(config) as ex:
        _send("vllm", _grpc(ex), records)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and len(sink.spans) < 3 * len(records):
            time.sleep(0.2)
    children = {}
    for s in sink.spans:
        children.setdefault((s.trace_id, s.parent_span_id), {})[s.name] = s
    assert len(children) == len(records)
    for kids in children.values():
        assert set(kids) == {"queue", "prefill", "decode"}
        q, p, d = kids["queue"], kids["prefill"], kids["decode"]
        assert q.end_time_unix_nano == p.start_time_unix_nano
        assert p.end_time_unix_nano == d.start_time_unix_nano
    # the children sum to each request's e2e (vLLM's e2e ends at the last token)
    by_start = sorted(children.values(), key=lambda k: k["queue"].start_time_unix_nano)
    for r, kids in zip(sorted(records, key=lambda r: r.arrival), by_start, strict=True):
        total = sum(k.end_time_unix_nano - k.start_time_unix_nano for k in kids.values()) / 1e9
        assert total == pytest.approx(r.last_token - r.arrival, abs=2e-6)
        attrs = {a.key: a.value for a in kids["decode"].attributes}
        assert attrs["gen_ai.usage.output_tokens"].int_value == r.output_tokens
