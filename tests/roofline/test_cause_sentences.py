"""Each cause reads the same on both of the dashboard's sources (issue 38): the exporter's
verdict (exporter/roofline/cause.py, what the JSON API and the exporter source show) and
the dashboard's Prometheus source (dashboard/prometheus_verdicts.py) write a cause's
sentence with the same code (exporter/roofline/cause_text.py). Here both are given the
same figures and must give the same sentence; where Prometheus does not hold a figure the
exporter's sentence uses, the Prometheus sentence is the exporter's without that part."""

from __future__ import annotations

import pytest

from phasewatch.dashboard import queries as q
from phasewatch.roofline.bottleneck import Result, imbalance
from phasewatch.roofline.cause import CAUSES, diagnose
from phasewatch.roofline.engine_metrics import EngineRates
from phasewatch.roofline.verdict import decide
from tests.dashboard.test_dashboard_cause import LABELS, LIVE, _prometheus_snapshot
from tests.roofline.test_cause import DECODE, DEP, QUEUE, estimate, records

WINDOW = 60.0  # the exporter's window, and the canned Prometheus range (1m)


def _exporter(phase: str, shares: dict, **engine) -> tuple[str, str]:
    est = estimate(shares, hi=WINDOW)
    rates = EngineRates(seconds=WINDOW, samples=15, **engine)
    cause = diagnose(phase, est, DEP, records(span=WINDOW), rates)
    return cause.name, cause.text


def _prometheus(phase: str, resource: str, cause: str, kv: float | None = None,
                preemptions: float | None = None, running: float | None = None,
                **answers) -> str:
    got = {**LIVE,
           q.VERDICT_VOTES: [({**LABELS, "phase": phase, "resource": resource}, 1.0)],
           q.VERDICT_CAUSES: [({**LABELS, "phase": phase, "resource": resource,
                                "cause": cause}, 1.0)],
           q.VERDICT_REPORTING: [(LABELS, 1.0)], **answers}
    if kv is not None:
        got[q.ENGINE_KV_USAGE] = [(LABELS, kv)]
    if preemptions is not None:
        got[q.ENGINE_PREEMPTIONS] = [(LABELS, preemptions)]
    if running is not None:
        got[q.ENGINE_REQUESTS] = [({**LABELS, "state": "running"}, running)]
    (row,) = _prometheus_snapshot(got).verdicts.to_dict("records")
    assert row["cause"] == cause, row
    return row["cause_text"]


@pytest.mark.parametrize(("name", "engine", "gauges"), [
    ("kv_cache", {"preemptions": 32.0, "max_kv_usage": 1.0},
     {"kv": 1.0, "preemptions": 32.0}),
    ("kv_cache", {"preemptions": 0.0, "max_kv_usage": 1.0, "waiting_share": 1.0},
     {"kv": 1.0, "preemptions": 0.0}),
    ("preemption_recompute", {"preemptions": 5.0, "max_kv_usage": 0.5},
     {"kv": 0.5, "preemptions": 5.0}),
])
def test_the_kv_cache_causes_read_the_same_from_both_sources(name, engine, gauges):
    found, text = _exporter("decode", DECODE, **engine)
    assert found == name, text
    assert _prometheus("decode", CAUSES[name].resource or "memory_bandwidth", name,
                       **gauges) == text


def test_a_slot_limit_reads_the_same_less_the_share_prometheus_does_not_hold():
    found, text = _exporter("queue", QUEUE, max_running=8.0, running_at_max_share=0.95,
                            waiting_share=1.0, max_kv_usage=0.012)
    assert (found, text) == ("concurrency_limit", "Slot limit: 8 requests running (95% of "
                             "the time at that maximum), the KV cache at most 1% full")
    assert _prometheus("queue", "capacity", "concurrency_limit", kv=0.012, running=8.0) == \
        text.replace(" (95% of the time at that maximum)", "")


def test_the_front_end_reads_the_same_from_both_sources():
    found, text = _exporter("preprocess", {"preprocess": 0.7, "decode": 0.3})
    assert found == "frontend"
    assert _prometheus("preprocess", "frontend", "frontend") == text


def test_an_imbalance_reads_the_same_from_both_sources():
    def result(pod: str, shares: dict) -> Result:
        est = estimate(shares)
        v = decide(est, DEP, None, lambda phase: diagnose(phase, est, DEP, records(), None))
        return Result("m", "vllm", ("m", "vllm", pod), DEP, est, v)

    busy = result("vllm-a", {"queue": 0.85, "prefill": 0.0, "decode": 0.15})
    imbalance([busy, result("vllm-b", {"queue": 0.0, "prefill": 0.0, "decode": 1.0})],
              ("model", "engine", "pod"))
    assert busy.verdict.cause.name == "imbalance"
    means = [({**LABELS, "pod": "vllm-a", "phase": "queue"}, 8.5),
             ({**LABELS, "pod": "vllm-a", "phase": "decode"}, 1.5),
             ({**LABELS, "pod": "vllm-b", "phase": "queue"}, 0.0),
             ({**LABELS, "pod": "vllm-b", "phase": "decode"}, 2.0)]
    assert _prometheus("queue", "capacity", "imbalance", **{q.PHASE_MEAN: means}) == \
        busy.verdict.cause.text


@pytest.mark.parametrize(("name", "shared"), [("compute_saturated", 0.0),
                                             ("prefill_interference", 1e16)])
def test_a_cause_whose_figures_prometheus_lacks_reads_as_its_title(name, shared):
    """The busy share and the prefill FLOPs in decode's steps are the records' (no family
    holds them): the Prometheus source names the cause with the title the exporter's
    sentence opens."""
    est = estimate(DECODE, hi=WINDOW, shared=shared)
    rates = EngineRates(seconds=WINDOW, samples=15, max_kv_usage=0.3, preemptions=0.0)
    cause = diagnose("decode", est, DEP, records(span=WINDOW), rates)
    assert cause.name == name, cause.text
    title = _prometheus("decode", "memory_bandwidth", name)
    assert title == CAUSES[name].title and cause.text.startswith(title), cause.text
