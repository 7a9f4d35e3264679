"""The metric catalog: every family phasewatch publishes, as data, in one place.

Each ``Family`` holds what a scrape shows of it (name, type, HELP text, label names in
order, buckets where it has them) and what it needs to be there at all. Everything
else reads it: the collectors and the three exposition formats (``phasewatch.publish``),
the self-counters (``phasewatch.selfstats``), the dashboard's PromQL
(``phasewatch.dashboard.queries``), the Grafana dashboard and the Prometheus rules
generators (``grafana/generate.py``, ``deploy/prometheus/generate_rules.py``) and the
reference page ``docs/metrics-reference.md`` (``python -m phasewatch.catalog`` writes it;
``--check`` fails when it is stale). The hand-written explanations are in
``docs/metrics.md``. (The hardware and model catalog is ``phasewatch.roofline.catalog``.)

Names are as Prometheus stores them: a counter's ends in ``_total`` (``family`` is the
name without it, what prometheus_client's ``CounterMetricFamily`` and OpenMetrics call
it). A family with ``per_series`` carries the request label set's labels first
(``model``, ``engine``; ``pod`` with ``--pod-label true``, ``source`` with
``--source-label true``), then its own ``labels``. The catalog imports nothing of
phasewatch's but the bucket sets, so anything may import it.

A module per stage holds its families; this one is their one face (``catalog.X`` for every
family and table): ``family`` the ``Family`` type, ``request_families`` the requests' and
the latency objectives', ``self_families`` the exporter's own (counters, gauges, the
scrape's, the build's), ``roofline_families`` the roofline's, the verdict's and the
engine's state, ``tap_families`` the stream tap's; ``sections`` every family by section,
in the order /metrics shows them (``SECTIONS``, ``ALL``, ``BY_NAME``, ``names()``), and
``reference_page`` the generated page. A new stage's families go in a module of their own
here, re-exported below and given a section in ``sections.SECTIONS``.
"""

from __future__ import annotations

from phasewatch.catalog.family import (
    NATIVE_SUFFIX,
    SERIES_LABELS,
    Family,
)
from phasewatch.catalog.reference_page import (
    REFERENCE,
    main,
    reference,
)
from phasewatch.catalog.request_families import (
    CLOCK_SKEW,
    COUNTERS,
    DECODE_TOKENS_PER_SECOND,
    E2E,
    HISTOGRAMS,
    ITL,
    ITL_PER_TOKEN,
    PHASE_DURATION,
    PREFILL_SECONDS_PER_TOKEN,
    REQUESTS,
    SAMPLED_REQUESTS,
    SAMPLING_NEEDS,
    SLO,
    SLO_GOOD_REQUESTS,
    SLO_MISSED_REQUESTS,
    SLO_NEEDS,
    SLO_OBJECTIVE,
    SLO_REQUESTS,
    TOKENS,
    TPOT,
    TTFT,
)
from phasewatch.catalog.roofline_families import (
    ACHIEVED_BANDWIDTH,
    ACHIEVED_FLOPS,
    ARITHMETIC_INTENSITY,
    BANDWIDTH_UTILIZATION,
    BOTTLENECK_CONFIDENCE,
    BOTTLENECK_INFO,
    CEILING_EXCEEDED,
    DECODE_BATCH_SIZE,
    ENGINE_KV_CACHE_CAPACITY,
    ENGINE_KV_CACHE_USAGE,
    ENGINE_PREEMPTIONS,
    ENGINE_REQUESTS,
    ENGINE_STATE,
    FLOPS_UTILIZATION,
    NO_ROOFLINE_REQUESTS,
    PEAK_BANDWIDTH,
    PEAK_FLOPS,
    PHASE_ESTIMATES,
    PHASE_TIME_SHARE,
    ROOFLINE,
    ROOFLINE_INPUTS,
)
from phasewatch.catalog.sections import (
    ALL,
    BY_NAME,
    SECTIONS,
    names,
)
from phasewatch.catalog.self_families import (
    AUTH_REFUSED,
    BUILD_INFO,
    ENGINE_SCRAPES,
    EXPORTER_GAUGES,
    IN_FLIGHT,
    IN_FLIGHT_BYTES,
    INGEST_ACCEPTED,
    INGEST_BATCHES,
    INGEST_DROPPED,
    INGEST_REFUSED,
    INGEST_REJECTED,
    INGEST_REQUESTS,
    LABEL_OVERFLOW,
    LIFECYCLE_EVENTS,
    LIFECYCLE_PENDING,
    MEMORY_LIMIT,
    MODEL_UNMATCHED,
    OTLP_JOIN_PENDING,
    OTLP_JOINED,
    OTLP_SPANS,
    PHASE_UNAVAILABLE,
    ROOFLINE_LAST_SUCCESS,
    ROOFLINE_UPDATES,
    SAMPLING_IGNORED,
    SCRAPE,
    SCRAPE_COLLECTOR_DURATION,
    SCRAPE_COLLECTOR_SUCCESS,
    SELF_COUNTERS,
    SWEEP_LAST_SUCCESS,
    SWEEPS,
    TLS_RELOADS,
    TRACE_JOIN,
    TRACE_JOIN_PENDING,
)
from phasewatch.catalog.tap_families import (
    TAP,
    TAP_ABORTS,
    TAP_NEEDS,
    TAP_RECORDS_ACCEPTED,
    TAP_RECORDS_DROPPED,
    TAP_REQUESTS,
    TAP_TOKEN_TIMES_DROPPED,
    TAP_UNREAD,
)

