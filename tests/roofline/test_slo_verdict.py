"""The verdict with latency objectives (exporter/roofline/slo_verdict.py, issue #28): the
phase is the one that broke the most misses, before the time-share rule, and the text
says so first; objectives met are said too. The simulator's scenarios with their own
objectives, in-process as tests/roofline/test_cause.py runs them."""

from __future__ import annotations

import numpy as np
import pytest

from phasewatch.aggregation.aggregate import Aggregator
from phasewatch.aggregation.window import RollingWindow
from phasewatch.requests.objectives import (
    MET,
    MISS_PHASES,
    MISSED,
    OBJECTIVES,
    Objectives,
    ObjectivesByModel,
    parse_objectives,
)
from phasewatch.requests.record import RequestBatch
from phasewatch.roofline import catalog
from phasewatch.roofline.bottleneck import BottleneckMonitor, _tell_idle
from phasewatch.roofline.deployments import Deployments
from phasewatch.roofline.estimate import Deployment, RooflineEstimate, phase_estimate
from phasewatch.roofline.inputs import InputSource
from phasewatch.roofline.slo_verdict import MATERIAL_MISS, MIN_REQUESTS, attainment
from phasewatch.roofline.verdict import LEVERS, decide
from phasewatch.sim.scenarios import SCENARIOS

LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
DEP = Deployment(LLAMA, catalog.model(LLAMA), catalog.hardware("H100", 1))
CHAT = parse_objectives("ttft:500,tpot:50")
# decode takes 80% of request time; the queue 15%
DECODE_HEAVY = {"preprocess": 0.0, "queue": 0.15, "prefill": 0.05, "decode": 0.8}


def estimate(shares: dict, requests: int = 100) -> RooflineEstimate:
    pre = phase_estimate(DEP, 5.0, 4e15, 1e12, requests)
    dec = phase_estimate(DEP, 30.0, 1e15, 6e13, requests)
    return RooflineEstimate("m", "vllm", 0.0, 30.0, 1.0, requests, pre, dec, 8.0, 0.02,
                            shares, {"decode_steps": InputSource("token_gaps")})


def rows(n: int, misses: dict[str, dict[str, int]], objectives: Objectives = CHAT):
    """The window's per-request columns for ``n`` requests that met every objective set
    but ``misses[objective][phase]`` of them (the first rows)."""
    outcome = np.full((n, len(OBJECTIVES)), -1, np.int8)
    phase = np.full((n, len(OBJECTIVES)), -1, np.int8)
    for name in objectives.set():
        j = OBJECTIVES.index(name)
        outcome[:, j] = MET
        at = 0
        for p, count in misses.get(name, {}).items():
            outcome[at:at + count, j] = MISSED
            phase[at:at + count, j] = MISS_PHASES.index(p)
            at += count
    return outcome, phase


def slo(n: int, misses: dict, objectives: Objectives = CHAT) -> dict:
    return attainment(objectives, *rows(n, misses, objectives))


def test_misses_in_the_queue_beat_decodes_time_share():
    """Decode takes 80% of request time and meets TPOT; 30% of requests miss TTFT, broken
    in the queue: the verdict is the queue's, with its levers, and says why first."""
    v = decide(estimate(DECODE_HEAVY), DEP, None, None, slo(100, {"ttft": {"queue": 30}}))
    assert (v.phase, v.resource) == ("queue", "capacity")
    assert v.levers == LEVERS[("queue", "capacity")]
    assert v.text.startswith("30% of requests missed TTFT 500 ms; 100% of those spent most "
                             "of it in the queue. Queue takes 15% of request time"), v.text
    e = v.evidence.slo
    assert e.ranked_by == "misses" and e.missed_by_phase == {"queue": 1.0}
    assert e.objectives["ttft"].attainment == pytest.approx(0.7)
    assert e.objectives["ttft"].missed_by_phase == {"queue": 30}
    assert e.objectives["tpot"].attainment == 1.0
    assert v.evidence.phase_time_share == DECODE_HEAVY  # the time shares stay evidence


