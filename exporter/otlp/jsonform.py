"""OTLP/JSON: the protobuf JSON mapping with the OTLP exceptions.

Per the OTLP specification: trace and span ids are hex strings (not base64, the
proto3 JSON default), enums are integers, 64-bit integers may be decimal strings,
keys are lowerCamelCase (snake_case accepted), and unknown fields are ignored.
The ids are rewritten to base64 before protobuf's own JSON parser does the rest.
"""

from __future__ import annotations

import base64
import binascii
import json

from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from exporter.otlp.spans import MalformedPayload

_ID_KEYS = {"traceId", "spanId", "parentSpanId", "trace_id", "span_id", "parent_span_id"}


def _hex_ids_to_base64(node):
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            if k in _ID_KEYS and isinstance(v, str):
                try:
                    v = base64.b64encode(bytes.fromhex(v)).decode()
                except ValueError:
                    raise MalformedPayload(f"{k} must be a hex string, got {v[:40]!r}") from None
            out[k] = _hex_ids_to_base64(v)
        return out
    if isinstance(node, list):
        return [_hex_ids_to_base64(x) for x in node]
    return node


def parse_json_request(data: bytes) -> ExportTraceServiceRequest:
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError
        # are ValueErrors; RecursionError: nested past the parser's depth
        raise MalformedPayload(f"invalid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise MalformedPayload("an OTLP/JSON request must be a JSON object")
    msg = ExportTraceServiceRequest()
    try:
        json_format.ParseDict(_hex_ids_to_base64(doc), msg, ignore_unknown_fields=True)
    except (json_format.ParseError, binascii.Error, TypeError, ValueError, OverflowError,
            RecursionError) as e:  # OverflowError: an integer past a double's range
        # given for a double; RecursionError: values nested deeper than the stack
        raise MalformedPayload(f"not an OTLP/JSON ExportTraceServiceRequest: {e}") from None
    return msg


def _base64_ids_to_hex(node):
    if isinstance(node, dict):
        return {k: (base64.b64decode(v).hex() if k in _ID_KEYS and isinstance(v, str)
                    else _base64_ids_to_hex(v)) for k, v in node.items()}
    if isinstance(node, list):
        return [_base64_ids_to_hex(x) for x in node]
    return node


def request_json(msg: ExportTraceServiceRequest) -> dict:
    """A request as an OTLP/JSON document (ids in hex), what ``parse_json_request`` reads;
    for tests and the benchmark (``json.dumps`` it)."""
    return _base64_ids_to_hex(json_format.MessageToDict(msg))


def to_json(message) -> bytes:
    """A response (or google.rpc.Status) in OTLP/JSON."""
    return json_format.MessageToJson(message, indent=None).encode()
