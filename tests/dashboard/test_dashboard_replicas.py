"""The Replicas panel (issue 29): with two pods or more, the dashboard shows each one side
by side and picks out the one that differs from the rest, saying why.

Unit tests on Prometheus's answers to ``queries.REPLICAS`` as recorded from the real run
below (tests/fixtures/prometheus/replicas-one-overloaded.json): the overloaded pod named,
no pod named among identical ones, no panel for one pod; the rule's margins and minimum
traffic. Then the real thing: three exporters (pods) behind Debian's Prometheus, one
overloaded, in a headless Chromium at the widths people use."""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace

import pytest

from phasewatch.app import Exporter
from phasewatch.client import PhasewatchClient
from phasewatch.config import ServeConfig
from phasewatch.dashboard import replicas as rp
from phasewatch.dashboard.app import DashboardServer, create_app, replica_outputs
from phasewatch.dashboard.frames import REPLICA_COLUMNS, Snapshot, frame
from phasewatch.dashboard.prometheus_source import PrometheusSource
from phasewatch.dashboard.replica_panel import replica_tables, rule_text
from phasewatch.roofline.deployments import ModelOptions
from phasewatch.sim.scenarios import scenario
from tests.conftest import TEST_PORTS, component_text
from tests.support import FIXTURES

RECORDED = FIXTURES / "prometheus" / "replicas-one-overloaded.json"
PODS = ("vllm-0", "vllm-1", "vllm-2")
OVERLOADED = "vllm-2"


def _key(metric: dict, pod: bool = False) -> dict:
    """As PrometheusSource names a series' label set."""
    return {"model": metric.get("model", ""), "engine": metric.get("engine", ""),
            "pod": metric.get("pod", "") if pod else "", "source": metric.get("source", "")}


def _answers(recorded: dict) -> dict:
    """Prometheus's JSON results as the source holds them: (metric, value) pairs."""
    return {f"replica:{name}": [(r["metric"], float(r["value"][1])) for r in result]
            for name, result in recorded["results"].items()}


def _recorded() -> tuple[dict, float]:
    data = json.loads(RECORDED.read_text())
    return _answers(data), data["range_seconds"]


def _rows(r: dict, range_seconds: float = 20.0) -> dict[str, dict]:
    return {row["pod"]: row for row in rp.replica_rows(r, _key, range_seconds)}


def _as(r: dict, like: str, pods=PODS) -> dict:
    """The answers with every pod in ``pods`` answering as pod ``like`` does."""
    out = {}
    for name, pairs in r.items():
        mine = [(m, v) for m, v in pairs if m.get("pod") == like]
        out[name] = [({**m, "pod": p}, v) for p in pods for m, v in mine]
    return out


def test_the_overloaded_replica_is_picked_out_and_said_why():
    r, range_seconds = _recorded()
    rows = _rows(r, range_seconds)
    assert sorted(rows) == list(PODS)
    assert [p for p, row in rows.items() if row["outlier"]] == [OVERLOADED], rows
    why = rows[OVERLOADED]["why"]
    assert "TTFT p95" in why and "x the median of the other replicas (" in why, why
    assert "queue share of request time" in why, why
    assert {"ttft_p95", "queue_share", "kv_usage"} <= set(rows[OVERLOADED]["flagged"])
    for pod in PODS:  # every figure there for each replica, and its verdict
        for column in (*rp.REPLICA_FIGURES, "headline"):
            value = rows[pod].get(column)
            assert value is not None and value == value, (pod, column)  # not NaN
    (table,) = replica_tables(frame(REPLICA_COLUMNS, list(rows.values())))
    text = component_text(table)
    assert "1 of 3 replicas stands out" in text and why.split("; ")[0][1:] in text
    rows_shown = [tr.to_plotly_json()["props"] for tr in table.children[1].children[1].children]
    assert [(tr["data-pod"], tr.get("className")) for tr in rows_shown] == [
        ("vllm-0", None), ("vllm-1", None), (OVERLOADED, "pw-outlier"), (OVERLOADED, "pw-why")]


