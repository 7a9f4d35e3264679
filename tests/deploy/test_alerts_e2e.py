"""The TTFT-regression alert end to end, with a real Prometheus evaluating the rule files.

Two models are simulated side by side for a baseline, each into its own exporter
behind one Prometheus, then:
- Llama-3.1-8B's prefill gets 3x slower per token (the GPU reaches a third of the
  FLOP/s it did): the alert must reach ``firing`` with ``regressed="prefill"``;
- Qwen2.5-7B's prompts get 3x longer at the same prefill speed: TTFT rises as
  much, but the alert must stay inactive.
Llama's exporter runs with --source-label (its series, and so its alert, carry
``source="engine"``), Qwen's without (no source label anywhere): the rules and the
dashboard must serve both at once, as during a rollout. Each exporter also scrapes
its engine's /metrics (a vLLM page for Llama, an SGLang one for Qwen, served by the
test): the engine-state alerts and panels read what it republishes.
The rules are the generator's, with the baseline offset scaled from a day/week to
40 s and the rate window to 20 s by its parameters (no hand edits). Afterwards,
every expression of the Grafana dashboard and of the rules is run against that
Prometheus and must parse and return data.

Both exporters judge requests against latency objectives (--slo ``SLO``): a TTFT
objective Llama's slower prefill breaks (Qwen's longer prompts too: an objective burns
whatever the cause), so the burn-rate alert of the objectives (PhasewatchSLOBurn) pages
and its description, a query the template runs, names the prefill; and a TPOT objective
both meet.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest

from phasewatch.app import Exporter
from phasewatch.client import PhasewatchClient
from phasewatch.config import ServeConfig
from phasewatch.roofline.deployments import ModelOptions
from phasewatch.sim.engine import EngineConfig
from phasewatch.sim.scenarios import Scenario
from phasewatch.sim.workload import Lengths, Workload
from tests.conftest import TEST_PORTS
from tests.roofline.test_engine_metrics import Pages
from tests.roofline.test_gpu_e2e import GPU_PANELS
from tests.support import ROOT
from tests.support.prom import PrometheusServer

sys.path.insert(0, str(ROOT / "deploy" / "prometheus"))
sys.path.insert(0, str(ROOT / "grafana"))
import generate as grafana
import generate_rules

WINDOW, OFFSET = "20s", "40s"
BASELINE_S = 50.0  # long enough for one full window at the offset
SETTLED_S = 75.0  # the current window [t-20, t] is all changed traffic from t = 70
DEADLINE_S = 88.0  # the baseline window [t-60, t-40] leaves the baseline phase at t = 90
PARAMS = generate_rules.Params(baseline_offsets=(OFFSET,), rate_window=WINDOW,
                               regression_for="5s", min_request_rate=0.5)
PROMPTS = Lengths(2000, 0.3, 500, 8000)
# ms. The simulated TTFT: p50 ~43 ms, p95 ~65 ms at the baseline; ~120 ms, three in four
# over 100 ms, with the prefill 3x slower (or the prompts 3x longer). TPOT: under 7 ms.
SLO = "ttft:100,tpot:50"
# One user in a closed loop, and a token budget that takes any prompt in one step: no
# two prefills ever share a step, so longer prompts really keep their prefill speed
# per token, as the scenario says. (With Poisson arrivals and ~25 requests per 20 s
# window, a clump of long prompts sharing steps raises the window's mean prefill
# time per token by a third: a real slowdown the rule would rightly report.)
ENGINE = EngineConfig(flops_efficiency=0.8, max_batched_tokens=32768)
BASE = Scenario("alert-base", "prefill-heavy, one user", Workload(
    PROMPTS, Lengths(16, 0.3, 2, 64), concurrency=1), ENGINE)
SLOWER_PREFILL = replace(BASE, engine=replace(ENGINE, flops_efficiency=0.8 / 3))
LONGER_PROMPTS = replace(BASE, workload=replace(BASE.workload, prompt=Lengths(6000, 0.3, 1500,
                                                                              24000)))


# What each engine's /metrics says, every scrape: one request running, none waiting, the
# KV cache nearly empty and no preemption (the engine-state alerts stay silent; their
# firing is promtool's to test: deploy/prometheus/tests/engine-state.test.yml).
ENGINE_PAGES = {
    "vllm": """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Llama-3.1-8B"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Llama-3.1-8B"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Llama-3.1-8B"} 0.05
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="Llama-3.1-8B"} 0.0
""",
    "sglang": """\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="Qwen2.5-7B",tp_rank="0"} 1.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="Qwen2.5-7B",tp_rank="0"} 0.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="Qwen2.5-7B",tp_rank="0"} 0.05
