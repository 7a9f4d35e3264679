"""Write phasewatch's Grafana dashboard (``grafana/dashboards/phasewatch.json``) from code.

    python grafana/generate.py            # rewrite the JSON
    python grafana/generate.py --check    # fail if it is stale

Metric names are the catalog's (``phasewatch.catalog``). The PromQL comes from
``dashboard/queries.py``, the same expressions the Dash app's
Prometheus source runs, with Grafana's variables in place of the selection:
``model``, ``engine``, ``source`` and ``pod`` (multi-select, "All" = ``.*``, which
also matches series without the label: a single exporter has no ``pod``, and only an
exporter run with ``--source-label`` has ``source``) and ``job`` for the exporter's
own series. ``source`` says who saw the requests (``engine``, ``tap``, or ``joined``:
the tap's client-visible TTFT with the engine's queue and prefill): every request
panel keeps it in its ``by (...)`` and its legend, so a client-visible TTFT is never
pooled with an engine-only one. The datasource is a variable too, so the JSON imports
into any Grafana with a Prometheus datasource. Panels use only raw series (no recording
rules), so the dashboard works before any rule is loaded; the alert panel reads
Prometheus's ``ALERTS`` series of the phasewatch rules. Beside the verdict: its cause,
and the engine's own state (KV-cache usage, running and waiting requests, preemptions)
that phasewatch republishes where it scrapes the engine's /metrics.

Panel types are the core ones of current Grafana (timeseries, stat, bargauge,
table, state-timeline, text); schemaVersion 39, which later versions migrate.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from phasewatch import catalog as cat
from phasewatch.dashboard import queries, theme
from phasewatch.dashboard.replicas import OUTLIER_RULES
from phasewatch.roofline import verdict
from phasewatch.roofline.cause import CAUSES

HERE = Path(__file__).resolve().parent
OUT = HERE / "dashboards" / "phasewatch.json"
UID = "phasewatch-overview"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'model=~"$model",engine=~"$engine",source=~"$source",pod=~"$pod"'
BY = queries.BY  # model, engine, source
WHO = "{{model}} {{source}}"  # a series' label set in a legend ({{source}}: "" where absent)
RANGE = "$__rate_interval"
EXPORTER_SEL = 'job=~"$job",pod=~"$pod"'


def who(rest: str = "") -> str:
    """A legend: the model and the source (joined, tap, engine), then ``rest``."""
    return f"{WHO} {rest}" if rest else WHO


def q(template: str) -> str:
    return queries.render(template, SEL, RANGE)


def target(expr: str, legend: str = "", ref: str = "A", instant: bool = False,
           table: bool = False) -> dict:
    t = {"datasource": DATASOURCE, "refId": ref, "expr": expr, "legendFormat": legend,
         "range": not instant, "instant": instant, "editorMode": "code"}
    if table:
        t["format"] = "table"
    return t


class Layout:
    """Places panels left to right on Grafana's 24-column grid, wrapping rows."""

    def __init__(self):
        self.panels: list[dict] = []
        self.x = self.y = self.row_height = 0

    def _id(self) -> int:
        return len(self.panels) + 1

    def row(self, title: str) -> None:
        self._newline()
        self.panels.append({"type": "row", "id": self._id(), "title": title,
                            "collapsed": False, "panels": [],
                            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}})
        self.y += 1

    def _newline(self) -> None:
        if self.x:
            self.y += self.row_height
            self.x = self.row_height = 0

    def add(self, panel: dict, w: int, h: int) -> None:
        if self.x + w > 24:
            self._newline()
        panel = {"id": self._id(), "gridPos": {"h": h, "w": w, "x": self.x, "y": self.y},
                 **panel}
        if panel["type"] not in ("text", "row"):
            panel["datasource"] = DATASOURCE
        self.panels.append(panel)
        self.x += w
        self.row_height = max(self.row_height, h)


def phase_overrides() -> list[dict]:
    """Series of a phase get its colour everywhere (legend names end with the phase)."""
    return [{"matcher": {"id": "byRegexp", "options": f".* {phase}$"},
             "properties": [{"id": "color", "value": {"mode": "fixed", "fixedColor": color}}]}
            for phase, color in theme.PHASE_COLORS.items()]


def timeseries(title: str, targets: list[dict], unit: str, description: str,
               stack: bool = False, log: bool = False, phases: bool = False) -> dict:
    custom = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 20 if stack else 0,
              "showPoints": "never", "spanNulls": True,
              "stacking": {"mode": "normal" if stack else "none", "group": "A"}}
    if log:
        custom["scaleDistribution"] = {"type": "log", "log": 10}
    return {"type": "timeseries", "title": title, "description": description,
            "targets": targets,
            "fieldConfig": {"defaults": {"unit": unit, "custom": custom},
                            "overrides": phase_overrides() if phases else []},
            "options": {"legend": {"displayMode": "table", "placement": "bottom",
                                   "calcs": ["lastNotNull", "max"]},
                        "tooltip": {"mode": "multi", "sort": "desc"}}}


