"""Span adapters on hand-made spans: each server's shape, the model rule, the edge cases."""

from __future__ import annotations

import pytest

from phasewatch.ingest.adapters import (
    AdapterContext,
    Rejected,
    classify,
    genai,
    remember,
    sglang,
    tgi,
    vllm,
)
from phasewatch.ingest.adapters.tgi import parse_duration
from phasewatch.ingest.adapters.traces import TraceParts
from phasewatch.ingest.otlp.spans import SpanView

NS = 1_000_000_000
T0 = 1_700_000_000 * NS


def span(name, attrs=None, resource=None, start=T0, end=T0 + 2 * NS, **kw):
    return SpanView(trace_id=b"t" * 16, span_id=kw.pop("span_id", b"s" * 8),
                    parent_span_id=kw.pop("parent", b""), name=name, kind=2, start_ns=start,
                    end_ns=end, attributes=attrs or {}, resource=resource or {}, scope="",
                    links=kw.pop("links", []))


VLLM_V1 = {"gen_ai.latency.time_to_first_token": 0.25, "gen_ai.latency.e2e": 1.75,
           "gen_ai.latency.time_in_queue": 0.05, "gen_ai.latency.time_in_model_prefill": 0.1,
           "gen_ai.latency.time_in_model_decode": 1.5, "gen_ai.usage.prompt_tokens": 900,
           "gen_ai.usage.completion_tokens": 151, "gen_ai.request.id": "cmpl-1"}


def test_vllm_v1_timeline():
    r = vllm.convert(span("llm_request", VLLM_V1), AdapterContext(default_model="llama"))
    model, engine, _, rid, arrival, queued, scheduled, first, last, finish, p, c, o, _ = r
    assert arrival == T0
    assert (model, engine, rid, p, c, o) == ("llama", "vllm", "cmpl-1", 900, None, 151)
    # scheduled = first token - prefill (exact), not arrival + time in queue; queued =
    # scheduled - time_in_queue (the engine's own queue), so preprocess = 0.1 s
    assert (queued - T0, scheduled - T0, first - T0, last - T0, finish - T0) == (
        0.10 * NS, 0.15 * NS, 0.25 * NS, 1.75 * NS, 1.75 * NS)


def test_vllm_v0_has_no_split_and_a_model():
    attrs = {"gen_ai.latency.time_to_first_token": 0.3, "gen_ai.latency.e2e": 2.0,
             "gen_ai.latency.time_in_queue": 0.1, "gen_ai.response.model": "opt-125m",
             "gen_ai.usage.prompt_tokens": 10, "gen_ai.usage.completion_tokens": 20}
    r = vllm.convert(span("llm_request", attrs), AdapterContext())
    # V0's time_in_queue runs from arrival: no queued time, no preprocess
    assert r[0] == "opt-125m" and r[6] - T0 == 0.1 * NS and r[8] is None and r[5] is None


def test_rounding_disagreements_of_a_few_ns_are_one_instant():
    attrs = dict(VLLM_V1, **{"gen_ai.latency.e2e": 1.75 - 3e-9})  # e2e a hair early
    r = vllm.convert(span("llm_request", attrs), AdapterContext())
    assert r[9] == r[8]  # finish == last token, not 3 ns before it


@pytest.mark.parametrize("attrs,reason", [
    ({"gen_ai.latency.e2e": "1.0"}, "bad_attribute_type"),
    ({"gen_ai.latency.e2e": -1.0}, "negative_duration"),
    ({"gen_ai.latency.e2e": float("nan")}, "bad_attribute_value"),
    ({"gen_ai.latency.e2e": 1.0, "gen_ai.usage.prompt_tokens": 1.5}, "bad_attribute_type"),
    ({"gen_ai.latency.e2e": 1.0, "gen_ai.usage.prompt_tokens": -2}, "negative_token_count"),
    ({"gen_ai.request.id": "x"}, "no_latency_attributes"),
])
def test_unusable_request_spans_say_why(attrs, reason):
    with pytest.raises(Rejected) as e:
        vllm.convert(span("llm_request", attrs), AdapterContext())
    assert e.value.reason == reason


