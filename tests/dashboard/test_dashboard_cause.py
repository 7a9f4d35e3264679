"""The verdict banner says the cause: its headline names it, its first sentence gives it
in words with numbers and says where it came from, its levers are the cause's. From the
exporter's JSON (entries made by the exporter's own ``roofline_json``) and from
Prometheus samples (a source whose answers are canned per query); and a ceiling that was
exceeded shows no percentage over 100 %.
"""

from __future__ import annotations

import re

import numpy as np

from phasewatch.aggregation.columns import WindowColumns
from phasewatch.dashboard import panels
from phasewatch.dashboard import queries as q
from phasewatch.dashboard.exporter_source import snapshot_from_api
from phasewatch.dashboard.frames import Snapshot
from phasewatch.dashboard.prometheus_source import PrometheusSource
from phasewatch.publish.api import roofline_json
from phasewatch.roofline import catalog
from phasewatch.roofline.bottleneck import Result
from phasewatch.roofline.cause import diagnose
from phasewatch.roofline.engine_metrics import EngineRates
from phasewatch.roofline.estimate import Deployment, RooflineEstimate, phase_estimate
from phasewatch.roofline.inputs import InputSource
from phasewatch.roofline.verdict import decide

LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
DEP = Deployment(LLAMA, catalog.model(LLAMA), catalog.hardware("H100", 1))
DECODE = {"preprocess": 0.01, "queue": 0.04, "prefill": 0.05, "decode": 0.9}
PREFILL = {"preprocess": 0.01, "queue": 0.04, "prefill": 0.8, "decode": 0.15}


def _records(n: int = 40, span: float = 30.0) -> WindowColumns:
    """Eight requests always in the engine, back to back: the columns the cause reads."""
    sched = np.linspace(0.0, span - 8.0, n)
    first, last = sched + 0.1, sched + 8.0
    return WindowColumns.of({
        "scheduled_at": sched, "first_token_at": first, "last_token_at": last,
        "end_at": last, "prompt": np.full(n, 500), "uncached": np.full(n, 500),
        "output": np.full(n, 200), "steps": np.full(n, 199)})


def _entry(shares: dict, engine: EngineRates | None, prefill_flops: float = 4e15,
           inputs: dict | None = None, inferred: dict | None = None) -> dict:
    """One ``/api/v1/roofline`` entry as the exporter writes it, for a verdict decided by
    the exporter's own rules on this estimate and engine state."""
    est = RooflineEstimate(LLAMA, "vllm", 0.0, 30.0, 1.0, 40,
                           phase_estimate(DEP, 5.0, prefill_flops, 1e12, 40),
                           phase_estimate(DEP, 30.0, 1e15, 6e13, 40), 8.0, 0.02, shares,
                           inputs or {"decode_steps": InputSource("tpot")},
                           shared_step_flops={"decode": 3e15}, inferred=inferred or {})
    v = decide(est, DEP, None, lambda phase: diagnose(phase, est, DEP, _records(), engine))
    return roofline_json(Result(LLAMA, "vllm", (LLAMA, "vllm"), DEP, est, v,
                                engine_state=engine.state() if engine else None))


def _banner_text(entry: dict) -> tuple[str, list[str]]:
    """(the banner's heading, its paragraphs and lines) as a reader sees them."""
    snap = snapshot_from_api({"models": []}, {"models": [entry]}, {"series": []}, [])
    (banner,) = panels.banners(snap)
    return _lines(banner)


def words(c) -> str:
    """A Dash component's words, as a reader sees them."""
    if isinstance(c, str):
        return c
    kids = getattr(c, "children", None)
    kids = kids if isinstance(kids, list) else [kids] if kids is not None else []
    return "".join(words(k) for k in kids)


def _lines(banner) -> tuple[str, list[str]]:
    return words(banner.children[0]), [words(c) for c in banner.children[1:]]


def _percentages(lines: list[str]) -> list[float]:
    return [float(x) for x in re.findall(r"(\d+(?:\.\d+)?)\s?%", " ".join(lines))]