def stat(title: str, expr: str, unit: str, description: str, legend: str = WHO,
         decimals: int | None = None) -> dict:
    defaults = {"unit": unit, "color": {"mode": "thresholds"},
                "thresholds": {"mode": "absolute",
                               "steps": [{"color": "text", "value": None}]}}
    if decimals is not None:
        defaults["decimals"] = decimals
    return {"type": "stat", "title": title, "description": description,
            "targets": [target(expr, legend, instant=True)],
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "",
                                          "values": False},
                        "textMode": "value_and_name", "colorMode": "none",
                        "graphMode": "none", "justifyMode": "auto"}}


def levers_text() -> str:
    lines = ["| verdict | levers that fit |", "|---|---|"]
    for (phase, resource), levers in verdict.LEVERS.items():
        lines.append(f"| {verdict.headline(phase, resource)} | {'; '.join(levers)} |")
    return "\n".join(lines)


def column_overrides(columns: list[tuple[str, str, str, str]]) -> list[dict]:
    """Each (ref, expr, name, unit) column's display name and unit in a merged table."""
    return [{"matcher": {"id": "byName", "options": f"Value #{ref}"},
             "properties": [{"id": "displayName", "value": name},
                            {"id": "unit", "value": unit}]}
            for ref, _, name, unit in columns]


def merged_table(title: str, description: str, columns: list[tuple[str, str, str, str]],
                 first: str, overrides: list[dict]) -> dict:
    """A table of instant queries merged into one row per series: the label columns
    model, engine, source and ``first`` (phase, pod) lead, then the columns."""
    return {
        "type": "table", "title": title, "description": description,
        "targets": [target(expr, ref=ref, instant=True, table=True)
                    for ref, expr, _, _ in columns],
        "transformations": [{"id": "merge", "options": {}},
                            {"id": "organize", "options": {
                                "excludeByName": {"Time": True},
                                "indexByName": {"model": 0, "engine": 1, "source": 2,
                                                first: 3}}}],
        "fieldConfig": {"defaults": {"decimals": 3}, "overrides": overrides},
        "options": {"showHeader": True, "cellHeight": "sm"},
    }


def roofline_table() -> dict:
    """Each phase's operating point: arithmetic intensity against the ridge, achieved
    FLOP/s against what the roof allows at that intensity."""
    peak_bw = (f'max by ({BY}) ({cat.PEAK_BANDWIDTH.name}'
               f'{{{SEL},ceiling="datasheet"}})')
    peak_fl = (f'max by ({BY}) ({cat.PEAK_FLOPS.name}'
               f'{{{SEL},ceiling="datasheet"}})')
    intensity = q(queries.INTENSITY)
    per_phase = f"({intensity}) * 0 + on ({BY}) group_left ()"
    sloped = f"({intensity}) * on ({BY}) group_left () {peak_bw}"
    flat = f"{per_phase} {peak_fl}"
    attainable = f"(({sloped}) < ({flat})) or ({flat})"
    columns = [
        ("A", intensity, "Intensity (FLOP/byte)", "none"),
        ("B", f"{per_phase} ({peak_fl} / {peak_bw})", "Ridge (FLOP/byte)", "none"),
        ("C", q(queries.ACHIEVED_FLOPS), "Achieved FLOP/s", "flops"),
        ("D", attainable, "Roof at this intensity (FLOP/s)", "flops"),
        ("E", f"({q(queries.ACHIEVED_FLOPS)}) / ({attainable})", "Of the roof", "percentunit"),
        ("F", f"avg by ({BY}, phase) ({cat.BANDWIDTH_UTILIZATION.name}{{{SEL}}})",
         "MBU", "percentunit"),
        ("G", f"avg by ({BY}, phase) ({cat.FLOPS_UTILIZATION.name}{{{SEL}}})",
         "MFU", "percentunit"),
    ]
    return merged_table(
        "Roofline operating points",
        "Where each phase sits on the roofline (datasheet ceilings): left of the ridge "
        "(intensity < ridge) the bandwidth slope limits it, right of it the compute roof. "
        "'Of the roof' is the achieved FLOP/s over what the roof allows at that intensity: "
        "the headroom left. " + theme.GLOSSARY["arithmetic intensity"],
        columns, "phase", column_overrides(columns))


