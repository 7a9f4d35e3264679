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
``--source-label true``), then its own ``labels``. This module imports nothing of
phasewatch's but the bucket sets, so anything may import it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import NamedTuple

from phasewatch.requests import buckets
from phasewatch.requests.buckets import BucketSet

SERIES_LABELS = ("model", "engine")  # then pod, source where those flags are on
NATIVE_SUFFIX = "_native"


class Family(NamedTuple):
    """One metric family, as a scrape shows it."""

    name: str  # a counter's with _total
    type: str  # counter, gauge, histogram
    help: str
    labels: tuple[str, ...] = ()  # after the label set's labels where per_series
    per_series: bool = False
    buckets: BucketSet | None = None
    native: bool = False  # also <name>_native, a native histogram (protobuf scrapes)
    needs: str = ""  # what it is published with ("": always)

    @property
    def family(self) -> str:
        """The family name without a counter's ``_total``."""
        return self.name.removesuffix("_total") if self.type == "counter" else self.name

    @property
    def native_name(self) -> str:
        return self.name + NATIVE_SUFFIX

    def label_names(self, series: tuple[str, ...] = SERIES_LABELS) -> list[str]:
        """Its label names, after ``series`` (the label set's names) where per_series."""
        return [*series, *self.labels] if self.per_series else list(self.labels)


def _hist(name: str, doc: str, bounds: BucketSet, labels: tuple[str, ...] = (),
          native: bool = False) -> Family:
    return Family(name, "histogram", doc, labels, True, bounds, native)


# ---- requests: the aggregator's histograms and counters, by aggregator key -------------
TTFT = _hist("gen_ai_server_time_to_first_token_seconds",
             "Time to first token: first token minus arrival.", buckets.TTFT,
             ("prompt_class",), native=True)
TPOT = _hist("gen_ai_server_time_per_output_token_seconds",
             "Per-request time per output token after the first: "
             "(last_token - first_token) / (output_tokens - 1).", buckets.TOKEN_LATENCY,
             native=True)
E2E = _hist("gen_ai_server_request_duration_seconds", "End-to-end request duration.",
            buckets.REQUEST_DURATION, native=True)
ITL = _hist("phasewatch_inter_token_latency_seconds",
            "Every gap between consecutive streamed emissions, pooled (vLLM's benchmark itl).",
            buckets.TOKEN_LATENCY, native=True)
ITL_PER_TOKEN = _hist("phasewatch_inter_token_latency_per_token_seconds",
                      "Every gap between streamed emissions spread over the tokens of the "
                      "emission ending it, pooled.", buckets.TOKEN_LATENCY, native=True)
PHASE_DURATION = _hist("phasewatch_phase_duration_seconds",
                       "Time a request spent in each phase (preprocess, queue, prefill, "
                       "kv_transfer, decode).", buckets.PHASE_DURATION, ("phase",), native=True)
PREFILL_SECONDS_PER_TOKEN = _hist(
    "phasewatch_prefill_seconds_per_token",
    "Prefill time per uncached prompt token (length-normalised TTFT).",
    buckets.PREFILL_SECONDS_PER_TOKEN)
DECODE_TOKENS_PER_SECOND = _hist(
    "phasewatch_decode_tokens_per_second",
    "Per-request decode speed: output tokens after the first per decode second.",
    buckets.DECODE_TOKENS_PER_SECOND)
CLOCK_SKEW = _hist("phasewatch_clock_skew_seconds",
                   "Disagreement absorbed per request between a two-clock server's frontend "
                   "and engine-core times.", buckets.CLOCK_SKEW)
TOKENS = Family("phasewatch_tokens_total", "counter",
                "Tokens of accepted requests: prompt, cached_prompt (prefix-cache hits), output.",
                ("kind",), True)
REQUESTS = Family("phasewatch_requests_total", "counter",
                  "Finished requests accepted, by finish reason.", ("finish_reason",), True)
# trace sampling (phasewatch.requests.sampling): requests and tokens count each sampled
# request 1/p times; these say how many came and what was ignored
SAMPLING_NEEDS = "trace sampling seen (a span's ot=th below 100 %, or --trace-sample-ratio)"
SAMPLED_REQUESTS = Family("phasewatch_sampled_requests_total", "counter",
                          "Finished requests accepted as received, each once: requests_total "
                          "counts each 1/its trace sampling probability times.",
                          ("finish_reason",), True, needs=SAMPLING_NEEDS)

