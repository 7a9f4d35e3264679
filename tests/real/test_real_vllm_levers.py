"""Issue 40: a lever's predicted effect, checked by pulling the lever on the real vLLM.

The slot-limit workload (24 closed-loop streams against ``--max-num-seqs 8``;
``tests/engines/verdict_runs.py``) makes phasewatch's verdict "Queue: Slot limit" and its
predictions for larger limits, from the step model it fitted over the window. vLLM is
then started again at ``--max-num-seqs 16``, the same clients run, and a fresh
phasewatch measures the operating point there. Predicted beside measured: the decode
batch, the step (TPOT), the mean queue time, TTFT and request time, and the output
tokens per second; each within ``TOLERANCE`` where the fit was inside its range, within
``TOLERANCE`` times the reach (at most ``PAST_RANGE``) past it (the queue within that
share of the time in the system: ``OF_E2E``), and each figure predicted to move by a
tenth moved that way. Every figure is printed (``-s``) and written to
``test-artifacts/real_vllm_levers.json``.

The slot_limit start is the verdict tests' own (``verdict_runs.session_runs``: one
start per session). In CI a missing ``.venv-vllm`` fails; elsewhere it skips.
"""

from __future__ import annotations

import json

import pytest

from tests.engines.verdict_runs import LEVER_PULLS, WorkloadRun, session_runs
from tests.real.test_real_vllm import require_vllm
from tests.support import ROOT

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
# The queue is the time in the system less the service: a difference, whose relative
# error is the others' magnified by e2e / queue. It is held to TOLERANCE of the time in
# the system (here 0.34 s off in 2.9 s, 59 % of a 0.58 s queue, on a host loaded 6x).
OF_E2E = ("queue_seconds",)


def _run(runs: list[WorkloadRun], name: str) -> WorkloadRun:
    return next(r for r in runs if r.name == name)


@pytest.fixture(scope="module")
def pulled(tmp_path_factory) -> dict[str, tuple[WorkloadRun, WorkloadRun]]:
    require_vllm()
    out = {}
    for cause, (config, _, pull) in LEVER_PULLS.items():
        (workload,) = {r.name for r in session_runs(tmp_path_factory, config)}
        out[cause] = (_run(session_runs(tmp_path_factory, config), workload),
                      _run(session_runs(tmp_path_factory, pull), workload))
    return out


def _table(cause: str, setting: str, predicted: dict, measured: dict, reach: float) -> dict:
    rows = {k: {"now": predicted["now"].get(k), "predicted": predicted["predicted"].get(k),
                "measured": measured.get(k)} for k in FIGURES}
    print(f"\n{cause}: {setting} (predicted {predicted['confidence']}; {predicted['basis']})")
    print(f"{'figure':<26} {'now':>10} {'predicted':>10} {'measured':>10} {'error':>7}")
    for k, r in rows.items():
        p, m = r["predicted"], r["measured"]
        r["error"] = (p - m) / m if p is not None and m else None
        print(f"{k:<26} {r['now'] or float('nan'):>10.4g} {p or float('nan'):>10.4g} "
              f"{m or float('nan'):>10.4g} "
              f"{'' if r['error'] is None else format(r['error'], '+.0%'):>7}")
    return {"setting": setting, "reach": reach, "figures": rows}


def test_the_slot_limit_pulled_lands_where_phasewatch_predicted(pulled):
    before, after = pulled["concurrency_limit"]
    _, setting, _ = LEVER_PULLS["concurrency_limit"]
    verdict = before.roofline.get("verdict") or {}
    assert verdict.get("cause") == "concurrency_limit", verdict.get("text")
    predictions = {p["setting"]: p for p in before.roofline.get("predictions") or ()}
    assert setting in predictions, (before.roofline.get("step_model"), list(predictions))
    p = predictions[setting]
    measured = after.roofline.get("operating_point") or {}
    report = _table("concurrency_limit", setting, p, measured, p["reach"])
    report["step_model"] = before.roofline.get("step_model")
    (ROOT / "test-artifacts").mkdir(exist_ok=True)
    (ROOT / "test-artifacts" / "real_vllm_levers.json").write_text(
        json.dumps({"concurrency_limit": report}, indent=1, default=str))
    assert p["kind"] == "predicted" and p["text"].startswith(setting)
    e2e = report["figures"]["e2e_seconds"]["measured"]
    within = TOLERANCE if p["reach"] <= 1.0 else min(TOLERANCE * p["reach"], PAST_RANGE)
    off = {k: r for k, r in report["figures"].items() if r["error"] is None or (
        abs(r["predicted"] - r["measured"]) > within * e2e if k in OF_E2E
        else abs(r["error"]) > within)}
    assert not off, (within, off, p["text"], report["step_model"])
    # and each figure the prediction moves by a tenth or more moved that way
    wrong_way = {k: r for k, r in report["figures"].items()
                 if abs(r["predicted"] - r["now"]) > 0.1 * r["now"]
                 and (r["predicted"] - r["now"]) * (r["measured"] - r["now"]) <= 0}
    assert not wrong_way, wrong_way
