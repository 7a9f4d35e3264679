"""The exporter's own families: its counters (``SELF_COUNTERS``, ``phasewatch.selfstats``
counts them), the gauges read from its parts at scrape (``EXPORTER_GAUGES``), the
scrape's own (``SCRAPE``) and the build's."""

from __future__ import annotations

from phasewatch.catalog.family import Family
from phasewatch.catalog.request_families import SAMPLING_NEEDS


# ---- the exporter's own counters (phasewatch.selfstats) ---------------------------------
def _self(name: str, doc: str, *labels: str) -> Family:
    return Family(name, "counter", doc, labels)


INGEST_BATCHES = _self("phasewatch_ingest_batches_total",
                       "Batches received, by protocol and outcome.", "protocol", "outcome")
INGEST_REQUESTS = _self("phasewatch_ingest_requests_total",
                        "Finished requests received, before validation.", "protocol")
INGEST_ACCEPTED = _self("phasewatch_ingest_accepted_total",
                        "Finished requests accepted into the metrics.", "protocol")
INGEST_REJECTED = _self("phasewatch_ingest_rejected_total",
                        "Requests or events rejected whole before any metric, by reason.",
                        "protocol", "reason")
INGEST_REFUSED = _self("phasewatch_ingest_refused_total",
                       "Calls or connections refused with a retryable error before decoding, "
                       "by protocol and reason.", "protocol", "reason")
INGEST_DROPPED = _self("phasewatch_ingest_dropped_total",
                       "Requests lost before reaching the exporter or evicted unfinished, by "
                       "reason.", "reason")
LIFECYCLE_EVENTS = _self("phasewatch_ingest_lifecycle_events_total",
                         "Lifecycle stream events, by outcome.", "outcome")
LABEL_OVERFLOW = _self("phasewatch_ingest_label_overflow_total",
                       "Requests whose label value was replaced by __overflow__, by label and "
                       "reason.", "label", "reason")
OTLP_SPANS = _self("phasewatch_otlp_spans_total",
                   "OTLP spans received, by protocol and outcome.", "protocol", "outcome")
OTLP_JOINED = _self("phasewatch_otlp_joined_requests_total",
                    "Requests joined from the spans of several processes or roles, by how the "
                    "join ended.", "outcome")
TRACE_JOIN = _self("phasewatch_trace_join_requests_total",
                   "Requests seen by the stream tap or the engine, by how their traceparent "
                   "join ended.", "outcome")
ENGINE_SCRAPES = _self("phasewatch_engine_scrapes_total",
                       "Scrapes of the engine's /metrics, by result.", "url", "result")
AUTH_REFUSED = _self("phasewatch_auth_refused_total",
                     "Connections or calls refused by access control, by receiver and reason.",
                     "receiver", "reason")
TLS_RELOADS = _self("phasewatch_tls_reloads_total",
                    "Reloads of changed TLS files, by result.", "result")
PHASE_UNAVAILABLE = _self("phasewatch_phase_unavailable_total",
                          "Accepted requests for which a phase could not be derived, by reason.",
                          "phase", "reason")
MODEL_UNMATCHED = _self("phasewatch_model_unmatched_requests_total",
                        "Requests whose model name matched none of the configured models "
                        "(each name logged once, with the configured ones).")
SAMPLING_IGNORED = _self("phasewatch_trace_sampling_ignored_total",
                         "Request spans whose sampling threshold (ot=th) was ignored as "
                         "unusable, by reason.", "reason")._replace(needs=SAMPLING_NEEDS)
ROOFLINE_UPDATES = _self("phasewatch_roofline_updates_total",
                         "Roofline and verdict updates (--roofline-interval), by outcome "
                         "(ok, error: the last good verdict stays).", "outcome")
SWEEPS = _self("phasewatch_sweeps_total",
               "Sweeps of each join's waiting room (every second), by join and outcome (ok, "
               "error: the next sweep tries again).", "join", "outcome")
SELF_COUNTERS = (INGEST_BATCHES, INGEST_REQUESTS, INGEST_ACCEPTED, INGEST_REJECTED,
                 INGEST_REFUSED, INGEST_DROPPED, LIFECYCLE_EVENTS, LABEL_OVERFLOW, OTLP_SPANS,
                 OTLP_JOINED, TRACE_JOIN, ENGINE_SCRAPES, AUTH_REFUSED, TLS_RELOADS,
                 PHASE_UNAVAILABLE, SAMPLING_IGNORED, MODEL_UNMATCHED, ROOFLINE_UPDATES, SWEEPS)


# ---- the exporter's own gauges (read from its parts at scrape; one with labels reads as
# its label values -> value) -----------------------------------------------------------
def _gauge(name: str, doc: str) -> Family:
    return Family(name, "gauge", doc)


LIFECYCLE_PENDING = _gauge("phasewatch_ingest_lifecycle_pending",
                           "Streamed requests being joined (not yet finished).")
OTLP_JOIN_PENDING = _gauge("phasewatch_otlp_join_pending",
                           "SGLang requests waiting for their stage spans or other role "
                           "(--otlp-join-wait).")
TRACE_JOIN_PENDING = _gauge("phasewatch_trace_join_pending",
                            "Stream-tap records and engine spans waiting for their other side "
                            "(--trace-join-wait).")
IN_FLIGHT = _gauge("phasewatch_ingest_in_flight",
                   "Ingest calls being decoded and ingested now, across receivers "
                   "(--max-in-flight bounds it).")
IN_FLIGHT_BYTES = _gauge("phasewatch_ingest_in_flight_bytes",
                         "Payload bytes of the ingest calls in flight (--max-in-flight-mib "
                         "bounds it).")
MEMORY_LIMIT = _gauge("phasewatch_memory_limit_bytes",
                      "Resident memory limit, above 0.8 x which ingest is refused (0: none).")
ROOFLINE_LAST_SUCCESS = _gauge("phasewatch_roofline_last_success_timestamp_seconds",
                               "Unix time of the last roofline and verdict update that "
                               "succeeded (0: none yet).")
SWEEP_LAST_SUCCESS = Family("phasewatch_sweep_last_success_timestamp_seconds", "gauge",
                            "Unix time of the last sweep of the join's waiting room that "
                            "succeeded (0: none yet).", ("join",))
EXPORTER_GAUGES = (LIFECYCLE_PENDING, OTLP_JOIN_PENDING, TRACE_JOIN_PENDING, IN_FLIGHT,
                   IN_FLIGHT_BYTES, MEMORY_LIMIT, ROOFLINE_LAST_SUCCESS, SWEEP_LAST_SUCCESS)
# one per collector on /metrics, as node_exporter's node_scrape_collector_*
SCRAPE_COLLECTOR_SUCCESS = Family("phasewatch_scrape_collector_success", "gauge",
                                  "1 if the collector's part of this scrape succeeded, 0 if it "
                                  "failed (its families are left off the page).", ("collector",))
SCRAPE_COLLECTOR_DURATION = Family("phasewatch_scrape_collector_duration_seconds", "gauge",
                                   "Seconds the collector's part of this scrape took.",
                                   ("collector",))
SCRAPE = (SCRAPE_COLLECTOR_SUCCESS, SCRAPE_COLLECTOR_DURATION)
BUILD_INFO = Family("phasewatch_build_info", "gauge",
                    "1, with the running phasewatch's version in its label.", ("version",))
