"""Nothing counted twice: replies lost after the exporter processed the batch.

Each real client talks to the exporter through ``tests.support.faultproxy``, which cuts the
connection (or holds the reply past the client's deadline) after the exporter has
ingested the batch and answered. The client retries the same batch; the exporter
recognises it (phasewatch batch ids, OTLP trace and span ids) and counts it once. The
faults must actually have happened, and the duplicates must have been seen.
"""

from __future__ import annotations

import time

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from phasewatch.client import PhasewatchClient
from phasewatch.sim.scenarios import scenario
from tests.conftest import scrape
from tests.ingest.test_otlp import _send
from tests.support.faultproxy import FaultProxy

BATCHES, PER_BATCH = 30, 10


@pytest.fixture(scope="module")
def records():
    recs = scenario("chat").build(seed=11).run(70.0, epoch=time.time() - 120)
    assert len(recs) >= BATCHES * PER_BATCH
    return recs[:BATCHES * PER_BATCH]


@pytest.mark.parametrize("fault", ["cut", "held"])
def test_phasewatch_client_retries_are_counted_once(exporter, records, fault):
    faults = dict(cut=0.3) if fault == "cut" else dict(hold=0.3, delay=0.6)
    with FaultProxy(exporter.grpc_port, seed=1, **faults) as proxy:
        client = PhasewatchClient(f"127.0.0.1:{proxy.port}", engine="vllm", timeout=0.3,
                                  initial_backoff=0.05, max_backoff=0.5)
        for i in range(BATCHES):
            for r in records[i * PER_BATCH:(i + 1) * PER_BATCH]:
                client.record_request(r)
            assert client.flush(timeout=30)
        client.close(timeout=10)
    m = scrape(exporter.http_port)
    assert proxy.faults[fault] >= 3, proxy.faults
    assert client.stats["retries"] >= proxy.faults[fault]
    assert m.value("phasewatch_ingest_batches_total", protocol="phasewatch",
                   outcome="duplicate") >= 1
    # the client's tally and the exporter's agree exactly: each request once
    assert client.stats["accepted"] == len(records)
    assert m.total("gen_ai_server_request_duration_seconds_count") == len(records)
    assert m.value("phasewatch_ingest_accepted_total", protocol="phasewatch") == len(records)


@pytest.mark.parametrize("protocol", ["otlp_grpc", "otlp_http"])
def test_sdk_exporter_retries_are_counted_once(exporter, records, protocol):
    mem = InMemorySpanExporter()
    _send("vllm", mem, records)
    spans = mem.get_finished_spans()
    port = exporter.otlp_grpc_port if protocol == "otlp_grpc" else exporter.otlp_http_port
    with FaultProxy(port, cut=0.3, seed=2, h2=protocol == "otlp_grpc") as proxy:
        sdk = (Grpc(endpoint=f"127.0.0.1:{proxy.port}", insecure=True, timeout=30)
               if protocol == "otlp_grpc" else
               Http(endpoint=f"http://127.0.0.1:{proxy.port}/v1/traces", timeout=30))
        results = [sdk.export(spans[i:i + PER_BATCH]) for i in range(0, len(spans), PER_BATCH)]
        sdk.shutdown()
    assert results == [SpanExportResult.SUCCESS] * BATCHES
    m = scrape(exporter.http_port)
    assert proxy.faults["cut"] >= 3, proxy.faults
    assert m.value("phasewatch_otlp_spans_total", protocol=protocol,
                   outcome="duplicate") >= PER_BATCH  # at least one whole batch came again
    assert m.value("phasewatch_otlp_spans_total", protocol=protocol,
                   outcome="request") == len(records)
    assert m.total("gen_ai_server_request_duration_seconds_count") == len(records)
