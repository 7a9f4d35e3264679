"""OTLP/JSON: the protobuf JSON mapping with the OTLP exceptions.

Per the OTLP specification: trace and span ids are hex strings (not base64, the
proto3 JSON default), enums are integers, 64-bit integers may be decimal strings,
keys are lowerCamelCase (snake_case accepted), and unknown fields are ignored.

Two readers give the same spans:
- ``json_spans`` walks the decoded JSON straight into ``SpanView``s (~5x faster
  than building the protobuf message first). It accepts only what it can decide
  exactly as protobuf would: anything unusual (a snake_case key, a null, a float
  for an integer, bytesValue, a string that needs protobuf's checks) sends the
  whole request down the second reader, so results and errors are protobuf's.
  A property test holds the two equal.
- ``parse_json_request``: the ids are rewritten to base64, then protobuf's own JSON
  parser (``json_format.ParseDict``) builds the message, which ``walk`` reads.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from collections.abc import Mapping

from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1 import trace_pb2

from phasewatch.ingest.otlp.spans import MalformedPayload, SpanView, walk

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


def _load(data: bytes) -> dict:
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError
        # are ValueErrors; RecursionError: nested past the parser's depth
        raise MalformedPayload(f"invalid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise MalformedPayload("an OTLP/JSON request must be a JSON object")
    return doc


def parse_json_request(data: bytes) -> ExportTraceServiceRequest:
    return _parse_doc(_load(data))


def json_spans(data: bytes, extract: Mapping[str, tuple[str, ...]] | None = None
               ) -> list[SpanView]:
    """The spans of an OTLP/JSON request, as ``walk(parse_json_request(data), extract)``
    gives them. Raises ``MalformedPayload``."""
    doc = _load(data)
    spans = fast_spans(doc, extract)
    return spans if spans is not None else walk(_parse_doc(doc), extract)


def _parse_doc(doc: dict) -> ExportTraceServiceRequest:
    msg = ExportTraceServiceRequest()
    try:
        json_format.ParseDict(_hex_ids_to_base64(doc), msg, ignore_unknown_fields=True)
    except (json_format.ParseError, binascii.Error, TypeError, ValueError, OverflowError,
            RecursionError, SystemError) as e:
        # OverflowError: an integer past a double's range given for a double;
        # RecursionError: values nested deeper than the stack; SystemError: upb's field
        # lookup on a lone surrogate (a string given where an object belongs is read key
        # by key: {"resource": "\ud800"})
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


# ---- the direct reader ------------------------------------------------------------
class _Slow(Exception):
    """Not decided here: protobuf's parser reads the whole request instead."""


_DIGITS = re.compile(r"-?[0-9]{1,20}\Z")  # longer is out of range (or past int()'s
# 4,300-digit limit): protobuf's parser refuses it
_SURROGATE = re.compile("[\ud800-\udfff]")  # json.loads leaves only unpaired ones
_U32, _U64, _I64, _I32 = 1 << 32, 1 << 64, 1 << 63, 1 << 31
_ABSENT = object()


# what each message may hold here: its camelCase fields, less those this reader does
# not read. Any other key (snake_case, unknown, entityRefs) goes to protobuf's parser,
# which also applies its id rewrite to unknown fields.
_UNREAD = {"resource": {"entityRefs"}}
_KEYS = {name: frozenset(f.json_name for f in desc.fields) - _UNREAD.get(name, set())
         for name, desc in (
             ("request", ExportTraceServiceRequest.DESCRIPTOR),
             ("resource_spans", trace_pb2.ResourceSpans.DESCRIPTOR),
             ("resource", trace_pb2.ResourceSpans.DESCRIPTOR.fields_by_name["resource"]
              .message_type),
             ("scope_spans", trace_pb2.ScopeSpans.DESCRIPTOR),
             ("scope", trace_pb2.ScopeSpans.DESCRIPTOR.fields_by_name["scope"].message_type),
             ("span", trace_pb2.Span.DESCRIPTOR),
             ("event", trace_pb2.Span.Event.DESCRIPTOR),
             ("link", trace_pb2.Span.Link.DESCRIPTOR),
             ("status", trace_pb2.Status.DESCRIPTOR))}
_KIND_NAMES = {v.name: v.number for v in trace_pb2.Span.SpanKind.DESCRIPTOR.values}
_STATUS_NAMES = {v.name: v.number for v in trace_pb2.Status.StatusCode.DESCRIPTOR.values}


def _fields(d, what: str) -> dict:
    if type(d) is not dict or not d.keys() <= _KEYS[what]:
        raise _Slow
    return d


def _get(d: dict, key: str, convert, default):
    v = d.get(key, _ABSENT)
    if v is _ABSENT:
        return default
    return convert(v)


def _str(v) -> str:
    if type(v) is str and (v.isascii() or not _SURROGATE.search(v)):
        return v
    raise _Slow


def _id(v) -> bytes:
    if type(v) is str:
        try:
            return bytes.fromhex(v)
        except ValueError:
            pass
    raise _Slow


def _integer(v, low: int, high: int) -> int:
    if type(v) is int:
        n = v
    elif type(v) is str and _DIGITS.match(v):
        n = int(v)
    else:
        raise _Slow
    if low <= n < high:
        return n
    raise _Slow


def _u32(v) -> int:
    return _integer(v, 0, _U32)


def _u64(v) -> int:
    return _integer(v, 0, _U64)


