"""The PromQL behind the dashboard's Prometheus source: one place, named, templated.

The Grafana dashboards use these same expressions (with Grafana's ``$model``-style
variables where these take ``{sel}``). ``{sel}`` is the label matcher of the
user's selection (it may be empty), ``{sel_and}`` the same opened for one more
matcher, ``{range}`` the rate window and ``{pod}`` the pod label's name. Quantiles are
``histogram_quantile`` over bucket rates summed across pods, so a cluster-wide p95
is a true pooled p95, not an average of per-pod p95s; from the native histograms
where Prometheus reads them (within ~4.4%), else from the classic buckets.

Every aggregation keeps ``source`` (``BY``): an exporter run with ``--source-label``
labels its series ``engine``, ``tap`` or ``joined`` (who saw the requests), and a
tap's client-visible TTFT must never be pooled with an engine's own. Series without
the label (the default) aggregate as before: ``by (..., source)`` over them gives
series without ``source``, and ``and on (..., source)`` matches them to each other.
"""

from __future__ import annotations

BY = "model, engine, source"

HISTOGRAMS = {
    "ttft": "gen_ai_server_time_to_first_token_seconds",
    "itl": "phasewatch_inter_token_latency_seconds",
    "tpot": "gen_ai_server_time_per_output_token_seconds",
    "e2e": "gen_ai_server_request_duration_seconds",
}


def quantile(metric: str, q: float, by: str = BY) -> str:
    """From the native histogram (``<metric>_native``, ~4.4% buckets) where Prometheus
    has one, else from the classic ``le`` buckets: a Prometheus without native
    histograms, or a series from an older exporter, still gets an answer."""
    return (f"histogram_quantile({q}, sum by ({by}) "
            f"(rate({metric}_native{{sel}}[{{range}}]))) or "
            f"histogram_quantile({q}, sum by ({by}, le) "
            f"(rate({metric}_bucket{{sel}}[{{range}}])))")


def mean(metric: str, by: str = BY) -> str:
    """The exact mean over the range: summed seconds over observations."""
    return (f"sum by ({by}) (rate({metric}_sum{{sel}}[{{range}}])) / "
            f"sum by ({by}) (rate({metric}_count{{sel}}[{{range}}]))")


def increase(metric: str, sel_and: str = "") -> str:
    return (f"sum by ({BY}) (increase({metric}{{sel_and}}{sel_and}}}[{{range}}]))" if sel_and
            else f"sum by ({BY}) (increase({metric}{{sel}}[{{range}}]))")


# KPI cards (instant queries), one series per (model, engine[, source]).
# Mean, p50, p90, p95, p99 of each: the cards and the ``vllm bench serve`` comparison.
KPIS: dict[str, str] = {
    **{f"{name}_{p}": quantile(metric, q)
       for name, metric in HISTOGRAMS.items()
       for p, q in (("p50", 0.5), ("p90", 0.9), ("p95", 0.95), ("p99", 0.99))},
    **{f"{name}_mean": mean(metric) for name, metric in HISTOGRAMS.items()},
    "requests_in_range": increase("phasewatch_requests_total"),
    "prompt_tokens_in_range": increase("phasewatch_tokens_total", 'kind="prompt"'),
    "output_tokens_in_range": increase("phasewatch_tokens_total", 'kind="output"'),
    "request_rate": f"sum by ({BY}) (rate(phasewatch_requests_total{{sel}}[{{range}}]))",
    "prompt_tokens_per_second":
        f'sum by ({BY}) (rate(phasewatch_tokens_total{{sel_and}}kind="prompt"}}[{{range}}]))',
    "output_tokens_per_second":
        f'sum by ({BY}) (rate(phasewatch_tokens_total{{sel_and}}kind="output"}}[{{range}}]))',
    # Utilizations are per replica: the mean over the selected pods.
    "mbu": f'avg by ({BY}) (phasewatch_bandwidth_utilization_ratio{{sel_and}}phase="decode"}})',
    "mfu": f'avg by ({BY}) (phasewatch_flops_utilization_ratio{{sel_and}}phase="prefill"}})',
    "decode_batch_size": f"avg by ({BY}) (phasewatch_decode_batch_size{{sel}})",
}

# Phase time shares: each phase's summed duration over all three, from the phase
# histograms' _sum (the same quantity the exporter's phase_time_share reports).
PHASE_SHARE = (f"sum by ({BY}, phase) (rate(phasewatch_phase_duration_seconds_sum{{sel}}"
               f"[{{range}}])) / ignoring(phase) group_left sum by ({BY}) "
               f"(rate(phasewatch_phase_duration_seconds_sum{{sel}}[{{range}}]))")

