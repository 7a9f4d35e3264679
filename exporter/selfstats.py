"""Counters about phasewatch itself: what was received, rejected, dropped and why.

Every drop or rejection anywhere in the exporter goes through ``SelfStats.inc`` with
a reason, and ``phasewatch.publish.metrics`` exposes them as ``phasewatch_ingest_*`` series.
"""

from __future__ import annotations

import threading
from collections import Counter

# name -> (type, help, label names). The single list of self-metrics.
SELF_METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "phasewatch_ingest_batches_total": (
        "counter", "Batches received, by protocol and outcome.",
        ("protocol", "outcome")),
    "phasewatch_ingest_requests_total": (
        "counter", "Finished requests received, before validation.", ("protocol",)),
    "phasewatch_ingest_accepted_total": (
        "counter", "Finished requests accepted into the metrics.", ("protocol",)),
    "phasewatch_ingest_rejected_total": (
        "counter", "Requests or events rejected whole before any metric, by reason.",
        ("protocol", "reason")),
    "phasewatch_ingest_refused_total": (
        "counter", "Calls or connections refused with a retryable error before decoding, by "
        "protocol and reason.", ("protocol", "reason")),
    "phasewatch_ingest_dropped_total": (
        "counter", "Requests lost before reaching the exporter or evicted unfinished, by reason.",
        ("reason",)),
    "phasewatch_ingest_lifecycle_events_total": (
        "counter",
        "Lifecycle stream events, by outcome.",
        ("outcome",)),
    "phasewatch_ingest_label_overflow_total": (
        "counter", "Requests whose label value was replaced by __overflow__, by label and reason.",
        ("label", "reason")),
    "phasewatch_otlp_spans_total": (
        "counter", "OTLP spans received, by protocol and outcome.",
        ("protocol", "outcome")),
    "phasewatch_otlp_joined_requests_total": (
        "counter", "Requests joined from the spans of several processes or roles, by how "
        "the join ended.",
        ("outcome",)),
    "phasewatch_trace_join_requests_total": (
        "counter", "Requests seen by the stream tap or the engine, by how their traceparent "
        "join ended.", ("outcome",)),
    "phasewatch_engine_scrapes_total": (
        "counter", "Scrapes of the engine's /metrics, by result.", ("url", "result")),
    "phasewatch_auth_refused_total": (
        "counter", "Connections or calls refused by access control, by receiver and "
        "reason.", ("receiver", "reason")),
    "phasewatch_tls_reloads_total": (
        "counter", "Reloads of changed TLS files, by result.", ("result",)),
    "phasewatch_phase_unavailable_total": (
        "counter", "Accepted requests for which a phase could not be derived, by reason.",
        ("phase", "reason")),
}


class SelfStats:
    """Thread-safe counters keyed by (metric name, label values)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: Counter = Counter()

    def inc(self, name: str, value: float = 1, **labels: str) -> None:
        if name not in SELF_METRICS:
            raise ValueError(f"unknown self-metric {name!r}")
        expected = SELF_METRICS[name][2]
        if tuple(labels) != expected:
            raise ValueError(f"{name} takes labels {expected}, got {tuple(labels)}")
        if value:
            with self._lock:
                self._values[(name, tuple(labels.values()))] += value

    def get(self, name: str, **labels: str) -> float:
        with self._lock:
            return self._values[(name, tuple(labels.values()))]

    def snapshot(self) -> dict[tuple[str, tuple[str, ...]], float]:
        with self._lock:
            return dict(self._values)