KV_FULL = EngineRates(seconds=30.0, samples=15, preemptions=32.0, max_kv_usage=1.0,
                      mean_kv_usage=0.97, mean_waiting=6.0, waiting_share=1.0)


def test_a_full_kv_cache_heads_the_banner_with_its_preemptions_and_levers():
    entry = _entry(DECODE, KV_FULL, inputs={"decode_steps": InputSource("tpot"),
                                             "flops": InputSource("engine_counters")},
                   inferred={"prefill": {"flops": 2e15}, "decode": {"flops": 1e15}})
    heading, (cause, rest, chips, levers) = _banner_text(entry)
    assert heading == f"Decode: KV cache full — {LLAMA}/vllm"
    assert cause.startswith("KV cache full: 32 preemptions in 30 s at 100% usage")
    # the cause's whole sentence (with the recomputed share, where there is one), once
    detail = entry["verdict"]["cause_detail"]["text"]
    assert cause == f"{detail}. (from the engine's /metrics)"
    assert rest.startswith("Decode takes 90% of request time") and "preemptions" not in rest
    assert "--kv-cache-dtype fp8" in levers and "--gpu-memory-utilization" in levers
    assert "faster GPUs" not in levers  # the roofline's levers give way to the cause's
    assert "decode 90%" in chips


def test_a_cause_from_the_records_says_the_engine_was_not_scraped():
    # no engine state: the records stand in, and the KV footprint of the requests in flight
    # decides (8 x 700 tokens of an 8B model do not fill an H100: no kv_cache)
    entry = _entry(DECODE, None)
    _, (cause, *_) = _banner_text(entry)
    assert entry["verdict"]["cause_detail"]["source"] == "records"
    assert cause.endswith("(from the records: engine metrics not scraped)")


def test_a_ceiling_exceeded_shows_no_percentage_over_100():
    """Prefill at 5 x the datasheet's FLOP/s (over fp8's too: the model is the likelier
    mistake): the banner names the model first, not `phasewatch calibrate`, and no chip
    or sentence shows a utilization over 100 %, even from an exporter that still
    published one."""
    entry = _entry(PREFILL, None, prefill_flops=5 * 5.0 * DEP.peak_flops)
    assert entry["verdict"]["evidence"]["ceiling_exceeded"]
    entry["estimate"]["prefill"]["flops_utilization"] = 5.0  # an older exporter's
    heading, lines = _banner_text(entry)
    assert heading.startswith("Prefill is of unknown limit")
    assert "prefill MFU over its ceiling" in " ".join(lines)
    assert "smaller model than the one configured" in " ".join(lines)
    assert "calibrate" not in " ".join(lines)
    assert max(_percentages(lines)) <= 100, lines


# ---- Prometheus -------------------------------------------------------------------
LABELS = {"model": LLAMA, "engine": "vllm"}


class CannedPrometheus(PrometheusSource):
    """Prometheus answering each of the dashboard's queries (rendered for no selection)
    with the samples given for it, and nothing for the rest."""

    def __init__(self, answers: dict[str, list[tuple[dict, float]]]):
        super().__init__("http://prometheus:9090", rate_range="1m", clock=lambda: 1000.0)
        self.answers = {q.render(t, "", "1m"): rows for t, rows in answers.items()}

    def instant(self, expr: str, at: float):
        return self.answers.get(expr, [])

    def range(self, expr: str, start: float, end: float, step: float):
        return []


def _prometheus_snapshot(answers: dict) -> Snapshot:
    source = CannedPrometheus(answers)
    try:
        snap = source.fetch()
    finally:
        source.close()
    assert snap.error is None, snap.error
    return snap


LIVE = {q.KPIS["request_rate"]: [(LABELS, 2.0)]}  # requests finished in the range