def test_identical_replicas_have_no_outlier():
    r, range_seconds = _recorded()
    for like in ("vllm-0", OVERLOADED):  # three calm pods, or three overloaded ones
        rows = _rows(_as(r, like), range_seconds)
        assert len(rows) == 3 and not any(row["outlier"] for row in rows.values()), rows
        (table,) = replica_tables(frame(REPLICA_COLUMNS, list(rows.values())))
        assert "3 replicas, none stands out" in component_text(table)


def test_one_pod_or_none_shows_no_panel():
    r, range_seconds = _recorded()
    one = {k: [(m, v) for m, v in pairs if m.get("pod") == "vllm-0"] for k, pairs in r.items()}
    assert _rows(one, range_seconds) == {}
    unlabelled = {k: [({x: y for x, y in m.items() if x != "pod"}, v) for m, v in pairs]
                  for k, pairs in r.items()}  # one exporter, no pod label
    assert _rows(unlabelled, range_seconds) == {}
    snap = Snapshot("prometheus", "http://prometheus:9090")
    assert replica_outputs(snap) == [[], {"display": "none"}]
    snap.replicas = frame(REPLICA_COLUMNS, list(_rows(r, range_seconds).values()))
    tables, style = replica_outputs(snap)
    assert len(tables) == 1 and style == {}


def _answer(**pods: dict) -> dict:
    """Answers for one label set, ``pods`` each {figure: value}."""
    r: dict = {f"replica:{n}": [] for n in rp.REPLICA_FIGURES}
    for pod, figures in pods.items():
        for name, v in figures.items():
            r[f"replica:{name}"].append(({"model": "m", "engine": "vllm", "pod": pod}, v))
    return r


def test_the_rule_needs_a_ratio_a_margin_and_traffic():
    calm = {"request_rate": 3.0, "ttft_p50": 0.020, "ttft_p95": 0.040, "queue_share": 0.01}
    # twice as slow, but 45 ms: nothing to act on
    fast = _rows(_answer(a=calm, b=calm, c={**calm, "ttft_p95": 0.085}))
    assert not fast["c"]["outlier"], fast["c"]
    # 0.3 s: picked out ...
    slow = _rows(_answer(a=calm, b=calm, c={**calm, "ttft_p95": 0.300}))
    assert slow["c"]["why"] == ("TTFT p95 7.5x the median of the other replicas (300 ms "
                                "against 40 ms)"), slow["c"]
    # ... unless it finished too few requests in the range to judge its latency by
    few = _rows(_answer(a=calm, b=calm, c={**calm, "ttft_p95": 0.500, "request_rate": 1.0}))
    assert rp.MIN_REQUESTS > 20 and not few["c"]["outlier"], few["c"]
    # two replicas: the slower one against the other; never both
    two = _rows(_answer(a=calm, b={**calm, "ttft_p95": 0.500}))
    assert [p for p, row in two.items() if row["outlier"]] == ["b"]
    # a queue share where the others have none: said against their 0 %
    none = {**calm, "queue_share": 0.0}
    queued = _rows(_answer(a=none, b=none, c={**calm, "queue_share": 0.4}))
    assert queued["c"]["why"] == ("queue share of request time 40% against 0% on the other "
                                  "replicas (median)"), queued["c"]
    # the KV cache is judged without traffic
    idle = {"request_rate": 0.0}
    kv = _rows(_answer(a={**calm, "kv_usage": 0.3}, b={**idle, "kv_usage": 0.35},
                       c={**idle, "kv_usage": 0.95}))
    assert kv["c"]["flagged"] == ("kv_usage",), kv["c"]
    # the page says the rule the code applies
    text = rule_text()
    for rule in rp.OUTLIER_RULES:
        assert f"{rule.words} " in text and f"{rule.ratio:g}x" in text, (rule, text)
    assert f"{rp.MIN_REQUESTS} requests" in text


def test_a_verdict_the_others_all_disagree_with_is_picked_out():
    calm = {"request_rate": 3.0, "ttft_p50": 0.020, "ttft_p95": 0.040, "queue_share": 0.01}
    r = _answer(a=calm, b=calm, c=calm)
    r["replica:verdict"] = [
        ({"model": "m", "engine": "vllm", "pod": p, "phase": phase, "resource": res,
          "cause": cause}, 1.0)
        for p, phase, res, cause in (("a", "decode", "memory_bandwidth", ""),
                                     ("b", "decode", "memory_bandwidth", ""),
                                     ("c", "queue", "capacity", "concurrency_limit"))]
    rows = _rows(r)
    assert rows["c"]["why"] == ('verdict "Queue: Slot limit", while the other 2 replicas '
                                'report "Decode is memory-bandwidth-bound"'), rows["c"]
    assert not rows["a"]["outlier"] and not rows["b"]["outlier"]
    del r["replica:verdict"][1]  # a against c, one each: neither is the odd one out
    r = {k: [(m, v) for m, v in pairs if m["pod"] != "b"] for k, pairs in r.items()}
    assert not any(row["outlier"] for row in _rows(r).values())


