"""OTLP/HTTP ``POST /v1/traces`` (default port 4318), per the OTLP specification.

``application/x-protobuf`` and ``application/json`` on the same path, optionally
``Content-Encoding: gzip``; the reply uses the request's content type. 200 with
an empty ``ExportTraceServiceResponse`` (or ``partial_success``); 400 with a
``google.rpc.Status`` body for an undecodable payload; 413 past the size limit
(checked before reading, and again after gunzip so a small bomb cannot expand);
415 for another content type; 503 with ``Retry-After`` when the admission gate
refuses (in-flight or memory limit; checked before the body is read), so the OTel
SDK's HTTP exporter retries. Any other method: 405 with ``Allow: POST``.
"""

from __future__ import annotations

import logging
import zlib
from http.server import BaseHTTPRequestHandler

from google.rpc import code_pb2, status_pb2

from phasewatch.ingest.otlp.grpc_receiver import export_response
from phasewatch.ingest.otlp.ingest import OtlpIngest
from phasewatch.ingest.otlp.jsonform import json_spans, to_json
from phasewatch.ingest.otlp.spans import MalformedPayload, parse_request
from phasewatch.transport.admission import RETRY_AFTER_SECONDS, Admission, Refused
from phasewatch.transport.auth import BearerAuth
from phasewatch.transport.grpc import MAX_MESSAGE_BYTES
from phasewatch.transport.http_server import send_body

log = logging.getLogger(__name__)
PROTOCOL = "otlp_http"
PROTOBUF = "application/x-protobuf"
JSON = "application/json"


class TooLarge(ValueError):
    pass


def gunzip(body: bytes, limit: int) -> bytes:
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        out = d.decompress(body, limit + 1)
    except zlib.error as e:
        raise MalformedPayload(f"Content-Encoding gzip, but the body is not gzip: {e}") from None
    if len(out) > limit:
        raise TooLarge(f"decompressed body exceeds {limit} bytes")
    return out