SLOT_LIMIT = {
    **LIVE,
    q.VERDICT_VOTES: [({**LABELS, "phase": "queue", "resource": "capacity"}, 1.0)],
    q.VERDICT_CAUSES: [({**LABELS, "phase": "queue", "resource": "capacity",
                         "cause": "concurrency_limit"}, 1.0)],
    q.VERDICT_REPORTING: [(LABELS, 1.0)],
    q.VERDICT_CONFIDENCE: [(LABELS, 0.8)],
    q.PHASE_SHARE: [({**LABELS, "phase": p}, v) for p, v in
                    (("queue", 0.6), ("prefill", 0.05), ("decode", 0.35))],
    q.ENGINE_KV_USAGE: [(LABELS, 0.012)],
    q.ENGINE_REQUESTS: [({**LABELS, "state": "running"}, 8.0),
                        ({**LABELS, "state": "waiting"}, 16.0)],
    q.ENGINE_PREEMPTIONS: [(LABELS, 0.0)],
}


def test_a_slot_limit_from_prometheus_names_the_limit_and_its_lever():
    snap = _prometheus_snapshot(SLOT_LIMIT)
    (banner,) = panels.banners(snap)
    heading, (cause, rest, _chips, levers) = _lines(banner)
    assert heading == f"Queue: Slot limit — {LLAMA}/vllm"
    # the exporter's own sentence (roofline.cause_text), the other gauges beside it
    assert cause == ("Slot limit: 8 requests running, the KV cache at most 1% full. "
                     "(from the engine's /metrics)")
    assert rest == "Queue takes 60% of request time. Engine state: 16 waiting."
    assert "a larger --max-num-seqs" in levers and "more replicas" not in levers
    assert banner.to_plotly_json()["props"]["data-cause"] == "concurrency_limit"


def test_prometheus_without_the_cause_label_keeps_the_phase_and_resource_levers():
    """An exporter older than the cause label: the verdict and levers as before."""
    newer = (q.VERDICT_CAUSES, q.ENGINE_KV_USAGE, q.ENGINE_REQUESTS, q.ENGINE_PREEMPTIONS)
    answers = {k: v for k, v in SLOT_LIMIT.items() if k not in newer}
    (row,) = _prometheus_snapshot(answers).verdicts.to_dict("records")
    assert row["headline"] == "Queue: requests wait for capacity" and row["cause"] == ""
    assert row["levers"] == ("more replicas", "admission control",
                             "disaggregated prefill/decode")
    assert row["cause_text"] == ""


def test_prometheus_ceiling_exceeded_shows_no_percentage_over_100():
    answers = {
        **LIVE,
        q.VERDICT_VOTES: [({**LABELS, "phase": "prefill", "resource": "unknown"}, 1.0)],
        q.VERDICT_CAUSES: [({**LABELS, "phase": "prefill", "resource": "unknown",
                             "cause": "none"}, 1.0)],
        q.VERDICT_REPORTING: [(LABELS, 1.0)],
        q.PHASE_SHARE: [({**LABELS, "phase": "prefill"}, 0.8)],
        q.KPIS["mfu"]: [(LABELS, 1.84)],  # an exporter that still published one
        q.CEILING_EXCEEDED: [({**LABELS, "phase": "prefill", "ceiling": "flops"}, 1.84)],
    }
    (banner,) = panels.banners(_prometheus_snapshot(answers))
    _, lines = _lines(banner)
    text = " ".join(lines)
    assert "Prefill achieved 1.84x its FLOP/s ceiling" in text and "--model" in text
    assert "calibrate" not in text  # the model first: a user who just calibrated was told to
    assert "prefill MFU over its ceiling" in text
    assert max(_percentages(lines)) <= 100, lines


