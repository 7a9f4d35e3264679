"""The verdict's evidence as typed records (``verdict.decide`` builds them,
``verdict_text.describe`` and ``bottleneck`` read them); ``Evidence.as_dict`` is the JSON
API's ``verdict.evidence``, key for key and in the same order as it always was.

What the roofline found for the phase (``verdict._utilization``) is one of three records:

* ``Utilization``: the phase's operating point against both ceilings (MFU, MBU, the shares
  of the achievable figures);
* ``CeilingExceeded``: an achieved rate above a peak, and what ``ceiling.blame`` says is
  wrong;
* ``ModelMismatch``: the configured model cannot be the one served
  (``ceiling.model_mismatch``);

or none of them (no deployment, no estimate for the phase, no FLOP/s ceiling: the reason
is then ``Evidence.unavailable``).
"""

from __future__ import annotations

from dataclasses import dataclass

from phasewatch.roofline.decode_step import DecodeStep
from phasewatch.roofline.gpu_check import GpuCheck
from phasewatch.roofline.slo_verdict import Attainment


@dataclass(frozen=True)
class Utilization:
    """A phase's operating point against the roofline: MFU and MBU against the peaks, the
    shares of the achievable figures (capped at 1), and where a share went past 1, by how
    much (``over_achievable``: the phase runs at that ceiling)."""

    mfu: float
    mbu: float
    shared_step_flops_share: float  # the other phase's FLOPs in the phase's steps
    arithmetic_intensity: float
    ridge: float
    of_achievable_flops: float
    of_achievable_bandwidth: float
    over_achievable: dict[str, float] | None = None  # "flops"/"bandwidth": the ratio

    @property
    def used(self) -> float:
        """The share of busy time the two ceilings explain (at most their sum)."""
        return self.of_achievable_flops + self.of_achievable_bandwidth

    def as_dict(self) -> dict:
        return {"mfu": self.mfu, "mbu": self.mbu,
                "shared_step_flops_share": self.shared_step_flops_share,
                "arithmetic_intensity": self.arithmetic_intensity, "ridge": self.ridge,
                **({"over_achievable": self.over_achievable} if self.over_achievable else {}),
                "of_achievable_flops": self.of_achievable_flops,
                "of_achievable_bandwidth": self.of_achievable_bandwidth}


@dataclass(frozen=True)
class CeilingExceeded:
    """An achieved rate above the peak: the ratios by ceiling ("flops", "bandwidth"), and
    what the evidence points to (``ceiling.blame``)."""

    ratios: dict[str, float]
    points_to: str
    blame: str  # the sentence
    arithmetic_intensity: float

    def as_dict(self) -> dict:
        return {"ceiling_exceeded": dict(self.ratios), "ceiling_points_to": self.points_to,
                "ceiling_blame": self.blame, "arithmetic_intensity": self.arithmetic_intensity}


@dataclass(frozen=True)
class ModelMismatch:
    """The configured model cannot be the one served: every FLOP and byte rests on it."""

    text: str  # ``ceiling.model_mismatch``'s sentence
    arithmetic_intensity: float

    def as_dict(self) -> dict:
        return {"model_mismatch": self.text,
                "arithmetic_intensity": self.arithmetic_intensity}


Roofline = Utilization | CeilingExceeded | ModelMismatch


@dataclass(frozen=True)
class Evidence:
    """What a verdict rests on. ``decide`` fills the window's part; ``bottleneck`` adds how
    busy the engine was (``busy_share``, ``idle``) and a model mismatch found before the
    phase was (``model_mismatch``), with ``dataclasses.replace``."""

    phase_time_share: dict[str, float] | None = None
    requests: int | None = None
    slo: Attainment | None = None  # the objectives, ranked (``slo_verdict.rank``)
    decode_batch_size: float | None = None
    roofline: Roofline | None = None
    unavailable: str | None = None  # why the hardware use cannot be estimated
    step: DecodeStep | None = None  # a decode's step against the roofline's
    view: str | None = None  # "client" for a verdict from a stream tap's records alone
    engine_prefill: bool = False  # its prefill timed by the engine's mean (ENGINE_PREFILL)
    busy_share: float | None = None
    idle: bool = False  # told "Nothing to fix"
    model_mismatch: str | None = None  # ``ceiling.model_mismatch``, found by the monitor
    gpu: GpuCheck | None = None  # the GPU's own counters over the range (``gpu_check``)

    @property
    def utilization(self) -> Utilization | None:
        return self.roofline if isinstance(self.roofline, Utilization) else None

    @property
    def ceiling_exceeded(self) -> CeilingExceeded | None:
        return self.roofline if isinstance(self.roofline, CeilingExceeded) else None

    @property
    def mismatch(self) -> str | None:
        """The model mismatch, from the roofline's record or the monitor's."""
        if isinstance(self.roofline, ModelMismatch):
            return self.model_mismatch or self.roofline.text
        return self.model_mismatch

    @property
    def ranked_by_misses(self) -> bool:
        return self.slo is not None and self.slo.ranked_by == "misses"

    def as_dict(self) -> dict:
        """The JSON API's ``verdict.evidence`` (keys absent where the figure is)."""
        out: dict = {}
        if self.phase_time_share is not None:
            out["phase_time_share"] = self.phase_time_share
        if self.requests is not None:
            out["requests"] = self.requests
        if self.slo is not None:
            out["slo"] = self.slo.as_dict()
        if self.decode_batch_size is not None:
            out["decode_batch_size"] = self.decode_batch_size
        if self.roofline is not None:
            out.update(self.roofline.as_dict())
            if self.model_mismatch is not None and "model_mismatch" in out:
                out["model_mismatch"] = self.model_mismatch  # the monitor's, in its place
        if self.unavailable is not None:
            out["unavailable"] = self.unavailable
        if self.step is not None:
            out.update(self.step.evidence())
        if self.view is not None:
            out["view"] = self.view
        if self.busy_share is not None:
            out["busy_share"] = self.busy_share
        if self.idle:
            out["idle"] = True
        if self.model_mismatch is not None and "model_mismatch" not in out:
            out["model_mismatch"] = self.model_mismatch
        if self.gpu is not None:
            out["gpu"] = self.gpu.summary()
        return out
