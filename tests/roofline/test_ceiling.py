"""An achieved rate above a ceiling (exporter/roofline/ceiling.py): what it points to, the
model first, and never "recalibrate" where the evidence says the model or the dtype.
Issue 37: told a ~100M model was Llama-3.1-8B, the verdict said "it achieved 2.23x the
flops ceiling ... run `phasewatch calibrate`" to a user who had just calibrated; the
demo's simulated H100 prefilling at its achievable figure was told the same at 1.01x."""

from __future__ import annotations

from dataclasses import replace

import pytest

from phasewatch.roofline import catalog, ceiling
from phasewatch.roofline.engine_metrics import EngineRates
from phasewatch.roofline.engine_view import with_engine_counters
from phasewatch.roofline.estimate import Deployment, RooflineEstimate, phase_estimate
from phasewatch.roofline.inputs import InputSource
from phasewatch.roofline.verdict import decide

LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
H100 = Deployment(LLAMA, catalog.model(LLAMA), catalog.hardware("H100", 1))
PREFILL = {"preprocess": 0.01, "queue": 0.05, "prefill": 0.8, "decode": 0.14}


def estimate(dep: Deployment, prefill_flops: float, busy: float = 10.0,
             shared: float = 0.0) -> RooflineEstimate:
    """A window whose prefill did ``prefill_flops`` in ``busy`` seconds, decode light."""
    pre = phase_estimate(dep, busy, prefill_flops, 1e12, 40)
    dec = phase_estimate(dep, 4.0, 1e13, 4e12, 40)
    inferred = {"prefill": {"flops": pre.flops, "bytes": pre.bytes, "weight_bytes": 0.0},
                "decode": {"flops": dec.flops, "bytes": dec.bytes, "weight_bytes": 0.0}}
    return RooflineEstimate("m", "vllm", 0.0, 30.0, 1.0, 40, pre, dec, 8.0, 0.02, PREFILL,
                            {"decode_steps": InputSource("token_gaps")},
                            shared_step_flops={"prefill": shared} if shared else {},
                            inferred=inferred)


def test_over_the_achievable_figure_under_the_peak_is_bound_not_a_wrong_ceiling():
    """The demo's rag: prefill at the achievable FLOP/s, the decode tokens sharing its
    steps tipping it to 1.01x. Bound by compute, at that ceiling: no calibrate advice."""
    achievable = H100.hardware.achievable_flops("bf16")
    est = estimate(H100, 0.99 * achievable * 10.0, shared=0.02 * achievable * 10.0)
    v = decide(est, H100)
    assert (v.phase, v.resource) == ("prefill", "compute")
    assert v.evidence.utilization.over_achievable["flops"] == pytest.approx(1.01, abs=1e-6)
    assert v.evidence.utilization.of_achievable_flops == 1.0
    assert "calibrate" not in v.text and "ceiling is wrong" not in v.text
    assert "it uses 100% of the achievable FLOP/s" in v.text
    assert "1.01x the figure taken as achievable: it runs at that ceiling" in v.text


def test_over_the_peak_without_the_engines_count_names_the_model_first():
    """Tokens at 8B's cost need 3x what an H100 can do, fp8 included: the model first."""
    est = estimate(H100, 3.0 * H100.peak_flops * 10.0)
    v = decide(est, H100)
    assert v.resource == "unknown"
    assert v.evidence.ceiling_exceeded.points_to == "model_or_dtype"
    assert v.text.index("smaller model") < v.text.index("compute dtype")
    assert "calibrate" not in v.text


def test_a_rate_under_another_dtypes_ceiling_names_the_dtype():
    """1.5x the bf16 peak fits under the H100's fp8 figure: the engine computes in fp8."""
    est = estimate(H100, 1.5 * H100.peak_flops * 10.0)
    found = ceiling.blame(est, H100, "prefill", "flops", 1.5)
    assert (found.points_to, found.dtype) == ("dtype", "fp8")
    assert "--compute-dtype fp8" in found.text
    v = decide(est, H100)
    assert v.evidence.ceiling_exceeded.points_to == "dtype"


def test_the_engines_own_flop_counter_far_below_the_models_cost_names_the_model():
    """A ~100M model served, Llama-3.1-8B configured: vLLM's own FLOP counter counts ~1/80
    of the configured model's cost for the same tokens. Said whether or not a ceiling
    was exceeded, and where one is, it points to the model."""
    est = estimate(H100, 0.3 * H100.peak_flops * 10.0)
    total = est.prefill.flops + est.decode.flops
    rates = EngineRates(seconds=30.0, samples=15, flops_per_gpu=total / 80 / 30.0)
    counted = with_engine_counters(est, H100, rates)
    assert ceiling.model_cost_ratio(counted) == pytest.approx(80.0)
    said = ceiling.model_mismatch(counted, H100)
    assert said.startswith("The configured model looks wrong")
    assert "0.0125x the FLOPs" in said and "--model" in said
    # over a ceiling too (a slower part's datasheet): the model, not the ceiling
    found = ceiling.blame(counted, H100, "prefill", "flops", 2.23)
    assert found.points_to == "model" and "calibrate" not in found.text


