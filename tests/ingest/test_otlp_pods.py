"""A central (gateway) exporter labels series with the pod from the OTLP resource, capped."""

from __future__ import annotations

import time
from dataclasses import replace

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from phasewatch.app import Exporter
from phasewatch.config import ServeConfig
from phasewatch.sim import otlp_shapes
from phasewatch.sim.scenarios import scenario
from tests.conftest import TEST_PORTS, scrape
from tests.ingest.test_otlp import _grpc


def _send_from(ex, pod_attrs: dict, records) -> None:
    tp = TracerProvider(resource=Resource.create({"service.name": "vllm", **pod_attrs}))
    tp.add_span_processor(SimpleSpanProcessor(_grpc(ex)))
    tracer = tp.get_tracer("vllm.tracing.otel")
    for r in records:
        otlp_shapes.emit_vllm(tracer, r)
    tp.shutdown()


def test_pods_from_the_resource_with_a_cap():
    records = scenario("chat").build(seed=2).run(4.0, epoch=time.time() - 10)
    config = replace(ServeConfig(**TEST_PORTS), pod_label=True, max_pods=2,
                     default_model="llama")
    with Exporter(config) as ex:
        _send_from(ex, {"k8s.pod.name": "vllm-0"}, records)
        _send_from(ex, {"service.instance.id": "vllm-1"}, records)
        _send_from(ex, {"k8s.pod.name": "vllm-2"}, records)  # past the cap
        s = scrape(ex.http_port)
        n = len(records)
        for pod in ("vllm-0", "vllm-1", "__overflow__"):
            assert s.value("gen_ai_server_request_duration_seconds_count", model="llama",
                           engine="vllm", pod=pod) == n
        assert s.value("phasewatch_ingest_label_overflow_total", label="pod",
                       reason="too_many_pods") == n


def test_a_sidecar_has_no_pod_label(exporter):
    records = scenario("chat").build(seed=2).run(2.0, epoch=time.time() - 10)
    _send_from(exporter, {"k8s.pod.name": "vllm-0"}, records)
    s = scrape(exporter.http_port)
    assert all("pod" not in x.labels for x in s.samples
               if x.name == "gen_ai_server_request_duration_seconds_count")
    assert s.total("gen_ai_server_request_duration_seconds_count") == len(records)