def cause_table() -> dict:
    """The verdict under its cause, one row per (model, engine, source, verdict): the
    engine's own state says why (exporter/roofline/cause.py), in the words of its title."""
    by = f"{BY}, phase, resource, cause"
    titles = {name: {"text": f"{c.title} ({name})", "index": i}
              for i, (name, c) in enumerate(CAUSES.items())}
    titles["none"] = {"text": "none: no cause found (an idle engine, or too little evidence)",
                      "index": len(titles)}
    return {
        "type": "table", "title": "Cause",
        "description": "Why the bottleneck phase is slow, from the engine's own state (its "
                       "/metrics: running and waiting requests, KV-cache usage, preemptions) "
                       "or from the requests where no engine is scraped: kv_cache, "
                       "preemption_recompute, concurrency_limit, imbalance, "
                       "prefill_interference, compute_saturated, frontend. 'pods' is how "
                       "many pods report that verdict. The levers of each cause are in the "
                       "alerts and in the exporter's /api/v1/roofline.",
        "targets": [target(f"count by ({by}) ({cat.BOTTLENECK_INFO.name}{{{SEL}}} == 1)",
                           instant=True, table=True)],
        "transformations": [{"id": "organize", "options": {
            "excludeByName": {"Time": True},
            "indexByName": {"model": 0, "engine": 1, "source": 2, "phase": 3, "resource": 4,
                            "cause": 5, "Value": 6},
            "renameByName": {"Value": "pods"}}}],
        "fieldConfig": {"defaults": {"decimals": 0}, "overrides": [
            {"matcher": {"id": "byName", "options": "cause"},
             "properties": [{"id": "mappings",
                             "value": [{"type": "value", "options": titles}]}]}]},
        "options": {"showHeader": True, "cellHeight": "sm"},
    }


def engine_state() -> dict:
    """KV-cache usage (left axis) and running/waiting requests (right) of each engine."""
    kv = f"max by ({BY}, pod) ({cat.ENGINE_KV_CACHE_USAGE.name}{{{SEL}}})"
    requests = f"sum by ({BY}, pod, state) ({cat.ENGINE_REQUESTS.name}{{{SEL}}})"
    panel = timeseries(
        "Engine: KV-cache usage and requests",
        [target(kv, who("{{pod}} KV cache"), "A"),
         target(requests, who("{{pod}} {{state}}"), "B")], "percentunit",
        "What the engine's own /metrics says (vLLM kv_cache_usage_perc, num_requests_running "
        "and _waiting; SGLang token_usage, num_running_reqs, num_queue_reqs), republished "
        "by phasewatch when it scrapes the engine (engine_metrics_url). A KV cache near 100 % "
        "with requests waiting is the kv_cache cause; running pinned with room left is "
        "concurrency_limit. With --source-label the same figures show under each source.")
    panel["fieldConfig"]["defaults"]["min"] = 0
    panel["fieldConfig"]["overrides"] = [
        {"matcher": {"id": "byRegexp", "options": ".* (running|waiting)$"},
         "properties": [{"id": "unit", "value": "none"}, {"id": "decimals", "value": 0},
                        {"id": "custom.axisPlacement", "value": "right"}]}]
    return panel


def preemptions() -> dict:
    expr = (f"sum by ({BY}, pod) (rate({cat.ENGINE_PREEMPTIONS.name}{{{SEL}}}"
            f"[{RANGE}]))")
    return timeseries(
        "Engine preemptions/s", [target(expr, who("{{pod}}"))], "reqps",
        "Requests the engine preempted per second (vLLM num_preemptions_total, SGLang "
        "retracted requests): it ran out of KV-cache blocks, and each preempted request "
        "is recomputed. Steady preemptions are the kv_cache or preemption_recompute cause "
        "(alert PhasewatchEnginePreempting). A restart of the engine resets its counter; "
        "rate() counts that as no preemption, not as a drop.")


# Attainment tiles turn green at this share met (the rules' default target, slo_target
# in deploy/prometheus/generate_rules.py).
SLO_TARGET = 0.99


