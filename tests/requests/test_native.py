"""Native histograms: bucket placement, spans and deltas, and the protobuf /metrics page."""

from __future__ import annotations

import math
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families as parse_text

from phasewatch.aggregation.aggregate import HISTOGRAMS, Aggregator
from phasewatch.protocol import exposition_pb2 as pb
from phasewatch.publish import exposition
from phasewatch.publish.metrics import HotText
from phasewatch.requests import native
from phasewatch.requests.buckets import TOKEN_LATENCY, WINDOW_INDEX
from phasewatch.requests.gaps import GapBins
from phasewatch.requests.record import RequestBatch, RequestRecord
from tests.publish.test_exposition import _aggregator

NATIVE_ACCEPT = exposition.PROMETHEUS_NATIVE_ACCEPT
CLASSIC_ACCEPT = exposition.PROMETHEUS_CLASSIC_ACCEPT


def _key_by_definition(v: float) -> int:
    """Bucket k holds (2**((k-1)/16), 2**(k/16)]: found by log2, then checked against
    the bounds themselves so a rounding at a boundary cannot hide."""
    k = math.ceil(math.log2(v) * native.PER_DOUBLING)
    while 2.0 ** ((k - 1) / native.PER_DOUBLING) >= v:
        k -= 1
    while 2.0 ** (k / native.PER_DOUBLING) < v:
        k += 1
    return k


def test_every_value_lands_in_the_bucket_its_definition_gives():
    layout = native.NativeLayout.around(TOKEN_LATENCY)
    rng = np.random.default_rng(3)
    inside = np.exp(rng.uniform(np.log(layout.zero_threshold), np.log(layout.bounds[-1]),
                                20_000))
    # the bounds themselves and their float neighbours: the boundary cases
    bounds = layout.bounds[1:-1]
    values = np.concatenate([inside, bounds, np.nextafter(bounds, 0),
                             np.nextafter(bounds, np.inf)])
    cols = layout.column(values)
    want = np.array([_key_by_definition(v) for v in values]) - layout.kmin
    np.testing.assert_array_equal(cols, want)
    # below the zero threshold (and zero, and negative): the zero bucket; above the top:
    # the top bucket
    edge = layout.column(np.array([0.0, -1.0, layout.zero_threshold, 1e9]))
    assert edge.tolist() == [0, 0, 0, layout.columns - 1]


def test_every_bucket_is_under_five_percent_wide():
    layout = native.NativeLayout(-10, 10)
    widths = layout.bounds[1:] / layout.bounds[:-1] - 1
    assert widths.max() == pytest.approx(2 ** (1 / 16) - 1) and widths.max() < 0.045


def _decode(zero: int, spans: list, deltas: list, kmin: int) -> dict[int, int]:
    """Per bucket key counts back from spans and deltas, as Prometheus reads them."""
    out, key, count, i = {}, None, 0, 0
    for offset, length in spans:
        key = offset if key is None else key + offset
        for _ in range(length):
            count += deltas[i]
            i += 1
            if count:
                out[key] = count
            key += 1
    if zero:
        out["zero"] = zero
    assert i == len(deltas)
    return out


@pytest.mark.parametrize("lo", [0, 7])
def test_spans_and_deltas_give_back_every_count(lo):
    """One series, and the same series among others (all rows are encoded at once)."""
    layout = native.NativeLayout(-40, 40)
    rng = np.random.default_rng(lo)
    row = np.zeros(50, np.int64)
    row[rng.choice(50, 15, replace=False)] = rng.integers(1, 1000, 15)
    row[[20, 22, 26]] = [5, 6, 7]  # gaps of 1 and 3 empty buckets
    zero, spans, deltas = native.encode(layout, row[None, :], lo)[0]
    want = {layout.kmin + lo + c: int(n) for c, n in enumerate(row) if n and lo + c >= 1}
    if lo == 0 and row[0]:
        want["zero"] = int(row[0])
    assert _decode(zero, spans, deltas, layout.kmin) == want
    assert all(length > 0 for _, length in spans)


