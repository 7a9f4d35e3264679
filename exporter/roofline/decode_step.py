"""The decode step against the roofline's step at the same batch: the verdict's evidence
(``step_evidence``), its sentence (``step_sentence``) and, for an overhead-bound decode,
the levers it tells apart (``overhead_levers``). From the estimate's
``decode_step_*`` figures (``estimate.RooflineEstimate``; ``intervals.step_by_batch``)."""

from __future__ import annotations

from phasewatch.roofline.estimate import RooflineEstimate

# a decode step that stays within this factor while the batch grows is flat: a per-step
# cost the batch does not change
FLAT_STEP = 1.15


def step_evidence(est: RooflineEstimate) -> dict:
    """The decode step against the roofline's step at the same batch, and how the step
    moved with the batch (``RooflineEstimate.decode_step_*``)."""
    out = {}
    step, roof = est.decode_step_seconds, est.decode_step_roofline_seconds
    if step and roof:
        out.update(decode_step_seconds=step, roofline_step_seconds=roof,
                   step_over_roofline=step / roof)
        if est.decode_step_weights_seconds:
            out["weights_step_seconds"] = est.decode_step_weights_seconds
    if est.decode_step_by_batch:
        out["step_by_batch"] = est.decode_step_by_batch
    return out


def flat_step(evidence: dict) -> dict | None:
    """``step_by_batch`` where the step stayed flat while the batch grew, else None."""
    by = evidence.get("step_by_batch")
    return by if by and by["growth"] <= FLAT_STEP else None


def overhead_levers(evidence: dict) -> tuple[str, ...] | None:
    """An overhead-bound decode's levers where its step is measured against the
    roofline's: what each does to ITL and throughput (a flat step: more concurrent
    requests cost ITL little); None without the step."""
    if "step_over_roofline" in evidence:
        flat = flat_step(evidence)
        batches = "larger batches" + (
            f": the step stayed flat from a batch of {flat['batch_low']:.0f} to "
            f"{flat['batch_high']:.0f}, so more concurrent requests raise throughput at "
            "little cost to ITL" if flat is not None else "")
        return ("CUDA graphs, a compiled model or a faster serving engine: the per-step "
                "overhead sets ITL", batches, "fewer tiny requests")
    return None


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 0.01 else f"{seconds * 1e3:.0f} ms"


def step_sentence(e: dict, overhead: bool) -> str:
    """The decode step against the roofline's at the same batch, and how it moved with
    the batch (read as the resource has it: a flat step far from the roofline is the
    server's per-step cost, near it the weights read once a step); "" without the
    figures."""
    if "step_over_roofline" not in e:
        return ""
    batch = e.get("decode_batch_size")
    at = f" at a batch of {batch:.1f}" if batch else ""
    text = (f"A decode step takes {_ms(e['decode_step_seconds'])}{at}, "
            f"{e['step_over_roofline']:.1f}x the {_ms(e['roofline_step_seconds'])} the "
            "roofline allows it")
    if e.get("weights_step_seconds"):
        text += (f" (the weights alone: {_ms(e['weights_step_seconds'])} at the achievable "
                 "bandwidth)")
    by = e.get("step_by_batch")
    if by:
        moved = (f"from a batch of {by['batch_low']:.0f} to {by['batch_high']:.0f} the step "
                 f"went from {_ms(by['step_low'])} to {_ms(by['step_high'])}")
        if by["growth"] <= FLAT_STEP:
            text += (f"; {moved}: flat, a per-step cost the batch does not change" if overhead
                     else f"; {moved}: flat, the weights read once a step set it, so a larger "
                     "batch costs little")
        else:
            text += (f"; {moved}: far from the roofline, the per-request work of each step "
                     "grows with it" if overhead else
                     f"; {moved}: the traffic that grows with the batch (the KV cache) sets it")
    return text + ". "
