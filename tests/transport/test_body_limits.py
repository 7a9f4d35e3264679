"""Request body size limits on every port: refused with a clear error, and counted."""

from __future__ import annotations

import socket

import grpc
import pytest

from phasewatch.transport.grpc import MAX_MESSAGE_BYTES
from tests.conftest import scrape

METHODS = {"phasewatch": ("grpc_port", "/phasewatch.v1.Phasewatch/Export"),
           "otlp_grpc": ("otlp_grpc_port",
                         "/opentelemetry.proto.collector.trace.v1.TraceService/Export")}


@pytest.mark.parametrize("protocol", sorted(METHODS))
def test_grpc_payload_over_the_limit_is_refused_and_counted(exporter, protocol):
    port, method = METHODS[protocol]
    options = [("grpc.max_send_message_length", 2 * MAX_MESSAGE_BYTES)]
    target = f"127.0.0.1:{getattr(exporter, port)}"
    with grpc.insecure_channel(target, options=options) as ch, pytest.raises(
            grpc.RpcError) as e:
        ch.unary_unary(method)(b"\0" * (MAX_MESSAGE_BYTES + 1), timeout=60)
    # not retryable: the same bytes can never fit
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "exceeds" in e.value.details()
    m = scrape(exporter.http_port)
    assert m.value("phasewatch_ingest_rejected_total", protocol=protocol,
                   reason="payload_too_large") == 1


def _raw(port: int, head: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(head)
        s.settimeout(5)
        return s.recv(4096)


def test_otlp_http_body_over_the_limit_is_refused_unread(exporter):
    reply = _raw(exporter.otlp_http_port,
                 b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                 b"Content-Length: %d\r\n\r\n" % (MAX_MESSAGE_BYTES + 1))
    assert reply.startswith(b"HTTP/1.1 413")
    assert scrape(exporter.http_port).value("phasewatch_ingest_rejected_total",
                                            protocol="otlp_http",
                                            reason="payload_too_large") == 1


def test_the_metrics_port_takes_no_bodies(exporter):
    reply = _raw(exporter.http_port, b"POST /metrics HTTP/1.1\r\nHost: x\r\n"
                                     b"Content-Length: 1000000000\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 501")