SGL_ROOT = {"gen_ai.latency.time_to_first_token": 0.25, "gen_ai.latency.e2e": 1.75,
            "gen_ai.latency.time_in_model_prefill": 0.2,  # holds the scheduler's wait
            "gen_ai.latency.time_in_model_decode": 1.5, "gen_ai.usage.prompt_tokens": 900,
            "gen_ai.usage.completion_tokens": 4, "gen_ai.usage.cached_tokens": 512,
            "gen_ai.response.model": "qwen", "gen_ai.response.finish_reasons": '["length"]',
            "rid": "1a2b3c4d5e", "gen_ai.request.id": "1a2b3c4d5e"}
MS = 1_000_000


def sglang_tree(role="", trace=b"t" * 16, steps=3, root_id=b"R" * 8, kv=False):
    """An SGLang request as 0.5.23 traces it (fixtures' README): root, scheduler thread
    span, stage spans on the scheduler's clock (here: 50 ms queue, 100 ms prefill from
    T0 + 40 ms, decode steps of 500 ms after it)."""
    name = f"{role} Req 1a2b3c4d".lstrip() if role else " Req 1a2b3c4d"
    attrs = dict(SGL_ROOT)
    root = SpanView(trace, root_id, b"", name, 1, T0, T0 + 1_760 * MS, attrs, {}, "")
    thread = SpanView(trace, root_id[:4] + b"thrd", root_id, "Scheduler [TP 0]  [PP 0] (host:x)",
                      1, T0 + 30 * MS, T0 + 1_740 * MS, {"thread_label": "Scheduler"}, {}, "")
    th = thread.span_id
    stages = [("prefill_waiting", 40, 90), ("prefill_forward", 90, 190)]
    if kv:
        stages.append(("prefill_transfer_kv_cache", 190, 210))
    stages += [("decode_loop", 190 + 500 * i, 690 + 500 * i) for i in range(steps)]
    kids = [SpanView(trace, root_id[:4] + i.to_bytes(4, "big"), th, n, 1, T0 + a * MS,
                     T0 + b * MS, {"decode_ct": i} if n == "decode_loop" else {}, {}, "")
            for i, (n, a, b) in enumerate(stages)]
    return root, thread, kids


def test_sglang_root_alone_leaves_queue_and_prefill_unknown():
    """Without its stage spans the root's time_in_model_prefill (which holds the
    scheduler's wait) is not taken for prefill: queue and prefill are unknown."""
    s = span(" Req 1a2b3c4d", SGL_ROOT)
    assert classify(s) is sglang
    r = sglang.convert(s, AdapterContext())
    assert (r[0], r[1], r[2], r[3], r[11]) == ("qwen", "sglang", "length", "1a2b3c4d5e", 512)
    assert r[5] is None and r[6] is None  # queued, scheduled
    assert (r[7] - T0, r[9] - T0) == (0.25 * NS, 1.75 * NS)
    assert classify(span("prefill_forward Req 1a2b3c4d")) is None  # a stage span


def test_sglang_stage_spans_give_queue_prefill_and_token_times():
    ctx = AdapterContext(trace_parts=TraceParts())
    root, thread, kids = sglang_tree()
    for k in [*kids, thread]:
        assert remember(k, ctx.trace_parts)
    r = sglang.convert(root, ctx)
    first = T0 + 250 * MS  # creation + TTFT
    assert (r[7], r[6], r[5]) == (first, first - 100 * MS, first - 150 * MS)  # 100 ms prefill
    assert r[8] == first + 1_500 * MS  # + decode
    assert r[13] == [first, first + 500 * MS, first + 1000 * MS, first + 1500 * MS]
    assert len(ctx.trace_parts) == 0  # taken


def test_sglang_stages_of_two_scheduler_ranks_are_not_added_up():
    """Two scheduler processes (tensor-parallel ranks) tracing the same request: the
    stages are one rank's, not the sum of both."""
    ctx = AdapterContext(trace_parts=TraceParts())
    root, thread, kids = sglang_tree()
    rank1 = SpanView(thread.trace_id, b"rank1thr", thread.parent_span_id, thread.name, 1,
                     thread.start_ns + 1, thread.end_ns, {"thread_label": "Scheduler"}, {}, "")
    twins = [SpanView(k.trace_id, b"r1" + k.span_id[2:], rank1.span_id, k.name, 1,
                      k.start_ns + 1, k.end_ns, k.attributes, {}, "") for k in kids]
    for k in [*kids, thread, *twins, rank1]:
        remember(k, ctx.trace_parts)
    r = sglang.convert(root, ctx)
    assert (r[7] - r[6], r[6] - r[5]) == (100 * MS, 50 * MS)  # prefill, queue: once
    assert len(r[13]) == 4