# aggregator key (phasewatch.aggregation.aggregate) -> family
HISTOGRAMS: dict[str, Family] = {
    "ttft": TTFT, "tpot": TPOT, "e2e": E2E, "itl": ITL, "itl_per_token": ITL_PER_TOKEN,
    "phase": PHASE_DURATION, "prefill_spt": PREFILL_SECONDS_PER_TOKEN,
    "decode_tps": DECODE_TOKENS_PER_SECOND, "clock_skew": CLOCK_SKEW}
COUNTERS: dict[str, Family] = {"tokens": TOKENS, "requests": REQUESTS,
                               "sampled_requests": SAMPLED_REQUESTS}


# ---- latency objectives (phasewatch.aggregation.slo, phasewatch.publish.slo_metrics) ----
SLO_NEEDS = "--slo (or slo in a [[models]] table)"


def _slo(name: str, kind: str, doc: str, *labels: str) -> Family:
    return Family(name, kind, doc, labels, True, needs=SLO_NEEDS)


SLO_REQUESTS = _slo("phasewatch_slo_requests_total", "counter",
                    "Accepted requests judged against each latency objective set, by "
                    "outcome: met, missed, or unknown (the value could not be derived).",
                    "objective", "outcome")
SLO_GOOD_REQUESTS = _slo("phasewatch_slo_good_requests_total", "counter",
                         "Accepted requests that met every latency objective set (goodput: "
                         "its rate).")
SLO_MISSED_REQUESTS = _slo("phasewatch_slo_missed_requests_total", "counter",
                           "Requests that missed an objective, by the phase that took the "
                           "largest part of the missed figure.", "objective", "phase")
SLO_OBJECTIVE = _slo("phasewatch_slo_objective_seconds", "gauge",
                     "The latency objective the label set's requests are judged against, "
                     "per prompt class where one overrides it.", "objective", "prompt_class")
SLO = (SLO_REQUESTS, SLO_GOOD_REQUESTS, SLO_MISSED_REQUESTS, SLO_OBJECTIVE)


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
SELF_COUNTERS = (INGEST_BATCHES, INGEST_REQUESTS, INGEST_ACCEPTED, INGEST_REJECTED,
                 INGEST_REFUSED, INGEST_DROPPED, LIFECYCLE_EVENTS, LABEL_OVERFLOW, OTLP_SPANS,
                 OTLP_JOINED, TRACE_JOIN, ENGINE_SCRAPES, AUTH_REFUSED, TLS_RELOADS,
                 PHASE_UNAVAILABLE, SAMPLING_IGNORED, MODEL_UNMATCHED, ROOFLINE_UPDATES)


# ---- the exporter's own gauges (read from its parts at scrape) --------------------------
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
EXPORTER_GAUGES = (LIFECYCLE_PENDING, OTLP_JOIN_PENDING, TRACE_JOIN_PENDING, IN_FLIGHT,
                   IN_FLIGHT_BYTES, MEMORY_LIMIT, ROOFLINE_LAST_SUCCESS)
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


# ---- the roofline and the verdict (phasewatch.publish.roofline_metrics) -----------------
def _roof(name: str, doc: str, *labels: str, kind: str = "gauge", needs: str = "") -> Family:
    return Family(name, kind, doc, labels, True, needs=needs)


ACHIEVED_BANDWIDTH = _roof("phasewatch_achieved_bandwidth_bytes_per_second",
                           "Bytes/s the phase moved over its busy time in the rolling window.",
                           "phase")
ACHIEVED_FLOPS = _roof("phasewatch_achieved_flops_per_second",
                       "FLOP/s the phase performed over its busy time in the rolling window.",
                       "phase")
BANDWIDTH_UTILIZATION = _roof("phasewatch_bandwidth_utilization_ratio",
                              "MBU: achieved bytes/s over the datasheet peak bandwidth x GPUs.",
                              "phase")
FLOPS_UTILIZATION = _roof("phasewatch_flops_utilization_ratio",
                          "MFU: achieved FLOP/s over the datasheet dense peak x GPUs.", "phase")
ARITHMETIC_INTENSITY = _roof("phasewatch_arithmetic_intensity_flops_per_byte",
                             "The phase's operating point on the roofline: FLOPs per byte "
                             "moved.", "phase")
PEAK_BANDWIDTH = _roof("phasewatch_peak_bandwidth_bytes_per_second",
                       "Memory bandwidth ceiling of the hardware x GPUs, datasheet or "
                       "achievable.", "ceiling")