def test_counts_grow_to_the_columns_and_rows_they_are_given():
    layout = native.NativeLayout(-200, 20)
    acc = native.NativeCounts()
    acc.add(native.count(layout, np.array([0, 1]), np.array([1.0, 2.0]), 2))
    acc.add(native.count(layout, np.array([2]), np.array([0.01]), 3))  # lower, new row
    acc.add(native.count(layout, np.array([0]), np.array([100.0]), 1))  # above the top
    lo, counts = acc.copy()
    got = {(r, layout.kmin + lo + c) for r, c in zip(*np.nonzero(counts), strict=True)}
    assert got == {(0, 0), (1, 16), (2, _key_by_definition(0.01)), (0, layout.kmax)}
    assert counts.sum() == 4


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("series", [1, 3])
def test_itl_gaps_get_the_same_native_buckets_as_one_by_one(dtype, series):
    layout = native.NativeLayout.around(TOKEN_LATENCY)
    bins = GapBins(np.asarray(TOKEN_LATENCY.bounds), WINDOW_INDEX, layout.bounds)
    rng = np.random.default_rng(5)
    gaps = np.exp(rng.normal(np.log(0.02), 1.5, 30_000)).astype(dtype)
    gaps[:200] = layout.bounds[100:300].astype(dtype)  # on the boundaries
    row_counts = np.full(100, 300)
    row_series = np.arange(100) % series
    got, _ = bins.count(gaps, row_series, row_counts)
    local = np.repeat(row_series, row_counts)
    cols = np.searchsorted(layout.bounds, gaps.astype(np.float64), side="left")
    for j, s in enumerate(got.series):
        want = np.bincount(cols[local == s], minlength=layout.columns + 1)
        np.testing.assert_array_equal(got.native[j], want)


def _page(agg: Aggregator) -> dict[str, pb.MetricFamily]:
    body = exposition.delimited(exposition.HotProto(agg).families())
    return {f.name: f for f in exposition.read_delimited(body)}


def test_protobuf_page_holds_the_text_pages_samples_and_the_native_histograms():
    agg = _aggregator(pod_label=True)
    fams = _page(agg)
    text = {f.name: f for f in parse_text(HotText(agg).render(False).decode())}
    for name, fam in text.items():
        got = fams[name if fam.type != "counter" else name + "_total"]
        want = sorted((s.name, tuple(sorted(s.labels.items())), s.value) for s in fam.samples)
        mine = []
        for m in got.metric:
            labels = tuple(sorted((p.name, p.value) for p in m.label))
            if fam.type == "counter":
                mine.append((got.name, labels, m.counter.value))
                continue
            h = m.histogram
            for b in h.bucket:
                le = str(b.upper_bound) if b.upper_bound != int(b.upper_bound) else \
                    f"{b.upper_bound:.1f}"
                mine.append((f"{name}_bucket", tuple(sorted((*labels, ("le", le)))),
                             b.cumulative_count))
            mine += [(f"{name}_bucket", tuple(sorted((*labels, ("le", "+Inf")))),
                      h.sample_count), (f"{name}_count", labels, h.sample_count),
                     (f"{name}_sum", labels, h.sample_sum)]
        assert sorted(mine) == want, name

    snap = agg.snapshot()
    for spec in HISTOGRAMS:
        if spec.native is None:
            assert exposition.native_name(fams_name(spec)) not in fams
            continue
        fam = fams[exposition.native_name(fams_name(spec))]
        _lo, _counts = snap.natives[spec.key]
        classic = fams[fams_name(spec)]
        assert len(fam.metric) == len(classic.metric) > 0
        for m, c in zip(fam.metric, classic.metric, strict=True):
            h = m.histogram
            assert [(p.name, p.value) for p in m.label] == [(p.name, p.value) for p in c.label]
            assert h.schema == native.SCHEMA and h.zero_threshold == spec.native.zero_threshold
            assert (h.sample_count, h.sample_sum) == (c.histogram.sample_count,
                                                      c.histogram.sample_sum)
            decoded = _decode(h.zero_count, [(s.offset, s.length) for s in h.positive_span],
                              list(h.positive_delta), spec.native.kmin)
            assert sum(decoded.values()) == h.sample_count


def fams_name(spec) -> str:
    from phasewatch.catalog import HISTOGRAMS as HISTOGRAM_NAMES

    return HISTOGRAM_NAMES[spec.key][0]


