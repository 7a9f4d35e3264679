"""The stream tap's record and the engine's span of one request, joined by traceparent.

Rows are built as the receivers build them (the tap's through the wire with source
tap, the engine's with its trace and parent span), on a hand-driven clock, so every
outcome (joined, alone after the wait, alone at once, late, capacity, n > 1) is decided
exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
from opentelemetry import context
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from phasewatch import tap as tapmod
from phasewatch.aggregation.aggregate import Aggregator
from phasewatch.aggregation.tracejoin import TraceJoin
from phasewatch.ingest import wire
from phasewatch.ingest.otlp.ingest import OtlpIngest
from phasewatch.requests.record import SOURCE_TAP, BatchBuilder, RequestBatch, RequestRecord
from phasewatch.selfstats import SelfStats
from phasewatch.sim import otlp_shapes

T0 = 1_800_000_000.0
KEY = "4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7"
KEY2 = "4bf92f3577b34da6a3ce929d0e0e4736-1111111111111111"
PRIMER = "0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331"  # another request's span


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def tap_record(key=KEY, choice=0, arrival=T0, first=T0 + 0.5, gaps=(0.1, 0.1, 0.1),
               output=4, cached=8, reason="stop") -> RequestRecord:
    times = list(np.cumsum([first, *gaps]))
    return RequestRecord("m", arrival=arrival, first_token=times[0], last_token=times[-1],
                         finish=times[-1] + 0.01, prompt_tokens=12, cached_prompt_tokens=cached,
                         output_tokens=output, finish_reason=reason, token_times=times,
                         trace_parent=key, choice=choice)


def engine_record(key=KEY, arrival=T0 + 0.02, queued=T0 + 0.05, scheduled=T0 + 0.25,
                  first=T0 + 0.45, last=T0 + 0.75, output=4,
                  request_id="cmpl-1") -> RequestRecord:
    return RequestRecord("m", arrival=arrival, queued=queued, scheduled=scheduled,
                         first_token=first, last_token=last, finish=last + 0.001,
                         prompt_tokens=12, output_tokens=output, request_id=request_id,
                         trace_parent=key)


def tap_batch(*records: RequestRecord) -> RequestBatch:
    """As the exporter decodes what ``phasewatch tap`` sends (source tap)."""
    data = wire.encode_export(RequestBatch.from_records(list(records)), "tap",
                              source=SOURCE_TAP)
    return wire.decode_export(data)[0]


def engine_batch(*records: RequestRecord, tapped: bool = False) -> RequestBatch:
    """As the OTLP receiver builds it (``tapped``: the spans carry the tap's tracestate
    member)."""
    return BatchBuilder.from_rows([r.row("vllm") for r in records]).columns(
        tapped=np.full(len(records), tapped)).build()


def fresh(clock: Clock, **kw) -> tuple[Aggregator, TraceJoin]:
    agg = Aggregator(SelfStats(), source_label=True)
    return agg, TraceJoin(agg, **{"wait": 10.0, "max_pending": 100, "clock": clock, **kw})


@pytest.fixture
def setup():
    """A join that has seen an engine sending trace context (one span of another
    request, counted alone at once and left out of what ``requests`` and ``outcomes``
    read): a tap's record waits for its engine span."""
    clock = Clock()
    agg, join = fresh(clock)
    join.ingest(engine_batch(engine_record(key=PRIMER, request_id="primer")), "otlp_grpc")
    return clock, agg, join


def requests(agg: Aggregator) -> list[dict]:
    return [r for r in agg.window.recent(agg.labels.pairs(), names=agg.labels.names)
            if r["request_id"] != "primer"]


def outcomes(agg: Aggregator) -> dict[str, float]:
    out = {lv[0]: v for (n, lv), v in agg.stats.snapshot().items()
           if n == "phasewatch_trace_join_requests_total"}
    if any(r["request_id"] == "primer" for r in agg.window.recent(
            agg.labels.pairs(), names=agg.labels.names)):
        out["engine_only_no_tap"] -= 1  # the primer's
    return {k: v for k, v in out.items() if v}