class OtlpHttpHandler(BaseHTTPRequestHandler):
    """One connection's requests; ``make_otlp_handler`` gives it its ingest and limits."""

    ingest: OtlpIngest
    admission: Admission
    max_bytes: int = MAX_MESSAGE_BYTES
    auth: BearerAuth | None = None
    protocol_version = "HTTP/1.1"
    server_version = "phasewatch-otlp"
    timeout = 30  # seconds a connection may stall (slowloris) before it is closed

    def log_message(self, fmt, *args):
        log.debug("%s " + fmt, self.address_string(), *args)

    def _reply(self, code: int, body: bytes, ctype: str, headers=()) -> None:
        send_body(self, code, body, ctype, headers)

    def _status(self, http: int, code: int, message: str, ctype: str, headers=()) -> None:
        status = status_pb2.Status(code=code, message=message)
        body = to_json(status) if ctype == JSON else status.SerializeToString()
        self._reply(http, body, ctype, headers)

    def _refuse(self, http: int, code: int, outcome: str, reason: str, message: str,
                ctype: str, headers=()) -> None:
        stats = self.ingest.stats
        stats.inc("phasewatch_ingest_batches_total", protocol=PROTOCOL, outcome=outcome)
        if reason:
            stats.inc("phasewatch_ingest_rejected_total", protocol=PROTOCOL, reason=reason)
        self._status(http, code, message, ctype, headers)

    def _only_post(self):
        """Any method but POST: 405 with ``Allow: POST`` on /v1/traces (404 off it),
        a short plain body, and the connection closed (a body sent is never read)."""
        on_path = self.path.split("?", 1)[0] == "/v1/traces"
        self.close_connection = True
        send_body(self, 405 if on_path else 404, b"POST OTLP traces to /v1/traces\n",
                  "text/plain; charset=utf-8",
                  ((("Allow", "POST"),) if on_path else ()) + (("Connection", "close"),),
                  head=self.command == "HEAD")

    do_GET = do_HEAD = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _only_post

    def do_POST(self):
        if self.path.split("?", 1)[0] != "/v1/traces":
            return self._status(404, code_pb2.NOT_FOUND, "POST OTLP traces to /v1/traces",
                                JSON)
        ctype = self.headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
        reply = JSON if ctype == JSON else PROTOBUF
        auth = self.auth
        if auth is not None and not auth.allows(PROTOCOL, self.headers.get("Authorization")):
            self.close_connection = True  # the body is never read
            return self._status(401, code_pb2.UNAUTHENTICATED, "phasewatch: missing or "
                                "wrong bearer token (Authorization header)", reply,
                                (("WWW-Authenticate", 'Bearer realm="phasewatch"'),
                                 ("Connection", "close")))
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self.close_connection = True
            return self._refuse(411, code_pb2.INVALID_ARGUMENT, "malformed",
                                "no_content_length", "Content-Length is required", reply)
        if length > self.max_bytes or length < 0:
            self.close_connection = True  # the body stays unread
            return self._refuse(413, code_pb2.RESOURCE_EXHAUSTED, "too_large",
                                "payload_too_large",
                                f"body of {length} bytes exceeds {self.max_bytes}", reply)
        if ctype not in (PROTOBUF, JSON):
            self.close_connection = True
            return self._refuse(415, code_pb2.INVALID_ARGUMENT, "malformed",
                                "unsupported_content_type",
                                f"Content-Type must be {PROTOBUF} or {JSON}, got "
                                f"{ctype or 'none'!r}", JSON)
        try:
            self.admission.admit(PROTOCOL, length)
        except Refused as e:
            self.close_connection = True  # the body stays unread: nothing is held
            return self._refuse(503, code_pb2.UNAVAILABLE, "overloaded", "", str(e),
                                reply, (("Retry-After", str(RETRY_AFTER_SECONDS)),
                                        ("Connection", "close")))
        try:
            self._export(self.rfile.read(length), ctype, reply)
        finally:
            self.admission.release(length)

    def _export(self, body: bytes, ctype: str, reply: str) -> None:
        try:
            outcome = self._decode_and_ingest(body, ctype)
        except TooLarge as e:
            return self._refuse(413, code_pb2.RESOURCE_EXHAUSTED, "too_large",
                                "payload_too_large", str(e), reply)
        except MalformedPayload as e:
            return self._refuse(400, code_pb2.INVALID_ARGUMENT, "malformed",
                                "undecodable_payload", str(e), reply)
        except Exception:  # a bug, not bad input: answered and counted
            log.exception("%s: ingest failed on a %d-byte body", PROTOCOL, len(body))
            return self._refuse(500, code_pb2.INTERNAL, "error", "", "phasewatch could "
                                "not ingest this batch; its log has the cause", reply)
        self.ingest.stats.inc("phasewatch_ingest_batches_total", protocol=PROTOCOL, outcome="ok")
        resp = export_response(outcome)
        body = to_json(resp) if reply == JSON else resp.SerializeToString()
        return self._reply(200, body, reply)

    def _decode_and_ingest(self, body: bytes, ctype: str):
        encoding = self.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding == "gzip":
            body = gunzip(body, self.max_bytes)
        elif encoding not in ("", "identity"):
            raise MalformedPayload(f"unsupported Content-Encoding {encoding!r}")
        if ctype == JSON:
            return self.ingest.export_spans(json_spans(body, self.ingest.extract), PROTOCOL)
        return self.ingest.export(parse_request(body), PROTOCOL)


def make_otlp_handler(ingest: OtlpIngest, admission: Admission,
                      max_bytes: int = MAX_MESSAGE_BYTES, auth: BearerAuth | None = None):
    """The handler class of an OTLP/HTTP listener (``transport.http_server.HttpServer``)."""
    return type("Handler", (OtlpHttpHandler,), {"ingest": ingest, "admission": admission,
                                                 "max_bytes": max_bytes, "auth": auth})
