"""OTLP load faster than the SDK can encode it: its own requests, built once, new ids each.

The SDK's exporters encode spans in Python (tens of microseconds a span), so a
load generator that encodes every span is slower than the receiver it measures.
Here one batch of vLLM-shaped spans (the simulator's emitter, as vLLM makes them)
is encoded once by the SDK's own encoder; each ``fresh`` batch is a copy of that
request with new trace and span ids, so every span is a distinct request to the
receiver. The SDK's exporters take it in place of encoding again and keep their
transport, retries and ``RetryInfo`` / ``Retry-After`` handling unchanged. Used by
the overload tests (``tests/support/flood.py``) and the benchmark (``bench/``).
"""

from __future__ import annotations

import random
import time

VLLM_BATCH_SPANS = 512  # the SDK BatchSpanProcessor's default max_export_batch_size


class Batch(list):
    """Spans whose ``ExportTraceServiceRequest`` was built ahead (``request``)."""

    request = None


def template_spans(n: int = VLLM_BATCH_SPANS, tokens: int = 16, seed: int = 7,
                   shape: str = "vllm", **emit):
    """Finished requests' spans from the simulator's emitter: ``n`` vLLM ``llm_request``
    spans, or for another ``shape`` (SGLang's trees) as many requests' spans as fit in
    ``n`` spans; ``emit``: the emitter's options (SGLang's ``level``)."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from phasewatch.requests.record import RequestRecord
    from phasewatch.sim import otlp_shapes

    rng = random.Random(seed)
    now = time.time()
    mem = InMemorySpanExporter()
    tp = otlp_shapes.provider(shape, mem, max_export_batch_size=n, max_queue_size=4 * n)
    tracer = otlp_shapes.tracer_for(tp, shape)
    for i in range(n):
        t0 = now - 5 + rng.random()
        first = t0 + 0.02 + 0.1 * rng.random()
        last = first + 0.02 * (tokens - 1)
        before = len(mem.get_finished_spans())
        otlp_shapes.EMIT[shape](tracer, RequestRecord(
            model="", engine=shape, request_id=f"req-{i}", arrival=t0, queued=t0 + 0.002,
            scheduled=t0 + 0.01, first_token=first, last_token=last, finish=last + 0.001,
            prompt_tokens=200 + i % 800, cached_prompt_tokens=0, output_tokens=tokens,
            finish_reason="stop", token_times=[first + 0.02 * k for k in range(tokens)]),
            **emit)
        tp.force_flush()
        if len(mem.get_finished_spans()) > n:  # this request's spans do not fit: drop them
            tp.shutdown()
            return mem.get_finished_spans()[:before]
    tp.shutdown()
    return mem.get_finished_spans()


class FreshBatches:
    """Batches of the template spans with new ids every time (``next()``)."""

    def __init__(self, templates, seed: int = 0):
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

        self._templates = templates
        self._request = encode_spans(templates)
        self._rng = random.Random(seed)

    def __len__(self) -> int:
        return len(self._templates)

    def next(self) -> Batch:
        request = type(self._request)()
        request.CopyFrom(self._request)
        rand = self._rng.randbytes
        traces: dict[bytes, bytes] = {}  # a request's tree keeps its shape under new ids
        spans: dict[bytes, bytes] = {b"": b""}
        for rs in request.resource_spans:
            for ss in rs.scope_spans:
                for span in ss.spans:
                    old = span.trace_id
                    span.trace_id = traces.get(old) or traces.setdefault(old, rand(16))
                    sid = span.span_id
                    span.span_id = spans.get(sid) or spans.setdefault(sid, rand(8))
                    if span.parent_span_id:
                        p = span.parent_span_id
                        span.parent_span_id = spans.get(p) or spans.setdefault(p, rand(8))
        batch = Batch(self._templates)
        batch.request = request
        return batch


def _prebuilt(encode):
    return lambda spans: spans.request if isinstance(spans, Batch) else encode(spans)


def grpc_exporter(target: str, interceptor=None, timeout: float = 30):
    """The SDK's OTLP/gRPC span exporter, taking ``Batch`` requests as built;
    ``interceptor`` (a grpc client interceptor) watches its calls."""
    import grpc
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    class Prebuilt(OTLPSpanExporter):
        def _translate_data(self, data):
            return data.request if isinstance(data, Batch) else super()._translate_data(data)

        def _initialize_channel_and_stub(self):
            super()._initialize_channel_and_stub()
            if interceptor is not None:
                self._client = self._stub(grpc.intercept_channel(self._channel, interceptor))

    return Prebuilt(endpoint=target, insecure=True, timeout=timeout)


def http_exporter(target: str, session=None, timeout: float = 30):
    """The SDK's OTLP/HTTP span exporter (``target`` a ``.../v1/traces`` URL), taking
    ``Batch`` requests as built; ``session`` (a requests Session) may watch replies."""
    from opentelemetry.exporter.otlp.proto.http import trace_exporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    if not hasattr(trace_exporter.encode_spans, "prebuilt"):
        trace_exporter.encode_spans = _prebuilt(trace_exporter.encode_spans)
        trace_exporter.encode_spans.prebuilt = True
    return OTLPSpanExporter(endpoint=target, session=session, timeout=timeout)