def _enum(names: dict):
    def convert(v) -> int:
        if type(v) is int and -_I32 <= v < _I32:
            return v
        if type(v) is str and v in names:
            return names[v]
        raise _Slow
    return convert


_kind = _enum(_KIND_NAMES)
_status_code = _enum(_STATUS_NAMES)


_MAX_NESTING = 8  # arrays and kvlists within a value; deeper goes to protobuf, whose own
# limit (100 messages, counted from the request) it then applies


def _any(v, depth: int = 0):
    if type(v) is not dict or len(v) > 1:
        raise _Slow
    if not v:
        return None  # an AnyValue with nothing set
    (k, x), = v.items()
    if k == "stringValue":
        return _str(x)
    if k == "intValue":
        return _integer(x, -_I64, _I64)
    if k == "doubleValue":
        if type(x) is float and math.isfinite(x):
            return x
        if type(x) is int:
            try:
                return float(x)
            except OverflowError:
                pass
        raise _Slow
    if k == "boolValue":
        if type(x) is bool:
            return x
        raise _Slow
    if k == "arrayValue" and depth < _MAX_NESTING:
        return [_any(e, depth + 1) for e in _values(x)]
    if k == "kvlistValue" and depth < _MAX_NESTING:
        return _attributes(_values(x), depth + 1)
    raise _Slow  # bytesValue (protobuf's base64 rules), stringValueStrindex, unknown,
    # or nested deeper than _MAX_NESTING


def _values(x) -> list:
    if type(x) is not dict or not x.keys() <= {"values"}:
        raise _Slow
    v = x.get("values", [])
    if type(v) is not list:
        raise _Slow
    return v


def _attributes(kvs, depth: int = 0) -> dict:
    if type(kvs) is not list:
        raise _Slow
    out = {}
    for kv in kvs:
        if type(kv) is not dict:
            raise _Slow
        key = kv.get("key", "")
        value = kv.get("value", _ABSENT)
        if len(kv) != ("key" in kv) + (value is not _ABSENT):
            raise _Slow  # keyStrindex or an unknown key
        out[_str(key)] = None if value is _ABSENT else _any(value, depth)
    return out


def _list(v) -> list:
    if type(v) is not list:
        raise _Slow
    return v


def _check_event(e) -> None:
    e = _fields(e, "event")
    _get(e, "timeUnixNano", _u64, 0)
    _get(e, "name", _str, "")
    _get(e, "attributes", _attributes, None)
    _get(e, "droppedAttributesCount", _u32, 0)


def _link(link) -> tuple[bytes, bytes]:
    link = _fields(link, "link")
    _get(link, "traceState", _str, "")
    _get(link, "attributes", _attributes, None)
    _get(link, "droppedAttributesCount", _u32, 0)
    _get(link, "flags", _u32, 0)
    return _get(link, "traceId", _id, b""), _get(link, "spanId", _id, b"")


def _check_status(st) -> None:
    st = _fields(st, "status")
    _get(st, "message", _str, "")
    _get(st, "code", _status_code, 0)


def fast_spans(doc: dict, extract: Mapping[str, tuple[str, ...]] | None = None
               ) -> list[SpanView] | None:
    """``json_spans`` without protobuf: None when the request holds anything this
    reader leaves to protobuf's parser."""
    try:
        return _fast_spans(doc, extract or {})
    except _Slow:  # (its recursion is bounded by _MAX_NESTING)
        return None


def _fast_spans(doc: dict, extract: Mapping[str, tuple[str, ...]]) -> list[SpanView]:
    out = []
    add = out.append
    for rs in _list(_fields(doc, "request").get("resourceSpans", [])):
        rs = _fields(rs, "resource_spans")
        _get(rs, "schemaUrl", _str, "")
        res = _fields(rs.get("resource", {}), "resource")
        _get(res, "droppedAttributesCount", _u32, 0)
        resource = _get(res, "attributes", _attributes, {})
        for ss in _list(rs.get("scopeSpans", [])):
            ss = _fields(ss, "scope_spans")
            _get(ss, "schemaUrl", _str, "")
            scope = _fields(ss.get("scope", {}), "scope")
            _get(scope, "version", _str, "")
            _get(scope, "attributes", _attributes, None)
            _get(scope, "droppedAttributesCount", _u32, 0)
            scope_name = _get(scope, "name", _str, "")
            for s in _list(ss.get("spans", [])):
                s = _fields(s, "span")
                name = _get(s, "name", _str, "")
                attrs = _get(s, "attributes", _attributes, {})
                for key in ("flags", "droppedAttributesCount", "droppedEventsCount",
                            "droppedLinksCount"):
                    _get(s, key, _u32, 0)
                trace_state = _get(s, "traceState", _str, "")
                if "events" in s:
                    for e in _list(s["events"]):
                        _check_event(e)
                if "status" in s:
                    _check_status(s["status"])
                links = [_link(k) for k in _list(s["links"])] if "links" in s else []
                keys = extract.get(name)
                add(SpanView(
                    _get(s, "traceId", _id, b""), _get(s, "spanId", _id, b""),
                    _get(s, "parentSpanId", _id, b""), name, _get(s, "kind", _kind, 0),
                    _get(s, "startTimeUnixNano", _u64, 0),
                    _get(s, "endTimeUnixNano", _u64, 0), attrs, resource, scope_name, links,
                    None if keys is None else [attrs.get(k) for k in keys], trace_state))
    return out