def test_the_phase_that_breaks_most_misses_names_the_share():
    v = decide(estimate(DECODE_HEAVY), DEP, None, None,
               slo(100, {"ttft": {"queue": 21, "prefill": 4}, "tpot": {"decode": 10}}))
    assert v.phase == "queue"
    assert v.evidence.slo.missed_by_phase == {"queue": 0.6, "prefill": pytest.approx(4 / 35),
                                                    "decode": pytest.approx(10 / 35)}
    assert v.text.startswith("25% of requests missed TTFT 500 ms; 84% of those spent most of "
                             "it in the queue. 10% missed TPOT 50 ms, mostly in decode."), v.text


def test_tpot_misses_name_decode():
    v = decide(estimate({"queue": 0.6, "prefill": 0.1, "decode": 0.3}), DEP, None, None,
               slo(100, {"tpot": {"decode": 40}}))
    assert v.phase == "decode"
    assert v.text.startswith("40% of requests missed TPOT 50 ms: their decode steps were "
                             "too slow. Decode takes 30% of request time"), v.text


def test_objectives_met_are_said_first_and_the_time_share_decides():
    v = decide(estimate(DECODE_HEAVY), DEP, None, None, slo(200, {"ttft": {"queue": 2}}))
    assert v.phase == "decode" and v.evidence.slo.ranked_by == "time_share"
    assert v.text.startswith("All objectives met: TTFT 500 ms by 99%, TPOT 50 ms by 100%. "
                             "Decode takes 80% of request time"), v.text
    assert v.levers == LEVERS[("decode", v.resource)]


def test_too_few_requests_leave_the_time_share_alone():
    few = slo(MIN_REQUESTS - 1, {"ttft": {"queue": 10}})
    v = decide(estimate(DECODE_HEAVY), DEP, None, None, few)
    assert v.phase == "decode" and v.text.startswith("Decode takes"), v.text
    assert v.evidence.slo.requests == MIN_REQUESTS - 1  # still evidence


def test_without_objectives_nothing_changes():
    plain = decide(estimate(DECODE_HEAVY), DEP)
    assert plain.evidence.slo is None and plain.lead == ""
    assert plain.text.startswith("Decode takes 80% of request time")
    assert attainment(Objectives(), *rows(100, {})) is None


def test_hysteresis_on_the_miss_share_and_the_phase():
    est = estimate(DECODE_HEAVY)
    burning = decide(est, DEP, None, None, slo(100, {"ttft": {"queue": 30}}))
    # 4% now: under the 5% that starts ranking by misses, over the 3% that ends it
    held = decide(est, DEP, burning, None, slo(100, {"ttft": {"queue": 4}}))
    assert held.phase == "queue" and held.evidence.slo.ranked_by == "misses"
    fresh = decide(est, DEP, None, None, slo(100, {"ttft": {"queue": 4}}))
    assert fresh.phase == "decode"  # the same 4% without a verdict ranked by misses
    gone = decide(est, DEP, held, None, slo(100, {"ttft": {"queue": 2}}))
    assert gone.phase == "decode" and gone.text.startswith("All objectives met")
    # another phase must break HYSTERESIS (5 points) more of the misses to take over
    near = slo(100, {"ttft": {"prefill": 16, "queue": 15}})  # 52% against 48%
    assert decide(est, DEP, burning, None, near).phase == "queue"
    far = slo(100, {"ttft": {"prefill": 20, "queue": 10}})
    assert decide(est, DEP, burning, None, far).phase == "prefill"
    assert MATERIAL_MISS == 0.05 and MIN_REQUESTS == 20


