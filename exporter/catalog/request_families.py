"""The requests' families: the aggregator's histograms and counters by aggregator key
(``HISTOGRAMS``, ``COUNTERS``), trace sampling's and the latency objectives' (``SLO``)."""

from __future__ import annotations

from phasewatch.catalog.family import Family
from phasewatch.requests import buckets
from phasewatch.requests.buckets import BucketSet


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
