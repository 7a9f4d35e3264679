"""Counters about phasewatch itself: what was received, rejected, dropped and why.

Every drop or rejection anywhere in the exporter goes through ``SelfStats.inc`` with
a reason, and ``exporter.publish.metrics`` exposes them as ``phasewatch_ingest_*`` series.
"""

from __future__ import annotations

import threading
from collections import Counter

# name -> (type, help, label names). The single list of self-metrics.
SELF_METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "phasewatch_ingest_batches_total": (
        "counter", "Batches received, by protocol and outcome (ok, duplicate, malformed, "
        "too_large, overloaded, error: failed inside phasewatch, see its log).",
        ("protocol", "outcome")),
    "phasewatch_ingest_requests_total": (
        "counter", "Finished requests received, before validation.", ("protocol",)),
    "phasewatch_ingest_accepted_total": (
        "counter", "Finished requests accepted into the metrics.", ("protocol",)),
    "phasewatch_ingest_rejected_total": (
        "counter", "Requests or events rejected, by reason. Nothing of them reached a metric.",
        ("protocol", "reason")),
    "phasewatch_ingest_refused_total": (
        "counter", "Calls or connections refused with a retryable error before decoding "
        "(gRPC UNAVAILABLE, HTTP 503): the client keeps the data and retries. By protocol and "
        "reason: in_flight, in_flight_bytes, memory, connections, in_progress (a resent batch "
        "whose first attempt is still being ingested).", ("protocol", "reason")),
    "phasewatch_ingest_dropped_total": (
        "counter", "Requests lost before reaching the exporter or evicted unfinished, by reason.",
        ("reason",)),
    "phasewatch_ingest_lifecycle_events_total": (
        "counter",
        "Lifecycle stream events by outcome: joined, duplicate, conflict (first value kept), "
        "late_duplicate, rejected_*; completed_incomplete counts requests completed after the "
        "grace period with parts missing.",
        ("outcome",)),
    "phasewatch_ingest_label_overflow_total": (
        "counter", "Requests whose label value was replaced by __overflow__, by label and reason.",
        ("label", "reason")),
    "phasewatch_otlp_spans_total": (
        "counter", "OTLP spans received, by protocol and outcome: request (accepted), ignored "
        "(not a request: startup or batch spans), duplicate (a retried export), rejected.",
        ("protocol", "outcome")),
    "phasewatch_otlp_joined_requests_total": (
        "counter", "Requests whose spans come from several processes or roles (SGLang: the "
        "tokenizer's root, the scheduler's stage spans, disaggregated prefill and decode "
        "roots), by how the join ended: complete; waited (counted after --otlp-join-wait "
        "with parts missing); capacity (counted early: too many requests waiting).",
        ("outcome",)),
    "phasewatch_trace_join_requests_total": (
        "counter", "Requests seen by the stream tap and the engine, by how their join by "
        "traceparent ended: joined (one request from both sides); tap_only, engine_only "
        "(the other side did not come within --trace-join-wait); capacity (counted alone "
        "early: too many waiting); late (a side that came after its request was counted "
        "without it: dropped, never counted twice); bad_trace_parent (not "
        "<32 hex>-<16 hex>: counted alone).", ("outcome",)),
    "phasewatch_engine_scrapes_total": (
        "counter", "Scrapes of an engine's /metrics for its state and counters, by "
        "result (ok, http_error, unreachable, unparsable).", ("url", "result")),
    "phasewatch_auth_refused_total": (
        "counter", "Connections or calls refused by access control, by receiver (phasewatch, "
        "otlp_grpc, otlp_http, http, api) and reason: missing_token, bad_token "
        "(--auth-token); no_client_certificate, bad_certificate, tls_handshake, "
        "handshake_timeout (TLS).", ("receiver", "reason")),
    "phasewatch_tls_reloads_total": (
        "counter", "Reloads of changed TLS files, by result (ok, error: the previous "
        "certificates stay in use).", ("result",)),
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
