"""Prometheus exposition: one collector that renders the aggregation snapshot at scrape.

Names follow docs/metrics.md's catalog; the OTel GenAI semconv names where one exists
(``gen_ai.server.time_to_first_token`` -> ``gen_ai_server_time_to_first_token_seconds``).
Sample exposition::

    gen_ai_server_time_to_first_token_seconds_bucket{model="Llama-3.1-8B",engine="vllm",prompt_class="1k-4k",le="0.25"} 812.0
    phasewatch_phase_duration_seconds_sum{model="Llama-3.1-8B",engine="vllm",phase="decode"} 1534.2
    phasewatch_tokens_total{model="Llama-3.1-8B",engine="vllm",kind="output"} 201533.0
    phasewatch_ingest_rejected_total{protocol="phasewatch",reason="clock_order"} 3.0
"""  # noqa: E501

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from importlib import metadata

import numpy as np
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, choose_encoder, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from phasewatch.aggregation.aggregate import COUNTERS, Aggregator, Snapshot
from phasewatch.requests.buckets import BucketSet
from phasewatch.selfstats import SELF_METRICS

# Aggregator key -> (Prometheus name, help). Units are in the names.
HISTOGRAM_NAMES: dict[str, tuple[str, str]] = {
    "ttft": ("gen_ai_server_time_to_first_token_seconds",
             "Time to first token: first token minus arrival."),
    "tpot": ("gen_ai_server_time_per_output_token_seconds",
             "Per-request time per output token after the first: "
             "(last_token - first_token) / (output_tokens - 1)."),
    "e2e": ("gen_ai_server_request_duration_seconds", "End-to-end request duration."),
    "itl": ("phasewatch_inter_token_latency_seconds",
            "Every gap between consecutive streamed emissions, pooled (vLLM's benchmark "
            "itl)."),
    "itl_per_token": ("phasewatch_inter_token_latency_per_token_seconds",
                      "Every gap between streamed emissions spread over the tokens of the "
                      "emission ending it, pooled."),
    "phase": ("phasewatch_phase_duration_seconds",
              "Time a request spent in each phase (preprocess, queue, prefill, "
              "kv_transfer, decode)."),
    "prefill_spt": ("phasewatch_prefill_seconds_per_token",
                    "Prefill time per uncached prompt token (length-normalised TTFT)."),
    "decode_tps": ("phasewatch_decode_tokens_per_second",
                   "Per-request decode speed: output tokens after the first per decode second."),
    "clock_skew": ("phasewatch_clock_skew_seconds",
                   "Disagreement absorbed per request between a two-clock server's frontend "
                   "and engine-core times."),
}
COUNTER_NAMES: dict[str, tuple[str, str]] = {
    "tokens": ("phasewatch_tokens_total",
               "Tokens of accepted requests: prompt, cached_prompt (prefix-cache hits), output."),
    "requests": ("phasewatch_requests_total", "Finished requests accepted, by finish reason."),
}


def coarse(bounds: BucketSet) -> BucketSet:
    """The 1-2-5 bounds of a bucket set (1, 2 or 5 times a power of ten) and its top one."""
    def one_two_five(b: float) -> bool:
        mantissa = b / 10 ** math.floor(math.log10(b))
        return any(math.isclose(mantissa, m, rel_tol=1e-9) for m in (1, 2, 5, 10))
    kept = tuple(b for b in bounds.bounds[:-1] if one_two_five(b)) + bounds.bounds[-1:]
    return replace(bounds, bounds=kept)


@dataclass(frozen=True)
class Exposure:
    """What /metrics shows of the aggregation: every label set's histograms, with the
    prompt-length split of TTFT (``--prompt-class-label``) and the classic buckets in
    full or coarse (``--classic-buckets``). The aggregation keeps everything; this only
    merges what a scrape carries, exactly (a coarse bucket is the sum of the fine ones
    it covers; TTFT without classes the sum over classes, native buckets too)."""

    prompt_class_label: bool = True
    classic_buckets: str = "full"

    def apply(self, snap: Snapshot) -> Snapshot:
        if self.prompt_class_label and self.classic_buckets == "full":
            return snap
        hists, natives = dict(snap.histograms), dict(snap.natives)
        for key, (spec, counts, sums) in snap.histograms.items():
            if not self.prompt_class_label and spec.sub_label == "prompt_class":
                k = len(spec.sub_values)
                counts, sums = _merge_rows(counts, k), _merge_rows(sums[:, None], k)[:, 0]
                if key in natives:
                    lo, ncounts = natives[key]
                    natives[key] = (lo, _merge_rows(ncounts, k))
                spec = replace(spec, sub_label=None, sub_values=("",))
            if self.classic_buckets == "coarse":
                fine = spec.buckets
                spec = replace(spec, buckets=coarse(fine))
                cols = [fine.bounds.index(b) for b in spec.buckets.bounds]
                cum = np.cumsum(counts, axis=1)[:, [*cols, -1]]
                counts = np.diff(cum, axis=1, prepend=0)
            hists[key] = (spec, counts, sums)
        return replace(snap, histograms=hists, natives=natives)


