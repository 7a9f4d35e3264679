"""The Grafana dashboard JSON: fresh from its generator, and importable as Grafana expects
(datasource variable, model/engine/source/pod variables, a sound grid), with every request
panel split by ``source``. Its PromQL is run against a real Prometheus in
test_alerts_e2e.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import yaml

from tests.support import ROOT

GRAFANA = ROOT / "grafana"
DOC = json.loads((GRAFANA / "dashboards" / "phasewatch.json").read_text())


def test_dashboard_json_is_fresh():
    r = subprocess.run([sys.executable, str(GRAFANA / "generate.py"), "--check"],
                       capture_output=True, text=True, cwd=GRAFANA.parent)
    assert r.returncode == 0, r.stdout + r.stderr


def test_datasource_and_selection_are_variables():
    variables = {v["name"]: v for v in DOC["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("model", "engine", "source", "pod"):
        assert variables[name]["multi"] and variables[name]["includeAll"]
        assert variables[name]["allValue"] == ".*"
    panels = [p for p in DOC["panels"] if p["type"] not in ("row", "text")]
    for p in panels:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}"
            assert "[$__rate_interval]" in t["expr"] or "[" not in t["expr"] \
                or "[$__range]" in t["expr"], (p["title"], t["expr"])
    selected = [p["title"] for p in panels
                if all('model=~"$model"' in t["expr"] for t in p["targets"])]
    assert len(selected) >= len(panels) - 2  # all but the exporter's own health panels


def test_request_panels_select_and_split_by_source():
    """With --source-label the exporter labels series source=engine/tap/joined: every
    request panel selects $source and keeps source in each aggregation and legend, so a
    tap's client-visible TTFT is never pooled with an engine-only one. All (.*) also
    matches series without the label (an exporter without --source-label)."""
    variables = {v["name"]: v for v in DOC["templating"]["list"]}
    assert variables["source"]["definition"] == (
        'label_values(phasewatch_requests_total{model=~"$model",engine=~"$engine"}, source)')
    assert re.fullmatch(variables["source"]["allValue"], "")  # matches an absent label
    checked = 0
    for panel in DOC["panels"]:
        for t in panel.get("targets", []):
            if 'model=~"$model"' not in t["expr"]:
                continue  # the exporter's own health
            checked += 1
            where = (panel["title"], t["expr"])
            assert t["expr"].count('source=~"$source"') == t["expr"].count('model=~"$model"'), \
                where
            for clause in re.findall(r"\b(?:by|on) \(([^)]*)\)", t["expr"]):
                assert "source" in [x.strip() for x in clause.split(",")], (clause, where)
            assert "{{source}}" in t["legendFormat"] or t.get("format") == "table", where
    assert checked >= 30


def test_grid_has_unique_ids_and_no_overlaps():
    ids = [p["id"] for p in DOC["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for p in DOC["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps at {(x, y)}"
                cells.add((x, y))


def test_the_issue_s_views_are_there():
    titles = {p["title"] for p in DOC["panels"]}
    for title in ("Bottleneck", "TTFT", "Mean request: seconds in each phase",
                  "Token latency: ITL (pooled gaps) and TPOT (per request)",
                  "Bandwidth utilization (MBU)", "FLOPs utilization (MFU)",
                  "Roofline operating points", "TTFT by prompt-length class",
                  "Prefill seconds per prompt token", "phasewatch alerts", "Cause",
                  "Engine: KV-cache usage and requests", "Engine preemptions/s",
                  "Objective attainment", "Good requests", "Goodput and request rate",
                  "Objective misses by phase", "Replicas", "Verdict per replica",
                  "TTFT p95 per replica", "Queue share per replica", "Sampled traces"):
        assert title in titles


def test_the_replicas_row_shows_each_pod_side_by_side():
    """Issue 29: every pod of a label set in one table, from the Dash app's per-replica
    queries, its TTFT p95 over the replicas' median turning red at the Dash rule's ratio."""
    from phasewatch.dashboard import queries
    from phasewatch.dashboard.replicas import OUTLIER_RULES

    (table,) = [p for p in DOC["panels"] if p["title"] == "Replicas"]
    exprs = [t["expr"] for t in table["targets"]]
    for name in ("request_rate", "ttft_p50", "ttft_p95", "queue_share", "kv_usage"):
        rendered = queries.render(queries.REPLICAS[name], 'model=~"$model",engine=~"$engine",'
                                  'source=~"$source",pod=~"$pod"', "$__rate_interval")
        assert rendered in exprs, name
    assert all("by (model, engine, source, pod)" in e for e in exprs)
    (ratio,) = [o for o in table["fieldConfig"]["overrides"]
                if {"id": "displayName", "value": "TTFT p95 / median of the replicas"}
                in o["properties"]]
    (steps,) = [p["value"]["steps"] for p in ratio["properties"] if p["id"] == "thresholds"]
    assert steps[-1] == {"color": "red", "value": OUTLIER_RULES[0].ratio}


def test_provisioning_points_at_the_dashboard_and_the_datasource():
    ds = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "phasewatch.yml")
                        .read_text())
    assert ds["datasources"][0]["type"] == "prometheus"
    dash = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "phasewatch.yml")
                          .read_text())
    (provider,) = dash["providers"]
    assert provider["type"] == "file" and provider["options"]["path"].startswith("/")
