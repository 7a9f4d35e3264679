"""The engines' own spans, replayed byte for byte into a real exporter.

The fixtures under tests/fixtures/otlp/engines/ are what vLLM 0.33.0's and SGLang
0.5.23's own tracing code exported when driven with a known ground truth
(tests/engines/*_spans.py, ``make engine-fixtures``): raw ``ExportTraceServiceRequest``
bytes per protocol and a ``truth.json``. Each set is sent as captured, over OTLP/gRPC
(the gRPC capture) and OTLP/HTTP (the HTTP capture, with its recorded content type),
and /metrics is checked against the ground truth and the engine's own figures.

vLLM: one ``llm_request`` span per finished sequence (n = 2 gives two spans with the
same ``gen_ai.request.id``; a client abort gives none). Latency histograms and the
request counter hold one observation per span, as vLLM's own /metrics do, each equal
to vLLM's own attribute (its formulas are in the fixture README); prompt tokens are
counted once per request id.
SGLang: one root span per request and role (disaggregated prefill + decode share one
``rid``), stage child spans; a request is counted once across roles.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from tests.conftest import scrape
from tests.support import FIXTURES

ENGINES = FIXTURES / "otlp" / "engines"
VLLM = ENGINES / "vllm-0.33.0"
EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
US = 1e-6


# ---- replay -------------------------------------------------------------------------------
def _bodies(d: Path) -> list[Path]:
    files = sorted(d.glob("*.pb"))
    assert files, f"no captured requests in {d}"
    return files


def replay(exporter, d: Path, transport: str) -> list[ExportTraceServiceResponse]:
    """Send the captured requests in ``d`` exactly as captured; the exporter's replies."""
    replies = []
    if transport == "grpc":
        with grpc.insecure_channel(f"127.0.0.1:{exporter.otlp_grpc_port}") as ch:
            export = ch.unary_unary(EXPORT, request_serializer=None,
                                    response_deserializer=ExportTraceServiceResponse.FromString)
            for p in _bodies(d):
                replies.append(export(p.read_bytes(), timeout=30))
        return replies
    for p in _bodies(d):
        meta = json.loads(p.with_suffix(".http.json").read_text())
        headers = {k: v for k, v in meta["headers"].items()
                   if k.lower() in ("content-type", "content-encoding", "user-agent")}
        req = urllib.request.Request(f"http://127.0.0.1:{exporter.otlp_http_port}{meta['path']}",
                                     data=p.read_bytes(), headers=headers, method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200
            replies.append(ExportTraceServiceResponse.FromString(r.read()))
    return replies


def spans_in(d: Path) -> list:
    """(resource, scope, span) for every span of the captured requests in ``d``."""
    out = []
    for p in _bodies(d):
        req = ExportTraceServiceRequest.FromString(p.read_bytes())
        for rs in req.resource_spans:
            for ss in rs.scope_spans:
                out.extend((rs.resource, ss.scope, sp) for sp in ss.spans)
    return out


def attrs_of(span) -> dict:
    return {kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in span.attributes}


def hist(s, name: str, **labels) -> tuple[float, float]:
    return s.total(f"{name}_count", **labels), s.total(f"{name}_sum", **labels)


def phase(s, which: str) -> tuple[float, float]:
    return hist(s, "phasewatch_phase_duration_seconds", phase=which)


def assert_hist(got: tuple[float, float], values: list[float], what: str) -> None:
    """Count exact; sum to 1 us per observation (float seconds on the wire)."""
    assert got[0] == len(values), f"{what}: {got[0]:g} observations, want {len(values)}"
    assert got[1] == pytest.approx(sum(values), rel=0, abs=max(1, len(values)) * US), (
        f"{what}: sum {got[1]!r}, want {sum(values)!r}")


def no_rejections(s, replies, n_spans: int) -> None:
    rejected = sum(r.partial_success.rejected_spans for r in replies)
    messages = [r.partial_success.error_message for r in replies if r.partial_success.error_message]
    assert rejected == 0, f"{rejected} of {n_spans} spans rejected: {messages}"
    assert s.total("phasewatch_ingest_rejected_total") == 0, [
        (x.labels, x.value) for x in s.samples if x.name == "phasewatch_ingest_rejected_total"]


# ---- vLLM 0.33.0 --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vllm_truth() -> dict:
    return json.loads((VLLM / "truth.json").read_text())


def vllm_spans(truth: dict, scenario: str) -> list[dict]:
    """vLLM's own span attributes, one entry per span, from the truth file."""
    return [sp["attributes"] for r in truth["scenarios"][scenario]["requests"].values()
            for sp in r["vllm_spans"]]


TRANSPORTS = ("grpc", "http")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_vllm_fixture_is_what_truth_says(vllm_truth, transport):
    """The captured bytes hold exactly the spans truth.json records, with vLLM's own
    values equal to the fed ground truth (to float error): the fixture is sound."""
    scen = vllm_truth["scenarios"]["main"]
    spans = spans_in(VLLM / "main" / transport)
    assert {sp.name for _, _, sp in spans} == {"llm_request"}
    got = sorted(json.dumps(attrs_of(sp), sort_keys=True) for _, _, sp in spans)
    want = sorted(json.dumps(a, sort_keys=True) for a in vllm_spans(vllm_truth, "main"))
    assert got == want
    for r in scen["requests"].values():
        if not r["span_expected"]:
            assert r["vllm_spans"] == []
            continue
        assert len(r["vllm_spans"]) == r["n"]
        by_ttft = sorted(r["vllm_spans"], key=lambda sp: (
            sp["attributes"]["gen_ai.latency.time_to_first_token"],
            sp["attributes"]["gen_ai.latency.e2e"]))
        seqs = sorted(r["sequences"], key=lambda q: (q["exact"]["ttft_s"], q["exact"]["e2e_s"]))
        for sp, q in zip(by_ttft, seqs, strict=True):
            a, ex = sp["attributes"], q["exact"]
            assert sp["start"] == int(r["arrival_wall_s"] * 1e9)
            for key, exact in (("time_to_first_token", "ttft_s"), ("e2e", "e2e_s"),
                               ("time_in_queue", "queue_s"), ("time_in_model_prefill",
                                                              "prefill_s"),
                               ("time_in_model_decode", "decode_s"),
                               ("time_in_model_inference", "inference_s")):
                assert a[f"gen_ai.latency.{key}"] == pytest.approx(ex[exact], abs=US), key
            assert a["gen_ai.usage.completion_tokens"] == q["output_tokens"]
            assert a["gen_ai.usage.prompt_tokens"] == r["prompt_tokens"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_vllm_every_request_span_accepted_once(exporter, vllm_truth, transport):
    scen = vllm_truth["scenarios"]["main"]
    n_spans = len(vllm_spans(vllm_truth, "main"))
    replies = replay(exporter, VLLM / "main" / transport, transport)
    s = scrape(exporter.http_port)
    no_rejections(s, replies, n_spans)
    assert s.total("phasewatch_otlp_spans_total", protocol=f"otlp_{transport}",
                   outcome="request") == n_spans
    # n = 2: two spans, two finished sequences, as vLLM's own request_success_total and
    # e2e histogram count them (its prompt is counted once: the next test)
    prom = scen["vllm_prometheus"]
    success = sum(v for k, v in prom.items() if k.startswith("vllm:request_success_total"))
    assert success == prom["vllm:e2e_request_latency_seconds_count"] == n_spans
    assert s.total("phasewatch_requests_total", engine="vllm") == success
    assert any(r["n"] > 1 for r in scen["requests"].values())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_vllm_tokens_prompt_once_per_request(exporter, vllm_truth, transport):
    scen = vllm_truth["scenarios"]["main"]
    replay(exporter, VLLM / "main" / transport, transport)
    s = scrape(exporter.http_port)
    requests = [r for r in scen["requests"].values() if r["span_expected"]]
    spans = vllm_spans(vllm_truth, "main")
    assert s.total("phasewatch_tokens_total", engine="vllm", kind="output") == sum(
        a["gen_ai.usage.completion_tokens"] for a in spans)
    # the n = 2 requests' spans each carry the whole prompt: it was prefilled once
    assert s.total("phasewatch_tokens_total", engine="vllm", kind="prompt") == sum(
        r["prompt_tokens"] for r in requests)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_vllm_cached_prompt_tokens_are_unknown_not_zero(exporter, vllm_truth, transport):
    """vLLM 0.33 sends no cached-token attribute although it had prefix-cache hits
    (truth: cached_prompt_tokens): phasewatch must not take that as 0 cached."""
    scen = vllm_truth["scenarios"]["main"]
    assert any(r["cached_prompt_tokens"] for r in scen["requests"].values())
    replay(exporter, VLLM / "main" / transport, transport)
    s = scrape(exporter.http_port)
    n_spans = len(vllm_spans(vllm_truth, "main"))
    assert s.total("phasewatch_tokens_total", engine="vllm", kind="cached_prompt") == 0
    assert hist(s, "phasewatch_prefill_seconds_per_token", engine="vllm")[0] == 0
    # every span's prefill per uncached token is unavailable: cached tokens unknown (or,
    # for an n > 1 request's further sequences, the prompt was shared)
    reasons = {x.labels["reason"]: x.value for x in s.samples
               if x.name == "phasewatch_phase_unavailable_total"
               and x.labels.get("phase") == "prefill_spt"}
    assert sum(reasons.values()) == n_spans, reasons
    assert set(reasons) <= {"cached_tokens_unknown", "prompt_shared"}, reasons


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_vllm_latencies_are_vllms_own(exporter, vllm_truth, transport):
    """One observation per span, each vLLM's own attribute, to 1 us per request; queue
    is vLLM's time_in_queue and preprocess (arrival -> engine queue) the rest of TTFT:
    TTFT - queue - prefill."""
    spans = vllm_spans(vllm_truth, "main")
    replay(exporter, VLLM / "main" / transport, transport)
    s = scrape(exporter.http_port)

    def col(key):
        return [a[f"gen_ai.latency.{key}"] for a in spans]

    assert_hist(hist(s, "gen_ai_server_time_to_first_token_seconds", engine="vllm"),
                col("time_to_first_token"), "ttft")
    assert_hist(hist(s, "gen_ai_server_request_duration_seconds", engine="vllm"),
                col("e2e"), "e2e")
    assert_hist(phase(s, "queue"), col("time_in_queue"), "queue")
    assert_hist(phase(s, "prefill"), col("time_in_model_prefill"), "prefill")
    assert_hist(phase(s, "decode"), col("time_in_model_decode"), "decode")
    assert_hist(phase(s, "preprocess"), [
        a["gen_ai.latency.time_to_first_token"] - a["gen_ai.latency.time_in_queue"]
        - a["gen_ai.latency.time_in_model_prefill"] for a in spans], "preprocess")
    # TPOT: vLLM's mean_time_per_output_token, defined past one output token
    assert_hist(hist(s, "gen_ai_server_time_per_output_token_seconds", engine="vllm"), [
        a["gen_ai.latency.time_in_model_decode"] / (a["gen_ai.usage.completion_tokens"] - 1)
        for a in spans if a["gen_ai.usage.completion_tokens"] > 1], "tpot")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_vllm_sums_match_vllms_prometheus(exporter, vllm_truth, transport):
    """Against vLLM's own /metrics (its PrometheusStatLogger fed the same steps): e2e,
    queue, prefill and decode hold what vLLM's histograms hold (client-aborted requests
    are in neither: vLLM observes only finished ones)."""
    prom = vllm_truth["scenarios"]["main"]["vllm_prometheus"]
    replay(exporter, VLLM / "main" / transport, transport)
    s = scrape(exporter.http_port)
    for ours, theirs in (
            (hist(s, "gen_ai_server_request_duration_seconds", engine="vllm"),
             "vllm:e2e_request_latency_seconds"),
            (phase(s, "queue"), "vllm:request_queue_time_seconds"),
            (phase(s, "prefill"), "vllm:request_prefill_time_seconds"),
            (phase(s, "decode"), "vllm:request_decode_time_seconds")):
        assert ours[0] == prom[f"{theirs}_count"], theirs
        assert ours[1] == pytest.approx(prom[f"{theirs}_sum"], abs=ours[0] * US), theirs


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_vllm_pause_abort_spans(exporter, vllm_truth, transport):
    """``pause_generation(mode="abort")``: vLLM ends the running request and the waiting
    one with ABORT and traces both. The waiting one was never scheduled: vLLM's span
    says time_in_queue 0 and a prefill of the engine's whole monotonic clock (~3 days).
    Every span is accounted for (accepted or rejected with a reason); no phase takes the
    3 days; TTFT and prefill exist only for the requests that produced a token."""
    scen = vllm_truth["scenarios"]["pause_abort"]
    spans = vllm_spans(vllm_truth, "pause_abort")
    assert max(a["gen_ai.latency.time_in_model_prefill"] for a in spans) > 86400
    replies = replay(exporter, VLLM / "pause_abort" / transport, transport)
    s = scrape(exporter.http_port)
    rejected = sum(r.partial_success.rejected_spans for r in replies)
    accepted = s.total("phasewatch_otlp_spans_total", protocol=f"otlp_{transport}",
                       outcome="request")
    assert accepted + rejected == len(spans)
    for which in ("preprocess", "queue", "prefill", "decode"):
        assert phase(s, which)[1] < 10, f"{which} took the engine's monotonic clock"
    assert hist(s, "gen_ai_server_request_duration_seconds", engine="vllm")[1] < 10
    produced = [a for a in spans if a["gen_ai.usage.completion_tokens"] > 0]
    assert_hist(hist(s, "gen_ai_server_time_to_first_token_seconds", engine="vllm"),
                [a["gen_ai.latency.time_to_first_token"] for a in produced], "ttft")
    assert_hist(phase(s, "prefill"), [a["gen_ai.latency.time_in_model_prefill"]
                                      for a in produced], "prefill")
    assert len(scen["requests"]) == len(spans)


# ---- SGLang 0.5.23 ------------------------------------------------------------------------
SGLANG = ENGINES / "sglang-0.5.23"
SGLANG_SETS = ("unified-level3", "unified-level1", "disagg-level3", "disagg-level1")


@pytest.fixture(scope="module")
def sglang_truth() -> dict:
    return json.loads((SGLANG / "truth.json").read_text())


def client_role(r: dict) -> dict:
    """The role whose root the client's stream came from: unified, or decode."""
    return r["roles"].get("unified") or r["roles"]["decode"]


def prefill_role(r: dict) -> dict:
    return r["roles"].get("unified") or r["roles"]["prefill"]


def root_attrs(role: dict) -> dict:
    (root,) = role["sglang_root"]
    return root["attributes"]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("name", SGLANG_SETS)
def test_sglang_fixture_is_what_truth_says(sglang_truth, name, transport):
    """Roots in the captured bytes are the ones truth.json records, and their latency
    attributes are SGLang's formulas over the fed instants (req_time_stats.py
    convert_to_gen_ai_span_attrs): the fixture is sound."""
    s = sglang_truth["sets"][name]
    spans = spans_in(SGLANG / name / transport)
    roots = {(attrs_of(sp)["rid"], sp.name.split(" Req ")[0] or "unified"): attrs_of(sp)
             for _, _, sp in spans if " Req " in sp.name}
    want = {(rid, role): root_attrs(rr) for rid, r in s["requests"].items()
            for role, rr in r["roles"].items()}
    assert roots == want
    for r in s["requests"].values():
        for rr in r["roles"].values():
            a, ex = root_attrs(rr), rr["exact"]
            for key, exact in (("time_to_first_token", "ttft_s"), ("e2e", "e2e_s"),
                               ("time_in_model_decode", "decode_s"),
                               ("time_in_model_prefill", "prefill_s"),
                               ("time_in_model_inference", "inference_s")):
                assert a[f"gen_ai.latency.{key}"] == pytest.approx(ex[exact], abs=US), key
    level = s["trace_level"]
    for r in s["requests"].values():
        for rr in r["roles"].values():
            loops = rr["spans"]["by_name"].get("decode_loop", 0)
            assert loops == (rr["exact"]["decode_steps"] if level >= 3 else 0)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("name", SGLANG_SETS)
def test_sglang_each_request_counted_once(exporter, sglang_truth, name, transport):
    """Every root accepted, and a disaggregated request (a `prefill Req` and a
    `decode Req` root with one rid) counted once."""
    s = sglang_truth["sets"][name]
    n_roots = sum(len(r["roles"]) for r in s["requests"].values())
    replies = replay(exporter, SGLANG / name / transport, transport)
    sc = scrape(exporter.http_port)
    no_rejections(sc, replies, n_roots)
    assert sc.total("phasewatch_requests_total", engine="sglang") == len(s["requests"])


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("name", SGLANG_SETS)
def test_sglang_ttft_e2e_are_the_client_facing_roots(exporter, sglang_truth, name, transport):
    """TTFT, e2e and decode: SGLang's own root attributes, of the root the client's
    stream came from (unified, or the decode server's), to 1 us per request."""
    s = sglang_truth["sets"][name]
    replay(exporter, SGLANG / name / transport, transport)
    sc = scrape(exporter.http_port)
    roots = [root_attrs(client_role(r)) for r in s["requests"].values()]
    assert_hist(hist(sc, "gen_ai_server_time_to_first_token_seconds", engine="sglang"),
                [a["gen_ai.latency.time_to_first_token"] for a in roots], "ttft")
    assert_hist(hist(sc, "gen_ai_server_request_duration_seconds", engine="sglang"),
                [a["gen_ai.latency.e2e"] for a in roots], "e2e")
    assert_hist(phase(sc, "decode"), [a["gen_ai.latency.time_in_model_decode"]
                                      for a in roots], "decode")


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("name", SGLANG_SETS)
def test_sglang_queue_and_prefill_from_stage_spans(exporter, sglang_truth, name, transport):
    """Queue = the `prefill_waiting` span, prefill = the `prefill_forward` span (which
    spans every chunk of a chunked prefill); not the root's time_in_model_prefill, which
    runs from the API server's dispatch and so holds the scheduler's wait. Exactly the
    spans' durations; the fed ground truth to within the fixture's clock calibration
    offsets (each stage time is converted to wall time with its process's offset; the
    fixture's roles are threads of one process, so a disaggregated stage span may carry
    a neighbouring role's offset: up to the offsets' spread)."""
    s = sglang_truth["sets"][name]
    replay(exporter, SGLANG / name / transport, transport)
    sc = scrape(exporter.http_port)
    spans = [sp for _, _, sp in spans_in(SGLANG / name / transport)]

    def durations(stage):
        return [(sp.end_time_unix_nano - sp.start_time_unix_nano) / 1e9 for sp in spans
                if sp.name == stage]

    assert_hist(phase(sc, "queue"), durations("prefill_waiting"), "queue")
    assert_hist(phase(sc, "prefill"), durations("prefill_forward"), "prefill")
    offsets = sglang_truth["calibration_offset_us"].values()
    spread = (max(offsets) - min(offsets) + 1) * US
    pre = [prefill_role(r)["exact"] for r in s["requests"].values()]
    for which, key in (("queue", "queue_s"), ("prefill", "prefill_forward_s")):
        count, total = phase(sc, which)
        assert count == len(pre)
        assert total == pytest.approx(sum(e[key] for e in pre), abs=len(pre) * spread), which
    if s["mode"] == "disagg":  # the KV transfer: the prefill server's own span
        assert_hist(phase(sc, "kv_transfer"), durations("prefill_transfer_kv_cache"),
                    "kv_transfer")
    else:
        assert phase(sc, "kv_transfer")[0] == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("name", SGLANG_SETS)
def test_sglang_pooled_itl_from_decode_loop_spans(exporter, sglang_truth, name, transport):
    """Level 3: one `decode_loop` span per decode step is one inter-token gap, pooled.
    Level 1 sends no per-step spans: no ITL observations."""
    s = sglang_truth["sets"][name]
    replay(exporter, SGLANG / name / transport, transport)
    sc = scrape(exporter.http_port)
    got = hist(sc, "phasewatch_inter_token_latency_seconds", engine="sglang")
    if s["trace_level"] < 3:
        assert got[0] == 0
        return
    ex = [client_role(r)["exact"] for r in s["requests"].values()]
    steps = sum(e["decode_steps"] for e in ex)
    assert got[0] == steps, f"{got[0]:g} ITL observations, want {steps} decode steps"
    assert got[1] == pytest.approx(sum(e["itl_sum_s"] for e in ex), rel=0, abs=steps * US)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("name", SGLANG_SETS)
def test_sglang_tokens(exporter, sglang_truth, name, transport):
    """Prompt and cached prompt tokens once per request (the prefill side's), output
    tokens from the client-facing root. A client-aborted request's root carries no
    usage attributes (set_finished_time without span_attrs): unified, it counts no
    tokens; disaggregated, its prefill server's root still counts the prompt."""
    s = sglang_truth["sets"][name]
    replay(exporter, SGLANG / name / transport, transport)
    sc = scrape(exporter.http_port)
    done = [r for r in s["requests"].values() if r["finish"] != "abort"]
    # a disaggregated request aborted while decoding was prefilled: the prefill server's
    # root says so (its own finish came before the abort)
    read = [r for r in s["requests"].values()
            if "gen_ai.usage.prompt_tokens" in root_attrs(prefill_role(r))]
    assert sc.total("phasewatch_tokens_total", engine="sglang", kind="prompt") == sum(
        r["prompt_tokens"] for r in read)
    assert sc.total("phasewatch_tokens_total", engine="sglang", kind="cached_prompt") == sum(
        r["cached_prompt_tokens"] for r in read)
    assert sc.total("phasewatch_tokens_total", engine="sglang", kind="output") == sum(
        client_role(r)["completion_tokens"] for r in done)


@pytest.mark.parametrize("name", ["unified-level3", "disagg-level1"])
def test_sglang_roots_before_their_stage_spans(exporter, sglang_truth, name):
    """SGLang's tokenizer and scheduler export on their own, so a root may reach
    phasewatch before its stage spans: the captured spans re-sent in that order (every
    root first, in its own export, then the rest) give the same figures, and nothing is
    counted before its stages have come."""
    s = sglang_truth["sets"][name]
    roots, rest = ExportTraceServiceRequest(), ExportTraceServiceRequest()
    for p in _bodies(SGLANG / name / "grpc"):
        req = ExportTraceServiceRequest.FromString(p.read_bytes())
        for rs in req.resource_spans:
            for target in (roots, rest):
                out = target.resource_spans.add(resource=rs.resource)
                for ss in rs.scope_spans:
                    sink = out.scope_spans.add(scope=ss.scope)
                    sink.spans.extend(sp for sp in ss.spans
                                      if (" Req " in sp.name) == (target is roots))
    with grpc.insecure_channel(f"127.0.0.1:{exporter.otlp_grpc_port}") as ch:
        export = ch.unary_unary(EXPORT, request_serializer=None,
                                response_deserializer=ExportTraceServiceResponse.FromString)
        export(roots.SerializeToString(), timeout=30)
        early = scrape(exporter.http_port)
        assert early.total("phasewatch_requests_total", engine="sglang") == 0
        assert early.total("phasewatch_otlp_join_pending") == len(s["requests"])
        export(rest.SerializeToString(), timeout=30)
    sc = scrape(exporter.http_port)
    assert sc.total("phasewatch_requests_total", engine="sglang") == len(s["requests"])
    assert sc.total("phasewatch_otlp_joined_requests_total", outcome="complete") == len(
        s["requests"])
    spans = [sp for _, _, sp in spans_in(SGLANG / name / "grpc")]
    for which, stage in (("queue", "prefill_waiting"), ("prefill", "prefill_forward")):
        assert_hist(phase(sc, which), [
            (sp.end_time_unix_nano - sp.start_time_unix_nano) / 1e9 for sp in spans
            if sp.name == stage], which)
    assert_hist(hist(sc, "gen_ai_server_time_to_first_token_seconds", engine="sglang"),
                [root_attrs(client_role(r))["gen_ai.latency.time_to_first_token"]
                 for r in s["requests"].values()], "ttft")