PEAK_FLOPS = _roof("phasewatch_peak_flops_per_second",
                   "Dense FLOP/s ceiling of the hardware x GPUs at the compute dtype, "
                   "datasheet or achievable.", "ceiling")
PHASE_TIME_SHARE = _roof("phasewatch_phase_time_share_ratio",
                         "Share of request time spent in each phase (preprocess, queue, "
                         "prefill, kv_transfer, decode) over the rolling window.", "phase")
DECODE_BATCH_SIZE = _roof("phasewatch_decode_batch_size",
                          "Estimated mean number of sequences decoding together while decode "
                          "runs.")
BOTTLENECK_INFO = _roof("phasewatch_bottleneck_info",
                        "1 for the current verdict: its phase, the resource that limits it "
                        "and the cause.", "phase", "resource", "cause")
BOTTLENECK_CONFIDENCE = _roof("phasewatch_bottleneck_confidence_ratio",
                              "Confidence of the verdict, 0..1.")
ROOFLINE_INPUTS = _roof("phasewatch_roofline_inputs_info",
                        "1 per input of the estimate, by where it came from.", "input", "origin")
ENGINE_KV_CACHE_USAGE = _roof("phasewatch_engine_kv_cache_usage_ratio",
                              "KV-cache usage the engine reports, 0..1 (vLLM "
                              "kv_cache_usage_perc, SGLang token_usage).")
ENGINE_REQUESTS = _roof("phasewatch_engine_requests",
                        "Requests the engine reports running or waiting.", "state")
ENGINE_PREEMPTIONS = _roof("phasewatch_engine_preemptions_total",
                           "Preemptions the engine has counted since it started (vLLM "
                           "num_preemptions, SGLang retracted requests).", kind="counter")
ENGINE_KV_CACHE_CAPACITY = _roof("phasewatch_engine_kv_cache_capacity_tokens",
                                 "Tokens the engine's KV cache holds (vLLM blocks x block "
                                 "size, SGLang max_total_num_tokens).")
CEILING_EXCEEDED = _roof("phasewatch_roofline_ceiling_exceeded_ratio",
                         "Achieved over the configured ceiling, only where above 1 (the "
                         "ceiling is then wrong).", "phase", "ceiling")
NO_ROOFLINE_REQUESTS = _roof("phasewatch_no_roofline_requests_total",
                             "Accepted requests of models with no roofline configured: latency "
                             "metrics only.", kind="counter")
# the gauges of each phase's estimate, by the PhaseEstimate attribute they show
PHASE_ESTIMATES: dict[str, Family] = {
    "achieved_bytes_per_second": ACHIEVED_BANDWIDTH,
    "achieved_flops_per_second": ACHIEVED_FLOPS,
    "bandwidth_utilization": BANDWIDTH_UTILIZATION,
    "flops_utilization": FLOPS_UTILIZATION,
    "arithmetic_intensity": ARITHMETIC_INTENSITY}
ROOFLINE = (*PHASE_ESTIMATES.values(), PEAK_BANDWIDTH, PEAK_FLOPS, PHASE_TIME_SHARE,
            DECODE_BATCH_SIZE, BOTTLENECK_INFO, BOTTLENECK_CONFIDENCE, ROOFLINE_INPUTS)
ENGINE_STATE = (ENGINE_KV_CACHE_USAGE, ENGINE_REQUESTS, ENGINE_PREEMPTIONS,
                ENGINE_KV_CACHE_CAPACITY, CEILING_EXCEEDED)


# ---- the stream tap (``phasewatch tap --metrics-port``, or serve --tap-upstream) --------
TAP_NEEDS = "--tap-upstream (or on the /metrics of `phasewatch tap --metrics-port`)"


def _tap(name: str, doc: str, *labels: str) -> Family:
    return Family(name, "counter", doc, labels, needs=TAP_NEEDS)


TAP_REQUESTS = _tap("phasewatch_tap_requests_total",
                    "Requests through the tap, one outcome each.", "outcome")
TAP_ABORTS = _tap("phasewatch_tap_aborts_total",
                  "Requests cut short on any path, by reason.", "reason")
TAP_RECORDS_DROPPED = _tap("phasewatch_tap_records_dropped_total",
                           "Records of timed requests lost, by reason.", "reason")
