"""The decode step against the roofline's step at the same batch: the verdict's evidence
(``DecodeStep.evidence``), its sentence (``step_sentence``) and, for an overhead-bound decode,
the levers it tells apart (``overhead_levers``). From the estimate's
``decode_step_*`` figures (``estimate.RooflineEstimate``; ``intervals.step_by_batch``)."""

from __future__ import annotations

from dataclasses import dataclass

from phasewatch.roofline.estimate import RooflineEstimate

# a decode step that stays within this factor while the batch grows is flat: a per-step
# cost the batch does not change
FLAT_STEP = 1.15


@dataclass(frozen=True)
class DecodeStep:
    """The window's decode step against the roofline's step at the same batch
    (``RooflineEstimate.decode_step_*``), and how the step moved with the batch."""

    seconds: float | None
    roofline_seconds: float | None
    weights_seconds: float | None = None  # the weights' part of the roofline's step
    by_batch: dict | None = None  # intervals.step_by_batch: the JSON API's figures
    batch: float | None = None  # the decode batch it was measured at

    @classmethod
    def of(cls, est: RooflineEstimate) -> DecodeStep:
        return cls(est.decode_step_seconds, est.decode_step_roofline_seconds,
                   est.decode_step_weights_seconds, est.decode_step_by_batch,
                   est.decode_batch_size)

    @property
    def measured(self) -> bool:
        """Both the step and the roofline's step are known."""
        return bool(self.seconds and self.roofline_seconds)

    @property
    def flat(self) -> dict | None:
        """``by_batch`` where the step stayed flat while the batch grew, else None."""
        by = self.by_batch
        return by if by and by["growth"] <= FLAT_STEP else None

    def evidence(self) -> dict:
        """The verdict's evidence: the step against the roofline's, by the batch."""
        out = {}
        if self.measured:
            out.update(decode_step_seconds=self.seconds,
                       roofline_step_seconds=self.roofline_seconds,
                       step_over_roofline=self.seconds / self.roofline_seconds)
            if self.weights_seconds:
                out["weights_step_seconds"] = self.weights_seconds
        if self.by_batch:
            out["step_by_batch"] = self.by_batch
        return out


def overhead_levers(step: DecodeStep | None) -> tuple[str, ...] | None:
    """An overhead-bound decode's levers where its step is measured against the
    roofline's: what each does to ITL and throughput (a flat step: more concurrent
    requests cost ITL little); None without the step."""
    if step is None or not step.measured:
        return None
    flat = step.flat
    batches = "larger batches" + (
        f": the step stayed flat from a batch of {flat['batch_low']:.0f} to "
        f"{flat['batch_high']:.0f}, so more concurrent requests raise throughput at "
        "little cost to ITL" if flat is not None else "")
    return ("CUDA graphs, a compiled model or a faster serving engine: the per-step "
            "overhead sets ITL", batches, "fewer tiny requests")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 0.01 else f"{seconds * 1e3:.0f} ms"


def step_sentence(step: DecodeStep | None, overhead: bool) -> str:
    """The decode step against the roofline's at the same batch, and how it moved with
    the batch (read as the resource has it: a flat step far from the roofline is the
    server's per-step cost, near it the weights read once a step); "" without the
    figures."""
    if step is None or not step.measured:
        return ""
    at = f" at a batch of {step.batch:.1f}" if step.batch else ""
    text = (f"A decode step takes {_ms(step.seconds)}{at}, "
            f"{step.seconds / step.roofline_seconds:.1f}x the {_ms(step.roofline_seconds)} "
            "the roofline allows it")
    if step.weights_seconds:
        text += (f" (the weights alone: {_ms(step.weights_seconds)} at the achievable "
                 "bandwidth)")
    by = step.by_batch
    if by:
        moved = (f"from a batch of {by['batch_low']:.0f} to {by['batch_high']:.0f} the step "
                 f"went from {_ms(by['step_low'])} to {_ms(by['step_high'])}")
        if step.flat:
            text += (f"; {moved}: flat, a per-step cost the batch does not change" if overhead
                     else f"; {moved}: flat, the weights read once a step set it, so a larger "
                     "batch costs little")
        else:
            text += (f"; {moved}: far from the roofline, the per-request work of each step "
                     "grows with it" if overhead else
                     f"; {moved}: the traffic that grows with the batch (the KV cache) sets it")
    return text + ". "
