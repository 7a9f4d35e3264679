"""The phasewatch gRPC receiver: ``Export`` (columnar batches) and ``StreamLifecycle``.

Wired with grpcio's generic handlers and an identity deserializer, so each call
decodes its own payload (``phasewatch.ingest.wire``): a malformed message is answered with
INVALID_ARGUMENT and counted instead of failing inside the framework.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from phasewatch.aggregation.sink import RequestSink
from phasewatch.ingest import wire
from phasewatch.ingest.dedupe import BatchIds
from phasewatch.ingest.lifecycle import LifecycleJoiner
from phasewatch.transport.admission import Admission, Refused
from phasewatch.transport.grpc import gated, identity, internal_error, refuse, serve_grpc

PROTOCOL = "phasewatch"


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


def start_grpc_server(service: PhasewatchService, host: str, port: int | None,
                      max_workers: int = 8,
                      interceptors: Sequence[grpc.ServerInterceptor] = ()
                      ) -> tuple[grpc.Server, int]:
    """Start the receiver; returns the server and the port actually bound."""
    handlers = grpc.method_handlers_generic_handler(wire.SERVICE, {
        "Export": grpc.unary_unary_rpc_method_handler(
            service.export, request_deserializer=identity, response_serializer=identity),
        "StreamLifecycle": grpc.stream_unary_rpc_method_handler(
            service.stream_lifecycle, request_deserializer=identity,
            response_serializer=identity),
    })
    return serve_grpc(handlers, host, port, max_workers, "phasewatch", interceptors)