TAP_UNREAD = _tap("phasewatch_tap_unread_total",
                  "Requests or answers passed on without being read, by reason.", "reason")
TAP_RECORDS_ACCEPTED = _tap("phasewatch_tap_records_accepted_total",
                            "Records the exporter accepted.")
TAP_TOKEN_TIMES_DROPPED = _tap(
    "phasewatch_tap_token_times_dropped_total",
    "Requests whose per-token times the token count contradicts, recorded without them, "
    "by reason.", "reason")
# tap.tallies() family key -> family
TAP: dict[str, Family] = {"requests": TAP_REQUESTS, "aborts": TAP_ABORTS,
                          "records_dropped": TAP_RECORDS_DROPPED, "unread": TAP_UNREAD,
                          "records_accepted": TAP_RECORDS_ACCEPTED,
                          "token_times_dropped": TAP_TOKEN_TIMES_DROPPED}

# Every family, by section, in the order /metrics shows them.
SECTIONS: dict[str, tuple[Family, ...]] = {
    "Requests": (*HISTOGRAMS.values(), *COUNTERS.values()),
    "Latency objectives (goodput)": SLO,
    "The exporter itself": (*SELF_COUNTERS, *EXPORTER_GAUGES),
    "Roofline and verdict": ROOFLINE,
    "The engine's own state and the ceilings": (*ENGINE_STATE, NO_ROOFLINE_REQUESTS),
    "The stream tap": tuple(TAP.values()),
    "Build": (BUILD_INFO,),
    "The scrape": SCRAPE,
}
ALL: tuple[Family, ...] = tuple(f for fams in SECTIONS.values() for f in fams)
BY_NAME: dict[str, Family] = {f.name: f for f in ALL}


def names() -> set[str]:
    """Every name a query may use: the families', a histogram's ``_bucket``, ``_count``
    and ``_sum`` and its native family's."""
    out = set()
    for f in ALL:
        out.add(f.name)
        if f.type == "histogram":
            out.update(f.name + s for s in ("_bucket", "_count", "_sum"))
            if f.native:
                out.add(f.native_name)
    return out


# ---- the reference page -----------------------------------------------------------------
REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "metrics-reference.md"


def _bounds(b: BucketSet) -> str:
    return ", ".join(f"{x:g}" for x in b.bounds)


def reference() -> str:
    """docs/metrics-reference.md: every family, from this catalog."""
    series = ", ".join(SERIES_LABELS)
    lines = [
        "# Metrics reference",
        "",
        "Generated from `exporter/catalog.py` by `python -m phasewatch.catalog`; do not edit",
        "(tests/publish/test_catalog.py fails when it is stale). What the figures mean, how",
        "they are derived and what each label value says: [Phases and metrics](metrics.md).",
        "",
        f"*label set*: {series}; then `pod` with `--pod-label true` and `source` with",
        "`--source-label true`. Counters are listed by the name Prometheus stores (with",
        "`_total`). A histogram marked *native* has a second family, `<name>_native`, a",
        "native histogram on protobuf scrapes. `prompt_class` is left out with",
        "`--prompt-class-label false`, and `--classic-buckets coarse` keeps the 1-2-5",
        "bounds of each bucket set and its top one.",
    ]
    for title, families in SECTIONS.items():
        lines += ["", f"## {title}", ""]
        shared = {f.needs for f in families}
        if len(shared) == 1 and "" not in shared:  # said once for the section
            lines += [f"With {shared.pop()}.", ""]
            families = [f._replace(needs="") for f in families]
        lines += ["| metric | type | labels | help |", "|---|---|---|---|"]
        for f in families:
            labels = ", ".join((["*label set*"] if f.per_series else []) + list(f.labels))
            kind = f.type + (", native" if f.native else "")
            doc = f.help.replace("|", "\\|")
            if f.needs:
                doc += f" *With {f.needs}.*"
            lines.append(f"| `{f.name}` | {kind} | {labels or '-'} | {doc} |")
    lines += ["", "## Histogram buckets", "", "| metric | buckets (`le`) |", "|---|---|"]
    for f in HISTOGRAMS.values():
        lines.append(f"| `{f.name}` | {_bounds(f.buckets)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    text = reference()
    if "--check" in args:
        if not REFERENCE.exists() or REFERENCE.read_text() != text:
            print(f"stale: {REFERENCE}; run python -m phasewatch.catalog")
            return 1
        return 0
    REFERENCE.write_text(text)
    print(f"wrote {REFERENCE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