def _ingest():
    from phasewatch.aggregation.aggregate import Aggregator
    from phasewatch.ingest.otlp.ingest import OtlpIngest

    now = [0.0]
    ing = OtlpIngest(Aggregator(), join_wait=10.0)
    ing.pending._clock = lambda: now[0]
    return ing, now


def _requests(ing) -> float:
    snap = ing._sink.snapshot()
    return float(snap.counters["requests"].sum())


def test_sglang_root_waits_for_the_schedulers_spans_from_another_process():
    """The scheduler's exporter may send after the tokenizer's: the root waits until its
    thread span (which ends after every stage) has come, then counts with all of it."""
    ing, _ = _ingest()
    root, thread, kids = sglang_tree()
    out = ing.export_spans([root], "otlp_grpc")
    assert out.accepted == 0 and len(ing.pending) == 1 and _requests(ing) == 0
    ing.export_spans(kids[:2], "otlp_grpc")  # some stages: still waiting
    assert len(ing.pending) == 1
    out = ing.export_spans([*kids[2:], thread], "otlp_grpc")
    assert out.accepted == 1 and len(ing.pending) == 0 and _requests(ing) == 1
    w = ing._sink.window
    assert w.columns().prefill[-1] == pytest.approx(0.1)
    assert w.columns().queue[-1] == pytest.approx(0.05)
    assert ing.stats.get("phasewatch_otlp_joined_requests_total", outcome="complete") == 1


def test_sglang_root_without_stage_spans_is_counted_after_the_wait():
    ing, now = _ingest()
    root, _, _ = sglang_tree()
    ing.export_spans([root], "otlp_http")
    assert ing.sweep() == 0 and _requests(ing) == 0
    now[0] = 10.0
    assert ing.sweep() == 1 and _requests(ing) == 1
    assert ing.stats.get("phasewatch_otlp_joined_requests_total", outcome="waited") == 1
    assert ing.stats.get("phasewatch_otlp_spans_total", protocol="otlp_http",
                         outcome="request") == 1
    assert ing.stats.get("phasewatch_phase_unavailable_total", phase="prefill",
                         reason="no_scheduled") == 1


def test_sglang_disaggregated_roles_are_one_request_with_a_kv_transfer():
    ing, _ = _ingest()
    p_root, p_thread, p_kids = sglang_tree("prefill", trace=b"p" * 16, steps=0,
                                           root_id=b"P" * 8, kv=True)
    d_root, d_thread, d_kids = sglang_tree("decode", trace=b"d" * 16, steps=3,
                                           root_id=b"D" * 8)
    d_kids = [k for k in d_kids if k.name == "decode_loop"]
    ing.export_spans([*p_kids, p_thread, p_root], "otlp_grpc")
    assert len(ing.pending) == 1 and _requests(ing) == 0  # waits for the decode role
    out = ing.export_spans([*d_kids, d_thread, d_root], "otlp_grpc")
    assert out.accepted == 2 and _requests(ing) == 1  # two roots, one request
    w = ing._sink.window
    assert w.columns().prefill[-1] == pytest.approx(0.1)
    assert w.columns().kv_transfer[-1] == pytest.approx(0.02)
    assert w.columns().queue[-1] == pytest.approx(0.05)
    assert w.columns().preprocess[-1] == pytest.approx(0.25 - 0.05 - 0.1 - 0.02)
    snap = ing._sink.snapshot()
    assert snap.counters["tokens"].sum(axis=0).tolist()[0] == 900  # the prompt, once


