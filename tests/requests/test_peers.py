"""phasewatch against the peers' own figures for one streamed workload.

tests/fixtures/peers/requests.json holds ~390 streamed requests (exact chunk times,
tokens per chunk, a few stalls, multi-token chunks, 1- and 2-token outputs, cached and
128k prompts) and what vLLM's benchmark (``calculate_metrics`` fed as its streaming client
fills ``RequestFuncOutput``), aiperf's metric pipeline and guidellm's metric code computed
for it (tests/fixtures/peers/make_requests.py made it, with the peers installed; this test
needs only phasewatch). Each request is sent through ``PhasewatchClient.record`` with one
emission time per streamed chunk, and /metrics, ``/api/v1/summary``, ``/api/v1/requests``
and ``/api/v1/bench`` are compared with the peers' figures.

Two clocks, the same requests:

* ``replay``: the run replayed at Unix time 1000 s. A float64 second there carries the
  fixture's microsecond times to the exact nanosecond (what the client sends), so every
  duration must equal the peers' to 1e-9 relative.
* ``live``: shifted so the last request finished now. A float64 Unix second today is only
  2**-22 s (~0.24 us) fine and the client's seconds-to-ns product rounds to 256 ns, so each
  time may move ~0.25 us on its way in; durations are compared within that (computed
  below from the clock, and stated in every message), plus 1e-9 relative.

Token gaps travel as float32 (exporter/ingest/wire.py), so ITL sums and the ITL mean are compared
within float32's 2**-24 per gap, and ITL percentiles, read from the window's log-linear bins
(exporter/requests/buckets.py ``WINDOW_INDEX``: 16 per octave, 3.1-6.25% wide) at the bin's
geometric middle, within a bin.
"""

from __future__ import annotations

import json
import math
import time
import urllib.request
from dataclasses import dataclass

import numpy as np
import pytest

from phasewatch.app import Exporter
from phasewatch.client import PhasewatchClient
from phasewatch.config import ServeConfig
from phasewatch.requests.buckets import WINDOW_INDEX
from tests.conftest import TEST_PORTS, Scrape, scrape
from tests.support import FIXTURES

FIXTURE = FIXTURES / "peers" / "requests.json"
MODEL, ENGINE = "peers-fixture", "vllm"
REL = 1e-9
QUANTILES = (50, 90, 95, 99)
F32 = 2.0**-24  # float32's relative rounding (token gaps on the wire)
REPLAY_BASE = 1000  # Unix seconds: where a float64 second resolves the ns exactly


@pytest.fixture(scope="module")
def peers() -> dict:
    return json.loads(FIXTURE.read_text())


@dataclass
class Clock:
    """How exactly the client can carry the fixture's times at this clock base."""

    name: str
    shift: int  # whole seconds added to the fixture's times (so ns stay integers)
    time_err: float  # the most one time (hence half an interval) can move, seconds
    gap_err: float  # the most one token gap can move before its float32 rounding, seconds

    def interval(self) -> float:
        return 2 * self.time_err


def clock_for(name: str, shift: int, t_max: float) -> Clock:
    # B + t as a float64 second, then round(seconds * 1e9) as the client converts it: when
    # both roundings together stay under half a ns, the ns integer is the exact one.
    err_ns = np.spacing(t_max) / 2 * 1e9 + np.spacing(t_max * 1e9) / 2
    time_err = 0.0 if err_ns < 0.5 else (err_ns + 0.5) / 1e9
    # gaps are differences of the float64 seconds (exact by Sterbenz): two roundings
    return Clock(name, shift, float(time_err), float(np.spacing(t_max)))


@dataclass
class Observed:
    clock: Clock
    metrics: Scrape
    summary: dict  # this model's entry of /api/v1/summary
    bench: dict  # this model's entry of /api/v1/bench
    rows: dict[str, dict]  # /api/v1/requests by request id
    sent_at: float  # time.time() when the last request was recorded
    queried_at: float  # time.time() after the last query