def test_the_engines_own_count_over_the_ceiling_blames_the_ceiling():
    """The engine's own counters agree with the model's cost and are over the peak:
    only here is the hardware figure (or the GPU count) wrong, and calibrate the advice."""
    est = estimate(H100, 3.0 * H100.peak_flops * 10.0)
    total = est.prefill.flops + est.decode.flops
    rates = EngineRates(seconds=30.0, samples=15, flops_per_gpu=total / 30.0)
    counted = with_engine_counters(est, H100, rates)
    assert ceiling.model_mismatch(counted, H100) is None
    ratio = counted.prefill.ceiling_exceeded["flops"]
    found = ceiling.blame(counted, H100, "prefill", "flops", ratio)
    assert found.points_to == "ceiling"
    assert "--gpus" in found.text and "phasewatch calibrate" in found.text


def test_a_measured_profile_in_another_dtype_names_the_dtype():
    """A CPU calibrated in fp32 and bf16 (AMX: bf16 ~3x fp32), the deployment told fp32:
    a rate over fp32's measured figure and under bf16's is the dtype."""
    hw = replace(catalog.hardware("H100", 1), name="CPU", flops={},
                 measured_flops={"fp32": 1e12, "bf16": 3e12})
    dep = Deployment(LLAMA, catalog.model(LLAMA), hw, compute_dtype="fp32",
                     hardware_source="profile")
    est = estimate(dep, 2.0e12 * 10.0)
    found = ceiling.blame(est, dep, "prefill", "flops", est.prefill.ceiling_exceeded["flops"])
    assert (found.points_to, found.dtype) == ("dtype", "bf16")


def test_with_the_engines_counters_the_verdict_gives_no_utilization_for_a_wrong_model():
    """The real vLLM's ~100M model read as Llama-3.1-8B: the engine's FLOPs replace the
    inferred ones, and the prefill chunks sharing decode's steps are rescaled by the same
    count (they were left at the 8B cost: "6.79x the figure taken as achievable"); the
    verdict's resource is unknown, its text the model's sentence, no calibrate."""
    est = estimate(H100, 0.3 * H100.peak_flops * 10.0)
    est = replace(est, shared_step_flops={"decode": 0.5 * est.prefill.flops})
    total = est.prefill.flops + est.decode.flops
    rates = EngineRates(seconds=30.0, samples=15, flops_per_gpu=total / 80 / 30.0)
    counted = with_engine_counters(est, H100, rates)
    assert counted.shared_step_flops["decode"] == pytest.approx(0.5 * counted.prefill.flops)
    v = decide(counted, H100)
    assert v.resource == "unknown" and v.evidence.mismatch is not None
    assert "its hardware use is not given: The configured model looks wrong" in v.text
    assert "calibrate" not in v.text


def test_the_other_phases_flops_past_the_peak_are_a_wrong_input_not_a_bound():
    """Decode's own FLOPs under the peak, with the prefill chunks in its steps 3x past it:
    impossible, so an input is wrong (the model first), never "runs at that ceiling"."""
    est = estimate(H100, 0.5 * H100.peak_flops * 10.0)
    est = replace(est, phase_time_share={"queue": 0.05, "prefill": 0.1, "decode": 0.85},
                  shared_step_flops={"decode": 3.0 * H100.peak_flops * est.decode.busy_seconds})
    v = decide(est, H100)
    assert (v.phase, v.resource) == ("decode", "unknown")
    assert v.evidence.ceiling_exceeded.points_to == "model_or_dtype"
    assert "runs at that ceiling" not in v.text and "calibrate" not in v.text


def test_the_engine_counting_more_than_the_model_costs_is_named_only_far_past_transients():
    """For the model it served, the real vLLM's count over a refresh's range read up to
    4.25x the inferred FLOPs (work in flight the records do not have yet): not the model.
    1/20 is; and nothing is judged before the range holds 20 requests."""
    est = estimate(H100, 0.3 * H100.peak_flops * 10.0)
    total = est.prefill.flops + est.decode.flops
    for engine_over, named in ((4.25, False), (20.0, True)):
        rates = EngineRates(seconds=30.0, samples=15,
                            flops_per_gpu=total * engine_over / 30.0)
        counted = with_engine_counters(est, H100, rates)
        assert (ceiling.model_mismatch(counted, H100) is not None) == named, engine_over
    few = replace(with_engine_counters(est, H100, EngineRates(
        seconds=30.0, samples=15, flops_per_gpu=total / 80 / 30.0)), requests=12)
    assert ceiling.model_mismatch(few, H100) is None