def test_the_tap_and_the_engine_make_one_request_on_one_timeline(setup):
    clock, agg, join = setup
    r = join.ingest(tap_batch(tap_record()), "grpc")
    assert r.accepted == 1 and requests(agg) == []  # waiting for the engine's span
    clock.t += 3
    join.ingest(engine_batch(engine_record()), "otlp_grpc")
    (row,) = requests(agg)
    assert (row["engine"], row["source"], row["request_id"]) == ("vllm", "joined", "cmpl-1")
    assert row["ttft"] == pytest.approx(0.5, abs=1e-6)  # the client's: tap arrival -> first chunk
    assert row["preprocess"] == pytest.approx(0.05, abs=1e-6)  # tap -> the engine's queue
    assert row["queue"] == pytest.approx(0.20, abs=1e-6)  # the engine's
    assert row["prefill"] == pytest.approx(0.25, abs=1e-6)  # scheduled -> the first token seen
    assert row["decode"] == pytest.approx(0.3, abs=1e-6)  # the tap's emissions
    assert (row["cached_prompt_tokens"], row["output_tokens"]) == (8, 4)  # tap's, engine's
    assert row["finish_reason"] == "stop"
    assert outcomes(agg) == {"joined": 1}
    assert join.pending_count() == 0


def test_the_engines_span_first_waits_for_the_tap_once_a_tap_is_seen(setup):
    _clock, agg, join = setup
    join.ingest(engine_batch(engine_record(key="")), "otlp_grpc")  # no parent: at once
    join.ingest(engine_batch(engine_record(key=KEY2)), "otlp_grpc")  # no tap seen yet
    assert len(requests(agg)) == 2 and outcomes(agg) == {"engine_only_no_tap": 1}
    join.ingest(tap_batch(tap_record(key=KEY2)), "grpc")  # its engine side was counted
    assert len(requests(agg)) == 2 and outcomes(agg) == {"engine_only_no_tap": 1,
                                                          "late": 1}
    join.ingest(engine_batch(engine_record()), "otlp_grpc")  # a tap is around: it waits
    assert len(requests(agg)) == 2
    join.ingest(tap_batch(tap_record()), "grpc")
    assert [r["source"] for r in requests(agg)] == ["joined", "engine", "engine"]


def test_a_side_alone_is_counted_after_the_wait_and_its_late_partner_dropped(setup):
    clock, agg, join = setup
    join.ingest(tap_batch(tap_record()), "grpc")
    clock.t += 9.9
    assert join.sweep() == 0
    clock.t += 0.2
    assert join.sweep() == 1
    (row,) = requests(agg)
    assert (row["engine"], row["source"], row["preprocess"]) == ("tap", "tap", None)
    join.ingest(engine_batch(engine_record()), "otlp_grpc")
    assert len(requests(agg)) == 1  # never counted twice
    assert outcomes(agg) == {"tap_only": 1, "late": 1}
    total = agg.snapshot().counters["requests"].sum()
    assert total == 1 + 1  # and the primer


def test_a_full_table_counts_its_oldest_alone(setup):
    _clock, agg, join = setup
    join.max_pending = 2
    keys = [f"{i:032x}-{i:016x}" for i in range(1, 5)]
    for k in keys:
        join.ingest(tap_batch(tap_record(key=k)), "grpc")
    assert join.pending_count() == 2
    assert outcomes(agg) == {"capacity": 2}
    assert len(requests(agg)) == 2


