"""A local OTLP trace receiver that keeps every export request exactly as it was sent.

Used by the engine-fixture generators (``make engine-fixtures``): the engine's own
tracing code exports to it over OTLP/gRPC or OTLP/HTTP and the raw
``ExportTraceServiceRequest`` bytes are written out unchanged.

* gRPC: ``opentelemetry.proto.collector.trace.v1.TraceService/Export`` served through a
  generic handler with no request deserializer, so the handler sees the message bytes
  as they came off the wire (after gRPC's own framing and any ``grpc-encoding``).
* HTTP: ``POST /v1/traces`` on ``http.server``; the body is kept byte for byte (before
  any ``Content-Encoding`` is undone), with the request line and headers.

Both answer an empty ``ExportTraceServiceResponse`` (full success).
"""

from __future__ import annotations

import http.server
import threading
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
_EMPTY = ExportTraceServiceResponse().SerializeToString()


@dataclass
class Captured:
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)  # HTTP headers / gRPC metadata
    path: str = ""


class _Sink:
    def __init__(self):
        self.requests: list[Captured] = []
        self._lock = threading.Lock()

    def add(self, item: Captured) -> None:
        with self._lock:
            self.requests.append(item)

    def take(self) -> list[Captured]:
        with self._lock:
            out, self.requests = self.requests, []
        return out


class GrpcSink(_Sink):
    """OTLP/gRPC on 127.0.0.1:<port 0>; ``endpoint`` is ``127.0.0.1:PORT``."""

    def __init__(self):
        super().__init__()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))

        def export(request: bytes, context) -> bytes:
            meta = {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}
            self.add(Captured(body=request, headers=meta, path=EXPORT_METHOD))
            return _EMPTY

        handler = grpc.method_handlers_generic_handler(
            "opentelemetry.proto.collector.trace.v1.TraceService",
            {"Export": grpc.unary_unary_rpc_method_handler(export)})  # raw bytes in and out
        self._server.add_generic_rpc_handlers((handler,))
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"127.0.0.1:{self.port}"

    def start(self) -> GrpcSink:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=1).wait()


class HttpSink(_Sink):
    """OTLP/HTTP ``POST /v1/traces`` on 127.0.0.1:<port 0>; ``endpoint`` is the full URL."""

    def __init__(self):
        super().__init__()
        sink = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                sink.add(Captured(body=body, headers={k: v for k, v in self.headers.items()},
                                  path=self.path))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(_EMPTY)))
                self.end_headers()
                self.wfile.write(_EMPTY)

            def log_message(self, *args):  # quiet
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def start(self) -> HttpSink:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
