"""The phasewatch gRPC receiver: ``Export`` (columnar batches) and ``StreamLifecycle``.

Wired with grpcio's generic handlers and an identity deserializer, so each call
decodes its own payload (``exporter.wire``): a malformed message is answered with
INVALID_ARGUMENT and counted instead of failing inside the framework.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent import futures

import grpc

from exporter import wire
from exporter.aggregate import Aggregator
from exporter.lifecycle import LifecycleJoiner

log = logging.getLogger(__name__)
SERVICE = "phasewatch.v1.Phasewatch"
PROTOCOL = "phasewatch"
MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # OTLP's recommended limit; the same here


class BatchIds:
    """Recently seen batch ids (bounded), so a retried batch is counted once."""

    def __init__(self, capacity: int = 65536):
        self._capacity = capacity
        self._ids: OrderedDict[int, None] = OrderedDict()
        self._lock = threading.Lock()

    def claim(self, batch_id: int) -> bool:
        """True if this id is new (and now remembered); False for a repeat."""
        with self._lock:
            if batch_id in self._ids:
                return False
            self._ids[batch_id] = None
            if len(self._ids) > self._capacity:
                self._ids.popitem(last=False)
            return True

    def release(self, batch_id: int) -> None:
        with self._lock:
            self._ids.pop(batch_id, None)


class PhasewatchService:
    def __init__(self, aggregator: Aggregator, joiner: LifecycleJoiner):
        self._agg = aggregator
        self._stats = aggregator.stats
        self._joiner = joiner
        self._batch_ids = BatchIds()

    def _malformed(self, e: wire.MalformedBatch, requests: int, context) -> None:
        self._stats.inc("phasewatch_ingest_batches_total", protocol=PROTOCOL,
                        outcome="malformed")
        self._stats.inc("phasewatch_ingest_rejected_total", max(requests, 1), protocol=PROTOCOL,
                        reason=e.reason)
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def export(self, request: bytes, context) -> bytes:
        try:
            batch, meta = wire.decode_export(request)
        except wire.MalformedBatch as e:
            return self._malformed(e, 0, context)
        if meta.batch_id and not self._batch_ids.claim(meta.batch_id):
            self._stats.inc("phasewatch_ingest_batches_total", protocol=PROTOCOL,
                            outcome="duplicate")
            return wire.export_response(0, {}, duplicate=True)
        try:
            self._stats.inc("phasewatch_ingest_dropped_total", meta.sender_dropped,
                            reason="sender_buffer_full")
            result = self._agg.ingest(batch, PROTOCOL)
        except Exception:
            if meta.batch_id:
                self._batch_ids.release(meta.batch_id)  # let the client's retry through
            raise
        self._stats.inc("phasewatch_ingest_batches_total", protocol=PROTOCOL, outcome="ok")
        return wire.export_response(result.accepted, dict(result.rejected))

    def stream_lifecycle(self, request_iterator, context) -> bytes:
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
            completed += self._joiner.add(engine, events)
        return wire.lifecycle_response(received, rejected, completed)


def identity(b: bytes) -> bytes:
    """Request/response (de)serializer that leaves the bytes to the handler."""
    return b


def serve_grpc(handlers, host: str, port: int, max_workers: int, what: str,
               interceptors: Sequence[grpc.ServerInterceptor] = ()) -> tuple[grpc.Server, int]:
    """A started grpc server for ``handlers`` with the message size limit; returns it
    and the port actually bound. ``what`` names it in thread names and errors."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=f"pw-{what}"),
        handlers=[handlers], interceptors=list(interceptors),
        options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                 ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)],
    )
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind the {what} gRPC port on {host}:{port}")
    server.start()
    return server, bound


def start_grpc_server(service: PhasewatchService, host: str, port: int,
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