# TYPE sglang:num_retracted_requests counter
sglang:num_retracted_requests_total{model_name="Qwen2.5-7B",tp_rank="0"} 0.0
""",
}
ENGINE_SCRAPES = 1000  # pages each engine serves: one a second for the whole run, and more
# Published only while an achieved rate is over its ceiling (a ceiling that is wrong):
# no data here is right; engine-state.test.yml covers its alert.
ONLY_WHEN_WRONG = {"phasewatch_roofline_ceiling_exceeded_ratio"}


def _feed(port: int, model: str, engine: str, changed: Scenario, t0: float,
          stop: threading.Event) -> None:
    client = PhasewatchClient(f"127.0.0.1:{port}", engine=engine)
    try:
        for i, (scenario, until) in enumerate(((BASE, t0 + BASELINE_S),
                                               (changed, t0 + DEADLINE_S + 30))):
            sim = scenario.build(seed=7 + i, model=model, name=f"{engine}-{i}")
            sim.run(until - time.time(), on_finish=client.record_request, time_scale=1.0,
                    should_stop=lambda until=until: stop.is_set() or time.time() >= until)
    finally:
        client.close(timeout=2)


def _alerts(prom: PrometheusServer) -> list[dict]:
    return [a for a in prom.api("alerts")["alerts"]
            if a["labels"]["alertname"] == "PhasewatchTTFTRegression"]


def _run(prom: PrometheusServer, expr: str) -> tuple[str | None, list]:
    """(error, result) of an instant query; a parse error is Prometheus's 400 body."""
    url = f"{prom.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return None, json.load(r)["data"]["result"]
    except urllib.error.HTTPError as e:
        return json.load(e).get("error", str(e)), []


def _models(engine_of: str, url: str) -> tuple[ModelOptions, ...]:
    """Both models on an H100, ``engine_of``'s engine scraped at ``url``."""
    return tuple(ModelOptions(model=m, hardware="H100-SXM",
                              engine_metrics_url=url if m == engine_of else "")
                 for m in ("Llama-3.1-8B", "Qwen2.5-7B"))


@pytest.fixture(scope="module")
def fired(tmp_path_factory):
    """Run the scenario once; yield the Prometheus (still up, the alert still firing),
    the rule files and what the alert polling saw."""
    tmp = tmp_path_factory.mktemp("alerts")
    rules = generate_rules.write(PARAMS, tmp / "rules")
    engines = {name: Pages([page] * ENGINE_SCRAPES) for name, page in ENGINE_PAGES.items()}
    config = ServeConfig(**TEST_PORTS, window_seconds=20.0, roofline_interval=1.0, slo=SLO)
    try:
        with Exporter(replace(config, source_label=True, models=_models(
                "Llama-3.1-8B", engines["vllm"].url))) as llama, Exporter(replace(
                config, models=_models("Qwen2.5-7B", engines["sglang"].url))) as qwen:
            pods = {f"127.0.0.1:{llama.http_port}": {"pod": "llm-0"},
                    f"127.0.0.1:{qwen.http_port}": {"pod": "llm-1"}}
            with PrometheusServer(
                    tmp, list(pods), rule_files=rules, target_labels=pods,
                    # as a current Prometheus is run: quantiles from the native histograms
                    # (promtool's rule tests cover the classic fallback)
                    native_histograms=True) as prom:
                yield from _scenario(prom, rules, llama, qwen)
    finally:
        for pages in engines.values():
            pages.close()


