"""Prometheus exposition: one collector that renders the aggregation snapshot at scrape.

Names follow product.md's catalog; the OTel GenAI semconv names where one exists
(``gen_ai.server.time_to_first_token`` -> ``gen_ai_server_time_to_first_token_seconds``).
Sample exposition::

    gen_ai_server_time_to_first_token_seconds_bucket{model="Llama-3.1-8B",engine="vllm",prompt_class="1k-4k",le="0.25"} 812.0
    phasewatch_phase_duration_seconds_sum{model="Llama-3.1-8B",engine="vllm",phase="decode"} 1534.2
    phasewatch_tokens_total{model="Llama-3.1-8B",engine="vllm",kind="output"} 201533.0
    phasewatch_ingest_rejected_total{protocol="phasewatch",reason="clock_order"} 3.0
"""  # noqa: E501

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from exporter.aggregate import COUNTERS, HISTOGRAMS, Aggregator
from exporter.selfstats import SELF_METRICS

# Aggregator key -> (Prometheus name, help). Units are in the names.
HISTOGRAM_NAMES: dict[str, tuple[str, str]] = {
    "ttft": ("gen_ai_server_time_to_first_token_seconds",
             "Time to first token (first_token - arrival), by prompt-length class."),
    "tpot": ("gen_ai_server_time_per_output_token_seconds",
             "Per-request time per output token after the first: "
             "(last_token - first_token) / (output_tokens - 1)."),
    "e2e": ("gen_ai_server_request_duration_seconds", "End-to-end request duration."),
    "itl": ("phasewatch_inter_token_latency_seconds",
            "Pooled inter-token latency: every gap between consecutive token emissions."),
    "phase": ("phasewatch_phase_duration_seconds",
              "Time a request spent in each phase: queue, prefill, decode."),
    "prefill_spt": ("phasewatch_prefill_seconds_per_token",
                    "Prefill time per uncached prompt token (length-normalised TTFT)."),
    "decode_tps": ("phasewatch_decode_tokens_per_second",
                   "Per-request decode speed: output tokens after the first per decode second."),
}
COUNTER_NAMES: dict[str, tuple[str, str]] = {
    "tokens": ("phasewatch_tokens_total",
               "Tokens of accepted requests: prompt, cached_prompt (prefix-cache hits), output."),
    "requests": ("phasewatch_requests_total", "Finished requests accepted, by finish reason."),
}


class PhasewatchCollector(Collector):
    """Builds fresh metric families from ``Aggregator.snapshot()`` at every scrape."""

    def __init__(self, aggregator: Aggregator,
                 gauges: dict[str, tuple[str, Callable[[], float]]] | None = None):
        self._agg = aggregator
        self._gauges = gauges or {}

    def collect(self) -> Iterator[Metric]:
        snap = self._agg.snapshot()
        pairs = snap.label_sets
        base = list(snap.label_names)
        for spec in HISTOGRAMS:
            name, doc = HISTOGRAM_NAMES[spec.key]
            _, counts, sums = snap.histograms[spec.key]
            labels = base + ([spec.sub_label] if spec.sub_label else [])
            fam = HistogramMetricFamily(name, doc, labels=labels)
            les = [floatToGoString(b) for b in spec.buckets.bounds] + ["+Inf"]
            k = len(spec.sub_values)
            cum = np.cumsum(counts, axis=1)
            for row in np.flatnonzero(cum[:, -1]):
                pair = pairs[row // k]
                values = [*pair, spec.sub_values[row % k]] if spec.sub_label else list(pair)
                fam.add_metric(values, list(zip(les, cum[row].tolist(), strict=True)),
                               float(sums[row]))
            yield fam
        for key, (label, values) in COUNTERS.items():
            name, doc = COUNTER_NAMES[key]
            fam = CounterMetricFamily(name, doc, labels=[*base, label])
            arr = snap.counters[key]
            for i in range(arr.shape[0]):
                for j, v in enumerate(values):
                    # Token kinds always shown per label set; finish reasons once seen.
                    if key == "tokens" or arr[i, j]:
                        fam.add_metric([*pairs[i], v], float(arr[i, j]))
            yield fam
        yield from self._self_metrics()

    def _self_metrics(self) -> Iterator[Metric]:
        values = self._agg.stats.snapshot()
        for name, (_, doc, labels) in SELF_METRICS.items():
            fam = CounterMetricFamily(name, doc, labels=list(labels))
            for (n, label_values), v in sorted(values.items()):
                if n == name:
                    fam.add_metric(list(label_values), float(v))
            yield fam
        for name, (doc, read) in self._gauges.items():
            yield GaugeMetricFamily(name, doc, value=float(read()))
