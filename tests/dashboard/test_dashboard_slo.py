"""The objectives (--slo) on the dashboard: their cards and attainment over time from the
exporter's JSON API, hidden where no objective is set, and the Prometheus source's
figures and verdict sentence from the exporters' counters. The same through a real
Prometheus and in a real browser: tests/dashboard/test_dashboard_prometheus.py and
tests/dashboard/test_dashboard_browser.py."""

from __future__ import annotations

import math
from dataclasses import replace

import dash

from phasewatch.dashboard import panels
from phasewatch.dashboard.app import slo_outputs
from phasewatch.dashboard.exporter_source import snapshot_from_api
from phasewatch.dashboard.prometheus_verdicts import slo_figures, slo_kpis, slo_lead
from phasewatch.roofline.slo_verdict import lead, rank
from tests.conftest import component_text


def _summary_entry(model: str, slo: dict | None) -> dict:
    q = {k: 0.1 for k in ("mean", "p50", "p90", "p95", "p99")}
    return {"model": model, "engine": "vllm", "request_rate": 10.0,
            "prompt_tokens_per_second": 1.0, "output_tokens_per_second": 1.0,
            "ttft_seconds": q, "tpot_seconds": q, "itl_seconds": q, "e2e_seconds": q,
            "phase_time_share": {"queue": 0.5, "prefill": 0.1, "decode": 0.4},
            **({"slo": slo} if slo else {})}


SLO = {"good_requests": 180, "goodput": 6.0, "good_ratio": 0.6, "objectives": {
    "ttft": {"objective_seconds": 0.5, "met": 2997, "missed": 3, "unknown": 0,
             "attainment": 0.999},
    "tpot": {"objective_seconds": 0.05, "met": 180, "missed": 120, "unknown": 0,
             "attainment": 0.6}}}


def _snap(entries: list[dict], history: list[dict] | None = None):
    return snapshot_from_api({"window_seconds": 30, "models": entries}, {"models": []},
                             {"series": history or []}, [])


def test_cards_say_goodput_and_each_objective_met_rounded_down():
    snap = _snap([_summary_entry("m", SLO)])
    cards = panels.slo_cards(snap.kpis)
    assert [c.id for c in cards] == ["kpi-goodput", "kpi-ttft-attainment",
                                     "kpi-tpot-attainment"]
    text = [component_text(c) for c in cards]
    assert "6.0 req/s" in text[0] and "60% of requests" in text[0]
    # 99.9 % met: never "100.0%" while 3 requests missed it
    assert "≤ 500 ms met" in text[1] and "99.9%" in text[1] and "3 missed" in text[1]
    assert "≤ 50 ms met" in text[2] and "60.0%" in text[2] and "120 missed" in text[2]
    assert panels.attainment_text(0.99996) == "99.9%"
    assert panels.attainment_text(1.0) == "100.0%"


def test_label_sets_with_different_objectives_show_each_threshold():
    other = {**SLO, "objectives": {"ttft": {**SLO["objectives"]["ttft"],
                                            "objective_seconds": 2.0}}}
    snap = _snap([_summary_entry("a", SLO), _summary_entry("b", other)])
    (ttft,) = [c for c in panels.slo_cards(snap.kpis) if c.id == "kpi-ttft-attainment"]
    text = component_text(ttft)
    assert "objective met" in text and "(≤ 500 ms)" in text and "(≤ 2000 ms)" in text
    assert "a/vllm" in text and "b/vllm" in text
    (tpot,) = [c for c in panels.slo_cards(snap.kpis) if c.id == "kpi-tpot-attainment"]
    assert "b/vllm" not in component_text(tpot)  # b has no TPOT objective


def test_no_objectives_no_section_and_attainment_over_time_with_them():
    cards, figure, style = slo_outputs(_snap([_summary_entry("m", None)]))
    assert cards == [] and figure is dash.no_update and style == {"display": "none"}
    history = [{"model": "m", "engine": "vllm", "at": [1.0, 2.0, 3.0],
                "good_ratio": [0.5, 0.6, None], "ttft_attainment": [1.0, 0.99, 0.98],
                "tpot_attainment": [0.5, 0.6, 0.7]}]  # no itl/e2el: an older exporter too
    cards, figure, style = slo_outputs(_snap([_summary_entry("m", SLO)], history))
    assert style == {} and len(cards) == 3
    lines = {t["name"]: t["y"] for t in figure["data"]}
    assert lines == {"every objective met": [0.5, 0.6], "TTFT met": [1.0, 0.99, 0.98],
                     "TPOT met": [0.5, 0.6, 0.7]}
    assert figure["layout"]["yaxis"]["tickformat"] == ".0%"


def _key(metric: dict, pod: bool = False) -> dict:
    return {"model": metric.get("model", ""), "engine": metric.get("engine", ""),
            "pod": "", "source": ""}


