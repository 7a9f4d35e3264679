"""Trace sampling (exporter/requests/sampling.py): the probability read from a span's
tracestate (OpenTelemetry's ``ot=th``) or configured (``--trace-sample-ratio``), and what
it weighs: request, token and objective counters and the JSON rates count a sampled
request 1/p times; histograms count it once; the roofline's work is weighted.

End to end through the OpenTelemetry SDK's samplers and exporters: test_otlp_sampling.py.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from phasewatch.aggregation.aggregate import Aggregator
from phasewatch.aggregation.window import RollingWindow
from phasewatch.app import Exporter
from phasewatch.config import ConfigError, ServeConfig, load_serve_config
from phasewatch.requests.record import RequestBatch
from phasewatch.requests.sampling import (
    MIN_PROBABILITY,
    TraceSampling,
    probability,
    threshold_probability,
)
from phasewatch.roofline.bottleneck import BottleneckMonitor
from phasewatch.roofline.deployments import Deployments
from phasewatch.roofline.estimate import Deployment
from phasewatch.roofline.intervals import busy_time, union_length
from phasewatch.sim.scenarios import SCENARIOS
from tests.conftest import TEST_PORTS, Scrape

PHASEWATCH = [sys.executable, "-m", "phasewatch.cli"]
EPOCH = 1.7e9
TEXT = "text/plain;version=0.0.4"


# ---- the threshold ---------------------------------------------------------------------
@pytest.mark.parametrize(("th", "p"), [
    ("0", 1.0), ("8", 0.5), ("c", 0.25), ("C", 0.25), ("e668", 6552 / 65536),
    ("00000000000000", 1.0), ("e6666666666666", 1 - 0xE6666666666666 / 2**56),
    ("ffffffffffffff", 2.0**-56), ("fffff", 2.0**-20),
])
def test_th_is_the_rejection_threshold_padded_to_56_bits(th, p):
    assert threshold_probability(th) == pytest.approx(p, rel=1e-12)


def test_th_e668_is_ten_percent():
    assert threshold_probability("e668") == pytest.approx(0.1, abs=3e-5)  # 0.0999756


@pytest.mark.parametrize("th", ["", "g", "0x8", "+8", "-8", "8_0", " 8", "8 ", "1" * 15,
                                "e668e668e668e668", "８"])
def test_a_th_that_is_not_1_to_14_hex_digits_is_refused(th):
    with pytest.raises(ValueError):
        threshold_probability(th)


@pytest.mark.parametrize(("state", "want"), [
    ("", (None, "")),
    ("ot=th:8", (0.5, "")),
    ("ot=rv:0123456789abcd;th:c", (0.25, "")),  # other sub-keys around it
    ("ot=th:c;rv:0123456789abcd;k1:v", (0.25, "")),
    ("vendor=t61rcWkgMzE,ot=th:e668,phasewatch=tap", (6552 / 65536, "")),  # other members
    ("phasewatch=tap , ot=th:8", (0.5, "")),  # optional white space around members
    ("ot=rv:0123456789abcd", (None, "")),  # ot without th
    ("phasewatch=tap", (None, "")),
    ("vendor=th:8", (None, "")),  # th of another member
    ("xot=th:8", (None, "")),
    ("ot=thx:8", (None, "")),
    ("ot=th:8;th:c", (0.5, "")),  # the first th
    ("ot=th:,x=y", (None, "bad_threshold")),
    ("ot=th:zz", (None, "bad_threshold")),
    ("ot=th:123456789abcdef", (None, "bad_threshold")),  # 15 digits
    ("ot=th:fffff", (None, "threshold_out_of_range")),  # 2^-20 < 1e-6
    ("ot=th:ffffffffffffff", (None, "threshold_out_of_range")),  # 2^-56: 7.2e16 each
])
def test_probability_from_the_tracestate(state, want):
    p, reason = probability(state)
    assert (p if p is None else pytest.approx(p), reason) == (
        want[0] if want[0] is None else pytest.approx(want[0]), want[1])


def test_weights_take_th_first_then_the_ratio_and_count_what_they_ignore():
    assert TraceSampling().weights(["", "phasewatch=tap"]) is None  # all 1: no column
    assert TraceSampling(0.1).weights(["", "x=y"]).tolist() == pytest.approx([10, 10])
    s = TraceSampling(0.5)
    w = s.weights(["ot=th:c", "", "ot=th:0", "ot=th:zz", "ot=th:ffffffffffffff", "ot=th:8"])
    assert w.tolist() == pytest.approx([4, 2, 1, 2, 2, 2])
    assert s.take_ignored() == {"bad_threshold": 1, "threshold_out_of_range": 1}
    assert s.take_ignored() == {}
    assert np.isfinite(w).all() and w.max() <= 1 / MIN_PROBABILITY


# ---- the configured ratio --------------------------------------------------------------
def test_the_ratio_from_a_flag_a_variable_and_a_file(tmp_path):
    assert load_serve_config(environ={}).trace_sample_ratio == 1.0
    cfg = tmp_path / "pw.toml"
    cfg.write_text("trace_sample_ratio = 0.25\n")
    assert load_serve_config(environ={"PHASEWATCH_CONFIG": str(cfg)}).trace_sample_ratio == 0.25
    assert load_serve_config(environ={"PHASEWATCH_TRACE_SAMPLE_RATIO": "0.1"}
                             ).trace_sample_ratio == 0.1


@pytest.mark.parametrize("value", ["0", "-0.1", "1.5", "nan", "inf", "1e-9", "ten"])
def test_a_bad_ratio_stops_the_exporter_at_start(value):
    with pytest.raises(ConfigError, match="trace_sample_ratio must be"):
        load_serve_config(environ={"PHASEWATCH_TRACE_SAMPLE_RATIO": value})


def test_a_bad_ratio_flag_exits_2_with_one_line():
    r = subprocess.run([*PHASEWATCH, "serve", "--trace-sample-ratio", "0"], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (
        "phasewatch: error: --trace-sample-ratio: trace_sample_ratio must be between 1e-06 "
        "and 1, got 0.0")


# ---- what the weight weighs ------------------------------------------------------------
def _records(n_max: int = 400):
    return SCENARIOS["chat"].build(seed=5).run(40.0, epoch=EPOCH)[:n_max]


def _page(batch: RequestBatch, **config) -> tuple[Scrape, dict]:
    ex = Exporter(ServeConfig(**TEST_PORTS, slo="ttft:500,tpot:50", window_seconds=120,
                              **config),
                  clock=lambda: EPOCH + 41.0)
    try:
        ex.trace_join.ingest(batch, "phasewatch")
        body, _ = ex.metrics_page.render(TEXT)
        summary = ex.aggregator.window.summary(ex.aggregator.labels.pairs())
    finally:
        ex.stop(0)
    return Scrape(body.decode()), summary["models"][0]


def test_counters_and_rates_are_weighted_histograms_are_not():
    records = _records()
    plain, plain_summary = _page(RequestBatch.from_records(records))
    batch = RequestBatch.from_records(records)
    w = np.where(np.arange(len(records)) % 2, 4.0, 10.0)  # th:c and about th:e668
    weighted, summary = _page(dataclasses.replace(batch, weight=w))
    ttft = "gen_ai_server_time_to_first_token_seconds_count"
    assert weighted.total(ttft) == plain.total(ttft) == len(records)
    for name in ("gen_ai_server_request_duration_seconds_count",
                 "phasewatch_phase_duration_seconds_count",
                 "phasewatch_inter_token_latency_seconds_count"):
        assert weighted.total(name) == plain.total(name)
    assert weighted.total("phasewatch_requests_total") == pytest.approx(w.sum())
    assert weighted.total("phasewatch_sampled_requests_total") == len(records)
    out = np.array([r.output_tokens for r in records])
    assert weighted.total("phasewatch_tokens_total", kind="output") == pytest.approx(
        (out * w).sum())
    # objectives: the same weighting, so goodput and attainment read against requests_total
    assert weighted.total("phasewatch_slo_requests_total", objective="ttft") == pytest.approx(
        w.sum())
    good = plain.total("phasewatch_slo_good_requests_total")
    assert good > 0 and weighted.total("phasewatch_slo_good_requests_total") > good
    # the JSON API's rates agree with /metrics
    assert summary["requests_in_window"] == pytest.approx(w.sum())
    assert summary["request_rate"] == pytest.approx(
        plain_summary["request_rate"] * w.sum() / len(records))
    assert summary["output_tokens_per_second"] == pytest.approx(
        plain_summary["output_tokens_per_second"] * (out * w).sum() / out.sum())
    assert summary["trace_sampling"] == {"received_requests": len(records),
                                         "sampled_share": pytest.approx(len(records) / w.sum())}
    assert summary["ttft_seconds"] == plain_summary["ttft_seconds"]  # unweighted samples
    assert "trace_sampling" not in plain_summary


def test_without_sampling_the_new_families_are_absent():
    plain, _ = _page(RequestBatch.from_records(_records(50)))
    assert "phasewatch_sampled_requests" not in plain.text
    assert "phasewatch_trace_sampling_ignored" not in plain.text
    assert plain.total("phasewatch_requests_total") == 50


def test_a_tap_joined_request_counts_once_whatever_the_engines_weight():
    """The tap records every request it passes: the joined request is one, though the
    engine's span came from a 10 % sample (the other nine are the tap's alone)."""
    from tests.aggregation.test_tapjoin import engine_batch, engine_record, tap_batch, tap_record

    ex = Exporter(ServeConfig(**TEST_PORTS))
    try:
        engine = engine_batch(engine_record(), tapped=True)
        ex.trace_join.ingest(dataclasses.replace(engine, weight=np.array([10.0])), "otlp_grpc")
        ex.trace_join.ingest(tap_batch(tap_record()), "grpc")
        assert ex.trace_join.pending_count() == 0
        snap = ex.aggregator.snapshot()
    finally:
        ex.stop(0)
    assert snap.counters["requests"].sum() == snap.counters["sampled_requests"].sum() == 1


# ---- the roofline ----------------------------------------------------------------------
def _kept(starts, ends, p: float, seed: int):
    kept = np.random.default_rng(seed).random(starts.size) < p
    return starts[kept], ends[kept], np.full(int(kept.sum()), 1 / p)


def _busy_from_samples(starts, ends, lo, hi, seeds=range(20)) -> tuple[float, float]:
    """Mean over 10 % samples (weights 10) of (estimated busy, the sample's union)."""
    got = [busy_time(*_kept(starts, ends, 0.1, seed), lo, hi) for seed in seeds]
    return float(np.mean([b for b, _ in got])), float(np.mean([u for _, u in got]))


def test_busy_time_is_the_union_when_all_is_seen_and_estimated_from_a_sample():
    rng = np.random.default_rng(7)
    # one request at a time with idle gaps; 8 back-to-back streams, on 100 s, off 50 s
    gaps = rng.exponential(1.0, 5001)
    start = np.cumsum(gaps[:-1])
    serial = start, start + gaps[1:] * rng.uniform(0.3, 0.9, 5000)
    on = [(a, a + 100.0) for a in np.arange(0.0, 1500.0, 150.0)]
    streams = [np.concatenate([np.arange(a + rng.uniform(0, 1), b - 1, 1.0) for a, b in on])
               for _ in range(8)]
    steady = np.concatenate(streams), np.concatenate(streams) + 1.0
    for starts, ends in (serial, steady):
        lo, hi = 10.0, float(ends.max()) - 10.0
        union = union_length(starts, ends, lo, hi)
        assert busy_time(starts, ends, np.ones(starts.size), lo, hi) == (union, union)
        est, seen = _busy_from_samples(starts, ends, lo, hi)
        assert seen < 0.7 * union  # the sample's union misses much of it
        assert est == pytest.approx(union, rel=0.05)  # steady concurrency: D^2/Q is busy
    # requests that come and go at random (Poisson, 2 at once on average): D^2/Q is a
    # lower bound, E[c]^2/E[c^2] = 2/3 of the time against P(c > 0) = 1 - e^-2 (0.77x)
    starts = np.sort(rng.uniform(0, 2000, 4000))
    ends = starts + 1.0
    union = union_length(starts, ends, 10.0, 1990.0)
    est, seen = _busy_from_samples(starts, ends, 10.0, 1990.0)
    assert seen < 0.3 * union and 0.72 * union < est < 0.83 * union


def _estimate(records, dep: Deployment, weights: np.ndarray | None = None):
    window = RollingWindow(30.0, capacity=200_000)
    agg = Aggregator(window=window)
    batch = RequestBatch.from_records(records, engine="sim")
    if weights is not None:
        batch = dataclasses.replace(batch, weight=weights)
    agg.ingest(batch, "test")
    [result] = BottleneckMonitor(window, agg.labels, Deployments([dep]),
                                 window_seconds=30.0).update()
    return result.estimate


def _ratios(full, est) -> dict[str, float]:
    return {"decode batch": est.decode_batch_size / full.decode_batch_size,
            **{f"{phase} {what}": getattr(getattr(est, phase), f"achieved_{what}_per_second")
               / getattr(getattr(full, phase), f"achieved_{what}_per_second")
               for phase in ("decode", "prefill") for what in ("flops", "bytes")}}


@pytest.mark.parametrize("name", ["chat", "long_generation", "tiny_batch"])
def test_the_roofline_from_a_sample_weighted_is_the_roofline_of_all(name):
    """10 % samples weighted 10x give the work, the decode batch and the achieved rates of
    all the requests: each window's figures scatter (a 30 s window of chat holds ~17
    sampled requests; the decode batch of one sample reads 0.3-2.3x), their median over
    samples lands on the full figures (within 13 % here), and decode's bandwidth (weights
    read once per step: MBU) holds within 30 % in every sample. Unweighted, a sample reads
    a tenth of the batch."""
    engine = SCENARIOS[name].build(seed=1)
    records = engine.run(150.0, epoch=EPOCH)
    dep = Deployment("Llama-3.1-8B", engine.model, engine.hw)
    full = _estimate(records, dep)
    ratios = []
    for seed in range(15):
        kept = np.random.default_rng(seed).random(len(records)) < 0.1
        sample = [r for r, k in zip(records, kept, strict=True) if k]
        ratios.append(_ratios(full, _estimate(sample, dep, np.full(len(sample), 10.0))))
        if seed == 0 and name != "tiny_batch":  # where requests overlap
            plain = _estimate(sample, dep)
            assert plain.decode_batch_size < 0.3 * full.decode_batch_size
    for what in ratios[0]:
        assert np.median([r[what] for r in ratios]) == pytest.approx(1, abs=0.2), what
    assert all(r["decode bytes"] == pytest.approx(1, abs=0.3) for r in ratios)
