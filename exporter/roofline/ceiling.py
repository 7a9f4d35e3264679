"""What an achieved rate above a hardware ceiling points to, said once for the verdict,
the log and the JSON API.

A phase's FLOPs and bytes are the configured model's cost per token times the tokens
the records carry (or the engine's own counters where scraped), over the time the
records show. A rate above the datasheet peak (or a measured profile's, where there is
no datasheet) is impossible, so one of the three inputs is wrong, and "recalibrate"
is the right advice for only one of them. Told a 100M-parameter model was
Llama-3.1-8B, phasewatch computed 80x the real FLOPs and said "run phasewatch
calibrate" to a user who just had. The evidence, in order:

1. **The model**: the engine counts its own FLOPs (vLLM ``--enable-mfu-metrics``) and
   the configured model's cost for the same tokens is far from that count
   (``MODEL_COST_RATIO``): the engine serves another model than ``--model`` names.
2. **The dtype**: the rate fits under another dtype's ceiling of the same part (FP8
   where bf16 is configured; a profile measured in another dtype): the engine computes
   in that dtype.
3. **The ceiling**: the engine's own counters are above the ceiling too (the count is
   the engine's, not the model's cost): the hardware figure or the GPU count is wrong;
   only here is ``phasewatch calibrate`` the advice.
4. Otherwise both, the model first: token rates at the configured model's cost need
   more than the part can do; the model is the likelier mistake (a local path or an
   alias served under another name), then the compute dtype and the GPU count.
"""

from __future__ import annotations

from dataclasses import dataclass

from phasewatch.roofline.estimate import Deployment, RooflineEstimate
from phasewatch.roofline.inputs import ENGINE_COUNTERS

# How far the configured model's cost of the window's tokens and the engine's own count
# of the same work may be apart before the model is named. The engine's count over a
# range is its rate over the last window of wall time (``with_engine_counters``), which
# holds work the records do not have yet (requests in flight, preempted prompts redone):
# on the real vLLM, for the model it served, the engine counted up to 4.25x the inferred
# FLOPs on some refreshes (prefill_heavy, kv_pressure) and 1.04x over the whole run. So
# a configured model that costs 4x what the engine counts is named (an 8B before the
# served ~100M model read 93x), one that costs less only at 1/16, and neither before the
# range holds ``MODEL_MIN_REQUESTS`` requests.
MODEL_COST_RATIO = 4.0  # configured / engine: the configured model is too large
MODEL_COST_RATIO_BELOW = 1 / 16  # configured / engine: too small
MODEL_MIN_REQUESTS = 20


def _model_off(cost: float | None, est: RooflineEstimate) -> bool:
    return cost is not None and est.requests >= MODEL_MIN_REQUESTS and not (
        MODEL_COST_RATIO_BELOW < cost < MODEL_COST_RATIO)


@dataclass(frozen=True)
class CeilingBlame:
    """Which input an exceeded ceiling points to: ``model``, ``dtype``, ``ceiling`` or
    ``model_or_dtype``, in a sentence with its numbers."""

    points_to: str
    text: str
    model_cost_ratio: float | None = None  # configured model's cost / engine's count
    dtype: str | None = None  # the dtype whose ceiling the rate fits under


def model_cost_ratio(est: RooflineEstimate, key: str = "flops") -> float | None:
    """The configured model's cost of the window's tokens over the engine's own count of
    the same work (``key``: flops or bytes), where the engine's counters replaced the
    inference (``engine_view.with_engine_counters`` keeps the inferred figures)."""
    if est.inputs.get(key) != ENGINE_COUNTERS:
        return None
    engine = sum(getattr(p, key) for p in (est.prefill, est.decode) if p is not None)
    inferred = sum(v[key] for v in est.inferred.values())
    return inferred / engine if engine > 0 and inferred > 0 else None


def _other_dtype(dep: Deployment, achieved: float) -> str | None:
    """A dtype of the same part (datasheet or measured) whose ceiling ``achieved`` FLOP/s
    fits under, other than the configured one."""
    hw = dep.hardware
    ceilings = {**hw.flops, **hw.measured_flops}
    fits = [d for d, v in ceilings.items() if d != dep.compute_dtype and v >= achieved]
    return min(fits, key=ceilings.get) if fits else None


def blame(est: RooflineEstimate, dep: Deployment, phase: str, what: str, ratio: float
          ) -> CeilingBlame:
    """What ``phase``'s ``what`` ceiling (flops or bandwidth), exceeded ``ratio`` times,
    points to (the module docstring's order)."""
    hw = dep.hardware
    over = (f"{phase} achieved {ratio:.2f}x the {what} ceiling of {hw.name} x{hw.gpus} "
            f"({dep.compute_dtype})")
    cost = model_cost_ratio(est, "flops" if what == "flops" else "bytes")
    if _model_off(cost, est):
        return CeilingBlame("model", (
            f"{over}, and the engine's own counters count {1 / cost:.3g}x the work "
            f"{dep.model.name} would need for the same tokens: the engine serves another "
            f"model than the one configured (--model or --hf-config), so the roofline is "
            "computed for the wrong model"), cost)
    # the rate the ratio stands for (with the other phase's FLOPs in its steps where the
    # verdict counted them), against the peak
    dtype = _other_dtype(dep, ratio * dep.peak_flops) if what == "flops" else None
    if dtype is not None:
        return CeilingBlame("dtype", (
            f"{over}, and fits under its {dtype} ceiling: the engine computes in {dtype}, "
            f"not {dep.compute_dtype}; set --compute-dtype {dtype}"), cost, dtype)
    if cost is not None:  # the engine's own count is over the ceiling too
        return CeilingBlame("ceiling", (
            f"{over} by the engine's own counters: the ceiling is wrong for this part "
            f"(check --gpus, now {hw.gpus}, and --compute-dtype; where the ceiling is "
            f"measured, run `phasewatch calibrate` in {dep.compute_dtype} on this "
            "hardware and pass --hardware-profile)"), cost)
    return CeilingBlame("model_or_dtype", (
        f"{over} at the cost per token of {dep.model.name}: the engine most likely serves "
        f"a smaller model than the one configured (check --model or --hf-config against "
        f"the model it serves), else the compute dtype ({dep.compute_dtype}) or the GPU "
        f"count ({hw.gpus}) is wrong"))


def model_mismatch(est: RooflineEstimate, dep: Deployment) -> str | None:
    """A sentence where the engine's own FLOP counter and the configured model's cost of
    the same tokens are ``MODEL_COST_RATIO`` or more apart (the model configured is not
    the one served), whether or not a ceiling was exceeded; else None."""
    cost = model_cost_ratio(est, "flops")
    if not _model_off(cost, est):
        return None
    return (f"The configured model looks wrong: the engine's own counters count "
            f"{1 / cost:.3g}x the FLOPs {dep.model.name} would need for the same tokens, so "
            "it serves another model; set --model or --hf-config to the one it serves "
            "(the roofline's bytes and ceilings are computed for the configured one)")
