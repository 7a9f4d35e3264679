"""What the GPU's own counters found (``gpu_check``), told to the verdict: the sentence
in its text, the resource it takes instead with that resource's levers, and the finding in
its evidence (``Evidence.gpu``, the JSON API's ``verdict.evidence.gpu``)."""

from __future__ import annotations

from dataclasses import replace

from phasewatch.aggregation.columns import WindowColumns
from phasewatch.roofline.cause import busy_share
from phasewatch.roofline.estimate import Deployment, RooflineEstimate
from phasewatch.roofline.gpu_check import GpuCheck, for_estimate
from phasewatch.roofline.gpu_watch import GpuWatch
from phasewatch.roofline.verdict import LEVERS, Verdict


def apply(verdict: Verdict, found: GpuCheck) -> None:
    """What the counters found, into ``verdict``: an overstated estimate or an idle GPU
    is said first and takes the resource ``found.resource`` (with that resource's levers
    from the verdict's table, unless a cause set its own); a check of a bound claim
    follows the text. The counters go in the evidence as ``gpu``."""
    if found.resource is not None and found.resource != verdict.resource:
        verdict.resource = found.resource
        if verdict.cause is None or not verdict.cause.levers:
            verdict.levers = LEVERS.get((verdict.phase, found.resource), ())
    verdict.evidence = replace(verdict.evidence, gpu=found)
    if not found.sentence:
        return
    if found.outcome in ("overstated", "idle"):
        verdict.prepend(found.sentence)
    else:
        verdict.text = f"{verdict.text} {found.sentence}".strip()


def for_verdict(gpus: GpuWatch | None, model: str, est: RooflineEstimate,
                dep: Deployment | None, cols: WindowColumns,
                verdict: Verdict | None) -> GpuCheck | None:
    """``for_estimate`` over the range of ``est`` (the engine's busy share from ``cols``,
    its records), and what it found told to ``verdict`` (``apply``)."""
    if gpus is None or dep is None:
        return None
    busy = busy_share(cols, est.range_start, est.range_end)
    found = for_estimate(gpus, model, est, dep, busy,
                         verdict.resource if verdict is not None else "")
    if found is not None and verdict is not None:
        apply(verdict, found)
    return found