def slo_panels(lay: Layout) -> None:
    """Latency objectives (--slo): attainment per objective over the dashboard's range,
    goodput against the request rate, and the misses by the phase that broke them. The
    series exist only where the exporter runs with --slo."""
    slo, good = cat.SLO_REQUESTS.name, cat.SLO_GOOD_REQUESTS.name
    missed = cat.SLO_MISSED_REQUESTS.name
    attainment = (f'sum by ({BY}, objective) (increase({slo}{{{SEL},outcome="met"}}'
                  f"[$__range])) / sum by ({BY}, objective) (increase({slo}{{{SEL}}}"
                  "[$__range]))")
    tile = stat("Objective attainment", attainment, "percentunit",
                "Share of the requests in the dashboard's time range that met each latency "
                "objective set with --slo (met over met, missed and unknown: a request "
                "whose value could not be derived counts against it), as vLLM's overview "
                f"dashboard's SLO attainment tiles. Green from {SLO_TARGET:.0%}, the "
                "burn-rate alerts' default target (PhasewatchSLOBurn).",
                legend=who("{{objective}}"), decimals=2)
    tile["fieldConfig"]["defaults"]["thresholds"]["steps"] = [
        {"color": "red", "value": None}, {"color": "green", "value": SLO_TARGET}]
    tile["options"]["colorMode"] = "background"
    lay.add(tile, 8, 6)
    judged = f"max by ({BY}) (sum by ({BY}, objective) (increase({slo}{{{SEL}}}[$__range])))"
    lay.add(stat("Good requests", f"sum by ({BY}) (increase({good}{{{SEL}}}[$__range])) / "
                 f"on ({BY}) {judged}", "percentunit",
                 "Share of the requests in the dashboard's time range that met every "
                 "objective set (the good requests; their rate is goodput).", decimals=2),
            4, 6)
    lay.add(stat("Sampled traces", q(queries.KPIS["sampled_share"]), "percentunit",
                 "Where traces were sampled upstream (the tracestate's ot=th, or the "
                 "exporter's --trace-sample-ratio): the requests received over the requests "
                 "they stand for. Counts, rates and goodput are weighted by its inverse; the "
                 "latency distributions are the received requests'. No value: nothing was "
                 "sampled.", decimals=1), 4, 6)
    lay.add(timeseries("Goodput and request rate", [
        target(f"sum by ({BY}) (rate({good}{{{SEL}}}[{RANGE}]))", who("goodput"), "A"),
        target(q(queries.KPIS["request_rate"]), who("requests"), "B")], "reqps",
        "Goodput: requests per second that met every latency objective set (DistServe's "
        "definition; vllm bench serve --goodput), against all finished requests per "
        "second."), 8, 6)
    lay.add(timeseries("Objective misses by phase", [target(
        f"sum by ({BY}, objective, phase) (rate({missed}{{{SEL}}}[{RANGE}]))",
        who("{{objective}} {{phase}}"))], "reqps",
        "Requests per second that missed each objective, by the phase that took the largest "
        "part of the missed figure: of the TTFT (preprocess, queue, prefill, kv_transfer) "
        "for a TTFT miss, decode for a TPOT or ITL miss, any phase for an e2el miss. The "
        "burn-rate alerts name the largest.", stack=True, phases=True), 24, 7)


def replica_panels(lay: Layout) -> None:
    """Each replica (pod) of a label set side by side, from ``queries.REPLICAS``, the
    Dash app's Replicas panel: a table of every pod's figures with its TTFT p95 over the
    median of the replicas' (red from ``dashboard.replicas``'s ratio), each pod's verdict,
    and TTFT p95, queue share and requests/s per pod over time."""
    r = {name: q(expr) for name, expr in queries.REPLICAS.items()}
    rule = OUTLIER_RULES[0]
    against = (f"({r['ttft_p95']}) / on ({BY}) group_left () "
               f"quantile by ({BY}) (0.5, {r['ttft_p95']})")
    columns = [("A", r["request_rate"], "Requests/s", "reqps"),
               ("B", r["ttft_p50"], "TTFT p50", "s"), ("C", r["ttft_p95"], "TTFT p95", "s"),
               ("D", against, "TTFT p95 / median of the replicas", "none"),
               ("E", r["queue_share"], "Queue share", "percentunit"),
               ("F", r["kv_usage"], "KV cache", "percentunit")]
    overrides = column_overrides(columns)
    overrides[3]["properties"] += [
        {"id": "decimals", "value": 2},
        {"id": "custom.cellOptions", "value": {"type": "color-background"}},
        {"id": "thresholds", "value": {"mode": "absolute", "steps": [
            {"color": "transparent", "value": None}, {"color": "red", "value": rule.ratio}]}}]
    lay.add(merged_table(
        "Replicas", theme.CAPTIONS["replicas"] + " The ratio is against the median of all "
        "the replicas, itself included (PromQL has no median of the others): red from "
        f"{rule.ratio:g}x. The Dash dashboard compares each with the median of the others "
        "and says why.", columns, "pod", overrides), 16, 8)
    lay.add({"type": "table", "title": "Verdict per replica",
             "description": "The verdict each pod's exporter reports: a pod whose verdict "
                            "differs from the others' is the one to look at.",
             "targets": [target(r["verdict"], instant=True, table=True)],
             "transformations": [{"id": "organize", "options": {
                 "excludeByName": {"Time": True, "Value": True},
                 "indexByName": {"model": 0, "engine": 1, "source": 2, "pod": 3,
                                 "phase": 4, "resource": 5, "cause": 6}}}],
             "fieldConfig": {"defaults": {}, "overrides": []},
             "options": {"showHeader": True, "cellHeight": "sm"}}, 8, 8)
    for name, title, unit in (("ttft_p95", "TTFT p95 per replica", "s"),
                              ("queue_share", "Queue share per replica", "percentunit"),
                              ("request_rate", "Requests/s per replica", "reqps")):
        lay.add(timeseries(title, [target(r[name], who("{{pod}}"))], unit,
                           theme.CAPTIONS["replicas"]), 8, 7)


