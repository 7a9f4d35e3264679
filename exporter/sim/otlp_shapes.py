"""Simulated requests as the real servers' OpenTelemetry spans, through the SDK.

Each ``emit_*`` creates the spans one server's own tracing code creates for a
finished request (docs/engines.md; sources below), with an OpenTelemetry SDK tracer, so
the SDK's own OTLP exporters carry them: used by ``phasewatch simulate --protocol
otlp`` and by the tests as real clients.

* vLLM V1 (``vllm/v1/engine/output_processor.py``): one ``llm_request`` SERVER span
  started at arrival, float-second latencies, no model attribute.
* SGLang 0.5.23 (``tests/fixtures/otlp/engines/sglang-0.5.23``): the tokenizer's root
  span ``" Req <rid[:8]>"`` with ``gen_ai.*`` latencies, cached tokens and finish
  reasons as a JSON list; thread spans and the scheduler's stage spans under it.
* TGI v3.3.7 (from its source; ``tests/fixtures/otlp/engines/tgi-3.3.7-from-source``):
  the router's handler span ``generate_stream`` with Rust ``Duration`` strings, and in
  its trace ``schedule`` > ``queued`` (enqueue -> scheduled) and ``infer`` (linked to
  the step's root ``batch`` span) > one ``send_generation`` per token; every span is
  INTERNAL and names its Rust module in ``code.namespace``.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Link, SpanKind

from phasewatch.requests.record import RequestRecord
from phasewatch.transport.auth import HEADER, bearer

NS = 1_000_000_000
SHAPES = ("vllm", "sglang", "tgi")


def _ns(t: float) -> int:
    return round(t * NS)


def emit_vllm(tracer, r: RequestRecord) -> None:
    arrival = _ns(r.arrival)
    with tracer.start_as_current_span("llm_request", kind=SpanKind.SERVER, start_time=arrival,
                                      end_on_exit=False) as span:
        span.set_attribute("gen_ai.latency.time_to_first_token", r.first_token - r.arrival)
        # vLLM's e2e runs to the engine step that finished the request: its last token
        span.set_attribute("gen_ai.latency.e2e", r.last_token - r.arrival)
        # the engine core's own queue: scheduled - queued (vllm/v1/metrics/stats.py)
        span.set_attribute("gen_ai.latency.time_in_queue", r.scheduled - (r.queued or r.arrival))
        span.set_attribute("gen_ai.usage.prompt_tokens", r.prompt_tokens)
        span.set_attribute("gen_ai.usage.completion_tokens", r.output_tokens)
        span.set_attribute("gen_ai.latency.time_in_model_prefill", r.first_token - r.scheduled)
        span.set_attribute("gen_ai.latency.time_in_model_decode", r.last_token - r.first_token)
        span.set_attribute("gen_ai.latency.time_in_model_inference", r.last_token - r.scheduled)
        span.set_attribute("gen_ai.request.id", r.request_id)
        span.set_attribute("gen_ai.request.max_tokens", r.output_tokens)
        span.end(end_time=_ns(r.last_token))


def emit_sglang(tracer, r: RequestRecord, level: int = 3) -> None:
    """One request as SGLang 0.5.23 traces it unified at SGLANG_TRACE_LEVEL ``level``
    (``tests/fixtures/otlp/engines/sglang-0.5.23``): all INTERNAL; the tokenizer's root
    ``" Req <rid[:8]>"``; under it a thread span per process (``thread_label``), and
    under those the stages: ``tokenize``, ``prefill_waiting`` (queued -> scheduled),
    ``prefill_forward`` (scheduled -> first token) and, at level 3, one ``decode_loop``
    per step."""
    rid = r.request_id.encode().hex()[:32]
    arrival, queued = _ns(r.arrival), _ns(r.queued or r.arrival)
    scheduled, first, last, finish = (_ns(t) for t in (r.scheduled, r.first_token,
                                                       r.last_token, r.finish))
    root = tracer.start_span(f" Req {rid[:8]}", start_time=arrival,
                             context=trace.set_span_in_context(trace.INVALID_SPAN),
                             attributes={"rid": rid, "module": "sglang::request"})
    in_root = trace.set_span_in_context(root)
    tok = tracer.start_span("Tokenizer(host:sim | pid:1)", start_time=arrival, context=in_root,
                            attributes={"thread_label": "Tokenizer", "pid": 1})
    tracer.start_span("tokenize", start_time=arrival, context=trace.set_span_in_context(
        tok)).end(end_time=queued)
    tok.end(end_time=queued)
    sched = tracer.start_span("Scheduler [TP 0]  [PP 0] (host:sim | pid:2)", start_time=queued,
                              context=in_root, attributes={"thread_label": "Scheduler",
                                                           "pid": 2, "tp_rank": 0})
    in_sched = trace.set_span_in_context(sched)
    tracer.start_span("prefill_waiting", start_time=queued, context=in_sched).end(
        end_time=scheduled)
    tracer.start_span("prefill_forward", start_time=scheduled, context=in_sched).end(
        end_time=first)
    times = [_ns(t) for t in r.token_times] if r.token_times else [first, last]
    for i, (a, b) in enumerate(itertools.pairwise(times) if level >= 3 else ()):
        tracer.start_span("decode_loop", start_time=a, context=in_sched,
                          attributes={"decode_ct": i}).end(end_time=b)
    sched.end(end_time=last)
    for key, value in (
            ("gen_ai.latency.time_to_first_token", r.first_token - r.arrival),
            ("gen_ai.latency.e2e", r.finish - r.arrival),
            # SGLang's: from the API server's dispatch, so it holds the scheduler's queue
            ("gen_ai.latency.time_in_model_prefill", r.first_token - (r.queued or r.arrival)),
            ("gen_ai.latency.time_in_model_decode", r.finish - r.first_token),
            ("gen_ai.latency.time_in_model_inference", r.finish - (r.queued or r.arrival)),
            ("gen_ai.usage.prompt_tokens", r.prompt_tokens),
            ("gen_ai.usage.completion_tokens", r.output_tokens),
            ("gen_ai.usage.cached_tokens", r.cached_prompt_tokens or 0),
            ("gen_ai.request.id", r.request_id), ("gen_ai.response.model", r.model),
            ("gen_ai.response.finish_reasons", json.dumps([r.finish_reason]))):
        root.set_attribute(key, value)
    root.end(end_time=finish)


def rust_duration(seconds: float) -> str:
    """Rust's ``{:?}`` of a Duration: the largest unit keeping an integer part."""
    ns = round(seconds * NS)
    for unit, scale in (("s", NS), ("ms", 10**6), ("µs", 10**3)):
        if ns >= scale:
            whole, frac = divmod(ns, scale)
            digits = len(str(scale)) - 1
            return f"{whole}.{frac:0{digits}d}".rstrip("0").rstrip(".") + unit
    return f"{ns}ns"


