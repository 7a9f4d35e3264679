"""OTLP trace requests flattened into plain span views, the only form adapters see.

Decoding follows the opentelemetry-proto specification: attributes are
``KeyValue`` lists of ``AnyValue`` (one of string, bool, int, double, array,
kvlist, bytes); ids are raw bytes; times are Unix nanoseconds. Nothing after this
module handles protobuf.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


class MalformedPayload(ValueError):
    """The payload cannot be decoded at all (answered INVALID_ARGUMENT / HTTP 400)."""


@dataclass(slots=True)
class SpanView:
    trace_id: bytes
    span_id: bytes
    parent_span_id: bytes
    name: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict
    resource: dict
    scope: str
    links: list[tuple[bytes, bytes]] = field(default_factory=list)


def any_value(v):
    """An ``AnyValue`` as a Python value (None when unset)."""
    kind = v.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [any_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind)


_NESTED = ("array_value", "kvlist_value")


def attributes(kvs) -> dict:
    """KeyValues as a dict. The scalar case is inlined: this runs for every attribute of
    every span, the bulk of an OTLP export's decode."""
    out = {}
    for kv in kvs:
        v = kv.value
        kind = v.WhichOneof("value")
        out[kv.key] = (None if kind is None else any_value(v) if kind in _NESTED
                       else getattr(v, kind))
    return out


def parse_request(data: bytes) -> ExportTraceServiceRequest:
    msg = ExportTraceServiceRequest()
    try:
        msg.ParseFromString(data)
    except DecodeError as e:
        raise MalformedPayload(f"not an ExportTraceServiceRequest: {e}") from None
    return msg


def walk(msg: ExportTraceServiceRequest) -> Iterator[SpanView]:
    """Every span of the request with its resource and scope (attributes decoded once
    per resource, once per span)."""
    for rs in msg.resource_spans:
        resource = attributes(rs.resource.attributes)
        for ss in rs.scope_spans:
            scope = ss.scope.name
            for s in ss.spans:
                yield SpanView(
                    trace_id=s.trace_id, span_id=s.span_id, parent_span_id=s.parent_span_id,
                    name=s.name, kind=s.kind, start_ns=s.start_time_unix_nano,
                    end_ns=s.end_time_unix_nano, attributes=attributes(s.attributes),
                    resource=resource, scope=scope,
                    links=[(link.trace_id, link.span_id) for link in s.links] if s.links
                    else [])