def test_sglang_late_role_is_refused_not_counted_twice():
    """A disaggregated request counted after the wait with one role: its other role,
    arriving later still, is refused with a reason, not counted as a second request."""
    ing, now = _ingest()
    p_root, p_thread, p_kids = sglang_tree("prefill", trace=b"p" * 16, steps=0,
                                           root_id=b"P" * 8, kv=True)
    d_root, d_thread, d_kids = sglang_tree("decode", trace=b"d" * 16, root_id=b"D" * 8)
    ing.export_spans([*p_kids, p_thread, p_root], "otlp_grpc")
    now[0] = 11.0
    assert ing.sweep() == 1 and _requests(ing) == 1
    out = ing.export_spans([*d_kids, d_thread, d_root], "otlp_grpc")
    assert out.rejected == {"late_role": 1} and _requests(ing) == 1


def test_sglang_waiting_roots_are_bounded():
    ing, _ = _ingest()
    ing.pending.max_pending = 2
    roots = [sglang_tree(trace=bytes([i]) * 16, root_id=bytes([i]) * 8)[0] for i in range(1, 5)]
    for r in roots:
        r.attributes = {**r.attributes, "rid": f"r{r.span_id.hex()}"}
    ing.export_spans(roots, "otlp_grpc")
    assert len(ing.pending) == 2 and _requests(ing) == 2  # the oldest counted early
    assert ing.stats.get("phasewatch_otlp_joined_requests_total", outcome="capacity") == 2


@pytest.mark.parametrize("text,seconds", [
    ("1.234567ms", 0.001234567), ("2.5s", 2.5), ("850µs", 850e-6), ("850μs", 850e-6),
    ("12ns", 12e-9), ("1.2345s", 1.2345), ("3600s", 3600.0)])
def test_rust_durations(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["1.2 minutes", "", "ms", "-3ms", "1e3s"])
def test_not_rust_durations(bad):
    with pytest.raises(ValueError):
        parse_duration(bad)


def test_tgi_first_token_and_token_times_from_its_own_trace():
    attrs = {"total_time": "2.0002s", "validation_time": "200µs", "queue_time": "50ms",
             "inference_time": "1.75s", "time_per_token": "25ms"}
    ctx = AdapterContext(trace_parts=TraceParts())
    req = span("generate_stream", attrs, {"service.name": "text-generation-inference.router"})
    r = tgi.convert(req, ctx)
    assert r[7] is None and r[12] == 70  # no TTFT without its child spans; 1.75 s / 25 ms
    assert (r[5] - T0, r[6] - T0) == (round(0.0002 * NS), round(0.0502 * NS))  # the fields
    router = {"code.namespace": "text_generation_router_v3::backend"}
    child = dict(parent=b"S" * 8)
    queued = span("queued", router, start=T0 + 300_000, end=T0 + 50_300_000,
                  span_id=b"q" * 8, **child)
    tokens = [T0 + round(0.3502 * NS) + i * 25_000_000 for i in range(70)]
    gens = [span("send_generation", router, start=t, end=t + 1000, span_id=i.to_bytes(8, "big"),
                 **child) for i, t in enumerate(tokens)]
    for s in [queued, *gens, gens[5]]:  # a repeated span (a retried export) adds nothing
        assert remember(s, ctx.trace_parts)
    assert not remember(span("queued", {}, span_id=b"x" * 8), ctx.trace_parts)  # not TGI's
    r = tgi.convert(req, ctx)
    assert (r[5] - T0, r[6] - T0) == (300_000, 50_300_000)  # the queue's own span
    assert r[7] == tokens[0] and r[8] == tokens[-1] and r[13] == tokens
    assert len(ctx.trace_parts) == 0  # taken
    with pytest.raises(Rejected, match="bad_duration"):
        tgi.convert(span("generate", dict(attrs, total_time="soon")), ctx)


def test_tgi_inner_spans_without_fields_are_not_requests():
    service = {"service.name": "text-generation-inference.router"}
    for name in ("generate", "generate_stream", "compat_generate"):
        assert classify(span(name, {"code.namespace": "text_generation_router::infer"},
                            service)) is None
    assert classify(span("vertex_compatibility", {"total_time": "1s", "inference_time": "1s"},
                         service)) is tgi


