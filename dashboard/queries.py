"""The PromQL behind the dashboard's Prometheus source: one place, named, templated.

Metric names are the catalog's (``phasewatch.catalog``), never spelled here.

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

from phasewatch import catalog as cat

BY = "model, engine, source"

HISTOGRAMS = {
    "ttft": cat.TTFT.name,
    "itl": cat.ITL.name,
    "tpot": cat.TPOT.name,
    "e2e": f"{cat.E2E.name}",
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
    "requests_in_range": increase(cat.REQUESTS.name),
    "prompt_tokens_in_range": increase(cat.TOKENS.name, 'kind="prompt"'),
    "output_tokens_in_range": increase(cat.TOKENS.name, 'kind="output"'),
    "request_rate": f"sum by ({BY}) (rate({cat.REQUESTS.name}{{sel}}[{{range}}]))",
    "prompt_tokens_per_second":
        f'sum by ({BY}) (rate({cat.TOKENS.name}{{sel_and}}kind="prompt"}}[{{range}}]))',
    "output_tokens_per_second":
        f'sum by ({BY}) (rate({cat.TOKENS.name}{{sel_and}}kind="output"}}[{{range}}]))',
    # Utilizations are per replica: the mean over the selected pods.
    "mbu": f'avg by ({BY}) ({cat.BANDWIDTH_UTILIZATION.name}{{sel_and}}phase="decode"}})',
    "mfu": f'avg by ({BY}) ({cat.FLOPS_UTILIZATION.name}{{sel_and}}phase="prefill"}})',
    "decode_batch_size": f"avg by ({BY}) ({cat.DECODE_BATCH_SIZE.name}{{sel}})",
    # traces sampled upstream: requests received over the requests they stand for (the
    # received family exists only where something was sampled)
    "sampled_share": (f"sum by ({BY}) (rate({cat.SAMPLED_REQUESTS.name}{{sel}}[{{range}}])) / "
                      f"sum by ({BY}) (rate({cat.REQUESTS.name}{{sel}}[{{range}}]))"),
}

# Phase time shares: each phase's summed duration over all three, from the phase
# histograms' _sum (the same quantity the exporter's phase_time_share reports).
PHASE_SHARE = (f"sum by ({BY}, phase) (rate({cat.PHASE_DURATION.name}_sum{{sel}}"
               f"[{{range}}])) / ignoring(phase) group_left sum by ({BY}) "
               f"(rate({cat.PHASE_DURATION.name}_sum{{sel}}[{{range}}]))")

# The mean request per pod, for the waterfall: mean seconds in each phase.
PHASE_MEAN = (f"sum by ({BY}, {{pod}}, phase) (rate({cat.PHASE_DURATION.name}_sum"
              f"{{sel}}[{{range}}])) / sum by ({BY}, {{pod}}, phase) "
              f"(rate({cat.PHASE_DURATION.name}_count{{sel}}[{{range}}]))")

# Verdict: how many pods report each (phase, resource), and how many report at all.
# Pods, not series: in a fleet every replica publishes a verdict for each sending pod it
# holds a share of (the replicas' series differ by instance), so series are grouped by
# pod first; a sidecar's series are one per pod already.
VERDICT = f"{cat.BOTTLENECK_INFO.name}{{sel}} == 1"
VERDICT_VOTES = (f"count by ({BY}, phase, resource) "
                 f"(group by ({BY}, {{pod}}, phase, resource) ({VERDICT}))")
# label sets whose verdict comes from the client's view alone (a tap's records)
CLIENT_VIEW = (f"count by ({BY}) ({cat.ROOFLINE_INPUTS.name}{{sel_and}}"
               'input="phases",origin="client_view"})')
VERDICT_REPORTING = f"count by ({BY}) (group by ({BY}, {{pod}}) ({VERDICT}))"
VERDICT_CONFIDENCE = f"avg by ({BY}) ({cat.BOTTLENECK_CONFIDENCE.name}{{sel}})"
# ... and why (the cause label: kv_cache, concurrency_limit, ... or none); an exporter
# older than the label answers series without it.
VERDICT_CAUSES = (f"count by ({BY}, phase, resource, cause) "
                  f"(group by ({BY}, {{pod}}, phase, resource, cause) ({VERDICT}))")

# The engine's own state as the exporter scraped it (--engine-metrics-url): the fullest
# pod's KV cache, requests running and waiting over all pods, preemptions in the range.
ENGINE_KV_USAGE = f"max by ({BY}) ({cat.ENGINE_KV_CACHE_USAGE.name}{{sel}})"
ENGINE_REQUESTS = f"sum by ({BY}, state) ({cat.ENGINE_REQUESTS.name}{{sel}})"
ENGINE_PREEMPTIONS = increase(cat.ENGINE_PREEMPTIONS.name)
# Achieved over a ceiling where it went above 1: the ceiling is wrong.
CEILING_EXCEEDED = (f"max by ({BY}, phase, ceiling) "
                    f"({cat.CEILING_EXCEEDED.name}{{sel}})")

# The GPU's own counters beside the estimate (--gpu-metrics-url, --gpu-nvml): per label
# set, the mean over its pods of each counter and of the estimate's share of the same
# peak, the GPUs counted, and the pods by what the counters say of their verdict.
GPU = {
    "dram": f"avg by ({BY}, gpu_source) ({cat.ACTIVITY['dram_active'].name}{{sel}})",
    "tensor": f"avg by ({BY}, gpu_source) ({cat.ACTIVITY['tensor_active'].name}{{sel}})",
    "dram_estimated": f'avg by ({BY}) ({cat.GPU_ESTIMATED.name}{{sel_and}}counter="dram"}})',
    "tensor_estimated": (f'avg by ({BY}) '
                         f'({cat.GPU_ESTIMATED.name}{{sel_and}}counter="tensor"}})'),
    "gpus": f"sum by ({BY}, gpu_source) ({cat.GPU_COUNTED.name}{{sel}})",
    "outcome": f"count by ({BY}, outcome) ({cat.GPU_CHECK.name}{{sel}} == 1)",
}

# Roofline operating points (per replica: the mean over the selected pods) and ceilings.
INTENSITY = f"avg by ({BY}, phase) ({cat.ARITHMETIC_INTENSITY.name}{{sel}})"
ACHIEVED_FLOPS = f"avg by ({BY}, phase) ({cat.ACHIEVED_FLOPS.name}{{sel}})"
PEAK_BANDWIDTH = f"max by ({BY}, ceiling) ({cat.PEAK_BANDWIDTH.name}{{sel}})"
PEAK_FLOPS = f"max by ({BY}, ceiling) ({cat.PEAK_FLOPS.name}{{sel}})"

# TTFT by prompt-length class.
PROMPT_CLASS = {
    "ttft_p50": quantile(HISTOGRAMS["ttft"], 0.5, f"{BY}, prompt_class"),
    "ttft_p95": quantile(HISTOGRAMS["ttft"], 0.95, f"{BY}, prompt_class"),
    "count": (f"sum by ({BY}, prompt_class) (increase("
              f"{cat.TTFT.name}_count{{sel}}[{{range}}]))"),
}

# Latency objectives (--slo), counted exactly per request by the exporters: requests by
# (objective, outcome) and the misses by the phase that broke them over the range, good
# requests per second (goodput), and the thresholds (the plain ones: an override for one
# prompt-length class carries ``prompt_class``; a label set's pods share their objectives).
SLO_OUTCOMES = (f"sum by ({BY}, objective, outcome) "
                f"(increase({cat.SLO_REQUESTS.name}{{sel}}[{{range}}]))")
SLO_MISSED_BY_PHASE = (f"sum by ({BY}, objective, phase) "
                       f"(increase({cat.SLO_MISSED_REQUESTS.name}{{sel}}[{{range}}]))")
SLO_GOODPUT = f"sum by ({BY}) (rate({cat.SLO_GOOD_REQUESTS.name}{{sel}}[{{range}}]))"
SLO_OBJECTIVE = f'max by ({BY}, objective) ({cat.SLO_OBJECTIVE.name}{{sel_and}}prompt_class=""}})'
SLO_CLASS_OBJECTIVE = (f"max by ({BY}, objective, prompt_class) "
                       f'({cat.SLO_OBJECTIVE.name}{{sel_and}}prompt_class!=""}})')
# ... over time: each objective's share met, and the share of requests good (met all)
SLO_ATTAINMENT = (f'sum by ({BY}, objective) (rate({cat.SLO_REQUESTS.name}{{sel_and}}'
                  f'outcome="met"}}[{{range}}])) / sum by ({BY}, objective) '
                  f"(rate({cat.SLO_REQUESTS.name}{{sel}}[{{range}}]))")
SLO_GOOD_RATIO = (f"{SLO_GOODPUT} / sum by ({BY}) "
                  f"(rate({cat.REQUESTS.name}{{sel}}[{{range}}]))")

# Each replica (pod) of a label set side by side, for the Replicas panel and Grafana's
# per-replica row (``phasewatch.dashboard.replicas`` picks out the ones that differ):
# its request rate, TTFT p50/p95 from its own buckets, the share of its request time in
# the queue (PHASE_SHARE per pod), its engine's KV-cache usage, and its verdict.
REPLICA_BY = f"{BY}, {{pod}}"
REPLICAS: dict[str, str] = {
    "request_rate": f"sum by ({REPLICA_BY}) (rate({cat.REQUESTS.name}{{sel}}[{{range}}]))",
    "ttft_p50": quantile(HISTOGRAMS["ttft"], 0.5, REPLICA_BY),
    "ttft_p95": quantile(HISTOGRAMS["ttft"], 0.95, REPLICA_BY),
    "queue_share": (f"sum by ({REPLICA_BY}) (rate({cat.PHASE_DURATION.name}_sum{{sel_and}}"
                    f'phase="queue"}}[{{range}}])) / sum by ({REPLICA_BY}) '
                    f"(rate({cat.PHASE_DURATION.name}_sum{{sel}}[{{range}}]))"),
    "kv_usage": f"max by ({REPLICA_BY}) ({cat.ENGINE_KV_CACHE_USAGE.name}{{sel}})",
    "verdict": (f"count by ({REPLICA_BY}, phase, resource, cause) "
                f"({cat.BOTTLENECK_INFO.name}{{sel}} == 1)"),
}

# Time series (range queries).
SERIES: dict[str, str] = {
    **{k: KPIS[k] for k in ("ttft_p50", "ttft_p95", "itl_p50", "itl_p95", "tpot_p50",
                            "tpot_p95", "prompt_tokens_per_second",
                            "output_tokens_per_second")},
    "phase_share": PHASE_SHARE,
    "attainment": SLO_ATTAINMENT,
    "good_ratio": SLO_GOOD_RATIO,
}

# Every label set, for the selectors (no selection applied).
LABEL_SETS = f"count by ({{by_pod}}) ({cat.REQUESTS.name})"


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