def emit_tgi(tracer, r: RequestRecord) -> None:
    """One request as TGI's router traces it (one batch span for the whole request:
    the real router opens one per engine step, which phasewatch does not read)."""
    arrival, queued = r.arrival, r.queued or r.arrival
    router = {"code.namespace": "text_generation_router::server"}
    backend = {"code.namespace": "text_generation_router_v3::backend"}
    request = tracer.start_span("generate_stream", start_time=_ns(arrival), attributes=router,
                                context=trace.set_span_in_context(trace.INVALID_SPAN))
    in_request = trace.set_span_in_context(request)
    schedule = tracer.start_span("schedule", start_time=_ns(queued), attributes=backend,
                                 context=in_request)
    in_schedule = trace.set_span_in_context(schedule)
    tracer.start_span("queued", start_time=_ns(queued), context=in_schedule, attributes={
        "code.namespace": "text_generation_router_v3::queue"}).end(end_time=_ns(r.scheduled))
    batch = tracer.start_span("batch", start_time=_ns(r.scheduled), attributes={
        **backend, "batch_size": "1"}, context=trace.set_span_in_context(trace.INVALID_SPAN))
    infer = tracer.start_span("infer", start_time=_ns(r.scheduled), attributes=backend,
                              context=in_schedule, links=[Link(batch.get_span_context())])
    for t in r.token_times or (r.first_token, r.last_token):
        tracer.start_span("send_generation", start_time=_ns(t), attributes=backend,
                          context=trace.set_span_in_context(infer)).end(end_time=_ns(t) + 1000)
    infer.end(end_time=_ns(r.last_token) + 2000)
    batch.end(end_time=_ns(r.last_token) + 2000)
    schedule.end(end_time=_ns(r.last_token) + 3000)
    inference = r.last_token - r.scheduled
    request.set_attribute("parameters", f"GenerateParameters {{ max_new_tokens: Some("
                                        f"{r.output_tokens}) }}")
    request.set_attribute("total_time", rust_duration(r.finish - arrival))
    request.set_attribute("validation_time", rust_duration(queued - arrival))
    request.set_attribute("queue_time", rust_duration(r.scheduled - queued))
    request.set_attribute("inference_time", rust_duration(inference))
    request.set_attribute("time_per_token", rust_duration(inference / r.output_tokens))
    request.set_attribute("seed", "None")
    request.end(end_time=_ns(r.finish))