def test_genai_semconv_old_and_new_names():
    new = {"gen_ai.usage.input_tokens": 30, "gen_ai.usage.output_tokens": 7,
           "gen_ai.request.model": "gpt-x", "gen_ai.response.time_to_first_chunk": 0.4,
           "gen_ai.response.finish_reasons": ["stop"]}
    old = {"gen_ai.usage.prompt_tokens": 30, "gen_ai.usage.completion_tokens": 7,
           "gen_ai.response.model": "gpt-x"}
    for attrs in (new, old):
        s = span("chat gpt-x", attrs)
        assert classify(s) is genai
        r = genai.convert(s, AdapterContext())
        assert (r[0], r[1], r[10], r[12]) == ("gpt-x", "otel", 30, 7)
    assert genai.convert(span("chat", new), AdapterContext())[7] - T0 == 0.4 * NS


def test_not_requests_are_ignored():
    for name in ("Load weights", "Worker init", "batch", "prefill", "infer", "decode"):
        assert classify(span(name)) is None


def test_model_rule():
    s = span("llm_request", VLLM_V1, {"service.name": "vllm-8b"})
    mapped = AdapterContext(service_models={"vllm-8b": "meta-llama/Llama-3.1-8B-Instruct"})
    assert mapped.model_for(s) == "meta-llama/Llama-3.1-8B-Instruct"
    assert AdapterContext(default_model="m").model_for(s) == "m"
    assert AdapterContext().model_for(s) == "vllm-8b"
    anon = span("llm_request", VLLM_V1, {"service.name": "unknown_service:python"})
    assert AdapterContext().model_for(anon) == "unknown"
    assert AdapterContext(default_model="m").model_for(anon, "from-attr") == "from-attr"


# ---- the vectorised latency path equals the per-span one ---------------------------------
_LATENCY_KEYS = ("gen_ai.latency.time_to_first_token", "gen_ai.latency.e2e",
                 "gen_ai.latency.time_in_queue", "gen_ai.latency.time_in_model_prefill",
                 "gen_ai.latency.time_in_model_decode")
_COUNT_KEYS = ("gen_ai.usage.prompt_tokens", "gen_ai.usage.input_tokens",
               "gen_ai.usage.cached_tokens", "gen_ai.usage.cache_read.input_tokens",
               "gen_ai.usage.completion_tokens", "gen_ai.usage.output_tokens")
_TEXT_KEYS = ("gen_ai.response.model", "gen_ai.request.model", "gen_ai.request.id",
              "gen_ai.response.finish_reasons")


def _odd_values():
    from hypothesis import strategies as st

    return st.one_of(
        st.none(), st.floats(allow_nan=True, allow_infinity=True),
        st.floats(min_value=0, max_value=100), st.integers(-5, 10**4),
        st.sampled_from([0, 0.0, -0.0, 1e-9, 3.0, 2.5, 1e8, 1e8 + 1, 9e17, 2**53, 2**53 - 1, 2**62,
                         10**400, True, False]),
        st.text(max_size=4), st.lists(st.sampled_from(["stop", "length"]), max_size=2))


def _attributes():
    from hypothesis import strategies as st

    return st.fixed_dictionaries({}, optional={
        **{k: st.one_of(st.floats(0, 10), _odd_values()) for k in _LATENCY_KEYS},
        **{k: st.one_of(st.integers(0, 5000), _odd_values()) for k in _COUNT_KEYS},
        **{k: st.one_of(st.sampled_from(["", "m1", "req-1", '["stop"]', "[bad"]), _odd_values())
           for k in _TEXT_KEYS}})


