"""The verdict checked against the GPU's own counters (docs/verdict.md, "The GPU's own
counters"): the rules as data, and what each finding does to the verdict.

In order, over the estimate's range, for the model's GPUs (``gpu_evidence.compare``):

1. **overstated**: the estimate's DRAM or tensor share is ``OVERSTATED`` times the
   counter's or more. The estimate is the least the work takes, so the configured model,
   dtype or GPU count is wrong: said first, with the numbers, and no roofline resource is
   claimed (``unknown``), as for an achieved rate above the peak.
2. **idle**: the engine had a request in prefill or decode most of the range and the
   GPU's tensor pipes and DRAM were both nearly idle (``gpu_evidence.IDLE``): whatever
   the records suggest, the GPU did not hold the requests up; a roofline resource
   (compute, memory bandwidth) becomes ``overhead``, with the counters as its evidence.
   A capacity cause (a full KV cache, a slot limit) stands: waiting for memory or a slot
   leaves the GPU idle too; the counters are added to its evidence.
3. **confirmed** / **not confirmed**: a compute-bound claim against tensor activity, a
   bandwidth-bound one against DRAM activity, each while the engine was busy (the
   counter over the range divided by the busy share: a GPU idle half the range reads
   half its busy activity). At ``BOUND_ACTIVITY`` or more the counter confirms the
   claim; under it the claim stands on the estimate alone and the verdict says so.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from phasewatch.roofline.estimate import Deployment, RooflineEstimate
from phasewatch.roofline.gpu_evidence import IDLE, GpuComparison, compare
from phasewatch.roofline.gpu_watch import GpuWatch

# activity while busy at which the counters confirm a bound claim: a phase bound by a
# ceiling runs at BOUND_FRACTION (0.6) of the achievable figure or more, and the
# counters read ~0.89 (DRAM, a streaming copy) and ~0.94 (tensor, a bf16 GEMM) at the
# achievable one: 0.6 x 0.89 is about 0.5
BOUND_ACTIVITY = 0.5
ROOFLINE_RESOURCES = ("compute", "memory_bandwidth", "overhead")
CLAIMED_COUNTER = {"compute": "tensor", "memory_bandwidth": "dram"}


@dataclass(frozen=True)
class GpuCheck:
    """What the counters say of one verdict: ``outcome`` (overstated, idle, confirmed,
    not_confirmed, or unchecked: no counter bears on the claim), the sentence the verdict
    adds, and the resource it takes instead (None: unchanged)."""

    comparison: GpuComparison
    outcome: str
    sentence: str
    resource: str | None = None
    point: dict | None = None  # the roofline chart's two points (``range_point``)

    def summary(self) -> dict:
        """For the JSON API: the outcome, the counters and the estimate beside them."""
        c = self.comparison
        return {"outcome": self.outcome, "counters": c.counters.summary(),
                "dram_estimated": c.dram_estimated, "dram_measured": c.dram_measured,
                "dram_ratio": c.dram_ratio, "tensor_estimated": c.tensor_estimated,
                "tensor_measured": c.tensor_measured, "tensor_ratio": c.tensor_ratio,
                "engine_busy": c.engine_busy, "sentence": self.sentence,
                "resource": self.resource, "point": self.point}


def _while_busy(measured: float | None, busy: float | None) -> float | None:
    if measured is None:
        return None
    return min(measured / busy, 1.0) if busy else measured


def check(c: GpuComparison, resource: str, model: str, dtype: str, gpus: int) -> GpuCheck:
    """The counters' finding for a verdict whose resource is ``resource``; ``model``,
    ``dtype`` and ``gpus`` the configured ones, named when the estimate exceeds them."""
    over = c.overstated_sentence(model, dtype, gpus)
    if over:
        counted = len(c.counters.gpus)
        if counted != gpus:
            over += (f"; the counters read {counted} GPU{'s' if counted != 1 else ''}, "
                     f"the deployment says {gpus}")
        return GpuCheck(c, "overstated", over[0].upper() + over[1:] + ".",
                        "unknown" if resource in ROOFLINE_RESOURCES else None)
    activity = c.activity_sentence()
    if c.idle(IDLE):
        busy = f"{c.engine_busy:.0%}" if c.engine_busy is not None else "most"
        if resource in ROOFLINE_RESOURCES:
            return GpuCheck(c, "idle", f"The GPU was nearly idle while the engine had work "
                            f"{busy} of the range: {activity}. The time goes to overhead "
                            "(the host, the scheduler, launches, small batches), not to "
                            "the GPU.", "overhead")
        return GpuCheck(c, "idle", f"GPU counters: {activity}.")
    counter = CLAIMED_COUNTER.get(resource)
    measured = None if counter is None else (
        c.tensor_measured if counter == "tensor" else c.dram_measured)
    if counter is None or measured is None:
        return GpuCheck(c, "unchecked", f"GPU counters: {activity}." if activity else "")
    busy_activity = _while_busy(measured, c.engine_busy)
    what = "tensor pipes" if counter == "tensor" else "DRAM"
    if busy_activity >= BOUND_ACTIVITY:
        return GpuCheck(c, "confirmed", f"The GPU's counters agree: its {what} were active "
                        f"{busy_activity:.0%} of the time the engine was busy ({activity}).")
    return GpuCheck(c, "not_confirmed", f"The GPU's counters do not confirm it: its {what} "
                    f"were active {busy_activity:.0%} of the time the engine was busy, under "
                    f"the {BOUND_ACTIVITY:.0%} a bound phase reads ({activity}).")


def range_point(c: GpuComparison, flops: float, nbytes: float, range_seconds: float,
                peak_bandwidth: float, at: float) -> dict | None:
    """The roofline chart's two points for the range: the estimate's work at its intensity
    (FLOPs over bytes, FLOPs over the range) and, at the same intensity, the FLOP/s the
    DRAM traffic the GPU counted would carry (its DRAM share x the datasheet bandwidth):
    the counted one sits higher by 1 / ``dram_ratio``. None without the figures."""
    measured = c.dram_measured
    if not (flops > 0 and nbytes > 0 and range_seconds > 0 and measured and peak_bandwidth):
        return None
    intensity = flops / nbytes
    return {"at": at, "arithmetic_intensity": intensity,
            "estimated_flops_per_second": flops / range_seconds,
            "measured_flops_per_second": intensity * measured * peak_bandwidth}


def for_estimate(gpus: GpuWatch | None, model: str, est: RooflineEstimate,
                 dep: Deployment | None, busy: float | None, resource: str) -> GpuCheck | None:
    """``model``'s GPUs' counters over ``est``'s range beside its traffic and work
    (``gpu_evidence.compare``: ``busy`` the share of the range the engine had a request in
    prefill or decode), what they say of a verdict on ``resource`` (``check``) and the
    chart's points; None without counters there or a roofline."""
    if gpus is None or dep is None:
        return None
    lo, hi = est.range_start, est.range_end
    (pf, pb), (df, db) = (((p.flops, p.bytes) if p is not None else (0.0, 0.0))
                          for p in (est.prefill, est.decode))
    found = compare(gpus.window(model, lo, hi), pb, db, pf, df, hi - lo, dep.peak_bandwidth,
                    dep.peak_flops, busy)
    if found is None:
        return None
    result = check(found, resource, dep.model.name, dep.compute_dtype, dep.hardware.gpus)
    return replace(result, point=range_point(found, pf + df, pb + db, hi - lo,
                                             dep.peak_bandwidth, hi))
