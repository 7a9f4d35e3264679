"""OTLP/gRPC ``TraceService/Export`` (default port 4317), per the OTLP specification.

Success is an empty response; unusable spans give ``partial_success`` with
``rejected_spans`` and a message (the client must not retry those). An
undecodable payload is ``INVALID_ARGUMENT``, and so is one over 64 MiB (counted;
past 68 MiB grpc itself refuses it with ``RESOURCE_EXHAUSTED``); when the admission
gate refuses (in-flight or memory limit) the answer is ``UNAVAILABLE`` with a
``google.rpc.RetryInfo`` (in ``grpc-status-details-bin`` and the
``google.rpc.retryinfo-bin`` trailer the OTel SDK reads), so the SDK's exporter
retries instead of dropping. gzip request compression is handled by grpc.
"""

from __future__ import annotations

import grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from phasewatch.ingest.otlp.ingest import OtlpIngest
from phasewatch.ingest.otlp.spans import MalformedPayload, parse_request
from phasewatch.transport.admission import Admission
from phasewatch.transport.grpc import gated, identity, serve_grpc

SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"
PROTOCOL = "otlp_grpc"


def export_response(outcome) -> ExportTraceServiceResponse:
    """Empty on full success; ``partial_success`` with the rejected spans and reasons."""
    resp = ExportTraceServiceResponse()
    if outcome.rejected:
        resp.partial_success.rejected_spans = outcome.rejected_spans
        resp.partial_success.error_message = outcome.message()
    return resp


class OtlpGrpcService:
    def __init__(self, ingest: OtlpIngest, admission: Admission):
        self._ingest = ingest
        self._stats = ingest.stats
        self._admission = admission

    def export(self, request: bytes, context) -> bytes:
        return gated(self._stats, self._admission, PROTOCOL, request, context, self._export)

    def _export(self, request: bytes, context) -> bytes:
        try:
            msg = parse_request(request)
        except MalformedPayload as e:
            self._stats.inc("phasewatch_ingest_batches_total", protocol=PROTOCOL,
                            outcome="malformed")
            self._stats.inc("phasewatch_ingest_rejected_total", protocol=PROTOCOL,
                            reason="undecodable_payload")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        outcome = self._ingest.export(msg, PROTOCOL)
        self._stats.inc("phasewatch_ingest_batches_total", protocol=PROTOCOL, outcome="ok")
        return export_response(outcome).SerializeToString()


def start_otlp_grpc_server(service: OtlpGrpcService, host: str, port: int | None,
                           max_workers: int = 8, interceptors=()) -> tuple[grpc.Server, int]:
    handlers = grpc.method_handlers_generic_handler(SERVICE, {
        "Export": grpc.unary_unary_rpc_method_handler(
            service.export, request_deserializer=identity, response_serializer=identity)})
    return serve_grpc(handlers, host, port, max_workers, "otlp", interceptors)
