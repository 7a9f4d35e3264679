"""An OTLP/gRPC relay that keeps every export it passes on.

It serves ``opentelemetry.proto.collector.trace.v1.TraceService/Export``, stores each
request's bytes exactly as the engine sent them (no decode and re-encode), forwards
the same bytes to the next hop (phasewatch's OTLP/gRPC receiver) and answers with the
next hop's response, or its error status. The engine cannot tell it is there.

In a test::

    with OtlpCapture(forward_to="127.0.0.1:4317") as cap:   # cap.port: where to send
        ...
    cap.requests()  # [ExportTraceServiceRequest, ...] in arrival order; cap.raw: bytes

As a program (``python -m tests.engines.otlp_capture --forward HOST:PORT --out DIR``)
it writes each export to ``DIR/export-NNNN.pb`` until interrupted.
"""

from __future__ import annotations

import argparse
import signal
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

SERVICE = trace_service_pb2.DESCRIPTOR.services_by_name["TraceService"].full_name
METHOD = f"/{SERVICE}/Export"


def _identity(b: bytes) -> bytes:
    return b


class OtlpCapture:
    """Relay-capture on ``127.0.0.1:port`` (0 = a free port, read ``.port`` after start)."""

    def __init__(self, forward_to: str, port: int = 0, host: str = "127.0.0.1",
                 max_timeout: float = 60.0, on_export=None):
        self.forward_to, self.host, self.max_timeout = forward_to, host, max_timeout
        self.requested_port = port
        self.on_export = on_export  # called with (bytes) after each stored export
        self.raw: list[bytes] = []  # every request received, in order
        self.received_at: list[float] = []  # time.time() of each
        self.responses: list[bytes] = []  # the next hop's answer to each, in order
        self.delivered: list[bytes] = []  # the requests the next hop took (answered OK)
        self.forward_seconds: list[float] = []  # how long the next hop took to answer each
        # each refused forward: (its error, seconds the engine's deadline had left when the
        # relay took the export, seconds the next hop then took)
        self.forward_failures: list[tuple[str, float, float]] = []
        self._lock = threading.Lock()
        self._server: grpc.Server | None = None
        self._channel: grpc.Channel | None = None
        self.port = 0

    def _export(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        with self._lock:
            self.raw.append(request)
            self.received_at.append(time.time())
        if self.on_export is not None:
            self.on_export(request)
        began = time.monotonic()
        try:
            # the engine's own deadline (grpc gives a far one where it set none): the
            # relay cuts no call sooner than the engine would
            left = min(context.time_remaining(), self.max_timeout)
            response = self._forward(request, timeout=left,
                                     compression=grpc.Compression.NoCompression)
        except grpc.RpcError as e:  # the next hop's refusal is the engine's answer
            with self._lock:
                took = time.monotonic() - began
                self.forward_seconds.append(took)
                self.forward_failures.append((f"{e.code()}: {e.details()}", left, took))
            context.abort(e.code(), e.details() or "")
        with self._lock:
            self.forward_seconds.append(time.monotonic() - began)
            self.responses.append(response)
            self.delivered.append(request)
        return response

    @property
    def forward_errors(self) -> list[str]:
        """Each refused forward's error, in order (``forward_failures``' first field)."""
        with self._lock:
            return [error for error, _, _ in self.forward_failures]

    def _connect(self) -> None:
        self._channel = grpc.insecure_channel(self.forward_to)
        self._forward = self._channel.unary_unary(
            METHOD, request_serializer=_identity, response_deserializer=_identity)

    def retarget(self, forward_to: str | None) -> None:
        """Pass later exports on to ``forward_to`` (a fresh exporter per workload); None
        answers them as a receiver that took them and passes them nowhere (an engine
        whose spans reach no phasewatch, without the retries of a refused export that
        would reach the next one)."""
        old = self._channel
        self.forward_to = forward_to
        if forward_to is None:
            self._channel = None
            self._forward = lambda request, **_: b""  # an empty ExportTraceServiceResponse
        else:
            self._connect()
        if old is not None:
            old.close()

    def start(self) -> OtlpCapture:
        self._connect()
        handler = grpc.method_handlers_generic_handler(SERVICE, {
            "Export": grpc.unary_unary_rpc_method_handler(
                self._export, request_deserializer=_identity, response_serializer=_identity),
        })
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4),
                                   options=[("grpc.max_receive_message_length", 64 << 20)])
        self._server.add_generic_rpc_handlers((handler,))
        self.port = self._server.add_insecure_port(f"{self.host}:{self.requested_port}")
        if not self.port:
            raise RuntimeError(f"could not bind {self.host}:{self.requested_port}")
        self._server.start()
        return self

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self, grace: float = 1.0) -> None:
        if self._server is not None:
            self._server.stop(grace).wait()
            self._server = None
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def requests(self) -> list[trace_service_pb2.ExportTraceServiceRequest]:
        with self._lock:
            raw = list(self.raw)
        return [trace_service_pb2.ExportTraceServiceRequest.FromString(b) for b in raw]

    def delivered_requests(self) -> list[trace_service_pb2.ExportTraceServiceRequest]:
        """The exports the next hop answered OK (a refused one is retried by the engine,
        or lost: it is in ``requests()`` and ``forward_errors``, not here)."""
        with self._lock:
            raw = list(self.delivered)
        return [trace_service_pb2.ExportTraceServiceRequest.FromString(b) for b in raw]

    def partial_successes(self) -> list[trace_service_pb2.ExportTracePartialSuccess]:
        """The next hop's ``partial_success`` answers that rejected spans or warned."""
        with self._lock:
            raw = list(self.responses)
        out = []
        for b in raw:
            r = trace_service_pb2.ExportTraceServiceResponse.FromString(b)
            if r.HasField("partial_success") and (r.partial_success.rejected_spans
                                                  or r.partial_success.error_message):
                out.append(r.partial_success)
        return out

    def __enter__(self) -> OtlpCapture:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--forward", required=True, help="next hop, HOST:PORT (OTLP/gRPC)")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--out", type=Path, required=True, help="directory for export-NNNN.pb")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    counter = iter(range(1 << 30))

    def save(b: bytes) -> None:
        (args.out / f"export-{next(counter):04d}.pb").write_bytes(b)

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with OtlpCapture(args.forward, port=args.port, on_export=save) as cap:
        print(f"OTLP/gRPC capture on {cap.endpoint} -> {args.forward}", flush=True)
        stop.wait()


if __name__ == "__main__":
    main()