def test_an_idle_engine_missing_objectives_is_not_told_nothing_to_fix():
    missing = decide(estimate(DECODE_HEAVY), DEP, None, None, slo(100, {"tpot": {"decode": 30}}))
    _tell_idle(missing, 0.1)
    assert "Nothing to fix" not in missing.text and missing.levers
    met = decide(estimate(DECODE_HEAVY), DEP, None, None, slo(100, {}))
    _tell_idle(met, 0.1)
    assert met.text.startswith("All objectives met: TTFT 500 ms by 100%, TPOT 50 ms by 100%. "
                               "Nothing to fix: the engine had a request"), met.text


def _scenario_verdict(name: str, seconds: float = 240.0, objectives: str | None = None):
    """A scenario's verdict after ``seconds``, judged against its own objectives or
    ``objectives`` (``--slo``'s spelling)."""
    sc = SCENARIOS[name]
    engine = sc.build(seed=1)
    records = engine.run(seconds, epoch=1_700_000_000.0)
    window = RollingWindow(120.0, capacity=100_000)
    agg = Aggregator(window=window, objectives=ObjectivesByModel(
        sc.objectives if objectives is None else parse_objectives(objectives)))
    agg.ingest(RequestBatch.from_records(records, engine="sim"), "test")
    monitor = BottleneckMonitor(window, agg.labels, Deployments(
        [Deployment(sc.model, engine.model, engine.hw)]), window_seconds=120.0)
    [result] = monitor.update()
    return result.verdict


def test_overload_burns_ttft_in_the_queue():
    assert SCENARIOS["overload"].objectives == CHAT
    v = _scenario_verdict("overload")
    e = v.evidence.slo
    ttft = e.objectives["ttft"]
    assert ttft.missed_share > 0.5 and e.ranked_by == "misses"
    queue = ttft.missed_by_phase["queue"] / ttft.missed
    assert queue > 0.9
    assert (v.phase, v.resource) == ("queue", "capacity")
    assert v.text.startswith(f"{ttft.missed_share:.0%} of requests missed TTFT 500 ms; "
                             f"{queue:.0%} of those spent most of it in the queue. "), v.text


def test_long_generation_meets_its_objectives():
    assert SCENARIOS["long_generation"].objectives == CHAT
    v = _scenario_verdict("long_generation")
    e = v.evidence.slo
    assert e.objectives["ttft"].attainment >= 0.95
    assert e.ranked_by == "time_share"
    assert (v.phase, v.resource) == ("decode", "memory_bandwidth")
    assert v.text.startswith("All objectives met: TTFT 500 ms by "), v.text
    assert "Decode takes" in v.text


def test_the_demo_follows_the_scenarios_objectives():
    """The demo's scenario switch retargets the exporter's objectives: requests after it
    are judged against the new ones, the threshold gauge follows."""
    agg = Aggregator(objectives=ObjectivesByModel(SCENARIOS["chat"].objectives))
    engine = SCENARIOS["rag"].build(seed=1)
    batch = RequestBatch.from_records(engine.run(60.0, epoch=1_700_000_000.0), engine="sim")
    agg.ingest(batch, "test")
    chat = agg.slo.snapshot()
    agg.slo.retarget(ObjectivesByModel(SCENARIOS["rag"].objectives))
    assert agg.slo.snapshot().objectives(0) == parse_objectives("ttft:2000,tpot:150")
    agg.ingest(batch, "test")
    after = agg.slo.snapshot()
    met = OBJECTIVES.index("ttft"), 0
    assert after.outcomes[0][met] - chat.outcomes[0][met] == len(batch)  # all met at 2 s
    assert chat.outcomes[0][met] < len(batch)  # not all at 500 ms


def test_the_demo_summary_line_shows_goodput():
    from phasewatch.commands import _goodput

    fig = {"goodput": 4.14, "objectives": {"ttft": {"attainment": 0.997},
                                           "tpot": {"attainment": 1.0}}}
    assert _goodput(fig) == " | goodput 4.1 req/s (TTFT 99%, TPOT 100%)"
    assert _goodput(None) == ""



