"""The direct OTLP/JSON reader against protobuf's parser: the same spans or the same
error, on well-formed and hostile documents."""

from __future__ import annotations

import copy
import json
import math
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from phasewatch.ingest.otlp.ingest import EXTRACT
from phasewatch.ingest.otlp.jsonform import fast_spans, json_spans, parse_json_request, request_json
from phasewatch.ingest.otlp.spans import MalformedPayload, walk
from phasewatch.sim import otlp_shapes
from phasewatch.sim.scenarios import scenario


def _nan_equal(x):
    """``x`` with every NaN replaced by a marker, so that equal results compare equal."""
    if isinstance(x, float) and math.isnan(x):
        return "<NaN>"
    if isinstance(x, dict):
        return {k: _nan_equal(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_nan_equal(v) for v in x)
    return x


def _norm(spans) -> list[tuple]:
    return _nan_equal([(s.trace_id, s.span_id, s.parent_span_id, s.name, s.kind, s.start_ns,
                        s.end_ns, dict(s.attributes), s.resource, s.scope, s.links, s.values)
                       for s in spans])


def _slow(data: bytes):
    try:
        return _norm(walk(parse_json_request(data), EXTRACT))
    except MalformedPayload:
        return "error"


def _check(doc) -> bool:
    """Both readers agree on ``doc``; True when the direct reader decided it."""
    data = json.dumps(doc).encode()
    slow = _slow(data)
    fast = fast_spans(json.loads(data), EXTRACT)
    if slow == "error":
        assert fast is None, "the direct reader accepted what protobuf refuses"
        with pytest.raises(MalformedPayload):
            json_spans(data, EXTRACT)
        return False
    assert _norm(json_spans(data, EXTRACT)) == slow
    if fast is None:
        return False
    assert _norm(fast) == slow
    return True


@pytest.mark.parametrize("shape", ["vllm", "sglang", "tgi"])
def test_sdk_documents_take_the_direct_reader_and_agree(shape):
    mem = InMemorySpanExporter()
    tp = otlp_shapes.provider(shape, mem)
    tracer = otlp_shapes.tracer_for(tp, shape)
    for r in scenario("chat").build(seed=3).run(5.0, epoch=time.time() - 30.0)[:40]:
        otlp_shapes.EMIT[shape](tracer, r)
    assert tp.force_flush(30_000)
    doc = request_json(encode_spans(mem.get_finished_spans()))
    assert _check(doc)
    # and as a Collector writes it: enums as numbers, 64-bit integers as numbers
    for rs in doc["resourceSpans"]:
        for ss in rs["scopeSpans"]:
            for s in ss["spans"]:
                s["kind"] = 2
                s["startTimeUnixNano"] = int(s["startTimeUnixNano"])
    assert _check(doc)


def test_a_quoted_nan_goes_to_protobuf_which_reads_it():
    """protobuf's JSON mapping spells special doubles as strings ("NaN", "Infinity"); the
    direct reader leaves them to it (the adapters then refuse the value, counted)."""
    for special in ("NaN", "Infinity", "-Infinity"):
        span = {"traceId": "0" * 32, "spanId": "0" * 16, "name": "llm_request",
                "attributes": [{"key": "gen_ai.latency.e2e",
                                "value": {"doubleValue": special}}]}
        assert not _check({"resourceSpans": [{"scopeSpans": [{"spans": [span]}]}]})


@pytest.mark.parametrize("depth", [1, 8, 9, 30, 48, 49, 60])
def test_nested_values_agree_at_every_depth(depth):
    """protobuf refuses values nested past its message depth (100, counted from the
    request); the direct reader leaves anything deeper than a few levels to it."""
    for kind in ("arrayValue", "kvlistValue"):
        value = {"stringValue": "x"}
        for _ in range(depth):
            value = ({"arrayValue": {"values": [value]}} if kind == "arrayValue" else
                     {"kvlistValue": {"values": [{"key": "k", "value": value}]}})
        span = {"traceId": "0" * 31 + "1", "spanId": "0" * 15 + "1", "name": "llm_request",
                "attributes": [{"key": "deep", "value": value}]}
        doc = {"resourceSpans": [{"scopeSpans": [{"spans": [span]}]}]}
        assert _check(doc) == (depth <= 8)


# ---- hostile documents: clean ones, then a few mutations at random places ------------
_ODD = [None, True, 1.5, -1, 2 ** 64, 2 ** 63, "12", "-3", " 4", "+5", "1e3", "x", [], {},
        "NaN", 1e300, 10 ** 400, "\ud800", "\ud83d\ude00", "0a 0b", "zz", 7, "007", "-0",
        2 ** 31, "SPAN_KIND_SERVER", "STATUS_CODE_ERROR", [{}], {"values": []},
        "1" * 5000, "0" * 25 + "1"]
_ODD_KEYS = ["trace_id", "future", "[ext]", "value", "values", "key", "keyStrindex",
             "bytesValue", "entityRefs", "string_value", "intValue", "\ud800"]

_hexid = st.binary(min_size=0, max_size=16).map(bytes.hex)
_text = st.one_of(st.text(max_size=8), st.sampled_from(["llm_request", "", "é"]))
_int64 = st.one_of(st.integers(-2 ** 63, 2 ** 63 - 1),
                   st.integers(-2 ** 63, 2 ** 63 - 1).map(str))
_u64 = st.one_of(st.integers(0, 2 ** 64 - 1), st.integers(0, 2 ** 64 - 1).map(str))
_u32 = st.integers(0, 2 ** 32 - 1)
_double = st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.integers(-10, 10))
_scalar = st.one_of(
    st.builds(lambda v: {"stringValue": v}, _text),
    st.builds(lambda v: {"intValue": v}, _int64),
    st.builds(lambda v: {"doubleValue": v}, _double),
    st.builds(lambda v: {"boolValue": v}, st.booleans()),
    st.builds(dict))  # an AnyValue with nothing set (a fresh one: mutations edit it)


