"""The phasewatch gRPC receiver: ``Export`` (columnar batches) and ``StreamLifecycle``.

Wired with grpcio's generic handlers and an identity deserializer, so each call
decodes its own payload (``phasewatch.ingest.wire``): a malformed message is answered with
INVALID_ARGUMENT and counted instead of failing inside the framework.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
from collections.abc import Sequence
from concurrent import futures

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

from phasewatch.aggregation.sink import RequestSink
from phasewatch.ingest import wire
from phasewatch.ingest.admission import RETRY_AFTER_SECONDS, Admission, Refused
from phasewatch.ingest.dedupe import BatchIds
from phasewatch.ingest.lifecycle import LifecycleJoiner

log = logging.getLogger(__name__)
SERVICE = "phasewatch.v1.Phasewatch"
PROTOCOL = "phasewatch"
MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # OTLP's recommended limit; the same here
# grpc's own limit sits a little higher, so that a payload just past ours reaches the
# handler and is refused there with a count; past this one grpc refuses it itself
# (RESOURCE_EXHAUSTED, before any phasewatch code runs).
GRPC_HARD_LIMIT = MAX_MESSAGE_BYTES + 4 * 1024 * 1024


def too_large(stats, protocol: str, size: int, context) -> None:
    """Refuse a payload over MAX_MESSAGE_BYTES: counted, INVALID_ARGUMENT (a resend of
    the same bytes cannot succeed, so it must not be retried)."""
    stats.inc("phasewatch_ingest_batches_total", protocol=protocol, outcome="too_large")
    stats.inc("phasewatch_ingest_rejected_total", protocol=protocol,
              reason="payload_too_large")
    context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                  f"payload of {size} bytes exceeds {MAX_MESSAGE_BYTES}; send smaller batches")


def retry_trailers(message: str) -> tuple:
    """``UNAVAILABLE`` details telling the client when to retry: a ``google.rpc.RetryInfo``
    in ``grpc-status-details-bin`` and in the ``google.rpc.retryinfo-bin`` trailer the
    OpenTelemetry SDK's exporter reads."""
    retry = error_details_pb2.RetryInfo(
        retry_delay=duration_pb2.Duration(seconds=RETRY_AFTER_SECONDS))
    detail = any_pb2.Any()
    detail.Pack(retry)
    status = status_pb2.Status(code=code_pb2.UNAVAILABLE, message=message, details=[detail])
    return (("google.rpc.retryinfo-bin", retry.SerializeToString()),
            ("grpc-status-details-bin", status.SerializeToString()))


def refuse(stats, protocol: str, e: Refused, context) -> None:
    """Answer a call the admission gate refused: ``UNAVAILABLE`` with ``RetryInfo``."""
    stats.inc("phasewatch_ingest_batches_total", protocol=protocol, outcome="overloaded")
    context.set_trailing_metadata(retry_trailers(str(e)))
    context.abort(grpc.StatusCode.UNAVAILABLE, str(e))


def gated(stats, admission: Admission, protocol: str, request: bytes, context,
          handle) -> bytes:
    """What every gRPC ingest call passes before ``handle(request, context)``: the size
    limit, then the admission gate (its slot released when ``handle`` returns)."""
    if len(request) > MAX_MESSAGE_BYTES:
        return too_large(stats, protocol, len(request), context)
    try:
        admission.admit(protocol, len(request))
    except Refused as e:
        return refuse(stats, protocol, e, context)
    try:
        return handle(request, context)
    except Exception:
        if context.code() is not None:  # the handler's own answer (context.abort)
            raise
        internal_error(stats, protocol, f"a {len(request)}-byte batch", context)
    finally:
        admission.release(len(request))


def internal_error(stats, protocol: str, what: str, context) -> None:
    """From an ``except`` block: a bug, not bad input. Logged with its traceback, counted
    as batches_total{outcome="error"} and answered INTERNAL, never a silent UNKNOWN."""
    log.exception("%s: ingest failed on %s", protocol, what)
    stats.inc("phasewatch_ingest_batches_total", protocol=protocol, outcome="error")
    context.abort(grpc.StatusCode.INTERNAL, f"phasewatch could not ingest {what}; its log "
                  "has the cause")