def _scenario(prom: PrometheusServer, rules: list[Path], llama: Exporter, qwen: Exporter):
    """Feed both models (Llama into the --source-label exporter) and watch the alerts."""
    stop = threading.Event()
    t0 = time.time()
    feeders = [threading.Thread(target=_feed, daemon=True,
                                args=(ex.grpc_port, model, engine, changed, t0, stop))
               for ex, model, engine, changed in (
                   (llama, "Llama-3.1-8B", "vllm", SLOWER_PREFILL),
                   (qwen, "Qwen2.5-7B", "sglang", LONGER_PROMPTS))]
    for f in feeders:
        f.start()
    # One request a sender's clock got wrong: rejected, and counted as such.
    bad = PhasewatchClient(f"127.0.0.1:{llama.grpc_port}", engine="vllm")
    bad.record("Llama-3.1-8B", arrival=t0, first_token=t0 - 1, last_token=t0 + 1,
               finish=t0 + 1, prompt_tokens=10, output_tokens=2)
    bad.close(timeout=5)
    seen: list[dict] = []
    firing, fired_at = None, None
    try:
        # Watch until the regression fires and the windows hold only changed
        # traffic (so Qwen is seen silent through a whole window of longer prompts).
        while time.time() < t0 + DEADLINE_S and (firing is None
                                                 or time.time() < t0 + SETTLED_S):
            time.sleep(1)
            alerts = _alerts(prom)
            seen += alerts
            if firing is None:
                firing = next((a for a in alerts if a["state"] == "firing"), None)
                fired_at = time.time() - t0 if firing else None
        yield prom, rules, firing, seen, fired_at
    finally:
        stop.set()
        for f in feeders:
            f.join(10)


def test_slower_prefill_fires_and_longer_prompts_do_not(fired):
    prom, _, firing, seen, fired_at = fired
    summary = sorted({(a["labels"]["model"], a["labels"]["regressed"], a["labels"]["quantile"],
                       a["state"]) for a in seen})
    assert firing is not None, f"no firing TTFT regression in {DEADLINE_S:.0f} s; saw {summary}"
    assert firing["labels"]["model"] == "Llama-3.1-8B"
    assert firing["labels"]["regressed"] == "prefill", summary
    assert "Prefill is slower per prompt token" in firing["annotations"]["description"]
    # Its exporter labels sources: the alert says whose TTFT regressed.
    assert firing["labels"]["source"] == "engine", firing["labels"]
    assert firing["annotations"]["summary"].startswith(
        f"TTFT {firing['labels']['quantile']} of Llama-3.1-8B (engine) regressed")
    # Longer prompts at the same prefill speed: never even pending.
    assert not [a for a in seen if a["labels"]["model"] == "Qwen2.5-7B"], summary
    # ... though its TTFT rose as much as Llama's: only the cause tells them apart.
    # Qwen's exporter has no --source-label: its recording rules carry no source.
    rates = {m["metric"]["model"]: m["metric"] for m in prom.query(
        f"phasewatch:requests:rate_{WINDOW}")}
    assert rates["Llama-3.1-8B"]["source"] == "engine" and "source" not in rates["Qwen2.5-7B"]
    ratios = {}
    for series in ("ttft_seconds:mean", "ttft_seconds:p50", "ttft_seconds:p95",
                   "prefill_seconds_per_token:mean", "queue_seconds:mean"):
        name = f"phasewatch:{series}_{WINDOW}"
        for m in prom.query(f"{name} / {name}:baseline"):
            ratios.setdefault(m["metric"]["model"], {})[series] = round(float(m["value"][1]), 2)
    print(f"firing {fired_at - BASELINE_S:.0f} s after the change; now/baseline at "
          f"{SETTLED_S - BASELINE_S:.0f} s: {ratios}")
    assert ratios["Qwen2.5-7B"]["ttft_seconds:mean"] > 2 * PARAMS.ttft_factor, ratios
    assert ratios["Qwen2.5-7B"]["prefill_seconds_per_token:mean"] < PARAMS.prefill_factor, ratios


def test_the_objective_s_burn_pages_and_names_the_phase(fired):
    """Llama's prefill 3x slower: its TTFT objective's misses page, and the description
    names the phase that took most of them; its TPOT objective never burns."""
    prom, *_ = fired
    burns = [a for a in prom.api("alerts")["alerts"]
             if a["labels"]["alertname"] == "PhasewatchSLOBurn"
             and a["labels"]["model"] == "Llama-3.1-8B"]
    pages = [a for a in burns if a["labels"]["objective"] == "ttft"
             and a["labels"]["severity"] == "page" and a["state"] == "firing"]
    assert pages, burns
    for a in pages:
        assert a["labels"]["source"] == "engine", a
        assert "missed their TTFT objective" in a["annotations"]["description"], a
        assert re.search(r"\d+(\.\d+)?% of the TTFT misses over the last \w+ spent most of "
                         r"their time in the prefill phase\.$", a["annotations"]["description"]), a
    assert not [a for a in burns if a["labels"]["objective"] == "tpot"], burns