@pytest.mark.parametrize("adapter", [vllm])
def test_latency_batch_equals_latency_row_span_by_span(adapter):
    """Every span gets from ``convert_many`` what ``convert`` gives it alone: the same
    columns when accepted, the same first reason when rejected (hostile values too)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from phasewatch.ingest.otlp.ingest import MAX_TIME_NS  # later spans are refused before this
    from phasewatch.requests.record import RequestBatch

    resources = [{}, {"service.name": "svc-a"}, {"service.name": "unknown_service:python"}]

    @settings(max_examples=300, deadline=None)
    @given(st.lists(st.tuples(_attributes(), st.integers(0, 2), st.integers(0, MAX_TIME_NS),
                              st.integers(0, 5 * NS)), max_size=12))
    def check(specs):
        ctx = AdapterContext(service_models={"svc-a": "mapped"})
        spans = [span("llm_request", attrs, resource=resources[r], start=start,
                      end=start + dur) for attrs, r, start, dur in specs]
        batch, reasons = adapter.convert_many(spans, ctx)
        want_rows, want_reasons = [], []
        for s in spans:
            try:
                want_rows.append(adapter.convert(s, ctx))
                want_reasons.append("")
            except Rejected as e:
                want_reasons.append(e.reason)
        assert reasons == want_reasons
        want = RequestBatch.from_rows(want_rows, times_in_ns=True)
        assert len(batch) == len(want)
        for col in ("arrival", "scheduled", "first_token", "last_token", "finish",
                    "prompt_tokens", "cached_prompt_tokens", "output_tokens"):
            assert getattr(batch, col).tolist() == getattr(want, col).tolist(), col
        for col in ("model", "engine", "finish_reason", "request_id"):
            assert batch.strings_of(getattr(batch, col)) == want.strings_of(getattr(want, col))

    check()


def test_parallel_sampling_counts_the_prompt_once_across_exports():
    from phasewatch.aggregation.aggregate import Aggregator

    ctx = AdapterContext(default_model="m")
    agg = Aggregator()
    # vLLM 0.32 (measured): n=3 gives three spans in three traces, one request id, one
    # arrival, the whole prompt on each, and gen_ai.request.n = 1 on each
    seq = dict(VLLM_V1, **{"gen_ai.request.n": 1, "gen_ai.request.id": "cmpl-7-0"})
    first, _ = vllm.convert_many([span("llm_request", seq, span_id=b"a" * 8),
                                  span("llm_request", seq, span_id=b"b" * 8),
                                  span("llm_request", VLLM_V1, span_id=b"c" * 8)], ctx)
    later, _ = vllm.convert_many([span("llm_request", seq, span_id=b"d" * 8)], ctx)
    assert first.prompt_shared.tolist() == [False, True, False]
    assert later.prompt_shared.tolist() == [True]
    # the same id at another arrival is another request (a client reusing X-Request-Id)
    again, _ = vllm.convert_many([span("llm_request", seq, start=T0 + NS, end=T0 + 3 * NS,
                                       span_id=b"e" * 8)], ctx)
    assert again.prompt_shared.tolist() == [False]
    for b in (first, later, again):
        agg.ingest(b, "test")
    snap = agg.snapshot()
    prompt, _, output = snap.counters["tokens"][0]
    assert (prompt, output) == (3 * 900, 5 * 151)  # the n=3 prompt once, outputs each
    assert snap.counters["requests"].sum() == 5  # every sequence is a request, as vLLM's


def test_classifying_an_engines_span_leaves_its_attributes_undecoded():
    """Issue 41: the tap's adapter, asked first, read its mark from every span, and a
    vLLM ``llm_request`` span's attributes (decoded lazily: ``walk`` extracts the keys
    its adapter reads) were all decoded for it: a third of the OTLP ingest's time. The
    tap's spans are named "{operation} {model}": the name is read first. Its own spans
    (and only they) are still the tap's."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
    from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

    from phasewatch.ingest.adapters import ADAPTERS, tap
    from phasewatch.ingest.otlp.spans import LazyAttributes, walk

    def kv(key, value):
        v = (AnyValue(string_value=value) if isinstance(value, str) else
             AnyValue(int_value=value) if isinstance(value, int) else
             AnyValue(double_value=value))
        return KeyValue(key=key, value=v)

    def pb(name, attrs):
        return Span(trace_id=b"t" * 16, span_id=b"s" * 8, name=name, kind=2,
                    start_time_unix_nano=T0, end_time_unix_nano=T0 + NS,
                    attributes=[kv(k, v) for k, v in attrs.items()])

    msg = ExportTraceServiceRequest(resource_spans=[ResourceSpans(scope_spans=[ScopeSpans(
        spans=[pb("llm_request", VLLM_V1),
               pb("chat llama", {tap.MARK: "tap", "gen_ai.request.model": "llama"}),
               pb("llm_request", {**VLLM_V1, tap.MARK: "tap"})])])])
    engine, ours, marked = walk(msg, ADAPTERS.extract)
    assert isinstance(engine.attributes, LazyAttributes)
    assert classify(engine) is vllm
    assert engine.attributes._decoded is None  # nothing decoded to classify it
    assert classify(ours) is tap
    assert classify(marked) is vllm  # the mark alone, on an engine's span, is not the tap's