class PhasewatchService:
    def __init__(self, sink: RequestSink, joiner: LifecycleJoiner,
                 admission: Admission | None = None):
        """``sink``: where batches go (the exporter passes its trace join, in front of
        the aggregator)."""
        self._sink = sink
        self._stats = sink.stats
        self._joiner = joiner
        self._batch_ids = BatchIds()
        self._admission = admission or Admission(self._stats)

    def _malformed(self, e: wire.MalformedBatch, requests: int, context) -> None:
        self._stats.inc("phasewatch_ingest_batches_total", protocol=PROTOCOL,
                        outcome="malformed")
        self._stats.inc("phasewatch_ingest_rejected_total", max(requests, 1), protocol=PROTOCOL,
                        reason=e.reason)
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def export(self, request: bytes, context) -> bytes:
        return gated(self._stats, self._admission, PROTOCOL, request, context, self._export)

    def _export(self, request: bytes, context) -> bytes:
        try:
            batch, meta = wire.decode_export(request)
        except wire.MalformedBatch as e:
            return self._malformed(e, 0, context)
        if meta.batch_id and not self._batch_ids.claim(meta.batch_id):
            return self._duplicate(meta.batch_id, context)
        try:
            self._stats.inc("phasewatch_ingest_dropped_total", meta.sender_dropped,
                            reason="sender_buffer_full")
            self._stats.inc("phasewatch_ingest_rejected_total", meta.sender_invalid,
                            protocol=PROTOCOL, reason="sender_invalid_value")
            result = self._sink.ingest(batch, PROTOCOL)
        except Exception:
            if meta.batch_id:
                self._batch_ids.release(meta.batch_id)  # let the client's retry through
            raise
        self._stats.inc("phasewatch_ingest_batches_total", protocol=PROTOCOL, outcome="ok")
        if meta.batch_id:
            self._batch_ids.settle(meta.batch_id, wire.export_response(
                result.accepted, dict(result.rejected), duplicate=True))
        return wire.export_response(result.accepted, dict(result.rejected))

    def _duplicate(self, batch_id: int, context) -> bytes:
        """A resent batch: the first attempt's counts, flagged duplicate, nothing counted
        again; if the first attempt is still being ingested, ask for a retry later."""
        reply = self._batch_ids.reply(batch_id)
        if reply is None:
            self._stats.inc("phasewatch_ingest_refused_total", protocol=PROTOCOL,
                            reason="in_progress")
            return refuse(self._stats, PROTOCOL, Refused(
                "in_progress", "this batch id is still being ingested; retry later"), context)
        self._stats.inc("phasewatch_ingest_batches_total", protocol=PROTOCOL,
                        outcome="duplicate")
        return reply

    def stream_lifecycle(self, request_iterator, context) -> bytes:
        try:  # a stream holds no slot: its events are small and the joiner is bounded
            self._admission.check_memory("lifecycle")
        except Refused as e:
            return refuse(self._stats, "lifecycle", e, context)
        received = rejected = completed = 0
        for raw in request_iterator:
            try:
                engine, events, unknown = wire.decode_lifecycle(raw)
            except wire.MalformedBatch as e:
                self._stats.inc("phasewatch_ingest_rejected_total", protocol="lifecycle",
                                reason=e.reason)
                rejected += 1
                continue
            if unknown:
                self._stats.inc("phasewatch_ingest_rejected_total", unknown,
                                protocol="lifecycle", reason="unknown_event_kind")
            received += len(events) + unknown
            rejected += unknown
            try:
                completed += self._joiner.add(engine, events)
            except Exception:
                internal_error(self._stats, "lifecycle", f"{len(events)} events", context)
        return wire.lifecycle_response(received, rejected, completed)


def identity(b: bytes) -> bytes:
    """Request/response (de)serializer that leaves the bytes to the handler."""
    return b


def _probe(host: str, port: int | None) -> None:
    """gRPC's bind failure says only "Failed to bind" (after a C-core log line), and
    with SO_REUSEPORT it shares a port another gRPC server holds: bind the address with
    a plain socket first, so a taken port fails here, with the OS's reason."""
    if not port:
        return
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    try:
        socket.create_server((host.strip("[]"), port), family=family).close()
    except OSError as e:
        if e.errno in (errno.EADDRINUSE, errno.EACCES, errno.EADDRNOTAVAIL):
            raise OSError(e.errno, os.strerror(e.errno)) from None
        # anything else (a name this probe cannot resolve): gRPC has the last word


def serve_grpc(handlers, host: str, port: int | None, max_workers: int, what: str,
               interceptors: Sequence[grpc.ServerInterceptor] = ()) -> tuple[grpc.Server, int]:
    """A started grpc server for ``handlers`` with the message size limit; returns it
    and the port actually bound. ``what`` names it in thread names and errors."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=f"pw-{what}"),
        handlers=[handlers], interceptors=list(interceptors),
        options=[("grpc.max_receive_message_length", GRPC_HARD_LIMIT),
                 ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)],
    )
    address = host if port is None else f"{host}:{port}"  # port None: host is unix:PATH
    _probe(host, port)
    bound = server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot bind the {what} gRPC port on {address}")
    server.start()
    return server, bound


def start_grpc_server(service: PhasewatchService, host: str, port: int | None,
                      max_workers: int = 8,
                      interceptors: Sequence[grpc.ServerInterceptor] = ()
                      ) -> tuple[grpc.Server, int]:
    """Start the receiver; returns the server and the port actually bound."""
    handlers = grpc.method_handlers_generic_handler(SERVICE, {
        "Export": grpc.unary_unary_rpc_method_handler(
            service.export, request_deserializer=identity, response_serializer=identity),
        "StreamLifecycle": grpc.stream_unary_rpc_method_handler(
            service.stream_lifecycle, request_deserializer=identity,
            response_serializer=identity),
    })
    return serve_grpc(handlers, host, port, max_workers, "phasewatch", interceptors)
