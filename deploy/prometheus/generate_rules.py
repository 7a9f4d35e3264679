"""Write phasewatch's Prometheus recording and alerting rules from one set of parameters.

    python deploy/prometheus/generate_rules.py            # rewrite rules/*.yml and the
                                                          # Kubernetes PrometheusRule
    python deploy/prometheus/generate_rules.py --check    # fail if one is stale

Metric names are the catalog's (``phasewatch.catalog``). The rules are generated so
that tuning is a parameter, not a hand edit: the TTFT
SLO's threshold and objective, regression factors, the minimum traffic, ``for``
durations, and the baseline offsets (one day and one week by default; the
end-to-end test scales them down to minutes with the same code).

TTFT regression, prompt-length aware. TTFT = queue + prefill, and prefill grows
with the prompt. A shift to longer prompts raises TTFT while prefill seconds per
uncached token and queue time stay put, so the alert needs TTFT clearly worse than
its baseline *and* a cause: prefill slower per token (``regressed="prefill"``) or
the queue longer (``regressed="queue"``). The baseline is the larger of the same
window one day and one week earlier, so a normal daily or weekly peak does not
page, and only with enough traffic now and then.

Series are grouped by ``BY`` (model, engine, source). An exporter run with
``--source-label`` labels them ``source`` = ``engine``, ``tap`` or ``joined``, so a
regression of the client-visible TTFT (``joined``: the tap's first token with the
engine's queue and prefill) alerts apart from one of the engine's own, and names its
source; series without the label (the default) group and match as before, with no
``source`` on the alert. Only "stopped reporting" is per service (model, engine): a
join that breaks moves requests from ``joined`` to ``engine`` and ``tap``, and is no
engine going quiet.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from phasewatch import catalog as cat
from phasewatch.dashboard import queries
from phasewatch.roofline.cause import CAUSES, KV_FULL

HERE = Path(__file__).resolve().parent
RULES = HERE / "rules"
PROMETHEUS_RULE = HERE.parent / "kubernetes" / "monitoring" / "prometheusrule.yaml"
BY = queries.BY  # model, engine, source
SERVICE = "model, engine"
# " (joined)" in an annotation where the alert has a source label, nothing where not
SOURCE = "{{ with $labels.source }} ({{ . }}){{ end }}"
SOURCE_IN = "{{ with $labels.source }}, source {{ . }}{{ end }}"  # inside parentheses
OBJECTIVE = "{{ $labels.objective | toUpper }}"  # TTFT, TPOT, ITL, E2EL
POD_IN = "{{ with $labels.pod }}, pod {{ . }}{{ end }}"  # inside parentheses
ONE_ENGINE = "max without (source)"  # one engine's state, repeated under each source


@dataclass(frozen=True)
class Params:
    baseline_offsets: tuple[str, ...] = ("1d", "1w")
    rate_window: str = "5m"
    ttft_factor: float = 1.5  # TTFT quantile this many times its baseline
    prefill_factor: float = 1.3  # prefill seconds per token this many times its baseline
    queue_share_of_rise: float = 0.5  # the queue's rise explains this much of TTFT's mean rise
    token_latency_factor: float = 1.5  # ITL p95 / TPOT p50 this many times the baseline
    min_request_rate: float = 0.1  # requests/s, now and in the baseline (30 per 5 m)
    regression_for: str = "10m"
    mbu_collapse_ratio: float = 0.5  # decode MBU below half its baseline
    ttft_slo_seconds: float = 1.0  # must be a bucket bound of the TTFT histogram
    ttft_slo_objective: float = 0.99  # share of requests with TTFT <= the threshold
    # The latency objectives' (--slo) target: the share of requests that must meet each
    # objective, from the exporter's exact per-request counts (catalog.SLO).
    slo_target: float = 0.99
    # Multi-window multi-burn-rate (Google SRE workbook, chapter 5), for the TTFT SLO
    # and every --slo objective: (severity, long window, short window, burn factor).
    burn_windows: tuple[tuple[str, str, str, float], ...] = (
        ("page", "1h", "5m", 14.4), ("page", "6h", "30m", 6),
        ("ticket", "1d", "2h", 3), ("ticket", "3d", "6h", 1))
    exporter_job: str = "phasewatch"
    engine_silence: str = "10m"
    kv_full_ratio: float = KV_FULL  # KV-cache usage read as full, as the verdict reads it
    kv_full_for: str = "5m"
    preemption_window: str = "5m"  # increase() over this, reset-safe
    preemption_for: str = "10m"  # longer than the window: one burst never fires
    ceiling_for: str = "10m"


def _baseline(series: str, offsets: tuple[str, ...]) -> str:
    """The largest of ``series`` at each offset; where one is missing, the others."""
    parts = [f"{series} offset {o}" for o in offsets]
    if len(parts) == 1:
        return parts[0]
    a, b = parts[0], parts[1]
    expr = f"({a} >= {b}) or ({b} > {a}) or {a} or {b}"
    for extra in parts[2:]:
        expr = f"(({expr}) >= {extra}) or ({extra} > ({expr})) or ({expr}) or {extra}"
    return expr


def recording(p: Params) -> dict:
    w = p.rate_window
    rules = []

    def rec(name: str, expr: str) -> None:
        rules.append({"record": name, "expr": expr})

    def shared(template: str) -> str:  # the dashboard's PromQL, over all series
        return queries.render(template, "", w)

    for name, metric in queries.HISTOGRAMS.items():
        for q in (0.5, 0.95, 0.99):
            rec(f"phasewatch:{name}_seconds:p{round(q * 100)}_{w}",
                shared(queries.quantile(metric, q)))
        rec(f"phasewatch:{name}_seconds:mean_{w}",
            f"sum by ({BY}) (rate({metric}_sum[{w}])) / sum by ({BY}) (rate({metric}_count[{w}]))")
    rec(f"phasewatch:ttft_seconds_by_prompt_class:p95_{w}",
        shared(queries.PROMPT_CLASS["ttft_p95"]))
    rec(f"phasewatch:requests:rate_{w}", shared(queries.KPIS["request_rate"]))
    rec(f"phasewatch:tokens:rate_{w}",
        f"sum by ({BY}, kind) (rate({cat.TOKENS.name}[{w}]))")
    rec(f"phasewatch:phase_seconds:mean_{w}",  # per service; the dashboard's PHASE_MEAN is per pod
        f"sum by ({BY}, phase) (rate({cat.PHASE_DURATION.name}_sum[{w}])) / "
        f"sum by ({BY}, phase) (rate({cat.PHASE_DURATION.name}_count[{w}]))")
    rec(f"phasewatch:phase_time_share:ratio_{w}", shared(queries.PHASE_SHARE))
    rec(f"phasewatch:prefill_seconds_per_token:mean_{w}",
        f"sum by ({BY}) (rate({cat.PREFILL_SECONDS_PER_TOKEN.name}_sum[{w}])) / "
        f"sum by ({BY}) (rate({cat.PREFILL_SECONDS_PER_TOKEN.name}_count[{w}]))")
    # Baselines: the larger of the same window one day and one week earlier.
    for series in (f"phasewatch:ttft_seconds:p95_{w}", f"phasewatch:ttft_seconds:p50_{w}",
                   f"phasewatch:ttft_seconds:mean_{w}", f"phasewatch:itl_seconds:p95_{w}",
                   f"phasewatch:tpot_seconds:p50_{w}",
                   f"phasewatch:prefill_seconds_per_token:mean_{w}",
                   f"phasewatch:requests:rate_{w}"):
        rec(f"{series}:baseline", _baseline(series, p.baseline_offsets))
    rec(f"phasewatch:queue_seconds:mean_{w}",
        f'sum without (phase) (phasewatch:phase_seconds:mean_{w}{{phase="queue"}})')
    rec(f"phasewatch:queue_seconds:mean_{w}:baseline",
        _baseline(f"phasewatch:queue_seconds:mean_{w}", p.baseline_offsets))
    # TTFT SLO: the share of requests slower than the threshold, over each burn window.
    le = _le(p.ttft_slo_seconds)
    for window in _burn_windows(p):
        rec(f"phasewatch:ttft_slo_errors:ratio_rate{window}",
            f"1 - sum by ({BY}) (rate({cat.TTFT.name}_bucket"
            f'{{le="{le}"}}[{window}])) / sum by ({BY}) '
            f"(rate({cat.TTFT.name}_count[{window}]))")
    # Latency objectives (--slo): the share of the judged requests (met or missed, not
    # unknown) that missed each objective, exact per request, over each burn window;
    # and over each long window, each phase's share of the misses (the phase that took
    # the largest part of each missed figure). Series exist only where --slo is set.
    slo = cat.SLO_REQUESTS.name
    for window in _burn_windows(p):
        rec(f"phasewatch:slo_errors:ratio_rate{window}",
            f'sum by ({BY}, objective) (rate({slo}{{outcome="missed"}}[{window}]))\n'
            f"/ sum by ({BY}, objective) "
            f'(rate({slo}{{outcome=~"met|missed"}}[{window}]))')
    missed = cat.SLO_MISSED_REQUESTS.name
    for window in dict.fromkeys(long for _, long, _, _ in p.burn_windows):
        rec(f"phasewatch:slo_missed_phase:ratio_rate{window}",
            f"sum by ({BY}, objective, phase) (rate({missed}[{window}]))\n"
            f"/ ignoring (phase) group_left sum by ({BY}, objective) "
            f"(rate({missed}[{window}]))")
    return {"groups": [{"name": "phasewatch-recording", "rules": rules}]}


def _burn_windows(p: Params) -> list[str]:
    """Every window a burn rule reads, shortest first."""
    seconds = {"m": 60, "h": 3600, "d": 86400, "w": 604800}
    windows = {w for _, long, short, _ in p.burn_windows for w in (long, short)}
    return sorted(windows, key=lambda w: float(w[:-1]) * seconds[w[-1]])


def _le(seconds: float) -> str:
    """The ``le`` label value client_python writes for a bucket bound (1.0 -> "1.0")."""
    from phasewatch.requests.buckets import TTFT

    if seconds not in TTFT.bounds:
        raise ValueError(f"the TTFT SLO threshold must be a TTFT bucket bound, one of "
                         f"{', '.join(f'{b:g}' for b in TTFT.bounds)}; got {seconds:g}")
    return repr(float(seconds))


def alerting(p: Params) -> dict:
    w = p.rate_window
    traffic = (f"(phasewatch:requests:rate_{w} > {p.min_request_rate}) and on ({BY}) "
               f"(phasewatch:requests:rate_{w}:baseline > {p.min_request_rate})")
    ttft_rules = []
    causes = {
        "prefill": (f"phasewatch:prefill_seconds_per_token:mean_{w} > {p.prefill_factor} * "
                    f"phasewatch:prefill_seconds_per_token:mean_{w}:baseline",
                    "Prefill is slower per prompt token than in the baseline: look at "
                    f"prefill MFU ({cat.FLOPS_UTILIZATION.name}{{phase=\"prefill\"}}), "
                    f"the prefix-cache hit rate ({cat.TOKENS.name}{{kind=\"cached_prompt\"}}), "
                    "GPU clocks and throttling, and any new model, engine or flag rollout."),
        "queue": (f"(phasewatch:queue_seconds:mean_{w} - phasewatch:queue_seconds:mean_{w}"
                  f":baseline) > {p.queue_share_of_rise} * (phasewatch:ttft_seconds:mean_{w} - "
                  f"phasewatch:ttft_seconds:mean_{w}:baseline)",
                  "Requests wait longer for a slot: look at the request rate against capacity "
                  "(phasewatch:requests:rate_5m), the decode batch "
                  f"({cat.DECODE_BATCH_SIZE.name}) against max_num_seqs, KV-cache pressure "
                  "and preemptions, and replicas that left the pool."),
    }
    for q in ("p95", "p50"):
        for cause, (cond, look) in causes.items():
            ttft_rules.append({
                "alert": "PhasewatchTTFTRegression",
                "expr": (f"(phasewatch:ttft_seconds:{q}_{w} > {p.ttft_factor} * "
                         f"phasewatch:ttft_seconds:{q}_{w}:baseline)\n"
                         f"and on ({BY}) ({cond})\nand on ({BY}) {traffic}"),
                "for": p.regression_for,
                "labels": {"severity": "warning", "regressed": cause, "quantile": q},
                "annotations": {
                    "summary": f"TTFT {q} of {{{{ $labels.model }}}}{SOURCE} regressed: "
                               f"{cause}",
                    "description": (
                        f"TTFT {q} of {{{{ $labels.model }}}} ({{{{ $labels.engine }}}}"
                        f"{SOURCE_IN}) is "
                        f"{{{{ $value | humanizeDuration }}}}, over {p.ttft_factor}x the same "
                        f"window {' and '.join(p.baseline_offsets)} ago, and the {cause} "
                        f"explains it (not longer prompts). {look}")}})
    # SLO burn rate, multi-window multi-burn-rate (Google SRE workbook, chapter 5).
    budget = round(1 - p.ttft_slo_objective, 10)
    burn = []
    for severity, long, short, factor in p.burn_windows:
        burn.append({
            "alert": "PhasewatchTTFTSLOBurn",
            "expr": (f"phasewatch:ttft_slo_errors:ratio_rate{long} > ({factor} * {budget})\n"
                     f"and on ({BY}) phasewatch:ttft_slo_errors:ratio_rate{short} > "
                     f"({factor} * {budget})"),
            "labels": {"severity": severity, "long_window": long, "short_window": short},
            "annotations": {
                "summary": f"TTFT SLO of {{{{ $labels.model }}}}{SOURCE} burning {factor}x",
                "description": (
                    f"{{{{ $value | humanizePercentage }}}} of requests of "
                    f"{{{{ $labels.model }}}}{SOURCE} took longer than {p.ttft_slo_seconds:g} s to "
                    f"the first token over {long} (and {short}): {factor}x the error budget "
                    f"of a {p.ttft_slo_objective:.2%} objective.")}})
    other = [
        {"alert": "PhasewatchITLRegression",
         "expr": (f"(phasewatch:itl_seconds:p95_{w} > {p.token_latency_factor} * "
                  f"phasewatch:itl_seconds:p95_{w}:baseline)\nand on ({BY}) {traffic}"),
         "for": p.regression_for, "labels": {"severity": "warning"},
         "annotations": {"summary": f"ITL p95 of {{{{ $labels.model }}}}{SOURCE} regressed",
                         "description": "Inter-token latency p95 is {{ $value | "
                         "humanizeDuration }}, over the baseline: look at the decode batch, "
                         "prefill chunks stalling decode steps, and decode MBU."}},
        {"alert": "PhasewatchTPOTRegression",
         "expr": (f"(phasewatch:tpot_seconds:p50_{w} > {p.token_latency_factor} * "
                  f"phasewatch:tpot_seconds:p50_{w}:baseline)\nand on ({BY}) {traffic}"),
         "for": p.regression_for, "labels": {"severity": "warning"},
         "annotations": {"summary": f"TPOT p50 of {{{{ $labels.model }}}}{SOURCE} regressed",
                         "description": "Median time per output token is {{ $value | "
                         "humanizeDuration }}, over the baseline."}},
        {"alert": "PhasewatchDecodeBandwidthCollapse",
         "expr": (f'avg_over_time({cat.BANDWIDTH_UTILIZATION.name}{{phase="decode"}}[30m]) '
                  f"< {p.mbu_collapse_ratio} * "
                  f'avg_over_time({cat.BANDWIDTH_UTILIZATION.name}{{phase="decode"}}[30m] '
                  f"offset {p.baseline_offsets[0]})"),
         "for": "15m", "labels": {"severity": "warning"},
         "annotations": {"summary": "Decode MBU of {{ $labels.model }} collapsed",
                         "description": "Decode bandwidth utilization is {{ $value | "
                         "humanizePercentage }}, under half of the same time a day ago: "
                         "smaller batches, a slower kernel path, or a degraded GPU."}},
        {"alert": "PhasewatchExporterDown",
         "expr": f'up{{job="{p.exporter_job}"}} == 0', "for": "5m",
         "labels": {"severity": "warning"},
         "annotations": {"summary": "phasewatch exporter {{ $labels.instance }} is down",
                         "description": "Prometheus cannot scrape the sidecar: its pod's "
                         "latency metrics and verdict are missing."}},
        {"alert": "PhasewatchRejectingEvents",
         "expr": (f"sum by (instance) (rate({cat.INGEST_REJECTED.name}[10m])) / "
                  f"sum by (instance) (rate({cat.INGEST_REQUESTS.name}[10m])) > 0.01"),
         "for": "10m", "labels": {"severity": "warning"},
         "annotations": {"summary": "phasewatch at {{ $labels.instance }} rejects events",
                         "description": "{{ $value | humanizePercentage }} of the events "
                         f"received are rejected: see {cat.INGEST_REJECTED.name} by "
                         "reason (a sender's clock, a span shape, a version mismatch)."}},
        {"alert": "PhasewatchEngineStoppedReporting",
         "expr": (f"(sum by ({SERVICE}) (rate({cat.REQUESTS.name}"
                  f"[{p.engine_silence}])) == 0)\nand on ({SERVICE}) (sum by ({SERVICE}) "
                  f"(rate({cat.REQUESTS.name}"
                  f"[{p.engine_silence}] offset 1h)) > 0)"),
         "for": "5m", "labels": {"severity": "warning"},
         "annotations": {"summary": "{{ $labels.model }} ({{ $labels.engine }}) stopped "
                                    "reporting requests",
                         "description": "It finished requests an hour ago and none in the "
                         f"last {p.engine_silence}: the engine, its tracing, or the path to "
                         "the sidecar broke."}},
    ]
    return {"groups": [{"name": "phasewatch-ttft", "rules": ttft_rules + burn},
                       {"name": "phasewatch-slo", "rules": slo_burn(p)},
                       {"name": "phasewatch-health", "rules": other},
                       {"name": "phasewatch-engine", "rules": engine_state(p)}]}


# Each phase's share of an alert's misses over its long window, the largest: run by the
# annotation (Prometheus's template ``query``), with the alert's own label values. An
# absent source label matches source="" (the series without it).
TOP_PHASE = ('topk(1, phasewatch:slo_missed_phase:ratio_rate%s{model=%q,engine=%q,'
             'source=%q,objective=%q})')


def slo_burn(p: Params) -> list[dict]:
    """Burn-rate alerts for every latency objective set with --slo (one rule per
    severity and window pair, grouped by objective), from the exact per-request counts;
    the description names the phase that took most of the misses."""
    budget = round(1 - p.slo_target, 10)
    target = f"{p.slo_target:.2%}"
    out = []
    for severity, long, short, factor in p.burn_windows:
        top = (f'{{{{ with printf "{TOP_PHASE}" "{long}" $labels.model $labels.engine '
               f"$labels.source $labels.objective | query }}}}{{{{ with first . }}}} "
               f"{{{{ .Value | humanizePercentage }}}} of the {OBJECTIVE} "
               f"misses over the last {long} spent most of their time in the "
               f"{{{{ .Labels.phase }}}} phase.{{{{ end }}}}{{{{ end }}}}")
        out.append({
            "alert": "PhasewatchSLOBurn",
            "expr": (f"phasewatch:slo_errors:ratio_rate{long} > ({factor} * {budget})\n"
                     f"and on ({BY}, objective) phasewatch:slo_errors:ratio_rate{short} > "
                     f"({factor} * {budget})"),
            "labels": {"severity": severity, "long_window": long, "short_window": short},
            "annotations": {
                "summary": (f"{OBJECTIVE} objective of {{{{ $labels.model }}}}"
                            f"{SOURCE} burning {factor}x its error budget"),
                "description": (
                    f"{{{{ $value | humanizePercentage }}}} of the requests of "
                    f"{{{{ $labels.model }}}} ({{{{ $labels.engine }}}}{SOURCE_IN}) missed "
                    f"their {OBJECTIVE} objective over {long} (and {short}): "
                    f"{factor}x the error budget of a {target} target.{top}")}})
    return out


def _levers(cause: str) -> str:
    """The verdict's levers for ``cause``, as one sentence's list."""
    return "; ".join(CAUSES[cause].levers)


def engine_state(p: Params) -> list[dict]:
    """Alerts on the engine's own state and on the roofline's ceilings, one per engine."""
    who = f"{{{{ $labels.model }}}} ({{{{ $labels.engine }}}}{POD_IN})"
    kv_full = f"{p.kv_full_ratio:.0%}"
    return [
        {"alert": "PhasewatchEngineKVCacheFull",
         "expr": f"{ONE_ENGINE} ({cat.ENGINE_KV_CACHE_USAGE.name}) >= {p.kv_full_ratio}",
         "for": p.kv_full_for, "labels": {"severity": "warning"},
         "annotations": {
             "summary": f"KV cache of {who} full for {p.kv_full_for}",
             "description": (
                 f"The engine reports its KV cache {{{{ $value | humanizePercentage }}}} "
                 f"used, {kv_full} or more for {p.kv_full_for}: new requests wait for "
                 "KV blocks and running ones get preempted and recomputed "
                 f"({cat.ENGINE_REQUESTS.name}{{state=\"waiting\"}}, "
                 f"{cat.ENGINE_PREEMPTIONS.name}; the verdict's cause kv_cache). "
                 f"Levers: {_levers('kv_cache')}.")}},
        {"alert": "PhasewatchEnginePreempting",
         "expr": (f"{ONE_ENGINE} (increase({cat.ENGINE_PREEMPTIONS.name}"
                  f"[{p.preemption_window}])) > 0"),
         "for": p.preemption_for, "labels": {"severity": "warning"},
         "annotations": {
             "summary": f"{who} keeps preempting requests",
             "description": (
                 f"The engine preempted about {{{{ $value | humanize }}}} requests in the "
                 f"last {p.preemption_window}, and has not stopped for {p.preemption_for}: "
                 "it runs out of KV-cache blocks, and each preempted request is recomputed "
                 "(prefill compute spent twice, TTFT and ITL spikes; the verdict's cause "
                 "kv_cache or preemption_recompute). Levers: "
                 f"{_levers('preemption_recompute')}; where PhasewatchEngineKVCacheFull "
                 "fires too, its levers.")}},
        {"alert": "PhasewatchRooflineCeilingExceeded",
         "expr": f"{ONE_ENGINE} ({cat.CEILING_EXCEEDED.name}) > 1",
         "for": p.ceiling_for, "labels": {"severity": "ticket"},
         "annotations": {
             "summary": (f"The roofline's {{{{ $labels.ceiling }}}} ceiling for {who} is "
                         "exceeded: an input is wrong"),
             "description": (
                 "{{ $labels.phase }} achieved {{ $value | humanize }}x the configured "
                 f"{{{{ $labels.ceiling }}}} ceiling for {p.ceiling_for}, which no "
                 "hardware does, so no {{ $labels.phase }} utilization is published "
                 "meanwhile. Most often the model is wrong (the engine serves a smaller "
                 "model than --model or --hf-config names: check it first), then the "
                 "compute dtype (--compute-dtype) or the GPU count (--gpus), then the "
                 "ceiling itself (--hardware, or a --hardware-profile measured by "
                 "`phasewatch calibrate`). The exporter's warning and the verdict say "
                 "which the evidence points to (docs/verdict.md, Honest ceilings).")}},
    ]


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper, value: str):
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def prometheus_rule(p: Params) -> dict:
    """The same groups as one PrometheusRule for the Prometheus Operator."""
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": {"name": "phasewatch", "labels": {"app.kubernetes.io/name": "phasewatch"}},
            "spec": {"groups": recording(p)["groups"] + alerting(p)["groups"]}}


HEAD = ("# Generated by deploy/prometheus/generate_rules.py; edit the parameters there "
        "and rerun it.\n")


def _yaml(doc: dict) -> str:
    return HEAD + yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=100)


def render(p: Params) -> dict[str, str]:
    """The Prometheus rule files, by name."""
    return {name: _yaml(doc) for name, doc in (("phasewatch-recording.yml", recording(p)),
                                               ("phasewatch-alerts.yml", alerting(p)))}


def outputs(p: Params) -> dict[Path, str]:
    """Every generated file: the rule files and the Kubernetes PrometheusRule."""
    out = {RULES / name: text for name, text in render(p).items()}
    out[PROMETHEUS_RULE] = _yaml(prometheus_rule(p))
    return out


def write(p: Params, directory: Path) -> list[Path]:
    """Write the rule files (only) into ``directory``: the tests' scaled-down rules."""
    directory.mkdir(parents=True, exist_ok=True)
    out = []
    for name, text in render(p).items():
        path = directory / name
        path.write_text(text)
        out.append(path)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="fail if a generated file is stale")
    args = ap.parse_args(argv)
    root = HERE.parents[1]
    if args.check:
        stale = [str(path.relative_to(root)) for path, text in outputs(Params()).items()
                 if not path.exists() or path.read_text() != text]
        if stale:
            print(f"stale: {', '.join(stale)}; run python deploy/prometheus/generate_rules.py")
            return 1
        return 0
    for path, text in outputs(Params()).items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path.relative_to(root)}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parents[1]))
    sys.exit(main())