def test_a_full_kv_cache_from_prometheus_gives_the_engine_gauges_in_words():
    answers = {
        **SLOT_LIMIT,
        q.VERDICT_VOTES: [({**LABELS, "phase": "decode", "resource": "capacity"}, 1.0)],
        q.VERDICT_CAUSES: [({**LABELS, "phase": "decode", "resource": "capacity",
                             "cause": "kv_cache"}, 1.0)],
        q.ENGINE_KV_USAGE: [(LABELS, 1.0)],
        q.ENGINE_REQUESTS: [({**LABELS, "state": "running"}, 14.0),
                            ({**LABELS, "state": "waiting"}, 6.0)],
        q.ENGINE_PREEMPTIONS: [(LABELS, 32.2)],
    }
    (banner,) = panels.banners(_prometheus_snapshot(answers))
    heading, (cause, rest, *_, levers) = _lines(banner)
    assert heading == f"Decode: KV cache full — {LLAMA}/vllm"
    assert cause == ("KV cache full: 32 preemptions in 60 s at 100% usage. "
                     "(from the engine's /metrics)")
    assert rest.endswith("Engine state: 6 waiting, 14 running."), rest
    assert "--kv-cache-dtype fp8" in levers


def test_an_outvoted_queueing_pod_is_an_imbalance():
    """Issue 29: two calm pods outvote the third, which queues most of its request time
    (the fleet-views run: 2 of 3 pods decode-bound, one queueing 85 % with its KV cache
    full). The banner named the majority's "Decode is memory-bandwidth-bound"; the pods
    differ, and the one users wait on queues: a routing imbalance, not the majority."""
    def pod(name: str, queue: float, decode: float) -> list:
        return [({**LABELS, "pod": name, "phase": "queue"}, queue),
                ({**LABELS, "pod": name, "phase": "decode"}, decode)]

    answers = {
        **LIVE,
        q.VERDICT_VOTES: [({**LABELS, "phase": "decode", "resource": "memory_bandwidth"}, 2.0),
                          ({**LABELS, "phase": "queue", "resource": "capacity"}, 1.0)],
        q.VERDICT_REPORTING: [(LABELS, 3.0)],
        q.PHASE_SHARE: [({**LABELS, "phase": p}, v) for p, v in (("queue", 0.52),
                                                                  ("decode", 0.48))],
        q.PHASE_MEAN: [*pod("vllm-0", 0.001, 2.0), *pod("vllm-1", 0.001, 2.1),
                       *pod("vllm-2", 10.3, 1.8)],
    }
    (row,) = _prometheus_snapshot(answers).verdicts.to_dict("records")
    assert (row["phase"], row["resource"], row["cause"]) == ("queue", "capacity",
                                                             "imbalance"), row
    assert row["cause_text"] == ("Load imbalance: queue 85% of request time on vllm-2 "
                                 "while vllm-1 queues 0%"), row
    assert (row["agreeing"], row["reporting"]) == (1, 3), row  # the pod whose verdict it is
    assert any("router" in lever for lever in row["levers"]), row
    calm = {**answers, q.PHASE_MEAN: [*pod("vllm-0", 0.001, 2.0), *pod("vllm-1", 0.001, 2.1),
                                      *pod("vllm-2", 0.002, 1.8)]}
    (row,) = _prometheus_snapshot(calm).verdicts.to_dict("records")
    assert (row["phase"], row["cause"]) == ("decode", ""), row  # alike: the majority


def test_a_verdict_prometheus_still_holds_for_a_stopped_workload_is_not_shown():
    """Issue 26: an exporter publishes its verdict until its own window empties, which a
    shorter --range outlasts: with no request finished in the range (a rate of 0 over
    series that are still there), the page has no banner and reads as stopped."""
    stopped = {**SLOT_LIMIT, q.KPIS["request_rate"]: [(LABELS, 0.0)],
               q.INTENSITY: [({**LABELS, "phase": "decode"}, 20.0)],
               q.ACHIEVED_FLOPS: [({**LABELS, "phase": "decode"}, 5e13)],
               q.LABEL_SETS: [({**LABELS, "pod": "vllm-0"}, 1.0)]}
    snap = _prometheus_snapshot(stopped)
    assert snap.idle and snap.verdicts.empty and snap.points.empty and snap.kpis.empty
    assert panels.banners(snap) == []
    assert panels.state_panel(snap).id == "state-idle"
    live = _prometheus_snapshot({**stopped, **LIVE})
    assert not live.idle and len(live.verdicts) == 1 and len(live.points) == 1
