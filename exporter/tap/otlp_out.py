"""The tap's records as OTLP spans (``phasewatch tap --otlp-endpoint``), for a fleet.

A tap sends its records over phasewatch gRPC to one exporter. In a fleet the engine's
spans go through the OpenTelemetry Collector, whose load-balancing exporter routes each
trace to one replica, and a tap record must reach that same replica to be joined with
them: so the tap sends them to the Collector as spans of the same trace
(``ingest.adapters.tap``, where the shape is read back), one per choice, and the
Collector routes them with the rest.

``OtlpRecorder`` is ``Tap``'s record callback: spans gather here and go out through the
OpenTelemetry SDK's own OTLP exporter (gRPC for ``host:port``, HTTP for an
``http(s)://.../v1/traces`` URL; it retries by itself within its timeout) from a thread
of its own, never from the tap's event loop. Its ``stats`` have the client's keys (sent,
accepted, dropped_<reason>), so the tap's counts read either: past ``max_buffer``
waiting records ``buffer_full``, after ``close()`` ``closed``, a record that cannot be a
span ``invalid``, a batch the exporter could not deliver ``export_failed``.
"""

from __future__ import annotations

import logging
import secrets

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, TraceFlags, TraceState

from phasewatch.ingest.adapters import tap as shape
from phasewatch.requests.record import NS, TAP_TRACESTATE_KEY
from phasewatch.tap.recorder import BufferedRecorder

log = logging.getLogger(__name__)

SCOPE = InstrumentationScope("phasewatch.tap")
MAX_BATCH = 512  # spans per export (the SDK batch processor's default)


def span_exporter(endpoint: str, *, token: str = "", tls=None,
                  timeout: float = 30.0) -> SpanExporter:
    """The SDK's OTLP exporter for ``endpoint``: an ``http(s)://`` URL is OTLP/HTTP (the
    full path, e.g. ``http://collector:4318/v1/traces``), ``host:port`` OTLP/gRPC
    (plain, or TLS with ``tls``'s CA, and its client certificate for mutual TLS).
    ``token``: sent as ``authorization: Bearer``, as phasewatch's receivers take it."""
    headers = {"authorization": f"Bearer {token}"} if token else None
    if endpoint.startswith(("http://", "https://")):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint, headers=headers, timeout=timeout,
                                certificate_file=(tls.ca or None) if tls else None,
                                client_certificate_file=(tls.cert or None) if tls else None,
                                client_key_file=(tls.key or None) if tls else None)
    if "/" in endpoint or ":" not in endpoint:
        raise ValueError(f"--otlp-endpoint takes host:port (OTLP/gRPC) or an http(s):// URL "
                         f"ending in /v1/traces (OTLP/HTTP), got {endpoint!r}")
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    credentials = None
    if tls is not None and tls.ca:
        import grpc

        def read(path: str) -> bytes | None:
            if not path:
                return None
            with open(path, "rb") as f:
                return f.read()

        credentials = grpc.ssl_channel_credentials(read(tls.ca), read(tls.key),
                                                   read(tls.cert))
    return OTLPSpanExporter(endpoint=endpoint, insecure=credentials is None,
                            credentials=credentials, headers=headers, timeout=timeout)


def to_span(model: str, record: dict, engine: str, resource: Resource,
            operation: str = "chat", caller_span: str = "") -> ReadableSpan:
    """One record (``PhasewatchClient.record`` keywords) as the tap's span
    (``ingest.adapters.tap``). Raises ValueError for a record without a traceparent or
    an arrival."""
    trace_hex, _, span_hex = (record.get("trace_parent") or "").partition("-")
    if len(trace_hex) != 32 or len(span_hex) != 16 or record.get("arrival") is None:
        raise ValueError("a tap record needs its traceparent and arrival to be a span")
    trace_id, tap_span = int(trace_hex, 16), int(span_hex, 16)
    choice = record.get("choice") or 0
    start = round(record["arrival"] * NS)
    ends = [t for t in (record.get("finish"), record.get("last_token")) if t is not None]
    end = max(start, round(max(ends) * NS)) if ends else start
    # the first choice is the span the tap's traceparent named (the engine's span is its
    # child); a further one a child of it, with an id of its own
    own = tap_span if not choice else secrets.randbits(64)
    parent_id = tap_span if choice else (int(caller_span, 16) if caller_span else 0)
    # the tap records every request: its span stands for one, whatever the caller's trace
    # was sampled at (its own tracestate member only: no ot=th of the caller's)
    state = TraceState([(TAP_TRACESTATE_KEY, "tap")])
    context = SpanContext(trace_id, own or 1, is_remote=False,
                          trace_flags=TraceFlags(TraceFlags.SAMPLED), trace_state=state)
    parent = (SpanContext(trace_id, parent_id, is_remote=not choice,
                          trace_flags=TraceFlags(TraceFlags.SAMPLED), trace_state=state)
              if parent_id else None)
    return ReadableSpan(f"{operation} {model}", context=context, parent=parent,
                        resource=resource, kind=SpanKind.CLIENT, start_time=start,
                        end_time=end, instrumentation_scope=SCOPE,
                        attributes=shape.attributes(model, record, engine, operation))


def default_resource() -> Resource:
    """The SDK's resource (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES), its service
    ``phasewatch-tap`` where none is set."""
    found = Resource.create({})
    if str(found.attributes.get("service.name", "")).startswith("unknown_service"):
        found = found.merge(Resource({"service.name": "phasewatch-tap"}))
    return found


class OtlpRecorder(BufferedRecorder):
    """``Tap``'s record callback that sends each record as a span through ``exporter``
    (module docstring), every ``interval`` seconds, at most ``max_batch`` spans an
    export."""

    def __init__(self, exporter: SpanExporter, engine: str, *,
                 resource: Resource | None = None, interval: float = 0.25,
                 max_buffer: int = 100_000, max_batch: int = MAX_BATCH):
        self._exporter, self._engine, self._batch = exporter, engine, max_batch
        # service.name and the pod (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES) as every
        # OpenTelemetry SDK reads them; a fleet's replica labels series with the pod
        self._resource = resource or default_resource()
        super().__init__(interval, max_buffer, "pw-tap-otlp")

    def _item(self, model: str, kwargs: dict, seen) -> ReadableSpan | None:
        try:
            return to_span(model, kwargs, self._engine, self._resource,
                           shape.OPERATIONS.get(getattr(seen, "path", ""), "chat"),
                           getattr(seen, "caller_span", ""))
        except (ValueError, TypeError, OverflowError):
            self.stats["dropped_invalid"] += 1
            return None

    def _send(self, spans: list) -> None:
        for at in range(0, len(spans), self._batch):
            part = spans[at:at + self._batch]
            try:
                result = self._exporter.export(part)
            except Exception:  # a bug in the exporter must not stop the tap: counted
                log.exception("exporting the tap's records failed")
                result = SpanExportResult.FAILURE
            if result is SpanExportResult.SUCCESS:
                self.stats["sent"] += len(part)
                self.stats["accepted"] += len(part)
            else:
                self.stats["dropped_export_failed"] += len(part)
                log.warning("the tap's OTLP exporter could not deliver %d records", len(part))

    def close(self, shutdown_exporter: bool = True) -> None:
        """Send what is waiting (the exporter retries for up to its timeout), then drop
        (and count) what comes after; the exporter is shut down too unless it is someone
        else's (``shutdown_exporter=False``)."""
        super().close(timeout=60)
        if shutdown_exporter:
            self._exporter.shutdown()