EMIT = {"vllm": emit_vllm, "sglang": emit_sglang, "tgi": emit_tgi}
SERVICE = {"vllm": "vllm", "sglang": "sglang", "tgi": "text-generation-inference.router"}


def provider(shape: str, exporter: SpanExporter, **batch) -> TracerProvider:
    """A tracer provider with the server's resource and a batch processor to ``exporter``."""
    resource = Resource.create({"service.name": SERVICE[shape]} | (
        {"vllm.instrumenting_module_name": "vllm.llm_engine", "vllm.process_id": 1}
        if shape == "vllm" else {}))
    tp = TracerProvider(resource=resource)
    tp.add_span_processor(BatchSpanProcessor(exporter, **batch))
    return tp


def tracer_for(tp: TracerProvider, shape: str):
    return tp.get_tracer("vllm.tracing.otel" if shape == "vllm" else shape)


class _Counting(SpanExporter):
    """Wraps the SDK exporter to count what it delivered (the batch processor only logs)."""

    def __init__(self, inner: SpanExporter, stats):
        self._inner, self._stats = inner, stats

    def export(self, spans):
        result = self._inner.export(spans)
        self._stats["exported" if result == SpanExportResult.SUCCESS else "failed"] += len(spans)
        return result

    def shutdown(self):
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)


class _Ended(SpanProcessor):
    """Counts the spans the shapes made (``stats["spans"]``), to compare with those the
    exporter delivered."""

    def __init__(self, stats: Counter):
        self._stats = stats

    def on_end(self, span) -> None:
        self._stats["spans"] += 1


class OtlpSink:
    """Finished simulated requests out as spans through the SDK's own OTLP exporter.

    ``protocol`` is ``otlp-grpc`` (target ``host:port``) or ``otlp-http`` (target a
    ``http://host:port/v1/traces`` URL). ``stats``: ``sent`` requests emitted, ``spans``
    made for them, ``exported`` / ``failed`` spans the exporter delivered or gave up on.
    """

    def __init__(self, protocol: str, target: str, shape: str = "vllm", token: str = "",
                 tls=None):
        """``tls``: an ``phasewatch.transport.tls.ClientTls`` for an exporter serving TLS."""
        if shape not in EMIT:
            raise ValueError(f"unknown span shape {shape!r}; choose one of {', '.join(EMIT)}")
        # The exporter's --auth-token, as any OTLP exporter sends a bearer token.
        headers = {HEADER: bearer(token)} if token else None
        secure = tls is not None and tls.enabled
        if protocol == "otlp-grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter,
            )

            exporter = OTLPSpanExporter(
                endpoint=target, insecure=not secure, headers=headers,
                credentials=tls.grpc_credentials() if secure else None)
        elif protocol == "otlp-http":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter,
            )

            files = dict(certificate_file=tls.ca or None,
                         client_certificate_file=tls.cert or None,
                         client_key_file=tls.key or None) if secure else {}
            exporter = OTLPSpanExporter(endpoint=target, headers=headers, **files)
        else:
            raise ValueError(f"unknown OTLP protocol {protocol!r}")
        self.shape = shape
        self.stats: Counter = Counter()
        # TGI's shape is one span per token: a queue deep enough for bursts of them
        self._tp = provider(shape, _Counting(exporter, self.stats), schedule_delay_millis=200,
                            max_queue_size=65536)
        self._tp.add_span_processor(_Ended(self.stats))
        self._tracer = tracer_for(self._tp, shape)
        self._emit = EMIT[shape]

    def record_request(self, r: RequestRecord) -> bool:
        self._emit(self._tracer, r)
        self.stats["sent"] += 1
        return True

    def close(self, timeout: float = 10.0) -> bool:
        flushed = self._tp.force_flush(int(timeout * 1000))
        self._tp.shutdown()
        return flushed