def test_prometheus_counters_give_the_exporters_figures_and_sentence():
    """Over the range, the counters' increases (fractional, as increase() extrapolates)
    make the same figures ``slo_verdict.attainment`` makes of an exporter's window, and
    the same first sentence."""
    m = {"model": "m", "engine": "vllm"}
    r = {"slo_outcomes": [({**m, "objective": "ttft", "outcome": "met"}, 69.6),
                          ({**m, "objective": "ttft", "outcome": "missed"}, 30.2),
                          ({**m, "objective": "ttft", "outcome": "unknown"}, 0.0),
                          ({**m, "objective": "tpot", "outcome": "met"}, 99.9)],
         "slo_missed": [({**m, "objective": "ttft", "phase": "queue"}, 24.1),
                        ({**m, "objective": "ttft", "phase": "prefill"}, 5.9),
                        ({**m, "objective": "ttft", "phase": "decode"}, 0.0)],
         "slo_objective": [({**m, "objective": "ttft"}, 0.5), ({**m, "objective": "tpot"},
                                                                0.05)],
         "slo_goodput": [(m, 2.3)]}
    (k, figures), = slo_figures(r, _key).items()
    ttft = figures.objectives["ttft"]
    assert (ttft.met, ttft.missed, ttft.missed_by_phase) == (70, 30, {"queue": 24,
                                                                      "prefill": 6})
    assert figures.requests == 100 and math.isclose(ttft.missed_share, 0.3)
    shares = {"queue_share": 0.5, "prefill_share": 0.1, "decode_share": 0.4}
    sentence = slo_lead(figures, shares)
    assert sentence == ("30% of requests missed TTFT 500 ms; 80% of those spent most of it "
                        "in the queue.")
    mine = replace(figures)
    assert sentence == lead(mine, rank(mine, {"queue": 0.5, "prefill": 0.1, "decode": 0.4}))
    kpis = slo_kpis(figures, 10.0)
    assert kpis["goodput"] == 2.3 and math.isclose(kpis["good_ratio"], 0.23)
    assert kpis["tpot_attainment"] == 1.0 and kpis["ttft_objective"] == 0.5
    # an objective whose threshold is not published is left out; none: no figures
    r["slo_objective"] = r["slo_objective"][:1]
    assert set(slo_figures(r, _key)[k].objectives) == {"ttft"}
    r["slo_objective"] = []
    assert slo_figures(r, _key) == {}


def test_prompt_class_thresholds_are_named_on_the_cards():
    """``ttft:500,ttft@4k-16k:3000``: the card names both; ``ttft@4k-16k:3000`` alone (no
    plain threshold) still has its card."""
    both = {**SLO, "objectives": {"ttft": {**SLO["objectives"]["ttft"],
                                           "by_prompt_class": {"4k-16k": 3.0}}}}
    (card,) = [c for c in panels.slo_cards(_snap([_summary_entry("m", both)]).kpis)
               if c.id == "kpi-ttft-attainment"]
    assert "≤ 500 ms (3000 ms for 4k-16k) met" in component_text(card)
    alone = {**SLO, "objectives": {"ttft": {**SLO["objectives"]["ttft"],
                                            "objective_seconds": None,
                                            "by_prompt_class": {"4k-16k": 3.0}}}}
    snap = _snap([_summary_entry("m", alone)])
    assert panels.has_objectives(snap.kpis)
    (card,) = [c for c in panels.slo_cards(snap.kpis) if c.id == "kpi-ttft-attainment"]
    said = component_text(card)
    assert "3000 ms for 4k-16k prompts met" in said and "99.9%" in said


def test_prometheus_reads_the_classes_thresholds():
    m = {"model": "m", "engine": "vllm"}
    r = {"slo_outcomes": [({**m, "objective": "ttft", "outcome": "met"}, 90.0),
                          ({**m, "objective": "ttft", "outcome": "missed"}, 10.0)],
         "slo_missed": [({**m, "objective": "ttft", "phase": "queue"}, 10.0)],
         "slo_objective": [],  # set only for a class
         "slo_class_objective": [({**m, "objective": "ttft", "prompt_class": "4k-16k"}, 3.0)],
         "slo_goodput": [(m, 3.0)]}
    (figures,) = slo_figures(r, _key).values()
    ttft = figures.objectives["ttft"]
    assert ttft.objective_seconds is None and ttft.by_prompt_class == {"4k-16k": 3.0}
    assert slo_kpis(figures, 10.0)["ttft_classes"] == "3000 ms for 4k-16k"
    assert slo_lead(figures, {"queue_share": 0.6, "decode_share": 0.4}) == (
        "10% of requests missed TTFT 3000 ms for 4k-16k prompts; 100% of those spent most "
        "of it in the queue.")


def test_the_sampled_share_has_a_card_only_where_traces_were_sampled():
    """Issue 29: counts weighted by 1 / p say so on the page; unsampled, no card. From
    Prometheus: the received requests' rate over the weighted one."""
    from phasewatch.dashboard import queries as q
    from tests.dashboard.test_dashboard_cause import LABELS, LIVE, _prometheus_snapshot

    plain = _prometheus_snapshot(LIVE)
    assert "kpi-sampled_share" not in [c.id for c in panels.kpi_cards(plain.kpis)]
    sampled = _prometheus_snapshot({**LIVE, q.KPIS["sampled_share"]: [(LABELS, 0.1)]})
    (card,) = [c for c in panels.kpi_cards(sampled.kpis) if c.id == "kpi-sampled_share"]
    assert " ".join(component_text(card).split()) == "sampled traces 10%"
    everything = _prometheus_snapshot({**LIVE, q.KPIS["sampled_share"]: [(LABELS, 1.0)]})
    assert "kpi-sampled_share" not in [c.id for c in panels.kpi_cards(everything.kpis)]