def test_a_central_exporter_s_pods_are_replicas_too():
    """An exporter run with --pod-label (the gateway) has a KPI row per pod: the same
    table, from its frames (no KV cache: it scrapes no engine)."""
    from phasewatch.dashboard.frames import KPI_COLUMNS, VERDICT_COLUMNS

    base = {"model": "m", "engine": "vllm", "source": "", "request_rate": 3.0,
            "requests_in_range": 90, "ttft_p50": 0.02, "ttft_p95": 0.04, "queue_share": 0.01}
    kpis = frame(KPI_COLUMNS, [{**base, "pod": "a"}, {**base, "pod": "b"},
                               {**base, "pod": "c", "ttft_p95": 0.4, "queue_share": 0.5}])
    verdicts = frame(VERDICT_COLUMNS, [{**base, "pod": p, "phase": "decode",
                                        "resource": "memory_bandwidth", "cause": ""}
                                       for p in "abc"])
    rows = {row["pod"]: row for row in rp.replicas_from_frames(kpis, verdicts)}
    assert [p for p, row in rows.items() if row["outlier"]] == ["c"]
    assert rows["a"]["headline"] == "Decode is memory-bandwidth-bound"


# ---- the real thing: three exporters behind a real Prometheus -------------------------
def engine_page(kv_usage: float, running: int, waiting: int) -> str:
    """vLLM's /metrics as the sidecar scrapes it: its KV cache and requests."""
    labels = 'engine="0",model_name="Llama-3.1-8B"'
    return (f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{{labels}}} "
            f"{running}\n# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{{{labels}}} {waiting}\n"
            f"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{{{labels}}} "
            f"{kv_usage}\n")


