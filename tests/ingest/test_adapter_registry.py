"""The adapter contract: a new engine is one module and one registry line, and the OTLP
ingest takes its spans without a word changed; an adapter that declares what it lacks
(or has what it does not declare) is refused when the registry is built."""

from __future__ import annotations

import importlib.util
import types

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from phasewatch.aggregation.aggregate import Aggregator
from phasewatch.ingest.adapters import ADAPTERS, AdapterRegistry, Capabilities, genai, vllm
from phasewatch.ingest.otlp.ingest import EXTRACT, OtlpIngest

NS = 1_000_000_000
T0 = 1_700_000_000 * NS

# A made-up engine's adapter, written as its module would be in ingest/adapters/.
LCPP = '''
"""A made-up server's ``lcpp_request`` spans: the request's arrival to its finish, with
its time to first token in milliseconds and its token counts."""

from phasewatch.ingest.adapters.attributes import after, count, seconds
from phasewatch.ingest.adapters.contract import Capabilities, Rejected
from phasewatch.ingest.adapters.rows import row

ENGINE = "lcpp"
CAPABILITIES = Capabilities()


def matches(span) -> bool:
    return span.name == "lcpp_request"


def convert(span, ctx) -> tuple:
    a = span.attributes
    ttft_ms = seconds(a, "lcpp.ttft_ms")
    if ttft_ms is None:
        raise Rejected("no_latency_attributes", "lcpp_request without lcpp.ttft_ms")
    first = after(span.start_ns, ttft_ms / 1000)
    return row(ctx.model_for(span), ENGINE, "stop", "", span.start_ns, None, first,
               span.end_ns, span.end_ns, count(a, "lcpp.prompt_tokens"), None,
               count(a, "lcpp.output_tokens"))
'''


@pytest.fixture
def lcpp(tmp_path):
    path = tmp_path / "lcpp.py"
    path.write_text(LCPP)
    spec = importlib.util.spec_from_file_location("lcpp", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _export(spans: list[tuple[str, dict, int]]) -> ExportTraceServiceRequest:
    """One resource's spans: (name, attributes, index) each, 2 s long, 1 s apart."""
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    kv = rs.resource.attributes.add(key="service.name")
    kv.value.string_value = "lcpp-server"
    ss = rs.scope_spans.add()
    for name, attrs, i in spans:
        s = ss.spans.add(name=name, trace_id=bytes([i + 1]) * 16, span_id=bytes([i + 1]) * 8,
                         start_time_unix_nano=T0 + i * NS,
                         end_time_unix_nano=T0 + (i + 2) * NS)
        for k, v in attrs.items():
            a = s.attributes.add(key=k)
            if isinstance(v, float):
                a.value.double_value = v
            else:
                a.value.int_value = v
    return req


def _requests_by_engine(agg: Aggregator) -> dict[str, float]:
    snap = agg.snapshot()
    engine = snap.label_names.index("engine")
    out: dict[str, float] = {}
    for labels, n in zip(snap.label_sets, snap.counters["requests"].sum(axis=1), strict=True):
        out[labels[engine]] = out.get(labels[engine], 0.0) + float(n)
    return out


def test_a_new_engine_is_one_module_and_one_registry_line(lcpp):
    registry = AdapterRegistry(lcpp, *ADAPTERS)  # the one line
    agg = Aggregator()
    ingest = OtlpIngest(agg, adapters=registry)
    ok = {"lcpp.ttft_ms": 250.0, "lcpp.prompt_tokens": 900, "lcpp.output_tokens": 40}
    vllm_span = {"gen_ai.latency.time_to_first_token": 0.25, "gen_ai.latency.e2e": 1.75,
                 "gen_ai.usage.prompt_tokens": 10, "gen_ai.usage.completion_tokens": 5}
    out = ingest.export(_export([("lcpp_request", ok, 0), ("lcpp_request", ok, 1),
                                 ("lcpp_request", {"lcpp.prompt_tokens": 3}, 2),
                                 ("llm_request", vllm_span, 3), ("lcpp_warmup", {}, 4)]),
                        "otlp_grpc")
    assert (out.accepted, out.ignored, dict(out.rejected)) == (3, 1,
                                                               {"no_latency_attributes": 1})
    assert _requests_by_engine(agg) == {"lcpp": 2.0, "vllm": 1.0}
    snap = agg.snapshot()
    models = {ls[snap.label_names.index("model")] for ls in snap.label_sets}
    assert models == {"lcpp-server"}  # the model rule is the context's, for every engine
    # without its line the same spans are not requests
    plain = OtlpIngest(Aggregator())
    out = plain.export(_export([("lcpp_request", ok, 0)]), "otlp_grpc")
    assert (out.accepted, out.ignored) == (0, 1)


def test_what_the_ingest_asks_comes_from_the_registry():
    assert dict(EXTRACT) == dict(ADAPTERS.extract) == {vllm.SPAN_NAME: vllm.CAPABILITIES.extract[
        vllm.SPAN_NAME]}
    assert list(ADAPTERS)[-1] is genai  # the catch-all comes last
    # an ingest without an adapter that pairs roots has an empty waiting room
    ingest = OtlpIngest(Aggregator(), adapters=AdapterRegistry(vllm, genai))
    assert len(ingest.pending) == 0 and ingest.sweep() == 0
    assert dict(ingest.extract) == dict(EXTRACT)


def _module(**attrs) -> types.ModuleType:
    m = types.ModuleType("broken")
    m.ENGINE, m.matches, m.convert = "broken", lambda span: False, lambda span, ctx: ()
    for k, v in attrs.items():
        setattr(m, k, v)
    return m


@pytest.mark.parametrize("attrs,message", [
    ({}, "lacks CAPABILITIES"),
    ({"CAPABILITIES": Capabilities(remembers=True)}, r"declares remembers .* no remember\(\)"),
    ({"CAPABILITIES": Capabilities(), "decode_step": lambda span: None},
     r"has decode_step\(\) but does not declare decode_steps"),
    ({"CAPABILITIES": Capabilities(extract={"x": ("k",)})}, "extract keys without"),
    ({"CAPABILITIES": Capabilities(pairs_roots=True), "waiting_room": lambda hold: None},
     "only one adapter may pair roots"),
])
def test_an_adapter_that_breaks_the_contract_is_refused(attrs, message):
    with pytest.raises(ValueError, match=message):
        AdapterRegistry(*ADAPTERS, _module(**attrs))