def test_tpot_misses_from_prefill_chunks_are_put_down_to_interference():
    """In the simulated chat every decode step that carries a prefill chunk is slower, so
    the requests that missed a tight TPOT objective are the ones whose decode ran beside
    others' prefills: without the fitted cost of that sharing most would have met it."""
    v = _scenario_verdict("chat", objectives="tpot:8.5")
    tpot = v.evidence.slo.objectives["tpot"]
    w = tpot.without_prefill
    print(tpot.missed_share, w)
    assert tpot.missed_share >= MATERIAL_MISS and w.misses_weighed >= 5
    assert w.would_meet_without_prefill >= 0.5 and w.slowdown > 1
    assert w.decode_shared_missed > w.decode_shared_met
    assert v.phase == "decode"
    assert (f"of requests missed TPOT 8.5 ms: their decode steps were too slow; "
            f"{w.would_meet_without_prefill:.0%} of those would have met it without the "
            "prefill chunks sharing their decode steps. Prefill interference: a decode step "
            f"shared with prefill takes {w.slowdown:.1f}x one that is not") in v.text, v.text
    # the cause the objectives found, though the sharing costs too little of all decode
    # time for the cause without objectives (cause.INTERFERENCE_LOST)
    assert v.cause.name == "prefill_interference", v.cause
    assert any("--max-num-batched-tokens" in lever for lever in v.levers), v.levers
    plain = _scenario_verdict("chat", objectives="ttft:500")
    assert plain.phase == "decode" and (plain.cause is None or
                                        plain.cause.name != "prefill_interference"), plain.text


def test_tpot_misses_not_from_prefill_chunks_are_not_put_down_to_them():
    """long_generation's decodes hardly ever run beside a prefill: its TPOT misses are
    the decode steps' own, and the verdict does not blame interference."""
    v = _scenario_verdict("long_generation", objectives="tpot:8.6")
    tpot = v.evidence.slo.objectives["tpot"]
    print(tpot.missed_share, tpot.without_prefill)
    assert tpot.missed_share >= MATERIAL_MISS
    w = tpot.without_prefill
    assert w is None or w.would_meet_without_prefill < 0.5, w
    assert "their decode steps were too slow." in v.text
    assert "would have met it without" not in v.text
    assert v.cause is None or v.cause.name != "prefill_interference", v.text


def test_tpot_misses_beside_prefills_are_told_where_the_line_undercounts_them():
    """A fresh-clone CI run on the real vLLM: a straight line through TPOT against the
    share of decode beside prefills gave back only a third of the misses, yet the misses
    spent 57 % of their decode beside prefill chunks against 1 % for the requests that
    met the objective (a long chunk stalls a step whatever the share): told so."""
    from dataclasses import replace

    from phasewatch.roofline.slo_verdict import (
        ObjectiveAttainment,
        WithoutPrefill,
        interference_told,
    )

    def tpot(w: WithoutPrefill) -> ObjectiveAttainment:
        return ObjectiveAttainment(0.05, 82, 18, 0, 0.82, 0.18, {"decode": 18},
                                   without_prefill=w)

    w = WithoutPrefill(misses_weighed=18, would_meet_without_prefill=1 / 3, slowdown=2.85,
                       tpot_without_prefill=0.0268, tpot_sharing_every_step=0.0765,
                       decode_shared_missed=0.571, decode_shared_met=0.0097)
    assert interference_told(tpot(w)) == (
        "they decoded beside other requests' prefill chunks 57% of the time, against 1% for "
        "the requests that met it")
    alike = replace(w, decode_shared_missed=0.25, decode_shared_met=0.15)
    assert interference_told(tpot(alike)) == ""  # not 2x, not 20 points
    few = replace(w, misses_weighed=4)
    assert interference_told(tpot(few)) == ""