def test_n_2_pairs_each_choice_with_a_sequence_and_counts_the_prompt_once(setup):
    _clock, agg, join = setup
    join.ingest(tap_batch(tap_record(choice=0, gaps=(0.1,), output=2),
                          tap_record(choice=1, gaps=(0.1, 0.1, 0.1), output=4)), "grpc")
    join.ingest(engine_batch(engine_record(last=T0 + 0.75, output=4)), "otlp_grpc")
    assert requests(agg) == []  # one sequence of two so far
    join.ingest(engine_batch(engine_record(last=T0 + 0.55, output=2)), "otlp_grpc")
    rows = requests(agg)
    assert sorted(r["output_tokens"] for r in rows) == [2, 4]
    assert {r["source"] for r in rows} == {"joined"}
    tokens = agg.snapshot().counters["tokens"].sum(axis=0)
    assert tokens[0] == 12 + 12  # the prompt, once (and the primer's)
    assert outcomes(agg) == {"joined": 2}


def test_a_malformed_trace_parent_is_counted_and_the_row_goes_on_alone(setup):
    _clock, agg, join = setup
    join.ingest(tap_batch(tap_record(key="not-a-traceparent")), "grpc")
    assert [r["source"] for r in requests(agg)] == ["tap"]
    assert outcomes(agg) == {"bad_trace_parent": 1}


def test_rows_without_the_join_keep_their_batch_and_the_reply_counts_waiting_rows(setup):
    _clock, agg, join = setup
    batch = tap_batch(tap_record(), tap_record(key=""), tap_record(key=KEY2))
    r = join.ingest(batch, "grpc")
    assert (r.accepted, list(r.kept)) == (3, [True, True, True])
    assert len(requests(agg)) == 1 and join.pending_count() == 2


def test_no_wait_is_no_join(setup):
    clock, agg, _ = setup
    join = TraceJoin(agg, wait=0, clock=clock)
    join.ingest(tap_batch(tap_record()), "grpc")
    join.ingest(engine_batch(engine_record()), "otlp_grpc")
    assert sorted(r["source"] for r in requests(agg)) == ["engine", "tap"]


def test_n_2_with_one_sequence_before_the_taps_record_waits_for_the_other(setup):
    _clock, agg, join = setup
    join.ingest(tap_batch(tap_record(key=KEY2)), "grpc")  # a tap is around
    join.ingest(engine_batch(engine_record(last=T0 + 0.75, output=4)), "otlp_grpc")
    join.ingest(tap_batch(tap_record(choice=0, gaps=(0.1,), output=2),
                          tap_record(choice=1, gaps=(0.1, 0.1, 0.1), output=4)), "grpc")
    assert requests(agg) == []  # two choices, one sequence so far
    join.ingest(engine_batch(engine_record(last=T0 + 0.55, output=2)), "otlp_grpc")
    assert len(requests(agg)) == 2 and outcomes(agg) == {"joined": 2}


def test_stopping_counts_every_waiting_row_alone(setup):
    _clock, agg, join = setup
    join.ingest(tap_batch(tap_record(), tap_record(key=KEY2)), "grpc")
    assert join.flush() == 2 and join.pending_count() == 0
    assert outcomes(agg) == {"tap_only": 2} and len(requests(agg)) == 2


def test_an_engine_span_that_came_through_a_tap_waits_before_any_tap_is_seen(setup):
    _clock, agg, join = setup
    join.ingest(engine_batch(engine_record(), tapped=True), "otlp_grpc")
    assert requests(agg) == [] and join.pending_count() == 1
    join.ingest(tap_batch(tap_record()), "grpc")
    assert [r["source"] for r in requests(agg)] == ["joined"]
    assert outcomes(agg) == {"joined": 1}