# The overloaded pod's engine runs at most 6 requests at once: the chat scenario's 6
# requests/s (each ~250 tokens, ~10 running on a free engine) queue up on it, while it
# still finishes ~3 a second (enough to judge its latency by: rp.MIN_REQUESTS).
CHAT = scenario("chat")
OVERLOADED_CHAT = replace(CHAT, engine=replace(CHAT.engine, max_num_seqs=6))
ENGINE_STATE = {"vllm-0": (0.31, 10, 0), "vllm-1": (0.34, 11, 0), OVERLOADED: (0.98, 4, 40)}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Three sidecars (pods vllm-0..2) under chat load behind one Prometheus, vllm-2's
    engine overloaded; yields (Prometheus URL, snapshot) after 25 s."""
    from tests.dashboard.test_dashboard_prometheus import _driving
    from tests.roofline.test_engine_metrics import Pages
    from tests.support.prom import PrometheusServer

    tmp = tmp_path_factory.mktemp("replicas")
    pages = {p: Pages([engine_page(*state)] * 2000) for p, state in ENGINE_STATE.items()}
    model = ModelOptions(model="Llama-3.1-8B", hardware="H100-SXM")
    configs = [ServeConfig(**TEST_PORTS, roofline_interval=1.0, model_flags=replace(
        model, engine_metrics_url=pages[p].url)) for p in PODS]
    exporters = [Exporter(c).start() for c in configs]
    try:
        pods = {f"127.0.0.1:{ex.http_port}": {"pod": p} for ex, p in zip(exporters, PODS,
                                                                           strict=True)}
        load = [((OVERLOADED_CHAT if p == OVERLOADED else CHAT).build(seed=i + 1),
                 PhasewatchClient(f"127.0.0.1:{ex.grpc_port}", engine="vllm"))
                for i, (ex, p) in enumerate(zip(exporters, PODS, strict=True))]
        with PrometheusServer(tmp, list(pods), target_labels=pods,
                              native_histograms=True) as prom, _driving(load):
            time.sleep(25)
            source = PrometheusSource(prom.url, rate_range="20s")
            snap = source.fetch()
            if os.environ.get("PHASEWATCH_UPDATE_FIXTURES"):
                record(source, snap.fetched_at)
            yield prom, source, snap
            source.close()
    finally:
        for ex in exporters:
            ex.stop(grace=1)
        for p in pages.values():
            p.close()


def record(source: PrometheusSource, at: float) -> None:
    """Write RECORDED: Prometheus's answers to ``queries.REPLICAS`` over the whole fleet
    (``PHASEWATCH_UPDATE_FIXTURES=1 pytest tests/dashboard/test_dashboard_replicas.py``)."""
    from phasewatch.dashboard import queries

    results = {name: source._api("/api/v1/query", queries.render(
        expr, "", source.rate_range), time=at) for name, expr in queries.REPLICAS.items()}
    RECORDED.parent.mkdir(parents=True, exist_ok=True)
    RECORDED.write_text(json.dumps({
        "about": "Prometheus 2.42's answers to dashboard/queries.py REPLICAS, recorded by "
                 "tests/dashboard/test_dashboard_replicas.py's fleet: three sidecars under chat "
                 f"load, {OVERLOADED}'s engine limited to 6 running requests",
        "range_seconds": source.range_seconds, "results": results}, indent=1) + "\n")


def test_an_overloaded_replica_is_named_through_prometheus(fleet):
    _, _, snap = fleet
    assert snap.error is None, snap.error
    rows = {r["pod"]: r for r in snap.replicas.to_dict("records")}
    report = {p: {k: r[k] for k in (*rp.REPLICA_FIGURES, "requests_in_range", "headline",
                                    "why")} for p, r in rows.items()}
    print(json.dumps(report, indent=1, default=str))
    assert sorted(rows) == list(PODS), report
    assert [p for p, r in rows.items() if r["outlier"]] == [OVERLOADED], report
    why = rows[OVERLOADED]["why"]
    assert why.startswith("TTFT p95 ") and "x the median of the other replicas" in why, why
    assert "KV-cache usage " in why and "(98% against 3" in why, why
    assert rows["vllm-0"]["kv_usage"] == pytest.approx(0.31)
    # the pooled view is one row, over all three
    (kpi,) = snap.kpis.to_dict("records")
    assert kpi["pod"] == "" and kpi["request_rate"] > max(r["request_rate"]
                                                          for r in rows.values())


def test_the_page_shows_the_replicas_side_by_side(fleet):
    """In a real browser: the Replicas table under the cards, one row per pod, the
    overloaded one marked and said why; it fits the page at every width (no sideways
    scrolling) and leaves the figure grid as it was (no hole)."""
    from tests.dashboard.test_dashboard_browser import _footer_changes
    from tests.dashboard.test_dashboard_page import WIDTHS, _check_grid
    from tests.support.browser import Browser

    prom, _, _ = fleet
    source = PrometheusSource(prom.url, rate_range="20s")
    server = DashboardServer(create_app(source, refresh=1.0), port=0).start()
    browser = Browser()
    try:
        browser.open(server.url)
        browser.viewport(1280)
        rows = "#replicas .pw-replica-table tbody tr:not(.pw-why)"
        browser.wait_for(lambda: len(browser.boxes(rows)) == 3, 60, "three replica rows")
        marked = browser.js("return Array.from(document.querySelectorAll("
                            "'#replicas tr.pw-outlier, #replicas tr.pw-why')).map(r => "
                            "[r.dataset.pod, r.innerText])")
        assert [pod for pod, _ in marked] == [OVERLOADED] * 2, marked
        assert marked[1][1].startswith("TTFT p95 "), marked
        assert "x the median of the other replicas" in marked[1][1], marked
        assert "1 of 3 replicas stands out" in browser.text("#replicas h3")
        for width in WIDTHS:
            browser.viewport(width)
            _footer_changes(browser, 1)
            overflow = browser.js("const p = document.querySelector('#replicas'); "
                                  "return p.scrollWidth - p.clientWidth")
            assert overflow <= 0, (width, overflow)
            _check_grid(browser, width)
            browser.full_page(f"replicas-{width}px", width)
        assert browser.console_errors() == []
    finally:
        browser.close()
        server.stop()
        source.close()