def _get(port: int, path: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as r:
        return json.load(r)


@pytest.fixture(scope="module", params=["replay", "live"])
def observed(request, peers) -> Observed:
    return observe(peers["requests"], request.param, goodput_slo(peers))


def observe(reqs: list[dict], clock_name: str, slo: str) -> Observed:
    """``reqs`` through the client into an exporter with objectives ``slo``, at the clock
    ``clock_name`` (``replay`` or ``live``), and what its /metrics and API say."""
    last = max(r["finish"] for r in reqs)
    shift = REPLAY_BASE if clock_name == "replay" else round(time.time() - last)
    clock = clock_for(clock_name, shift, shift + last)
    ex = Exporter(ServeConfig(**TEST_PORTS, window_seconds=600, slo=slo)).start()
    try:
        with PhasewatchClient(f"127.0.0.1:{ex.grpc_port}", engine=ENGINE) as client:
            for r in reqs:
                times = [shift + t for t in r["chunk_times"]]
                assert client.record(
                    MODEL, arrival=shift + r["arrival"], first_token=times[0],
                    last_token=times[-1], finish=shift + r["finish"],
                    prompt_tokens=r["prompt_tokens"], cached_prompt_tokens=r["cached_tokens"],
                    output_tokens=r["output_tokens"], finish_reason=r["finish_reason"],
                    request_id=r["id"], token_times=times)
            sent_at = time.time()
            assert client.flush(30)
            assert client.stats["accepted"] == len(reqs), client.stats
        metrics = scrape(ex.http_port)
        (summary,) = [m for m in _get(ex.http_port, "/api/v1/summary")["models"]
                      if m["model"] == MODEL]
        (bench,) = [m for m in _get(ex.http_port, "/api/v1/bench?window=600")["models"]
                    if m["model"] == MODEL]
        rows = {row["request_id"]: row
                for row in _get(ex.http_port, "/api/v1/requests?limit=5000")["requests"]}
        return Observed(clock, metrics, summary, bench, rows, sent_at, time.time())
    finally:
        ex.stop(grace=1)


def goodput_slo(peers) -> str:
    """The objectives vLLM's goodput was computed with, as --slo takes them."""
    config = peers["expected"]["vllm"]["goodput"]["goodput_config_ms"]
    return " ".join(f"{k}:{v:g}" for k, v in config.items())


def close(actual, expected, abs_tol: float, what: str, why: str = "") -> None:
    allowed = abs_tol + REL * abs(expected)
    assert actual is not None and abs(actual - expected) <= allowed, (
        f"{what}: phasewatch {actual!r}, peer {expected!r} (diff "
        f"{(actual or 0) - expected:.3g}, allowed {allowed:.3g}{': ' + why if why else ''})")


def resolution(o: Observed) -> str:
    c = o.clock
    return (f"{c.name} clock: each time may move {c.time_err:.3g} s through the client's "
            f"float64 Unix seconds, each token gap {c.gap_err:.3g} s before float32")


# ---- what vLLM's benchmark says --------------------------------------------------------------
def vllm(peers) -> dict:
    return peers["expected"]["vllm"]["metrics"]


def vllm_seconds(peers, name: str) -> dict[str, float]:
    """vLLM's mean and percentiles of ``name`` (ttft, tpot, itl, e2el), in seconds."""
    m = vllm(peers)
    out = {"mean": m[f"mean_{name}_ms"] / 1000}
    for p, v in m[f"percentiles_{name}_ms"]:
        out[f"p{round(p)}"] = v / 1000
    assert m[f"median_{name}_ms"] / 1000 == out["p50"]
    return out


def per_request(peers) -> dict[str, dict]:
    return peers["expected"]["vllm"]["per_request"]


def itl_gaps(peers) -> np.ndarray:
    return np.array([g for v in per_request(peers).values() for g in v["itl"]])


def tpot_count(peers) -> int:
    return sum(v["tpot"] is not None for v in per_request(peers).values())


def hist(o: Observed, name: str, part: str, **labels) -> float:
    return o.metrics.total(f"{name}_{part}", model=MODEL, engine=ENGINE, **labels)


# ---- counts and tokens ------------------------------------------------------------------------
def test_requests_and_tokens(observed, peers):
    m, s, reqs = vllm(peers), observed.summary, peers["requests"]
    assert m["completed"] == len(reqs) and m["failed"] == 0
    assert observed.metrics.total("phasewatch_requests_total", model=MODEL) == m["completed"]
    for reason in ("stop", "length"):
        assert observed.metrics.total("phasewatch_requests_total", model=MODEL,
                                      finish_reason=reason) == sum(
            r["finish_reason"] == reason for r in reqs)
    tokens = {kind: observed.metrics.total("phasewatch_tokens_total", model=MODEL, kind=kind)
              for kind in ("prompt", "cached_prompt", "output")}
    assert tokens == {"prompt": m["total_input"],
                      "cached_prompt": sum(r["cached_tokens"] for r in reqs),
                      "output": m["total_output"]}
    assert (s["requests_in_window"], s["prompt_tokens_in_window"],
            s["output_tokens_in_window"]) == (m["completed"], m["total_input"],
                                              m["total_output"])
    assert s["sampled_requests"] == len(reqs)
    assert s["ttft_seconds"]["count"] == s["e2e_seconds"]["count"] == m["completed"]
    assert s["tpot_seconds"]["count"] == tpot_count(peers)
    assert s["itl_seconds"]["count"] == len(itl_gaps(peers))
    aiperf = peers["expected"]["aiperf"]["metrics"]
    assert aiperf["request_count"]["avg"] == m["completed"]
    assert aiperf["total_isl"]["avg"] == m["total_input"]
    assert aiperf["total_osl"]["avg"] == m["total_output"]
    assert aiperf["inter_chunk_latency"]["count"] == len(itl_gaps(peers))
    assert aiperf["inter_token_latency"]["count"] == tpot_count(peers)


# ---- /metrics histograms: _count and _sum --------------------------------------------------------
def test_histogram_counts_and_sums(observed, peers):
    m, c, why = vllm(peers), observed.clock, resolution(observed)
    n = m["completed"]
    # TTFT: vLLM's mean x its count
    name = "gen_ai_server_time_to_first_token_seconds"
    assert hist(observed, name, "count") == n
    close(hist(observed, name, "sum"), m["mean_ttft_ms"] / 1000 * n, n * c.interval(),
          "TTFT _sum", why)
    # TPOT: only requests with more than one output token (vLLM's tpots)
    name, k = "gen_ai_server_time_per_output_token_seconds", tpot_count(peers)
    assert hist(observed, name, "count") == k
    close(hist(observed, name, "sum"), m["mean_tpot_ms"] / 1000 * k, k * c.interval(),
          "TPOT _sum", why)
    # e2e runs to the end of the stream (finish): guidellm's request_latency, not vLLM's E2EL
    name = "gen_ai_server_request_duration_seconds"
    e2e = math.fsum(r["finish"] - r["arrival"] for r in peers["requests"])
    assert hist(observed, name, "count") == n
    close(hist(observed, name, "sum"), e2e, n * c.interval(), "request duration _sum", why)
    g = peers["expected"]["guidellm"]["metrics"]["request_latency"]
    close(hist(observed, name, "sum"), g["total_sum"], n * c.interval(),
          "request duration _sum vs guidellm request_latency", why)
    # pooled ITL: every gap between chunks, vLLM's mean x its count
    gaps = itl_gaps(peers)
    name = "phasewatch_inter_token_latency_seconds"
    assert hist(observed, name, "count") == len(gaps)
    itl_sum = m["mean_itl_ms"] / 1000 * len(gaps)
    close(itl_sum, math.fsum(gaps), 0.0, "vLLM's ITL mean x count vs its gaps")
    close(hist(observed, name, "sum"), itl_sum,
          len(gaps) * c.gap_err + F32 * float(np.abs(gaps).sum()), "ITL _sum",
          f"{why}; each gap is a float32 on the wire")


def test_decode_sum_gives_guidellms_inter_token_latency(observed, peers):
    """guidellm's inter_token_latency_ms is vLLM's TPOT weighted by output_tokens - 1: the
    decode time of all requests over their tokens after the first."""
    g = peers["expected"]["guidellm"]["metrics"]["inter_token_latency_ms"]
    decode = hist(observed, "phasewatch_phase_duration_seconds", "sum", phase="decode")
    steps = (observed.metrics.total("phasewatch_tokens_total", model=MODEL, kind="output")
             - observed.metrics.total("phasewatch_requests_total", model=MODEL))
    assert g["count"] == steps
    close(decode / steps, g["mean"] / 1000,
          len(peers["requests"]) * observed.clock.interval() / steps,
          "decode sum / (output tokens - requests) vs guidellm inter_token_latency mean",
          resolution(observed))


# ---- per request ---------------------------------------------------------------------------------
def test_every_request_matches_vllm(observed, peers):
    c, why = observed.clock, resolution(observed)
    aiperf = peers["expected"]["aiperf"]["per_request"]
    assert set(observed.rows) == set(per_request(peers))
    for r in peers["requests"]:
        rid, row, v = r["id"], observed.rows[r["id"]], per_request(peers)[r["id"]]
        close(row["ttft"], v["ttft"], c.interval(), f"{rid} TTFT", why)
        close(row["ttft"] + row["decode"], v["e2el"], 2 * c.interval(),
              f"{rid} arrival to last token (vLLM E2EL)", why)
        close(row["e2e"], r["finish"] - r["arrival"], c.interval(), f"{rid} e2e", why)
        if v["tpot"] is None:
            assert row["tpot"] is None, f"{rid}: one output token, TPOT undefined"
        else:
            close(row["tpot"], v["tpot"], c.interval(), f"{rid} TPOT", why)
        assert (row["prompt_tokens"], row["cached_prompt_tokens"], row["output_tokens"]) == (
            r["prompt_tokens"], r["cached_tokens"], r["output_tokens"])
        close(row["ttft"], aiperf[rid]["time_to_first_token"] / 1e9, c.interval(),
              f"{rid} TTFT vs aiperf", why)
        if aiperf[rid]["inter_token_latency"] is not None:
            close(row["tpot"], aiperf[rid]["inter_token_latency"] / 1e9, c.interval(),
                  f"{rid} TPOT vs aiperf inter_token_latency", why)


# ---- the JSON summary's statistics ---------------------------------------------------------------
@pytest.mark.parametrize("pw,peer", [("ttft_seconds", "ttft"), ("tpot_seconds", "tpot"),
                                     ("e2e_to_last_token_seconds", "e2el")])
def test_summary_equals_vllm(observed, peers, pw, peer):
    """Mean and p50/p90/p95/p99 as vLLM's np.mean and np.percentile (linear)."""
    c = observed.clock
    got, want = observed.summary[pw], vllm_seconds(peers, peer)
    # e2e to the last token is read as two float seconds (last token, arrival) and
    # subtracted: one more float64 rounding at this clock
    extra = float(np.spacing(c.shift + peers["expected"]["vllm"]["duration_s"])) \
        if pw.startswith("e2e") else 0.0
    for key, value in want.items():
        close(got[key], value, c.interval() + extra, f"{pw} {key} vs vLLM {peer}",
              resolution(observed))


@pytest.mark.parametrize("pw,peer", [("ttft_seconds", "time_to_first_token"),
                                     ("tpot_seconds", "inter_token_latency"),
                                     ("e2e_to_last_token_seconds", "request_latency")])
def test_summary_equals_aiperf(observed, peers, pw, peer):
    """aiperf interpolates percentiles linearly too (metric_result_from_array); its
    inter_token_latency is vLLM's TPOT and its request_latency vLLM's E2EL."""
    c = observed.clock
    got, want = observed.summary[pw], peers["expected"]["aiperf"]["metrics"][peer]
    assert want["unit"] == "ms"
    extra = float(np.spacing(c.shift + peers["expected"]["vllm"]["duration_s"])) \
        if pw.startswith("e2e") else 0.0
    assert got["count"] == want["count"]
    for key, theirs in (("mean", "avg"), *((f"p{q}", f"p{q}") for q in QUANTILES)):
        close(got[key], want[theirs] / 1000, c.interval() + extra, f"{pw} {key} vs aiperf {peer}",
              resolution(observed))


def test_summary_means_equal_guidellm(observed, peers):
    """guidellm's percentiles are nearest-rank on a weighted CDF, so only its means and
    counts compare: TTFT, and request_latency (to the end of the stream: phasewatch's e2e)."""
    c, g = observed.clock, peers["expected"]["guidellm"]["metrics"]
    assert g["time_to_first_token_ms"]["count"] == observed.summary["ttft_seconds"]["count"]
    close(observed.summary["ttft_seconds"]["mean"], g["time_to_first_token_ms"]["mean"] / 1000,
          c.interval(), "TTFT mean vs guidellm", resolution(observed))
    close(observed.summary["e2e_seconds"]["mean"], g["request_latency"]["mean"],
          c.interval(), "e2e mean vs guidellm request_latency", resolution(observed))


def test_itl_mean_and_percentiles(observed, peers):
    c, why = observed.clock, resolution(observed)
    got, want = observed.summary["itl_seconds"], vllm_seconds(peers, "itl")
    gaps = np.sort(itl_gaps(peers))
    n = len(gaps)
    close(got["mean"], want["mean"], c.gap_err + F32 * float(gaps.max()), "ITL mean",
          f"{why}; each gap is a float32 on the wire")
    aiperf = peers["expected"]["aiperf"]["metrics"]["inter_chunk_latency"]
    close(got["mean"], aiperf["avg"] / 1000, c.gap_err + F32 * float(gaps.max()),
          "ITL mean vs aiperf inter_chunk_latency", f"{why}; float32 gaps")
    lo_edges, hi_edges = WINDOW_INDEX.bounds()
    for q in QUANTILES:
        v = want[f"p{q}"]
        # vLLM's value (ms / 1000) interpolates between these two order statistics
        close(float(np.percentile(gaps, q)), v, 0.0, f"np.percentile of vLLM's gaps, p{q}")
        k = math.floor(q / 100 * (n - 1))
        neighbours = gaps[k], gaps[min(k + 1, n - 1)]
        bins = set()
        for x in neighbours:
            err = c.gap_err + F32 * x
            bins.update(range(int(WINDOW_INDEX.index(np.array([x - err]))[0]),
                              int(WINDOW_INDEX.index(np.array([x + err]))[0]) + 1))
        b = int(WINDOW_INDEX.index(np.array([got[f"p{q}"]]))[0])
        lo, hi = lo_edges[b - 1], hi_edges[b - 1]
        assert b in bins, (
            f"ITL p{q}: phasewatch {got[f'p{q}']!r} (window bin [{lo:.6g}, {hi:.6g}], "
            f"{(hi - lo) / lo:.2%} wide) holds neither order statistic vLLM's np.percentile "
            f"{v!r} interpolates between ({neighbours[0]!r}, {neighbours[1]!r}): ITL "
            f"percentiles come from log-linear bins (exporter/requests/buckets.py "
            f"WINDOW_INDEX, 16 per octave), read at the bin's geometric middle; {why}")
        assert abs(got[f"p{q}"] - v) <= (hi - lo) + (neighbours[1] - neighbours[0]), (
            f"ITL p{q}: phasewatch {got[f'p{q}']!r} vs vLLM {v!r}: more than a window bin "
            f"apart")


# ---- /api/v1/bench: the window laid out as `vllm bench serve` prints a run -----------------------
def test_bench_figures_are_the_summary(observed, peers):
    f, s, m = observed.bench["figures"], observed.summary, vllm(peers)
    assert (f["requests"], f["prompt_tokens"], f["output_tokens"]) == (
        m["completed"], m["total_input"], m["total_output"])
    for key in ("ttft", "tpot", "itl", "e2e"):
        assert f[key] == s[f"{key}_seconds"]
    text = observed.bench["text"]
    assert f"{'Successful requests:':<40} {m['completed']}" in text
    assert f"{'Total input tokens:':<40} {m['total_input']}" in text
    assert f"{'Total generated tokens:':<40} {m['total_output']}" in text


def test_bench_duration_runs_from_the_first_arrival_to_the_last_finish(observed, peers):
    """The window over this run spans its requests' own clock: from the first request's
    arrival to the last stream's end, plus the wall time since the last ingest (the
    window keeps moving when traffic stops). vLLM's benchmark duration starts earlier,
    when its client starts, before it sends the first request: time no server sees, so
    vLLM's throughputs divide by that much more. aiperf's duration is phasewatch's
    but for its end (the last content chunk, not the end of the stream)."""
    reqs = peers["requests"]
    got = observed.bench["figures"]["duration_s"]
    first_arrival = min(r["arrival"] for r in reqs)
    last_finish = max(r["finish"] for r in reqs)
    slack = observed.queried_at - observed.sent_at
    want = last_finish - first_arrival
    assert want - observed.clock.interval() - 1e-9 <= got <= want + slack, (
        f"/api/v1/bench duration_s {got!r} s, first arrival to last finish {want!r} s (+ up to "
        f"{slack:.3f} s since the requests were sent; {resolution(observed)})")
    vllm_duration = peers["expected"]["vllm"]["duration_s"]
    close(vllm_duration - want, first_arrival, 1e-6, "vLLM's duration past phasewatch's",
          "vLLM's clock starts before its first request")
    aiperf = peers["expected"]["aiperf"]["metrics"]["benchmark_duration"]["avg"]
    last_chunk = max(r["chunk_times"][-1] for r in reqs)
    close(aiperf, last_chunk - first_arrival, 1e-6, "aiperf's benchmark_duration",
          "aiperf: first request to last content chunk")
    rate = observed.bench["figures"]["requests"] / got
    print(f"request throughput: phasewatch {rate:.4f}/s over {got:.3f} s, vLLM "
          f"{vllm(peers)['request_throughput']:.4f}/s over {vllm_duration:.3f} s, aiperf over "
          f"{aiperf:.3f} s")


# ---- goodput: vLLM bench's --goodput ------------------------------------------------------------
def test_goodput_equals_vllms(observed, peers):
    """Through the client, the wire and either clock, with the objectives vLLM's
    ``calculate_metrics`` was given (``--slo ttft:150 tpot:25 e2el:2500``): vLLM's good
    requests exactly, in /metrics, the summary and /api/v1/bench; good requests over
    vLLM's duration (its benchmark's start, before the first request, to the last
    stream's end) are its ``request_goodput``; each objective's met count is what vLLM's
    per-request figures give. The window's goodput divides by the window's duration (first
    arrival to last finish), as its request throughput does. No value lies within 10 us of
    an objective (checked in tests/requests/test_slo.py), far beyond what either clock moves."""
    gp = peers["expected"]["vllm"]["goodput"]
    good = gp["good_requests"]
    assert observed.metrics.total("phasewatch_slo_good_requests_total", model=MODEL) == good
    per = per_request(peers)
    slo = observed.summary["slo"]
    for key, ms in gp["goodput_config_ms"].items():
        met = sum((per[rid][key] or 0.0) <= ms / 1000 for rid in per)  # TPOT None: 0
        assert observed.metrics.total("phasewatch_slo_requests_total", model=MODEL,
                                      objective=key, outcome="met") == met, key
        assert slo["objectives"][key]["met"] == met, key
        assert slo["objectives"][key]["unknown"] == 0, key
    assert slo["good_requests"] == good
    close(good / gp["dur_s"], gp["request_goodput"], 0.0, "good requests / vLLM's dur_s")
    f = observed.bench["figures"]
    assert f["good_requests"] == good
    assert f"{'Request goodput (req/s):':<40} {good / f['duration_s']:.2f}" \
        in observed.bench["text"]
    close(slo["goodput"], good / observed.summary["covered_seconds"], 0.0,
          "the window's goodput over its covered time")


# ---- goodput: aiperf's --goodput ----------------------------------------------------------------
AIPERF_NAMES = {"ttft": "time_to_first_token", "tpot": "inter_token_latency",
                "e2el": "request_latency"}  # phasewatch's (vLLM's) objective: aiperf's metric


@pytest.fixture(scope="module")
def observed_multi_token(observed, peers) -> Observed:
    """The requests with two output tokens or more, alone, through an exporter with
    vLLM's objectives, at ``observed``'s clock."""
    reqs = [r for r in peers["requests"] if r["output_tokens"] >= 2]
    return observe(reqs, observed.clock.name, goodput_slo(peers))


def test_goodput_equals_aiperfs_where_defined_alike(observed, observed_multi_token, peers):
    """aiperf 0.13.0 given vLLM's objectives in its own names (``--goodput
    time_to_first_token:150 inter_token_latency:25 request_latency:2500``) counts 123 good
    requests where vLLM counts 136.

    The metrics are vLLM's: request_latency is vLLM's E2EL, inter_token_latency its TPOT,
    (request_latency - TTFT) / (output tokens - 1) (test_every_request_matches_vllm). So
    is the rule: an objective is met when the value is at most it
    (aiperf/metrics/types/good_request_count_metric.py:82; vLLM ``slo >= value``), and a
    good request meets every objective set (:76). They part on requests with one output
    token. vLLM takes their TPOT as 0 (vllm/benchmarks/serve.py:625; phasewatch too,
    exporter/requests/objectives.py), so TTFT and E2EL decide. aiperf's
    inter_token_latency has no value under two output tokens
    (aiperf/metrics/types/inter_token_latency_metric.py:64), and good_request_count
    requires the metric of every objective set (good_request_count_metric.py:63; a
    missing one raises at aiperf/metrics/base_metric.py:163 and the request adds
    nothing), so with an inter_token_latency objective a 1-token request is never good.

    Where the definitions agree, on the requests with two output tokens or more,
    phasewatch must give aiperf's figures exactly. aiperf gave no 1-token request a
    verdict (no value), so its count is over those requests alone; an exporter with the
    same objectives fed those requests alone counts aiperf's good requests, each
    objective's met count is
    what aiperf's per-request values give, and that count over aiperf's duration is
    aiperf's goodput (good_request_count / benchmark_duration, goodput_metric.py:36; its
    duration runs from the first request to the last content chunk, not from vLLM's
    benchmark start to the last stream's end). vLLM's (and phasewatch's) count over all
    the requests exceeds aiperf's by exactly the 1-token requests that met TTFT and E2EL
    by aiperf's own per-request figures."""
    gp = peers["expected"]["aiperf"]["goodput"]
    aiperf = peers["expected"]["aiperf"]
    vllm_ms = peers["expected"]["vllm"]["goodput"]["goodput_config_ms"]
    assert gp["slos"] == {AIPERF_NAMES[k]: v for k, v in vllm_ms.items()}
    assert gp["goodput_config"] == " ".join(f"{k}:{v:g}" for k, v in gp["slos"].items())
    defs = peers["definitions"]["aiperf"]
    assert defs["goodput: an objective is met when value <= it"] == \
        "aiperf/metrics/types/good_request_count_metric.py:82"
    assert defs["goodput: inter_token_latency has no value under 2 output tokens"] == \
        "aiperf/metrics/types/inter_token_latency_metric.py:64"

    reqs = {r["id"]: r for r in peers["requests"]}
    one = {rid for rid, r in reqs.items() if r["output_tokens"] < 2}
    many = set(reqs) - one
    assert set(gp["no_value_request_ids"]) == one, "aiperf judged no 1-token request"
    good_ids = set(gp["good_request_ids"])
    assert len(good_ids) == gp["good_request_count"] and good_ids <= many

    o = observed_multi_token
    good = o.metrics.total("phasewatch_slo_good_requests_total", model=MODEL)
    assert good == gp["good_request_count"], (
        f"phasewatch counts {good:g} good requests of the {len(many)} with two output tokens "
        f"or more, aiperf {gp['good_request_count']}")
    assert o.summary["slo"]["good_requests"] == o.bench["figures"]["good_requests"] == good
    per = aiperf["per_request"]
    for key, name in AIPERF_NAMES.items():
        ns = gp["slos"][name] * 1_000_000  # aiperf's display unit (ms) to its unit (ns)
        met = sum(per[rid][name] <= ns for rid in many)
        assert o.metrics.total("phasewatch_slo_requests_total", model=MODEL, objective=key,
                               outcome="met") == met, key
        assert o.summary["slo"]["objectives"][key]["met"] == met, key
    duration = gp["benchmark_duration_s"]
    assert duration == aiperf["metrics"]["benchmark_duration"]["avg"]
    close(good / duration, gp["goodput_per_s"], 0.0, "good requests / aiperf's duration")

    # vLLM's (and phasewatch's) excess: the 1-token requests good by TTFT and E2EL alone
    ttft_ns, e2el_ns = (gp["slos"][AIPERF_NAMES[k]] * 1_000_000 for k in ("ttft", "e2el"))
    one_good = sum(per[rid]["time_to_first_token"] <= ttft_ns
                   and per[rid]["request_latency"] <= e2el_ns for rid in one)
    everyone = observed.metrics.total("phasewatch_slo_good_requests_total", model=MODEL)
    assert everyone - good == one_good, (
        f"phasewatch's good requests over all of them ({everyone:g}) less those over the "
        f"multi-token ones ({good:g}) are not the {one_good} 1-token requests that met TTFT "
        "and E2EL by aiperf's figures")
    print(f"goodput: aiperf {gp['good_request_count']} good, {gp['goodput_per_s']:.4f}/s over "
          f"{duration:.3f} s; phasewatch {good:g} of the multi-token requests and {everyone:g} of "
          f"all (vLLM's {peers['expected']['vllm']['goodput']['good_requests']}: +{one_good} "
          "1-token requests aiperf cannot judge)")


# ---- percentiles through a real Prometheus ---------------------------------------------------
PROM_QUANTILES = (0.5, 0.9, 0.95, 0.99)
PROM_TOLERANCE = 0.05


def _exact(values) -> dict[float, tuple[float, float]]:
    """Each percentile as vLLM's benchmark computes it (np.percentile, linear between
    order statistics; aiperf too) and by nearest rank (the first value whose share of
    the requests reaches q: Prometheus's rank q x count, guidellm's "first value whose
    cumulative probability reaches p"). In a sparse tail they are a whole order
    statistic apart: for this workload's TTFT p99, 2.908 s (vLLM) vs 3.177 s (guidellm's
    own code, in the fixture)."""
    v = np.asarray(values, dtype=np.float64)
    return {q: (float(np.percentile(v, q * 100)),
                float(np.percentile(v, q * 100, method="inverted_cdf")))
            for q in PROM_QUANTILES}


def test_prometheus_percentiles_within_5_percent(peers, tmp_path):
    """A real Prometheus with native histograms on scrapes the exporter after this
    workload (and a simulated overload, for the phases): every p50/p90/p95/p99 of TTFT,
    ITL, TPOT, e2e and each phase that histogram_quantile gives from the native
    histograms is within 5% of the exact value over the requests' own figures. "Exact"
    as the peers define it, which in a sparse tail is a range (``_exact``): the answer
    must lie within 5% of the range from vLLM's linear percentile to the nearest-rank
    one. The error against vLLM's alone and the classic buckets' answers (the fallback
    for a Prometheus without native histograms) are printed beside them."""
    from phasewatch.sim.scenarios import scenario
    from tests.support.prom import PrometheusServer

    reqs = peers["requests"]
    shift = round(time.time() - max(r["finish"] for r in reqs))
    sim = scenario("overload").build(seed=7)
    records = sim.run(120.0, epoch=time.time() - 130.0)
    sim_model = records[0].model
    ex = Exporter(ServeConfig(**TEST_PORTS, window_seconds=600)).start()
    try:
        with PhasewatchClient(f"127.0.0.1:{ex.grpc_port}", engine=ENGINE) as client:
            for r in reqs:
                times = [shift + t for t in r["chunk_times"]]
                client.record(MODEL, arrival=shift + r["arrival"], first_token=times[0],
                              last_token=times[-1], finish=shift + r["finish"],
                              prompt_tokens=r["prompt_tokens"],
                              cached_prompt_tokens=r["cached_tokens"],
                              output_tokens=r["output_tokens"],
                              finish_reason=r["finish_reason"], token_times=times)
            for rec in records:
                client.record_request(rec)
            assert client.flush(30)
            assert client.stats["accepted"] == len(reqs) + len(records), client.stats
        with PrometheusServer(tmp_path, [f"127.0.0.1:{ex.http_port}"],
                              native_histograms=True) as prom:
            count = (f'sum(gen_ai_server_request_duration_seconds_native{{model="{MODEL}"}})')
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not prom.query(
                    f"histogram_count({count}) == {len(reqs)}"):
                time.sleep(0.5)
            assert prom.query(f"histogram_count({count})"), "Prometheus never scraped them"

            def asked(metric: str, q: float, sel: str, native: bool) -> float:
                expr = (f"histogram_quantile({q}, sum({metric}_native{{{sel}}}))" if native
                        else f"histogram_quantile({q}, sum by (le) ({metric}_bucket{{{sel}}}))")
                (result,) = prom.query(expr)
                return float(result["value"][1])

            gaps = itl_gaps(peers)
            per = per_request(peers)
            fixture = f'model="{MODEL}"'
            simulated = f'model="{sim_model}"'
            figures = {
                "ttft": ("gen_ai_server_time_to_first_token_seconds", fixture,
                         [r["chunk_times"][0] - r["arrival"] for r in reqs]),
                "itl": ("phasewatch_inter_token_latency_seconds", fixture, gaps),
                "tpot": ("gen_ai_server_time_per_output_token_seconds", fixture,
                         [v["tpot"] for v in per.values() if v["tpot"] is not None]),
                "e2e": ("gen_ai_server_request_duration_seconds", fixture,
                        [r["finish"] - r["arrival"] for r in reqs]),
                "decode": ("phasewatch_phase_duration_seconds", fixture + ',phase="decode"',
                           [r["chunk_times"][-1] - r["chunk_times"][0] for r in reqs]),
                "preprocess (sim)": ("phasewatch_phase_duration_seconds",
                                     simulated + ',phase="preprocess"',
                                     [r.queued - r.arrival for r in records]),
                "queue (sim)": ("phasewatch_phase_duration_seconds",
                                simulated + ',phase="queue"',
                                [r.scheduled - r.queued for r in records]),
                "prefill (sim)": ("phasewatch_phase_duration_seconds",
                                  simulated + ',phase="prefill"',
                                  [r.first_token - r.scheduled for r in records]),
                "decode (sim)": ("phasewatch_phase_duration_seconds",
                                 simulated + ',phase="decode"',
                                 [r.last_token - r.first_token for r in records]),
            }
            worst, lines, bad = 0.0, [], []
            for name, (metric, sel, values) in figures.items():
                for q, (linear, rank) in _exact(values).items():
                    got = asked(metric, q, sel, native=True)
                    classic = asked(metric, q, sel, native=False)
                    lo, hi = min(linear, rank), max(linear, rank)
                    err = (lo - got) / lo if got < lo else (got - hi) / hi if got > hi else 0.0
                    worst = max(worst, err)
                    lines.append(f"{name:>17} p{round(q * 100):<2} exact {linear:.6g} (vLLM) .. "
                                 f"{rank:.6g} (rank) native {got:.6g} ({err:.1%} outside; "
                                 f"{got / linear - 1:+.1%} vs vLLM) classic {classic:.6g} "
                                 f"({classic / linear - 1:+.1%} vs vLLM)")
                    if err > PROM_TOLERANCE:
                        bad.append(lines[-1])
            print("\n".join(lines))
            assert not bad, "beyond 5%:\n" + "\n".join(bad)
            print(f"worst native error {worst:.2%} over {len(lines)} percentiles")
    finally:
        ex.stop(grace=1)
