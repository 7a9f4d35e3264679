"""The baseline: the OTLP-to-Prometheus exporter a user would write first.

An OTLP/gRPC ``TraceService`` from the generated stubs (grpc decodes the request),
a loop over the spans, and for each vLLM ``llm_request`` span one record per
histogram and counter through the OpenTelemetry SDK's metrics API, read out by the
SDK's Prometheus reader on a prometheus_client HTTP server. The same figures
phasewatch derives from that span: TTFT, time in queue, prefill and decode,
end-to-end latency, time per output token, prompt and completion tokens and
finished requests, per model; with the same TTFT and token-latency buckets.

    python bench/baseline_exporter.py   # prints "baseline gRPC on :P metrics on :Q"

``make bench`` runs it pinned to the same core as phasewatch, on the same load.
"""

from __future__ import annotations

import signal
import sys
import threading
from concurrent import futures
from pathlib import Path

import grpc
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from prometheus_client import start_http_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from phasewatch.requests import buckets


def value(v):
    return getattr(v, v.WhichOneof("value"))


class TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, meter):
        seconds = "s"
        self.ttft = meter.create_histogram("llm_time_to_first_token", unit=seconds)
        self.queue = meter.create_histogram("llm_time_in_queue", unit=seconds)
        self.prefill = meter.create_histogram("llm_prefill_time", unit=seconds)
        self.decode = meter.create_histogram("llm_decode_time", unit=seconds)
        self.e2e = meter.create_histogram("llm_e2e_request_latency", unit=seconds)
        self.tpot = meter.create_histogram("llm_time_per_output_token", unit=seconds)
        self.prompt = meter.create_counter("llm_prompt_tokens")
        self.completion = meter.create_counter("llm_completion_tokens")
        self.requests = meter.create_counter("llm_requests")

    def Export(self, request, context):
        for rs in request.resource_spans:
            resource = {kv.key: value(kv.value) for kv in rs.resource.attributes}
            model = resource.get("service.name", "unknown")
            for ss in rs.scope_spans:
                for span in ss.spans:
                    if span.name != "llm_request":
                        continue
                    a = {kv.key: value(kv.value) for kv in span.attributes}
                    labels = {"model": model, "engine": "vllm"}
                    self.ttft.record(a["gen_ai.latency.time_to_first_token"], labels)
                    self.queue.record(a["gen_ai.latency.time_in_queue"], labels)
                    self.prefill.record(a["gen_ai.latency.time_in_model_prefill"], labels)
                    decode = a["gen_ai.latency.time_in_model_decode"]
                    self.decode.record(decode, labels)
                    self.e2e.record(a["gen_ai.latency.e2e"], labels)
                    out = a["gen_ai.usage.completion_tokens"]
                    if out > 1:
                        self.tpot.record(decode / (out - 1), labels)
                    self.prompt.add(a["gen_ai.usage.prompt_tokens"], labels)
                    self.completion.add(out, labels)
                    self.requests.add(1, labels)
        return trace_service_pb2.ExportTraceServiceResponse()


def main() -> int:
    reader = PrometheusMetricReader()
    views = [View(instrument_name=name, aggregation=ExplicitBucketHistogramAggregation(
        bucket_set.bounds)) for name, bucket_set in (
            ("llm_time_to_first_token", buckets.TTFT),
            ("llm_time_per_output_token", buckets.TOKEN_LATENCY),
            ("llm_e2e_request_latency", buckets.REQUEST_DURATION),
            ("llm_time_in_queue", buckets.PHASE_DURATION),
            ("llm_prefill_time", buckets.PHASE_DURATION),
            ("llm_decode_time", buckets.PHASE_DURATION))]
    provider = MeterProvider(metric_readers=[reader], views=views)
    meter = provider.get_meter("baseline")
    http_server, _ = start_http_server(0, addr="127.0.0.1")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8),
                         options=[("grpc.max_receive_message_length", 64 << 20)])
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceService(meter), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"baseline gRPC on :{port} metrics on :{http_server.server_port}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    server.stop(1)
    http_server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