def test_every_rule_evaluates_and_every_series_it_reads_has_data(fired):
    prom, rule_files, *_ = fired
    groups = prom.api("rules")["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) == sum(len(g["rules"]) for f in rule_files
                             for g in generate_rules.yaml.safe_load(f.read_text())["groups"])
    unhealthy = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
    assert not unhealthy, unhealthy
    # The engines' pages say: KV cache at 5 %, no preemption. Their alerts stay silent.
    engine_alerts = {r["name"]: r["state"] for g in groups if g["name"] == "phasewatch-engine"
                     for r in g["rules"]}
    assert engine_alerts and set(engine_alerts.values()) == {"inactive"}, engine_alerts
    assert {m["metric"]["model"]: float(m["value"][1]) for m in prom.query(
        "phasewatch_engine_kv_cache_usage_ratio")} == {"Llama-3.1-8B": 0.05, "Qwen2.5-7B": 0.05}
    empty = []
    for r in rules:
        if r["type"] == "recording":
            _, result = _run(prom, r["name"])
            if not result:
                empty.append(r["name"])
        # Every series an alert reads exists, so none is silently comparing nothing.
        for name in set(re.findall(r"\b(?:phasewatch[:_][\w:]*|gen_ai_\w+|up)\b", r["query"])
                        ) - ONLY_WHEN_WRONG:
            error, result = _run(prom, f"count({name})")
            if error or not result:
                empty.append(f"{name} (in {r['name']})")
    assert not empty, f"no data: {empty}"


def test_the_shipped_rules_parse_against_prometheus(fired):
    prom, *_ = fired
    for path in sorted((ROOT / "deploy" / "prometheus" / "rules").glob("*.yml")):
        for group in generate_rules.yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                error, _ = _run(prom, rule["expr"])
                assert error is None, f"{path.name} {rule.get('record') or rule['alert']}: {error}"


# Panels with data only where something happens that this scenario does not do; each
# must still parse here, and returns data in the test named.
ONLY_WHERE = {
    **{title: "GPU counters read (--gpu-metrics-url): tests/roofline/test_gpu_e2e.py::"
              "test_grafanas_gpu_panels_and_the_dashboard_through_a_real_prometheus"
       for title in GPU_PANELS},
    "Sampled traces": "traces sampled upstream: tests/ingest/test_otlp_sampling.py::"
                      "test_the_sampled_share_through_prometheus_on_the_dashboard_and_"
                      "grafanas_panel",
}
# expressions with data only where something is (by a piece of the expression): the
# client's-view line of the Bottleneck stat, where a tap's records are all there is
ONLY_WHERE_EXPR = {
    'origin="client_view"': "a tap's records alone: tests/roofline/test_client_view.py::"
                            "test_grafanas_bottleneck_says_client_view_through_a_real_"
                            "prometheus",
}


def _only_where(title: str, expr: str) -> bool:
    return title in ONLY_WHERE or any(k in expr for k in ONLY_WHERE_EXPR)


def test_every_grafana_expression_parses_and_returns_data(fired):
    prom, *_ = fired
    doc = json.loads(grafana.OUT.read_text())
    values = {"$__rate_interval": WINDOW, "$__range": "5m", "$model": ".*", "$engine": ".*",
              "$source": ".*", "$pod": ".*", "$job": ".*"}
    checked, problems = 0, []
    for title, expr in grafana.expressions(doc) + grafana.variable_queries(doc):
        filled = grafana.substitute(expr, values)
        assert "$" not in filled, f"{title}: unfilled variable in {filled}"
        error, result = _run(prom, filled)
        checked += 1
        if error or (not result and not _only_where(title, expr)):
            problems.append(f"{title}: {error or 'no data'}: {filled}")
    # One model selected, as a user narrows the dashboard: the panels still have data,
    # from an exporter without a source label (All sources, .*, matches the absent label)
    # and from one with it (its one source picked).
    for model, pod, source in (("Qwen2\\\\.5-7B", "llm-1", ".*"),
                               ("Llama-3\\\\.1-8B", "llm-0", "engine")):
        values.update({"$model": model, "$pod": pod, "$source": source})
        for title, expr in grafana.expressions(doc):
            if (("ALERTS" in expr and model.startswith("Qwen"))  # Qwen has no alert, rightly
                    or _only_where(title, expr)):
                continue
            error, result = _run(prom, grafana.substitute(expr, values))
            if error or not result:
                problems.append(f"{title} ({model}, source {source}): {error or 'no data'}")
    assert checked >= 40 and not problems, "\n".join(problems)