def _kv(values):
    return st.one_of(st.fixed_dictionaries({"key": st.sampled_from(
        ["gen_ai.latency.e2e", "gen_ai.latency.time_to_first_token",
         "gen_ai.usage.prompt_tokens", "gen_ai.usage.completion_tokens",
         "gen_ai.response.model", "gen_ai.response.finish_reasons", "k", ""]),
        "value": values}), st.fixed_dictionaries({"key": _text}))


def _any_value(children):
    return st.one_of(
        _scalar,
        st.builds(lambda v: {"arrayValue": {"values": v}}, st.lists(children, max_size=3)),
        st.builds(lambda v: {"kvlistValue": {"values": v}}, st.lists(_kv(children),
                                                                     max_size=3)))


_values = st.recursive(_scalar, lambda children: _any_value(children), max_leaves=6)
_attrs = st.lists(_kv(_values), max_size=8)


def _obj(required: dict, optional: dict):
    return st.fixed_dictionaries(required, optional=optional)


_span = _obj({"traceId": _hexid, "spanId": _hexid, "name": st.sampled_from(
    ["llm_request"] * 4 + ["infer", "prefill", "generate", "x"])},
    {"parentSpanId": _hexid, "kind": st.sampled_from([0, 2, 99, "SPAN_KIND_SERVER"]),
     "startTimeUnixNano": _u64, "endTimeUnixNano": _u64, "attributes": _attrs,
     "traceState": _text, "flags": _u32, "droppedAttributesCount": _u32,
     "droppedEventsCount": _u32, "droppedLinksCount": _u32,
     "events": st.lists(_obj({}, {"timeUnixNano": _u64, "name": _text,
                                  "attributes": _attrs, "droppedAttributesCount": _u32}),
                        max_size=2),
     "links": st.lists(_obj({"traceId": _hexid, "spanId": _hexid},
                            {"attributes": _attrs, "flags": _u32, "traceState": _text}),
                       max_size=2),
     "status": _obj({}, {"code": st.sampled_from([0, 2, "STATUS_CODE_ERROR"]),
                         "message": _text})})
_clean = _obj({"resourceSpans": st.lists(_obj(
    {"scopeSpans": st.lists(_obj({"spans": st.lists(_span, min_size=1, max_size=4)},
                                 {"scope": _obj({}, {"name": _text, "version": _text,
                                                     "attributes": _attrs}),
                                  "schemaUrl": _text}), min_size=1, max_size=2)},
    {"resource": _obj({}, {"attributes": _attrs, "droppedAttributesCount": _u32}),
     "schemaUrl": _text}), min_size=1, max_size=2)}, {})


def _nodes(x, out):
    if isinstance(x, dict):
        out.append(x)
        for v in x.values():
            _nodes(v, out)
    elif isinstance(x, list):
        out.append(x)
        for v in x:
            _nodes(v, out)
    return out


@st.composite
def _doc(draw):
    """A clean document, then 0 to 3 mutations, each at a random object or list: a
    value replaced by an odd one, a key removed, or an odd key added."""
    doc = draw(_clean)
    for _ in range(draw(st.sampled_from([0, 0, 1, 1, 2, 3]))):
        node = draw(st.sampled_from(_nodes(doc, [])))
        odd = copy.deepcopy(draw(st.sampled_from(_ODD)))
        if isinstance(node, list):
            if node and draw(st.booleans()):
                node[draw(st.integers(0, len(node) - 1))] = odd
            else:
                node.append(odd)
        elif node and draw(st.booleans()):
            key = draw(st.sampled_from(sorted(node)))
            if draw(st.booleans()):
                node[key] = odd
            else:
                del node[key]
        else:
            node[draw(st.sampled_from(_ODD_KEYS))] = odd
    return doc


@settings(max_examples=600, deadline=None, suppress_health_check=list(HealthCheck))
@given(_doc())
def test_the_direct_reader_agrees_with_protobuf_on_hostile_documents(doc):
    _check(doc)


def test_the_generator_reaches_both_readers_and_errors():
    """The property above is only as good as its inputs: they must exercise the direct
    reader, the fallback and protobuf's errors, each often."""
    outcomes = {"direct": 0, "fallback": 0, "error": 0}

    @settings(max_examples=300, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(_doc())
    def tally(doc):
        data = json.dumps(doc).encode()
        if _slow(data) == "error":
            outcomes["error"] += 1
        elif fast_spans(json.loads(data), EXTRACT) is not None:
            outcomes["direct"] += 1
        else:
            outcomes["fallback"] += 1

    tally()
    assert min(outcomes.values()) >= 20, outcomes