__all__ = [  # every name, as catalog.X
    "ACHIEVED_BANDWIDTH", "ACHIEVED_FLOPS", "ALL", "ARITHMETIC_INTENSITY", "AUTH_REFUSED",
    "BANDWIDTH_UTILIZATION", "BOTTLENECK_CONFIDENCE", "BOTTLENECK_INFO", "BUILD_INFO",
    "BY_NAME", "CEILING_EXCEEDED", "CLOCK_SKEW", "COUNTERS", "DECODE_BATCH_SIZE",
    "DECODE_TOKENS_PER_SECOND", "E2E", "ENGINE_KV_CACHE_CAPACITY", "ENGINE_KV_CACHE_USAGE",
    "ENGINE_PREEMPTIONS", "ENGINE_REQUESTS", "ENGINE_SCRAPES", "ENGINE_STATE",
    "EXPORTER_GAUGES", "FLOPS_UTILIZATION", "HISTOGRAMS", "INGEST_ACCEPTED", "INGEST_BATCHES",
    "INGEST_DROPPED", "INGEST_REFUSED", "INGEST_REJECTED", "INGEST_REQUESTS", "IN_FLIGHT",
    "IN_FLIGHT_BYTES", "ITL", "ITL_PER_TOKEN", "LABEL_OVERFLOW", "LIFECYCLE_EVENTS",
    "LIFECYCLE_PENDING", "MEMORY_LIMIT", "MODEL_UNMATCHED", "NATIVE_SUFFIX",
    "NO_ROOFLINE_REQUESTS", "OTLP_JOINED", "OTLP_JOIN_PENDING", "OTLP_SPANS", "PEAK_BANDWIDTH",
    "PEAK_FLOPS", "PHASE_DURATION", "PHASE_ESTIMATES", "PHASE_TIME_SHARE", "PHASE_UNAVAILABLE",
    "PREFILL_SECONDS_PER_TOKEN", "REFERENCE", "REQUESTS", "ROOFLINE", "ROOFLINE_INPUTS",
    "ROOFLINE_LAST_SUCCESS", "ROOFLINE_UPDATES", "SAMPLED_REQUESTS", "SAMPLING_IGNORED",
    "SAMPLING_NEEDS", "SCRAPE", "SCRAPE_COLLECTOR_DURATION", "SCRAPE_COLLECTOR_SUCCESS",
    "SECTIONS", "SELF_COUNTERS", "SERIES_LABELS", "SLO", "SLO_GOOD_REQUESTS",
    "SLO_MISSED_REQUESTS", "SLO_NEEDS", "SLO_OBJECTIVE", "SLO_REQUESTS", "SWEEPS",
    "SWEEP_LAST_SUCCESS", "TAP", "TAP_ABORTS", "TAP_NEEDS", "TAP_RECORDS_ACCEPTED",
    "TAP_RECORDS_DROPPED", "TAP_REQUESTS", "TAP_TOKEN_TIMES_DROPPED", "TAP_UNREAD",
    "TLS_RELOADS", "TOKENS", "TPOT", "TRACE_JOIN", "TRACE_JOIN_PENDING", "TTFT", "Family",
    "main", "names", "reference",
]