def test_the_engines_span_inherits_the_taps_tracestate_through_the_sdk(setup):
    """As vLLM and SGLang do: the W3C propagator reads the headers the tap sent, the
    request span starts in that context, and OpenTelemetry's SDK gives it the parent's
    tracestate; exported as OTLP, it waits for the tap's record though no tap has been
    seen yet, while a parented span without the member (another caller's traceparent)
    is counted at once."""
    _clock, agg, join = setup
    ingest = OtlpIngest(join)
    mem = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(mem))
    tracer = provider.get_tracer("vllm.llm_engine")
    tapped, _ = tapmod.trace_headers(None)
    for headers in ({"traceparent": tapped, "tracestate": tapmod.trace_headers(None)[1]},
                    {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                     "tracestate": "congo=t61rcWkgMzE"}):
        token = context.attach(TraceContextTextMapPropagator().extract(headers))
        try:
            otlp_shapes.emit_vllm(tracer, engine_record(key=""))
        finally:
            context.detach(token)
    spans = mem.get_finished_spans()
    assert [s.context.trace_state.to_header() for s in spans] == [
        "phasewatch=tap", "congo=t61rcWkgMzE"]
    out = ingest.export(encode_spans(spans), "otlp_grpc")
    assert out.accepted == 2 and [r["source"] for r in requests(agg)] == ["engine"]
    assert join.pending_count() == 1
    join.ingest(tap_batch(tap_record(key=tapped[3:-3])), "grpc")
    assert sorted(r["source"] for r in requests(agg)) == ["engine", "joined"]
    assert outcomes(agg) == {"joined": 1, "engine_only_no_tap": 1}


# ---- who waits: a side waits only while its other side is sending (issue 26) ----------

def key(i: int) -> str:
    return f"{i:032x}-{i:016x}"


def test_a_tap_with_no_engine_tracing_is_counted_at_once_with_its_reason():
    """Issue 26: a tap used alone showed nothing for --trace-join-wait (10 s)."""
    clock = Clock()
    agg, join = fresh(clock)
    join.ingest(tap_batch(tap_record(key=key(1))), "grpc")
    join.ingest(tap_batch(tap_record(key=key(2), choice=0),
                          tap_record(key=key(2), choice=1)), "grpc")  # n = 2: each counted
    assert [r["source"] for r in requests(agg)] == ["tap"] * 3  # no sweep, no wait
    assert join.pending_count() == 0
    assert outcomes(agg) == {"tap_only_no_engine": 3}


def test_the_first_engine_span_makes_tap_records_wait_and_join():
    """At start: the records before the engine's first span are counted from the tap at
    once, their spans (arriving seconds after, as vLLM batches) are dropped as late:
    counted once; every request after the first span joins."""
    clock = Clock()
    agg, join = fresh(clock)
    join.ingest(tap_batch(tap_record(key=key(1))), "grpc")
    clock.t += 3
    join.ingest(engine_batch(engine_record(key=key(1))), "otlp_grpc")  # its first export
    assert [r["source"] for r in requests(agg)] == ["tap"]
    join.ingest(tap_batch(tap_record(key=key(2))), "grpc")
    assert join.pending_count() == 1  # an engine traces now: it waits for its span
    clock.t += 4
    join.ingest(engine_batch(engine_record(key=key(2))), "otlp_grpc")
    assert sorted(r["source"] for r in requests(agg)) == ["joined", "tap"]
    assert outcomes(agg) == {"tap_only_no_engine": 1, "late": 1, "joined": 1}
    assert agg.snapshot().counters["requests"].sum() == 2  # two requests, each once


def test_tap_records_stop_waiting_once_the_engine_is_silent_for_the_horizon():
    """Records that waited in vain over the horizon (first expired at 10 s, the 13th at
    70 s) with no engine span in between: the engine is gone, later records count at
    once; its next span makes them wait again."""
    clock = Clock()
    agg, join = fresh(clock)
    assert join.horizon == 60.0  # max(60 s, 6 x the wait)
    join.ingest(engine_batch(engine_record(key=key(100))), "otlp_grpc")  # an engine traces
    waited = []
    for i in range(16):  # a record every 5 s, no engine span ever again
        join.ingest(tap_batch(tap_record(key=key(i))), "grpc")
        waited.append("tap_only_no_engine" not in outcomes(agg))
        join.sweep()
        clock.t += 5
    assert waited == [True] * 15 + [False]  # 75 s: counted at once
    join.flush()
    assert outcomes(agg) == {"engine_only_no_tap": 1, "tap_only": 15,
                             "tap_only_no_engine": 1}
    # the engine speaks again: records wait for it again, and join
    join.ingest(engine_batch(engine_record(key=key(101))), "otlp_grpc")
    join.ingest(tap_batch(tap_record(key=key(20))), "grpc")
    join.ingest(engine_batch(engine_record(key=key(20))), "otlp_grpc")
    assert outcomes(agg)["joined"] == 1