def gpu_panels(lay: Layout) -> None:
    """The GPUs' DRAM and tensor activity against the estimate's share of the same peaks
    (the estimate is the least the work needs: it should sit at or under the counter),
    their ratio, and what the counters say of the verdict."""
    for counter, family, words in (("dram", cat.ACTIVITY["dram_active"], "DRAM"),
                                   ("tensor", cat.ACTIVITY["tensor_active"], "tensor pipes")):
        lay.add(timeseries(f"GPU {words} active: counted and estimated", [
            target(f"avg by ({BY}) ({family.name}{{{SEL}}})", who("counted"), "A"),
            target(f'avg by ({BY}) ({cat.GPU_ESTIMATED.name}{{{SEL},counter="{counter}"}})',
                   who("estimated"), "B")], "percentunit",
            f"{family.help} Beside it, the estimate's share of the same peak over the "
            "same range: at most the counter when the configured model, dtype and GPU "
            "count are right (docs/verdict.md, \"The GPU's own counters\")."), 8, 8)
    lay.add(timeseries("Estimate over counted activity", [target(
        f"max by ({BY}, counter) ({cat.GPU_ESTIMATE_OVER_MEASURED.name}{{{SEL}}})",
        who("{{counter}}"))], "none",
        f"{cat.GPU_ESTIMATE_OVER_MEASURED.help} 1.1 and over: the verdict claims no "
        "resource and names the configuration to check."), 8, 8)


def lever_panels(lay: Layout) -> None:
    """The verdict's levers with their predicted effect (one row per setting and figure,
    now beside predicted), the step model's costs and its error on the steps it was
    fitted on (docs/verdict.md, "What pulling a lever would change")."""
    pred = cat.LEVER_PREDICTION.name
    by = f"{BY}, lever, setting, figure"
    columns = [("A", f'max by ({by}) ({pred}{{{SEL},when="now"}})', "Now", "none"),
               ("B", f'max by ({by}) ({pred}{{{SEL},when="predicted"}})', "Predicted", "none"),
               # the setting's reach beside each of its figures
               ("C", f"max by ({by}) (max by ({BY}, lever, setting) ("
                     f"{cat.LEVER_PREDICTION_REACH.name}{{{SEL}}}) * on ({BY}, lever, "
                     f'setting) group_right () (0 * {pred}{{{SEL},when="predicted"}} + 1))',
                "Past the fitted range (x)", "none")]
    table = merged_table(
        "If the lever is pulled (predicted)",
        f"{cat.LEVER_PREDICTION.help} A reach over 1 is an extrapolation past the batches "
        "and KV tokens the step model was fitted on. Predictions, not measurements.",
        columns, "lever", column_overrides(columns))
    table["transformations"][1]["options"]["indexByName"].update(setting=4, figure=5)
    lay.add(table, 24, 8)
    lay.add(timeseries("Step model: fitted costs", [target(
        f"max by ({BY}, term) ({cat.STEP_MODEL_COST.name}{{{SEL}}})", who("{{term}}"))],
        "s", cat.STEP_MODEL_COST.help), 12, 7)
    lay.add(timeseries("Step model: error on the steps it was fitted on", [target(
        f"max by ({BY}, quantile) ({cat.STEP_MODEL_ERROR.name}{{{SEL}}})",
        who("q{{quantile}}"))], "percentunit", cat.STEP_MODEL_ERROR.help), 12, 7)


def alert_states() -> dict:
    by = "alertname, model, engine, source, objective, regressed, quantile, severity"
    sel = 'alertname=~"Phasewatch.*",model=~"$model",source=~"$source"'
    expr = (f'2 * max by ({by}) (ALERTS{{{sel},alertstate="firing"}}) or '
            f'max by ({by}) (ALERTS{{{sel},alertstate="pending"}})')
    return {
        "type": "state-timeline", "title": "phasewatch alerts",
        "description": "The phasewatch alerting rules (deploy/prometheus) over time: yellow "
                       "pending, red firing. TTFT regressions say whether the queue or the "
                       "prefill regressed and, from an exporter run with --source-label, "
                       "whose TTFT: joined or tap (what clients see) or engine (its own); "
                       "PhasewatchSLOBurn names the --slo objective that burns its budget.",
        "targets": [target(expr, "{{alertname}} {{model}} {{source}} {{objective}} "
                                 "{{regressed}} {{quantile}} {{severity}}")],
        "fieldConfig": {"defaults": {
            "color": {"mode": "thresholds"},
            "thresholds": {"mode": "absolute", "steps": [
                {"color": "transparent", "value": None}, {"color": "yellow", "value": 1},
                {"color": "red", "value": 2}]},
            "mappings": [{"type": "value", "options": {
                "1": {"text": "pending", "index": 0}, "2": {"text": "firing", "index": 1}}}]},
            "overrides": []},
        "options": {"showValue": "never", "mergeValues": True, "rowHeight": 0.8,
                    "legend": {"showLegend": False}},
    }