def _merge_rows(a: np.ndarray, k: int) -> np.ndarray:
    """Rows ``i*k .. i*k+k-1`` summed into row ``i`` (a sub-label's values merged)."""
    rows = -(-a.shape[0] // k) * k
    padded = np.zeros((rows, a.shape[1]), dtype=a.dtype)
    padded[: a.shape[0]] = a
    return padded.reshape(rows // k, k, a.shape[1]).sum(axis=1)


class HotCollector(Collector):
    """The aggregator's histograms and counters as prometheus_client families, built from
    ``Aggregator.snapshot()`` at every scrape. ``HotText`` renders the same samples
    straight to text (what /metrics serves in the two standard formats); this is the
    path for any other format, and the reference it is tested against."""

    def __init__(self, aggregator: Aggregator, exposure: Exposure | None = None):
        self._agg = aggregator
        self._exposure = exposure or Exposure()

    def collect(self) -> Iterator[Metric]:
        snap = self._exposure.apply(self._agg.snapshot())
        pairs = snap.label_sets
        base = list(snap.label_names)
        for spec, counts, sums in snap.histograms.values():
            name, doc = HISTOGRAM_NAMES[spec.key]
            labels = base + ([spec.sub_label] if spec.sub_label else [])
            fam = HistogramMetricFamily(name, doc, labels=labels)
            les = [floatToGoString(b) for b in spec.buckets.bounds] + ["+Inf"]
            cum = np.cumsum(counts, axis=1)
            for row in np.flatnonzero(cum[:, -1]):
                fam.add_metric(row_labels(spec, pairs, row),
                               list(zip(les, cum[row].tolist(), strict=True)), float(sums[row]))
            yield fam
        for key, (label, values) in COUNTERS.items():
            name, doc = COUNTER_NAMES[key]
            fam = CounterMetricFamily(name, doc, labels=[*base, label])
            arr = snap.counters[key]
            for i, j in counter_cells(key, arr):
                fam.add_metric([*pairs[i], values[j]], float(arr[i, j]))
            yield fam


def row_labels(spec, pairs: list[tuple], row: int) -> list[str]:
    """The label values of a histogram's count row: its label set's, then its
    sub-label's (prompt class, phase) where it has one."""
    pair = pairs[row // len(spec.sub_values)]
    return [*pair, spec.sub_values[row % len(spec.sub_values)]] if spec.sub_label else list(pair)


def counter_cells(key: str, arr: np.ndarray) -> list[tuple[int, int]]:
    """Which (label set, value) cells a counter shows: token kinds always, finish reasons
    once seen."""
    return [(i, j) for i in range(arr.shape[0]) for j in range(arr.shape[1])
            if key == "tokens" or arr[i, j]]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(v: float) -> str:
    return str(int(v)) if v.is_integer() and abs(v) < 2**53 else floatToGoString(v)


class HotText:
    """``HotCollector``'s samples rendered straight to the text format (0.0.4) or
    OpenMetrics 1.0.0. A scrape of 20 models x 3 engines is ~20,000 samples; through
    metric family objects that takes ~5 us a sample, here the label part of each line
    is built once per label set and cached, and a sample costs one string join.
    Counts are written as integers (valid floats in both formats). Label names are in
    alphabetical order, ``le`` among them, as prometheus_client writes every other
    family on the page."""

    def __init__(self, aggregator: Aggregator, exposure: Exposure | None = None):
        self._agg = aggregator
        self._exposure = exposure or Exposure()
        self._prefixes: dict[tuple, list[str]] = {}

    def _lines(self, key: tuple, name: str, pairs: list[tuple[str, str]],
               les: list[str]) -> list[str]:
        got = self._prefixes.get(key)
        if got is None:
            if len(self._prefixes) > 100_000:  # label sets churned: start again
                self._prefixes.clear()
            pairs = sorted(pairs)
            before = "".join(f'{n}="{_escape(v)}",' for n, v in pairs if n < "le")
            after = "".join(f',{n}="{_escape(v)}"' for n, v in pairs if n > "le")
            plain = ",".join(f'{n}="{_escape(v)}"' for n, v in pairs)
            got = self._prefixes[key] = [
                *(f'{name}_bucket{{{before}le="{le}"{after}}} ' for le in les),
                f"{name}_count{{{plain}}} ", f"{name}_sum{{{plain}}} "]
        return got

    def render(self, openmetrics: bool) -> bytes:
        snap = self._exposure.apply(self._agg.snapshot())
        names = snap.label_names
        out = []
        for spec, counts, sums in snap.histograms.values():
            name, doc = HISTOGRAM_NAMES[spec.key]
            out.append(f"# HELP {name} {_help(doc, openmetrics)}\n# TYPE {name} histogram\n")
            les = [floatToGoString(b) for b in spec.buckets.bounds] + ["+Inf"]
            k = len(spec.sub_values)
            cum = np.cumsum(counts, axis=1)
            for row in np.flatnonzero(cum[:, -1]).tolist():
                pair = snap.label_sets[row // k]
                sub = spec.sub_values[row % k] if spec.sub_label else None
                pairs = list(zip(names, pair, strict=True))
                if spec.sub_label:
                    pairs.append((spec.sub_label, sub))
                prefixes = self._lines((spec.key, pair, sub), name, pairs, les)
                values = cum[row].tolist()
                buckets = prefixes[:-2]
                out.append("".join([f"{p}{v}\n" for p, v in zip(buckets, values, strict=True)]))
                out.append(f"{prefixes[-2]}{values[-1]}\n{prefixes[-1]}"
                           f"{floatToGoString(sums[row])}\n")
        for key, (label, values) in COUNTERS.items():
            name, doc = COUNTER_NAMES[key]
            family = name.removesuffix("_total") if openmetrics else name
            out.append(f"# HELP {family} {_help(doc, openmetrics)}\n"
                       f"# TYPE {family} counter\n")
            arr = snap.counters[key]
            for i, j in counter_cells(key, arr):
                pairs = sorted([*zip(names, snap.label_sets[i], strict=True),
                                (label, values[j])])
                text = ",".join(f'{n}="{_escape(v)}"' for n, v in pairs)
                out.append(f"{name}{{{text}}} {_number(float(arr[i, j]))}\n")
        return "".join(out).encode()


def _help(doc: str, openmetrics: bool) -> str:
    """HELP text escaped: OpenMetrics as label values, the text format without quotes."""
    return _escape(doc) if openmetrics else doc.replace("\\", "\\\\").replace("\n", "\\n")


def package_version() -> str:
    """The installed phasewatch's version (a source tree run without installing: unknown)."""
    try:
        return metadata.version("phasewatch")
    except metadata.PackageNotFoundError:
        return "unknown"


class SelfCollector(Collector):
    """The exporter's own counters (``SelfStats``) and the gauges it is given."""

    def __init__(self, aggregator: Aggregator,
                 gauges: dict[str, tuple[str, Callable[[], float]]] | None = None):
        self._agg = aggregator
        self._gauges = gauges or {}

    def collect(self) -> Iterator[Metric]:
        values = self._agg.stats.snapshot()
        for name, (_, doc, labels) in SELF_METRICS.items():
            fam = CounterMetricFamily(name, doc, labels=list(labels))
            for (n, label_values), v in sorted(values.items()):
                if n == name:
                    fam.add_metric(list(label_values), float(v))
            yield fam
        for name, (doc, read) in self._gauges.items():
            yield GaugeMetricFamily(name, doc, value=float(read()))
        info = GaugeMetricFamily("phasewatch_build_info",
                                 "1, with the running phasewatch's version in its label.",
                                 labels=["version"])
        info.add_metric([package_version()], 1.0)
        yield info


class MetricsPage:
    """The /metrics body for an ``Accept`` header: text 0.0.4 and OpenMetrics 1.0.0 (what
    Prometheus asks for) are ``HotText`` followed by ``rest``; the protobuf format
    (what Prometheus asks for with native histograms on) is ``phasewatch.publish.exposition``'s,
    the hot families with their native histograms followed by ``rest``; any other
    format goes through prometheus_client's own encoder over ``full``."""

    def __init__(self, hot: HotText, rest, full, proto=None):
        self._hot, self._rest, self._full, self._proto = hot, rest, full, proto

    def render(self, accept: str) -> tuple[bytes, str]:
        from phasewatch.publish import exposition

        if self._proto is not None and exposition.wants_protobuf(accept):
            families = self._proto.families() + exposition.registry_families(self._rest)
            return exposition.delimited(families), exposition.CONTENT_TYPE
        encoder, ctype = choose_encoder(accept)
        if ctype == CONTENT_TYPE_PLAIN_0_0_4:
            return self._hot.render(False) + generate_latest(self._rest), ctype
        if ctype in (openmetrics.CONTENT_TYPE_LATEST,
                     f"{openmetrics.CONTENT_TYPE_LATEST}; escaping=underscores"):
            return self._hot.render(True) + openmetrics.generate_latest(self._rest), ctype
        return encoder(self._full), ctype
