"""OTLP/gRPC ``TraceService/Export`` (default port 4317), per the OTLP specification.

Success is an empty response; unusable spans give ``partial_success`` with
``rejected_spans`` and a message (the client must not retry those). An
undecodable payload is ``INVALID_ARGUMENT``; one over the size limit is refused by
grpc itself with ``RESOURCE_EXHAUSTED``; at the in-flight limit the answer is
``UNAVAILABLE`` with a ``google.rpc.RetryInfo`` (in ``grpc-status-details-bin``
and the ``google.rpc.retryinfo-bin`` trailer the OTel SDK reads), so the SDK's
exporter retries instead of dropping. gzip request compression is handled by grpc.
"""

from __future__ import annotations

import threading

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from exporter.grpc_server import identity, serve_grpc
from exporter.otlp.ingest import OtlpIngest
from exporter.otlp.spans import MalformedPayload, parse_request

SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"
PROTOCOL = "otlp_grpc"
RETRY_AFTER_SECONDS = 1


def export_response(outcome) -> ExportTraceServiceResponse:
    """Empty on full success; ``partial_success`` with the rejected spans and reasons."""
    resp = ExportTraceServiceResponse()
    if outcome.rejected:
        resp.partial_success.rejected_spans = outcome.rejected_spans
        resp.partial_success.error_message = outcome.message()
    return resp


def retry_trailers(message: str) -> tuple:
    retry = error_details_pb2.RetryInfo(
        retry_delay=duration_pb2.Duration(seconds=RETRY_AFTER_SECONDS))
    detail = any_pb2.Any()
    detail.Pack(retry)
    status = status_pb2.Status(code=code_pb2.UNAVAILABLE, message=message, details=[detail])
    return (("google.rpc.retryinfo-bin", retry.SerializeToString()),
            ("grpc-status-details-bin", status.SerializeToString()))


class OtlpGrpcService:
    def __init__(self, ingest: OtlpIngest, max_in_flight: int):
        self._ingest = ingest
        self._stats = ingest.stats
        self._slots = threading.BoundedSemaphore(max_in_flight)

    def export(self, request: bytes, context) -> bytes:
        if not self._slots.acquire(blocking=False):
            self._stats.inc("phasewatch_ingest_batches_total", protocol=PROTOCOL,
                            outcome="overloaded")
            message = "phasewatch is at its OTLP in-flight limit; retry later"
            context.set_trailing_metadata(retry_trailers(message))
            context.abort(grpc.StatusCode.UNAVAILABLE, message)
        try:
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
        finally:
            self._slots.release()


def start_otlp_grpc_server(service: OtlpGrpcService, host: str, port: int,
                           max_workers: int = 8, interceptors=()) -> tuple[grpc.Server, int]:
    handlers = grpc.method_handlers_generic_handler(SERVICE, {
        "Export": grpc.unary_unary_rpc_method_handler(
            service.export, request_deserializer=identity, response_serializer=identity)})
    return serve_grpc(handlers, host, port, max_workers, "otlp", interceptors)