def test_native_buckets_hold_the_requests_own_values():
    """TTFT of known requests: each request's value counted in the bucket its
    definition gives, in its own prompt class's series."""
    t = 1_700_000_000.0
    ttfts = [0.011, 0.25, 0.25, 1.0, 3.7, 0.0, 1e-7]
    recs = [RequestRecord("m", arrival=t, scheduled=t, first_token=t + v, last_token=t + v,
                          finish=t + v + 0.001, prompt_tokens=100, output_tokens=1,
                          finish_reason="stop") for v in ttfts]
    agg = Aggregator()
    agg.ingest(RequestBatch.from_records(recs, engine="e"), "test")
    fam = _page(agg)[exposition.native_name("gen_ai_server_time_to_first_token_seconds")]
    (m,) = fam.metric
    h = m.histogram
    got = _decode(h.zero_count, [(s.offset, s.length) for s in h.positive_span],
                  list(h.positive_delta), 0)
    assert got == {"zero": 2, _key_by_definition(0.011): 1, 0: 1,
                   _key_by_definition(0.25): 2, _key_by_definition(3.7): 1}


@pytest.mark.parametrize(("accept", "proto"), [
    (NATIVE_ACCEPT, True), (CLASSIC_ACCEPT, False), ("", False), ("*/*", False),
    ("text/plain;version=0.0.4;q=0.9,application/vnd.google.protobuf;"
     "proto=io.prometheus.client.MetricFamily;encoding=delimited;q=0.5", False),
    ("application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;"
     "encoding=text", False),
    ("application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;"
     "encoding=delimited;q=0", False),
])
def test_protobuf_only_when_the_scraper_prefers_it(accept, proto):
    assert exposition.wants_protobuf(accept) is proto


def test_metrics_endpoint_answers_prometheus_native_accept(exporter):
    from phasewatch.client import PhasewatchClient

    t = 1_700_000_000.0
    with PhasewatchClient(f"127.0.0.1:{exporter.grpc_port}", engine="vllm") as client:
        for i in range(10):
            client.record("m", arrival=t + i, scheduled=t + i + 0.01, first_token=t + i + 0.1,
                          last_token=t + i + 0.3, finish=t + i + 0.31, output_tokens=3,
                          prompt_tokens=100, token_times=[t + i + 0.1, t + i + 0.2, t + i + 0.3])
        assert client.flush(10)
    pages = {}
    for accept in (NATIVE_ACCEPT, CLASSIC_ACCEPT):
        req = urllib.request.Request(f"http://127.0.0.1:{exporter.http_port}/metrics",
                                     headers={"Accept": accept})
        with urllib.request.urlopen(req, timeout=10) as r:
            pages[accept] = (r.headers["Content-Type"], r.read())
    ctype, body = pages[NATIVE_ACCEPT]
    assert ctype == exposition.CONTENT_TYPE
    names = {f.name for f in exposition.read_delimited(body)}
    text_names = {s.name.removesuffix("_created") for f in parse_text(
        pages[CLASSIC_ACCEPT][1].decode().replace("# EOF\n", "")) for s in f.samples}
    # every family of the text page (counters by their _total name), plus the natives
    for name in ("process_resident_memory_bytes", "phasewatch_ingest_accepted_total",
                 "phasewatch_requests_total", "gen_ai_server_time_to_first_token_seconds",
                 "gen_ai_server_time_to_first_token_seconds_native",
                 "phasewatch_inter_token_latency_seconds_native",
                 "phasewatch_phase_duration_seconds_native"):
        assert name in names, name
    plain = {n.removesuffix("_bucket").removesuffix("_count").removesuffix("_sum")
             for n in text_names}
    missing = {n for n in plain if n not in names and n + "_total" not in names}
    assert not missing, missing


def test_many_series_encode_as_each_alone():
    layout = native.NativeLayout(-40, 40)
    rng = np.random.default_rng(9)
    counts = rng.integers(0, 3, (12, 60)) * (rng.random((12, 60)) < 0.2)
    counts[4] = 0  # a series with nothing filled
    counts[7, 0] = 5  # a zero bucket
    for lo in (0, 3):
        together = native.encode(layout, counts, lo)
        alone = [native.encode(layout, row[None, :], lo)[0] for row in counts]
        assert together == alone
        assert together[4] == (0, [], [])