def test_a_quiet_server_whose_engine_answers_every_request_keeps_joining():
    """Silence is counted from the first unanswered record, not the clock: one request
    every five minutes, each answered by its engine span, joins every time."""
    clock = Clock()
    agg, join = fresh(clock)
    join.ingest(engine_batch(engine_record(key=key(100))), "otlp_grpc")
    for i in range(4):
        clock.t += 300
        join.ingest(tap_batch(tap_record(key=key(i))), "grpc")
        clock.t += 4
        join.ingest(engine_batch(engine_record(key=key(i))), "otlp_grpc")
    assert outcomes(agg) == {"engine_only_no_tap": 1, "joined": 4}


def test_an_aborted_request_before_an_idle_hour_does_not_stop_the_join():
    """vLLM sends no span for an aborted request: its record waits in vain once, which
    is no evidence the engine is gone, however long the idle time after it."""
    clock = Clock()
    agg, join = fresh(clock)
    join.ingest(engine_batch(engine_record(key=key(100))), "otlp_grpc")
    join.ingest(tap_batch(tap_record(key=key(0), reason="abort")), "grpc")
    clock.t += 3600
    join.sweep()
    for i in (1, 2):  # two requests at once after the idle hour, spans seconds later
        join.ingest(tap_batch(tap_record(key=key(i))), "grpc")
    clock.t += 4
    join.ingest(engine_batch(engine_record(key=key(1)), engine_record(key=key(2))),
                "otlp_grpc")
    assert outcomes(agg) == {"engine_only_no_tap": 1, "tap_only": 1, "joined": 2}


def test_a_tapped_engine_span_stops_waiting_when_no_tap_record_answers_for_the_horizon():
    """The engine side, symmetric: spans that came through a tap wait for its record,
    but a tap whose records go to another exporter must not hold them forever."""
    clock = Clock()
    agg, join = fresh(clock)
    for t in range(0, 130, 10):  # spans at 0, 40, 80 s (waited in vain 10..90 s), 120 s
        if t % 40 == 0:
            join.ingest(engine_batch(engine_record(key=key(t)), tapped=True), "otlp_grpc")
        join.sweep()  # as the exporter does, every second (here every 10 s)
        clock.t += 10
    assert join.pending_count() == 0
    join.flush()
    assert outcomes(agg) == {"engine_only": 3, "engine_only_no_tap": 1}
    join.ingest(tap_batch(tap_record(key=key(50))), "grpc")  # a tap shows up: waits again
    join.ingest(engine_batch(engine_record(key=key(200)), tapped=True), "otlp_grpc")
    assert join.pending_count() == 2


def test_an_engines_start_up_spans_make_the_first_tap_record_wait():
    """vLLM exports a dozen start-up spans (``Load weights``, no parent, no request) as
    it loads, before any request: seen through the OTLP receiver, they make the first
    request's tap record wait for its span, so it joins."""
    clock = Clock()
    agg, join = fresh(clock)
    mem = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(mem))
    with provider.get_tracer("vllm.model_executor").start_as_current_span("Load weights"):
        pass
    out = OtlpIngest(join).export(encode_spans(mem.get_finished_spans()), "otlp_grpc")
    assert (out.accepted, requests(agg)) == (0, [])  # not a request
    join.ingest(tap_batch(tap_record(key=key(1))), "grpc")
    assert join.pending_count() == 1
    clock.t += 5
    join.ingest(engine_batch(engine_record(key=key(1))), "otlp_grpc")
    assert outcomes(agg) == {"joined": 1}