# The mean request per pod, for the waterfall: mean seconds in each phase.
PHASE_MEAN = (f"sum by ({BY}, {{pod}}, phase) (rate(phasewatch_phase_duration_seconds_sum"
              f"{{sel}}[{{range}}])) / sum by ({BY}, {{pod}}, phase) "
              f"(rate(phasewatch_phase_duration_seconds_count{{sel}}[{{range}}]))")

# Verdict: how many pods report each (phase, resource), and how many report at all.
VERDICT_VOTES = f"count by ({BY}, phase, resource) (phasewatch_bottleneck_info{{sel}} == 1)"
VERDICT_REPORTING = f"count by ({BY}) (phasewatch_bottleneck_info{{sel}} == 1)"
VERDICT_CONFIDENCE = f"avg by ({BY}) (phasewatch_bottleneck_confidence_ratio{{sel}})"
# ... and why (the cause label: kv_cache, concurrency_limit, ... or none); an exporter
# older than the label answers series without it.
VERDICT_CAUSES = (f"count by ({BY}, phase, resource, cause) "
                  f"(phasewatch_bottleneck_info{{sel}} == 1)")

# The engine's own state as the exporter scraped it (--engine-metrics-url): the fullest
# pod's KV cache, requests running and waiting over all pods, preemptions in the range.
ENGINE_KV_USAGE = f"max by ({BY}) (phasewatch_engine_kv_cache_usage_ratio{{sel}})"
ENGINE_REQUESTS = f"sum by ({BY}, state) (phasewatch_engine_requests{{sel}})"
ENGINE_PREEMPTIONS = increase("phasewatch_engine_preemptions_total")
# Achieved over a ceiling where it went above 1: the ceiling is wrong.
CEILING_EXCEEDED = (f"max by ({BY}, phase, ceiling) "
                    f"(phasewatch_roofline_ceiling_exceeded_ratio{{sel}})")

# Roofline operating points (per replica: the mean over the selected pods) and ceilings.
INTENSITY = f"avg by ({BY}, phase) (phasewatch_arithmetic_intensity_flops_per_byte{{sel}})"
ACHIEVED_FLOPS = f"avg by ({BY}, phase) (phasewatch_achieved_flops_per_second{{sel}})"
PEAK_BANDWIDTH = f"max by ({BY}, ceiling) (phasewatch_peak_bandwidth_bytes_per_second{{sel}})"
PEAK_FLOPS = f"max by ({BY}, ceiling) (phasewatch_peak_flops_per_second{{sel}})"

# TTFT by prompt-length class.
PROMPT_CLASS = {
    "ttft_p50": quantile(HISTOGRAMS["ttft"], 0.5, f"{BY}, prompt_class"),
    "ttft_p95": quantile(HISTOGRAMS["ttft"], 0.95, f"{BY}, prompt_class"),
    "count": (f"sum by ({BY}, prompt_class) (increase("
              f"gen_ai_server_time_to_first_token_seconds_count{{sel}}[{{range}}]))"),
}

# Time series (range queries).
SERIES: dict[str, str] = {
    **{k: KPIS[k] for k in ("ttft_p50", "ttft_p95", "itl_p50", "itl_p95", "tpot_p50",
                            "tpot_p95", "prompt_tokens_per_second",
                            "output_tokens_per_second")},
    "phase_share": PHASE_SHARE,
}

# Every label set, for the selectors (no selection applied).
LABEL_SETS = "count by ({by_pod}) (phasewatch_requests_total)"


def render(template: str, sel: str, rate_range: str, pod_label: str = "pod") -> str:
    """Fill a template. ``sel`` is the matcher body (``model=~"a|b",pod="x"``) or ""."""
    return (template.replace("{sel_and}", "{" + (sel + "," if sel else ""))
            .replace("{sel}", "{" + sel + "}" if sel else "")
            .replace("{range}", rate_range).replace("{pod}", pod_label)
            .replace("{by_pod}", f"{BY}, {pod_label}"))


def matcher(models=(), engines=(), pods=(), pod_label: str = "pod", sources=()) -> str:
    """A PromQL matcher body selecting the given label values (empty: all)."""
    parts = []
    for label, values in (("model", models), ("engine", engines), (pod_label, pods),
                          ("source", sources)):
        if values:
            alternatives = "|".join(_regex_literal(v) for v in values)
            parts.append(f'{label}=~"{_quote(alternatives)}"')
    return ",".join(parts)


def _regex_literal(value: str) -> str:
    return "".join("\\" + ch if ch in r"\.+*?()|[]{}^$" else ch for ch in value)


def _quote(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"')