@pytest.mark.parametrize("dense", [True, False])
@pytest.mark.parametrize("series", [1, 3])
def test_counts_of_the_rows_kept_equal_counting_them_alone(dense, series, monkeypatch):
    """GapBins.count(leave_out=...) gives, from one pass, what counting only the other
    rows' gaps gives (the per-token ITL of requests whose emissions are one token)."""
    import phasewatch.requests.gaps as gaps_mod

    if not dense:
        monkeypatch.setattr(gaps_mod, "_MAX_DENSE_CELLS", 1)
    layout = native.NativeLayout.around(TOKEN_LATENCY)
    bins = GapBins(np.asarray(TOKEN_LATENCY.bounds), WINDOW_INDEX, layout.bounds)
    rng = np.random.default_rng(11)
    row_counts = rng.integers(0, 200, 60)
    gaps = np.exp(rng.normal(np.log(0.02), 1.5, int(row_counts.sum())))
    gaps[:100] = layout.bounds[50:150]  # on boundaries
    row_series = np.arange(60) % series
    leave_out = rng.random(60) < 0.4
    ends = np.cumsum(row_counts)
    sums = np.array([gaps[e - n:e].sum() for e, n in zip(ends, row_counts, strict=True)])
    whole, part = bins.count(gaps, row_series, row_counts, leave_out, sums)
    alone, none = bins.count(gaps[np.repeat(~leave_out, row_counts)],
                             row_series[~leave_out], row_counts[~leave_out])
    assert none is None
    np.testing.assert_array_equal(whole.series, part.series)
    at = np.searchsorted(part.series, alone.series)
    np.testing.assert_array_equal(part.buckets[at], alone.buckets)
    np.testing.assert_array_equal(part.native[at], alone.native)
    np.testing.assert_allclose(part.sums[at], alone.sums, rtol=1e-12)


def test_registry_families_carry_every_kind_of_prometheus_client_metric():
    """The protobuf page's other families (the exporter's own counters and gauges, the
    process collector, anything registered later) carry prometheus_client's samples:
    counters, gauges, info, histograms and summaries, checked against its text page."""
    from prometheus_client import (
        CollectorRegistry,
        Counter,
        Gauge,
        Histogram,
        Info,
        Summary,
        generate_latest,
    )

    reg = CollectorRegistry()
    Counter("pw_test_events", "events", ["kind"], registry=reg).labels("a").inc(3)
    Gauge("pw_test_depth", "depth", registry=reg).set(7.5)
    Info("pw_test_build", "build", registry=reg).info({"version": "1.2"})
    h = Histogram("pw_test_seconds", "seconds", ["op"], buckets=(0.1, 1.0), registry=reg)
    for v in (0.05, 0.5, 2.0):
        h.labels("x").observe(v)
    Summary("pw_test_size", "size", registry=reg).observe(4.0)
    fams = {f.name: f for f in exposition.read_delimited(
        exposition.delimited(exposition.registry_families(reg)))}
    text = {s.name: s for f in parse_text(generate_latest(reg).decode()) for s in f.samples}

    (m,) = fams["pw_test_events_total"].metric
    assert fams["pw_test_events_total"].type == pb.COUNTER
    assert (m.label[0].value, m.counter.value) == ("a", text["pw_test_events_total"].value)
    assert fams["pw_test_depth"].metric[0].gauge.value == 7.5
    (info,) = fams["pw_test_build_info"].metric
    assert [(p.name, p.value) for p in info.label] == [("version", "1.2")]
    assert info.gauge.value == 1.0
    (hm,) = fams["pw_test_seconds"].metric
    assert fams["pw_test_seconds"].type == pb.HISTOGRAM
    assert [(p.name, p.value) for p in hm.label] == [("op", "x")]
    assert [(b.upper_bound, b.cumulative_count) for b in hm.histogram.bucket] == [
        (0.1, 1), (1.0, 2)]
    assert (hm.histogram.sample_count, hm.histogram.sample_sum) == (3, 2.55)
    (sm,) = fams["pw_test_size"].metric
    assert (sm.summary.sample_count, sm.summary.sample_sum) == (1, 4.0)
    assert "pw_test_events_created" not in fams
