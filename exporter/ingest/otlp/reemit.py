"""Prefill and decode spans out: each request re-emitted as queue/prefill/decode children.

With ``--otlp-export-endpoint``, every request span accepted over OTLP gets three
child spans under its own context (same trace id, the request span as parent):
``queue`` [arrival, scheduled], ``prefill`` [scheduled, first token] and
``decode`` [first token, last token], carrying the token counts and the model, so
Jaeger or Tempo shows where each request spent its time. They go through the
OpenTelemetry SDK's batch processor and OTLP exporter: bounded, non-blocking
(spans past the queue are dropped by the SDK, which logs it), retried by the SDK.
An endpoint given as an ``http(s)://.../v1/traces`` URL uses OTLP/HTTP, else
``host:port`` OTLP/gRPC.
"""

from __future__ import annotations

import itertools

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

# (name, start, end): indexes into (arrival, scheduled, first token, last token)
PHASES = (("queue", 0, 1), ("prefill", 1, 2), ("decode", 2, 3))


class PhaseSpanEmitter:
    def __init__(self, endpoint: str, max_queue_size: int = 16384):
        if endpoint.startswith(("http://", "https://")):
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter,
            )

            exporter = OTLPSpanExporter(endpoint=endpoint)
        else:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter,
            )

            exporter = OTLPSpanExporter(endpoint=endpoint, insecure=True)
        self._tp = TracerProvider(resource=Resource.create({"service.name": "phasewatch"}))
        self._tp.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=max_queue_size))
        self._tracer = self._tp.get_tracer("phasewatch")

    def emit(self, ids: list[tuple[bytes, bytes]], batch) -> int:
        """Children for each (trace id, span id) and its row of ``batch`` (a
        ``RequestBatch``, times in ns) whose clocks are complete and in order; returns how
        many requests got them."""
        done = 0
        strings = batch.strings
        columns = (batch.arrival, batch.scheduled, batch.first_token, batch.last_token)
        for i, (trace_id, span_id) in enumerate(ids):
            times = [int(c[i]) for c in columns]
            if not all(times) or any(b < a for a, b in itertools.pairwise(times)):
                continue
            parent = trace.set_span_in_context(NonRecordingSpan(SpanContext(
                int.from_bytes(trace_id), int.from_bytes(span_id), is_remote=True,
                trace_flags=TraceFlags(TraceFlags.SAMPLED))))
            attributes = {"gen_ai.request.model": strings[batch.model[i]],
                          "phasewatch.engine": strings[batch.engine[i]]}
            for key, column in (("gen_ai.usage.input_tokens", batch.prompt_tokens),
                                ("gen_ai.usage.cache_read.input_tokens",
                                 batch.cached_prompt_tokens),
                                ("gen_ai.usage.output_tokens", batch.output_tokens)):
                if column[i] >= 0:
                    attributes[key] = int(column[i])
            for name, a, b in PHASES:
                span = self._tracer.start_span(name, context=parent, start_time=times[a],
                                               attributes={**attributes,
                                                           "phasewatch.phase": name})
                span.end(end_time=times[b])
            done += 1
        return done

    def shutdown(self, timeout: float = 5.0) -> None:
        self._tp.force_flush(int(timeout * 1000))
        self._tp.shutdown()