def panels() -> list[dict]:
    k = {name: q(expr) for name, expr in queries.KPIS.items()}
    g = theme.GLOSSARY
    lay = Layout()

    lay.row("Verdict: which phase is the bottleneck, and why")
    lay.add({"type": "stat", "title": "Bottleneck",
             "description": "The exporter's verdict per model: the phase that dominates request "
                            "time and the resource limiting it. The value is how many pods "
                            "report it. Phase ttft: from the client's view (a stream tap's "
                            "records, no engine spans), time to first token undivided "
                            "(preprocess, queue and prefill); a second line says so.",
             "targets": [target(q(queries.VERDICT_VOTES),
                                who("({{engine}}): {{phase}} bound by {{resource}}"),
                                instant=True),
                         target(q(queries.CLIENT_VIEW),
                                who("({{engine}}): from the client's view (no engine spans)"),
                                ref="B", instant=True)],
             "fieldConfig": {"defaults": {"unit": "none", "decimals": 0,
                                          "color": {"mode": "fixed", "fixedColor": "text"}},
                             "overrides": []},
             "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "",
                                           "values": False},
                         "textMode": "name", "colorMode": "none", "graphMode": "none",
                         "justifyMode": "auto"}}, 10, 5)
    lay.add({"type": "bargauge", "title": "Share of request time per phase",
             "description": "Each phase's summed time over all of them (preprocess, queue, "
                            "prefill, kv_transfer, decode). Preprocess shows where the server "
                            "says when its engine took the request in (vLLM, TGI, SGLang); "
                            "elsewhere it is inside the queue. kv_transfer: disaggregated "
                            "prefill/decode only (SGLang).",
             "targets": [target(q(queries.PHASE_SHARE), who("{{phase}}"), instant=True)],
             "fieldConfig": {"defaults": {"unit": "percentunit", "min": 0, "max": 1},
                             "overrides": phase_overrides()},
             "options": {"orientation": "horizontal", "displayMode": "basic",
                         "reduceOptions": {"calcs": ["lastNotNull"], "fields": "",
                                           "values": False}}}, 7, 5)
    lay.add({"type": "text", "title": "Levers by verdict",
             "options": {"mode": "markdown", "content": levers_text()}}, 7, 5)
    for name, title, unit, desc in (
            ("ttft_p95", "TTFT p95", "s", g["TTFT"]), ("ttft_p50", "TTFT p50", "s", g["TTFT"]),
            ("itl_p95", "ITL p95 (pooled gaps)", "s", g["ITL"]),
            ("tpot_p50", "TPOT p50 (per request)", "s", g["TPOT"]),
            ("request_rate", "Requests/s", "reqps", "Finished requests per second."),
            ("output_tokens_per_second", "Output tokens/s", "none", "Generated tokens/s."),
            ("mbu", "Decode MBU", "percentunit", g["MBU"]),
            ("mfu", "Prefill MFU", "percentunit", g["MFU"])):
        lay.add(stat(title, k[name], unit, desc), 3, 4)
    lay.add(cause_table(), 8, 7)
    lay.add(engine_state(), 8, 7)
    lay.add(preemptions(), 8, 7)

    lay.row("Latency split by phase")
    ttft = [target(k["ttft_p50"], who("p50"), "A"),
            target(k["ttft_p95"], who("p95"), "B")]
    lay.add(timeseries("TTFT", ttft, "s", g["TTFT"]), 12, 8)
    phase_mean = (f"sum by ({BY}, phase) (rate({cat.PHASE_DURATION.name}_sum"
                  f"{{{SEL}}}[{RANGE}])) / sum by ({BY}, phase) "
                  f"(rate({cat.PHASE_DURATION.name}_count{{{SEL}}}[{RANGE}]))")
    lay.add(timeseries("Mean request: seconds in each phase", [target(
        phase_mean, who("{{phase}}"))], "s",
        "Mean time a request spends in preprocess (the API server's templating, tokenisation "
        "and hand-off), the engine's queue, prefill, the KV transfer of a disaggregated "
        "request, and decode. TTFT = preprocess + queue + prefill (+ kv_transfer): this says "
        "which of them moved.", stack=True, phases=True), 12, 8)
    tokens = [target(k["itl_p50"], who("ITL p50"), "A"),
              target(k["itl_p95"], who("ITL p95"), "B"),
              target(k["tpot_p50"], who("TPOT p50"), "C"),
              target(k["tpot_p95"], who("TPOT p95"), "D")]
    lay.add(timeseries("Token latency: ITL (pooled gaps) and TPOT (per request)", tokens, "s",
                       f"{g['ITL']} {g['TPOT']}"), 12, 8)
    lay.add(timeseries("Phase share of request time", [target(
        q(queries.PHASE_SHARE), who("{{phase}}"))], "percentunit",
        "Share of summed request time in each phase.", stack=True, phases=True), 12, 8)
    lay.add(timeseries("End-to-end latency", [
        target(k["e2e_p50"], who("p50"), "A"), target(k["e2e_p95"], who("p95"), "B")],
        "s", g["e2e"]), 12, 8)
    lay.add(timeseries("Tokens/s", [
        target(k["prompt_tokens_per_second"], who("prompt"), "A"),
        target(k["output_tokens_per_second"], who("output"), "B")], "none",
        "Prompt tokens read and output tokens generated per second."), 12, 8)

    lay.row("Replicas: each pod side by side")
    replica_panels(lay)

    lay.row("Latency objectives (--slo): attainment, goodput, misses by phase")
    slo_panels(lay)

    lay.row("Roofline: achieved bandwidth and FLOP/s against the hardware")
    util_by = f"avg by ({BY}, phase)"
    lay.add(timeseries("Bandwidth utilization (MBU)", [target(
        f"{util_by} ({cat.BANDWIDTH_UTILIZATION.name}{{{SEL}}})", who("{{phase}}"))],
        "percentunit", g["MBU"], phases=True), 8, 8)
    lay.add(timeseries("FLOPs utilization (MFU)", [target(
        f"{util_by} ({cat.FLOPS_UTILIZATION.name}{{{SEL}}})", who("{{phase}}"))],
        "percentunit", g["MFU"], phases=True), 8, 8)
    ridge = (f'max by ({BY}) ({cat.PEAK_FLOPS.name}{{{SEL},'
             f'ceiling="datasheet"}}) / max by ({BY}) '
             f'({cat.PEAK_BANDWIDTH.name}{{{SEL},ceiling="datasheet"}})')
    lay.add(timeseries("Arithmetic intensity against the ridge", [
        target(q(queries.INTENSITY), who("{{phase}}"), "A"),
        target(ridge, who("ridge"), "B")], "none",
        g["arithmetic intensity"], log=True, phases=True), 8, 8)
    lay.add(roofline_table(), 24, 7)
    lay.add(timeseries("Decode batch size", [target(k["decode_batch_size"], who())],
                       "none", g["decode batch"]), 12, 7)
    lay.add(timeseries("Achieved memory bandwidth", [target(
        f"{util_by} ({cat.ACHIEVED_BANDWIDTH.name}{{{SEL}}})",
        who("{{phase}}"))], "Bps", "Bytes per second each phase moves, per replica.",
        phases=True), 12, 7)

    lay.row("The GPU's own counters beside the estimate (--gpu-metrics-url, --gpu-nvml)")
    gpu_panels(lay)

    lay.row("Levers: what pulling each would change (predicted from the step model)")
    lever_panels(lay)

    lay.row("TTFT against prompt length")
    by_class = [target(q(queries.PROMPT_CLASS["ttft_p50"]), who("{{prompt_class}} p50"), "A"),
                target(q(queries.PROMPT_CLASS["ttft_p95"]), who("{{prompt_class}} p95"),
                       "B")]
    lay.add(timeseries("TTFT by prompt-length class", by_class, "s",
                       theme.CAPTIONS["prompt-ttft"]), 12, 8)
    per_token = (f"sum by ({BY}) (rate({cat.PREFILL_SECONDS_PER_TOKEN.name}_sum"
                 f"{{{SEL}}}[{RANGE}])) / sum by ({BY}) "
                 f"(rate({cat.PREFILL_SECONDS_PER_TOKEN.name}_count{{{SEL}}}[{RANGE}]))")
    lay.add(timeseries("Prefill seconds per prompt token", [target(per_token, who())], "s",
                       "Prefill time over uncached prompt tokens: TTFT normalised for prompt "
                       "length. Longer prompts leave it flat; a slower prefill raises it. "
                       "The TTFT regression alert needs this (or the queue) to rise."), 12, 8)
    lay.add({"type": "bargauge", "title": "Requests by prompt-length class",
             "description": "Requests in the dashboard's time range per prompt-length class.",
             "targets": [target(q(queries.PROMPT_CLASS["count"]).replace(RANGE, "$__range"),
                                who("{{prompt_class}}"), instant=True)],
             "fieldConfig": {"defaults": {"unit": "none", "decimals": 0}, "overrides": []},
             "options": {"orientation": "horizontal", "displayMode": "basic",
                         "reduceOptions": {"calcs": ["lastNotNull"], "fields": "",
                                           "values": False}}}, 24, 6)

    lay.row("Alerts and the exporter itself")
    lay.add(alert_states(), 24, 7)
    ingest = [target(f"sum by (protocol) (rate({cat.INGEST_ACCEPTED.name}"
                     f"{{{EXPORTER_SEL}}}[{RANGE}]))", "accepted {{protocol}}", "A"),
              target(f"sum by (reason) (rate({cat.INGEST_REJECTED.name}"
                     f"{{{EXPORTER_SEL}}}[{RANGE}])) or label_replace(vector(0), "
                     f'"reason", "none", "", "")', "rejected {{reason}}", "B")]
    lay.add(timeseries("Ingest: accepted and rejected requests/s", ingest, "reqps",
                       "Requests the exporter accepted per protocol, and rejections by "
                       "reason (a steady 'none' line at 0 when nothing is rejected)."), 12, 7)
    lay.add(timeseries("Exporter memory", [target(
        f"process_resident_memory_bytes{{{EXPORTER_SEL}}}", "{{instance}} {{pod}}")], "bytes",
        "Resident memory of each phasewatch exporter."), 12, 7)
    return lay.panels


