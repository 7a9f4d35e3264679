"""OTLP trace requests flattened into plain span views, the only form adapters see.

Decoding follows the opentelemetry-proto specification: attributes are
``KeyValue`` lists of ``AnyValue`` (one of string, bool, int, double, array,
kvlist, bytes); ids are raw bytes; times are Unix nanoseconds. Nothing after this
module handles protobuf.

Attribute decode is most of an export's cost (one protobuf wrapper per key and per
value). ``walk`` can be told, per span name, which keys a vectorised adapter reads
(``extract``): those spans get the values of just those keys in ``values`` and
their full attributes are decoded only if something asks (``LazyAttributes``).
"""

from __future__ import annotations

from collections.abc import Mapping
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
    values: list | None = None  # the ``extract`` keys' values, in order (None = absent)
    trace_state: str = ""  # W3C tracestate: a stream tap's member says its record follows


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


class LazyAttributes(Mapping):
    """A span's attributes, decoded on first use."""

    __slots__ = ("_decoded", "_kvs")

    def __init__(self, kvs):
        self._kvs, self._decoded = kvs, None

    def _dict(self) -> dict:
        if self._decoded is None:
            self._decoded = attributes(self._kvs)
        return self._decoded

    def __getitem__(self, key):
        return self._dict()[key]

    def __iter__(self):
        return iter(self._dict())

    def __len__(self) -> int:
        return len(self._dict())


def parse_request(data: bytes) -> ExportTraceServiceRequest:
    msg = ExportTraceServiceRequest()
    try:
        msg.ParseFromString(data)
    except DecodeError as e:
        raise MalformedPayload(f"not an ExportTraceServiceRequest: {e}") from None
    return msg


def walk(msg: ExportTraceServiceRequest,
         extract: Mapping[str, tuple[str, ...]] | None = None) -> list[SpanView]:
    """Every span of the request with its resource and scope (resource attributes
    decoded once per resource). A span whose name is in ``extract`` gets ``values``
    (those keys' values) and lazily decoded attributes; others get their attributes."""
    slots = {name: {k: i for i, k in enumerate(keys)} for name, keys in (extract or {}).items()}
    out = []
    add = out.append
    nested = _NESTED
    for rs in msg.resource_spans:
        resource = attributes(rs.resource.attributes)
        for ss in rs.scope_spans:
            scope = ss.scope.name
            for s in ss.spans:
                name = s.name
                slot = slots.get(name)
                values = None
                if slot is None:
                    attrs = attributes(s.attributes)
                else:
                    values = [None] * len(slot)
                    for kv in s.attributes:
                        i = slot.get(kv.key)
                        if i is not None:
                            v = kv.value
                            kind = v.WhichOneof("value")
                            values[i] = (None if kind is None else any_value(v)
                                         if kind in nested else getattr(v, kind))
                    attrs = LazyAttributes(s.attributes)
                links = s.links
                add(SpanView(s.trace_id, s.span_id, s.parent_span_id, name, s.kind,
                             s.start_time_unix_nano, s.end_time_unix_nano, attrs, resource,
                             scope, [(k.trace_id, k.span_id) for k in links] if links else [],
                             values, s.trace_state))
    return out