def variable(name: str, label: str, query: str, hide: int = 0) -> dict:
    return {"type": "query", "name": name, "label": label, "datasource": DATASOURCE,
            "definition": query, "query": {"qryType": 1, "query": query,
                                           "refId": "PrometheusVariableQueryEditor"},
            "refresh": 2, "multi": True, "includeAll": True, "allValue": ".*",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
            "sort": 1, "hide": hide, "options": [], "regex": ""}


def dashboard() -> dict:
    return {
        "uid": UID, "title": "phasewatch: LLM serving by phase",
        "description": "Queue, prefill and decode of every request; TTFT/ITL/TPOT; achieved "
                       "bandwidth and FLOP/s against the roofline; the bottleneck verdict. "
                       "Generated by grafana/generate.py.",
        "tags": ["phasewatch", "llm", "vllm", "tgi", "sglang"],
        "editable": True, "graphTooltip": 1, "schemaVersion": 39, "version": 1,
        "time": {"from": "now-1h", "to": "now"}, "refresh": "10s",
        "timepicker": {}, "timezone": "", "fiscalYearStartMonth": 0, "liveNow": False,
        "links": [], "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
            "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
            "name": "Annotations & Alerts", "type": "dashboard"}]},
        "templating": {"list": [
            {"type": "datasource", "name": "datasource", "label": "Prometheus",
             "query": "prometheus", "current": {}, "hide": 0, "refresh": 1, "regex": "",
             "options": []},
            variable("model", "model", f"label_values({cat.REQUESTS.name}, model)"),
            variable("engine", "engine",
                     f'label_values({cat.REQUESTS.name}{{model=~"$model"}}, engine)'),
            # engine, tap or joined; none (All = .*) from an exporter without --source-label
            variable("source", "source", f'label_values({cat.REQUESTS.name}{{'
                                         'model=~"$model",engine=~"$engine"}, source)'),
            variable("pod", "pod", f'label_values({cat.REQUESTS.name}{{model=~"$model",'
                                   'engine=~"$engine"}, pod)'),
            variable("job", "exporter job", f"label_values({cat.INGEST_REQUESTS.name}, job)",
                     hide=0)]},
        "panels": panels(),
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def expressions(doc: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every panel target in a dashboard document."""
    out = []
    for panel in doc["panels"]:
        for p in [panel, *panel.get("panels", [])]:
            for t in p.get("targets", []):
                out.append((p["title"], t["expr"]))
    return out


def variable_queries(doc: dict) -> list[tuple[str, str]]:
    """(variable, PromQL) for each ``label_values(selector, label)`` variable, as the
    series query Grafana makes of it."""
    out = []
    for v in doc["templating"]["list"]:
        if v["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\((.+), (\w+)\)", v["definition"])
        if not m:
            raise ValueError(f"variable {v['name']}: not a label_values() query")
        out.append((v["name"], f"count by ({m[2]}) ({m[1]})"))
    return out


def substitute(expr: str, values: dict[str, str]) -> str:
    """Fill Grafana's variables (longest names first, so $__rate_interval wins)."""
    for name in sorted(values, key=len, reverse=True):
        expr = expr.replace(name, values[name])
    return expr


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="fail if the JSON is stale")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"stale: {OUT}; run python grafana/generate.py")
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(HERE.parent)}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    sys.exit(main())
