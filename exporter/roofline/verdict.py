"""The bottleneck verdict: which phase dominates request time and what limits it.

The rules and the levers are data, here and nowhere else (the numbers in
``cause_limits.Thresholds``; docs/verdict.md, "The roofline and the verdict"):

1. The **phase** is the one with the largest share of request time (preprocess,
   queue, prefill, decode). To move away from the current verdict's phase, another
   phase's share must exceed it by ``HYSTERESIS``.
2. The **resource**: a dominant queue means ``capacity`` (requests wait for a
   slot); a dominant preprocess means ``frontend``: the time goes before the
   engine's queue (templating, tokenisation, multimodal inputs, the hand-off, the
   first output's trip back), to the API server's CPU, not the GPU. For prefill
   or decode, the phase's operating point is compared with both ceilings of the
   roofline, each taken as *achievable* (measured, or the datasheet x a typical
   efficiency): whichever ceiling it is nearer is the
   candidate (``compute`` or ``memory_bandwidth``); when even that one is used
   less than ``BOUND_FRACTION``, the time goes neither to arithmetic nor to
   memory traffic but to ``overhead`` (scheduling, launches, small batches). With
   chunked prefill a decode step may also carry a prefill chunk: its FLOPs count
   toward the decode steps' compute (see ``_utilization``).
   The threshold moves by ``HYSTERESIS`` in favour of the current verdict.
3. **Confidence** grows with the sample size, the margins over the thresholds,
   and the quality of the inputs (emission times beat TPOT).
4. The **cause** (``cause.diagnose``, from the engine's own state where it is
   scraped) comes last and wins where it knows better: a full KV cache, a slot limit
   or an imbalance make the resource ``capacity`` whatever the phase, and a cause's
   levers replace the (phase, resource) ones.
5. **Objectives first** (``slo_verdict``): with latency objectives set and enough
   requests, an objective missed by a material share makes the phase the one that broke
   the most misses, before rule 1, and the text starts with the misses (or with the
   attainment when every objective was met).
6. **Honest ceilings**: an achieved rate above the peak (datasheet, or measured where
   there is no datasheet) is impossible: the configured model, the dtype or the ceiling
   is wrong, and ``ceiling.blame`` says which the evidence points to, instead of a
   percentage over 100; the resource is ``unknown``. A rate over the *achievable*
   figure but under the peak runs at that ceiling: bound by it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from phasewatch.roofline import ceiling
from phasewatch.roofline.cause import Cause
from phasewatch.roofline.cause_limits import RULES
from phasewatch.roofline.decode_step import DecodeStep, overhead_levers
from phasewatch.roofline.estimate import Deployment, RooflineEstimate
from phasewatch.roofline.evidence import (
    CeilingExceeded,
    Evidence,
    ModelMismatch,
    Roofline,
    Utilization,
)
from phasewatch.roofline.inputs import ENGINE_PREFILL
from phasewatch.roofline.slo_verdict import Attainment
from phasewatch.roofline.slo_verdict import interference_cause as slo_interference
from phasewatch.roofline.slo_verdict import lead as slo_lead
from phasewatch.roofline.slo_verdict import rank as slo_rank
from phasewatch.roofline.verdict_text import (
    CLIENT_NOTE,
    ENGINE_PREFILL_NOTE,
    describe,
    headline,
)

BOUND_FRACTION = RULES.bound
PEAK_TOLERANCE = RULES.peak_tolerance
HYSTERESIS = RULES.hysteresis
MIN_REQUESTS_FOR_FULL_CONFIDENCE = RULES.full_confidence_requests
# phases whose time goes to waiting, not to the GPU, and the resource that limits them
WAITING = {"queue": "capacity", "preprocess": "frontend", "kv_transfer": "interconnect"}
RESOURCES = ("compute", "memory_bandwidth", "capacity", "frontend", "interconnect", "overhead",
             "unknown")

# Levers by (phase, resource), as docs/verdict.md's table lists them
# (tests/roofline/test_verdict.py).
LEVERS: dict[tuple[str, str], tuple[str, ...]] = {
    ("prefill", "compute"): (
        "prompt (prefix) caching", "chunked prefill", "tensor parallelism", "FP8",
        "shorter prompts", "faster GPUs"),
    ("decode", "memory_bandwidth"): (
        "weight quantization", "KV-cache quantization", "speculative decoding",
        "larger batches", "GQA/MQA models", "higher-bandwidth GPUs"),
    ("queue", "capacity"): (
        "more replicas", "admission control", "disaggregated prefill/decode"),
    ("preprocess", "frontend"): (
        "more API-server processes (vLLM --api-server-count)",
        "a fast (Rust) tokenizer and a lighter chat template",
        "send token ids instead of text", "move multimodal preprocessing off the API server",
        "more CPU for the serving pod"),
    ("kv_transfer", "interconnect"): (
        "a faster KV transport (RDMA / NIXL / Mooncake instead of TCP)",
        "prefill and decode servers on the same node or NVLink domain",
        "KV-cache quantization (fewer bytes to send)", "prefix caching on the decode side",
        "fewer prefill servers per decode server if the transfer queue backs up"),
    ("prefill", "overhead"): ("larger batches", "CUDA graphs", "fewer tiny requests"),
    ("decode", "overhead"): ("larger batches", "CUDA graphs", "fewer tiny requests"),
    ("prefill", "memory_bandwidth"): (
        "batch more prompts per step (raise max_num_batched_tokens)", "weight quantization",
        "prompt (prefix) caching"),
    ("decode", "compute"): (
        "FP8", "tensor parallelism", "disaggregated prefill/decode", "faster GPUs"),
}

@dataclass
class Verdict:
    phase: str
    resource: str
    confidence: float
    confidence_level: str
    evidence: Evidence = field(default_factory=Evidence)
    levers: tuple[str, ...] = ()
    text: str = ""
    cause: Cause | None = None
    lead: str = ""  # the objectives' sentence the text starts with ("" without objectives)
    view: str = "engine"  # "client": from a stream tap's records alone (no engine spans)

    @property
    def step(self) -> DecodeStep | None:
        """A decode's step against the roofline's (``Evidence.step``)."""
        return self.evidence.step

    @property
    def headline(self) -> str:
        return headline(self.phase, self.resource, self.cause.name if self.cause else None)

    def prepend(self, sentence: str) -> None:
        """Put ``sentence`` at the front of the text, after the objectives' sentence."""
        body = self.text[len(self.lead):].lstrip() if self.lead and \
            self.text.startswith(self.lead) else self.text
        self.text = " ".join(x for x in (self.lead, sentence, body) if x)


def _utilization(est: RooflineEstimate, dep: Deployment, phase: str
                 ) -> tuple[str, float | None, Roofline | None, str | None]:
    """(candidate resource, share of busy time the two resources explain, what the
    roofline found, why it found nothing).

    The candidate is the ceiling the phase is nearer (an intensity above the ridge
    reaches the FLOP/s ceiling first). Compute counts every FLOP done in the phase's
    steps, including the other phase's work in mixed steps (a prefill chunk in a
    decode step). A step lasts at least max(FLOPs / achievable FLOP/s, bytes /
    achievable bandwidth); over a mix of steps, the time the two explain is at most
    the sum of the two shares, so a phase is called overhead-bound only when even
    that sum is under the bound.
    """
    ph = getattr(est, phase)
    wrong = ceiling.model_mismatch(est, dep)
    if ph is not None and wrong is not None:  # every FLOP and byte rests on the model
        return "unknown", None, ModelMismatch(wrong, ph.arithmetic_intensity), None
    if ph is not None and ph.ceiling_exceeded:  # over the datasheet (or the profile's) peak
        return "unknown", None, _exceeded(est, dep, phase, dict(ph.ceiling_exceeded)), None
    if ph is not None and not dep.peak_flops:
        return "unknown", None, None, (
            f"{dep.hardware.name} has no {dep.compute_dtype} FLOP/s ceiling: run `phasewatch "
            f"calibrate` where torch is importable, or set --compute-dtype")
    if ph is None or ph.flops_utilization is None or ph.bandwidth_utilization is None:
        return "unknown", None, None, None
    hw = dep.hardware
    shared = est.shared_step_flops.get(phase, 0.0)
    of_flops = (ph.flops + shared) / ph.busy_seconds / hw.achievable_flops(dep.compute_dtype)
    of_bw = ph.achieved_bytes_per_second / hw.achievable_bandwidth
    # Under the peak but over the *achievable* figure (a typical efficiency, or parts
    # measured elsewhere): the phase runs at that ceiling, not past a wrong one (the
    # demo's simulator prefills at exactly the achievable FLOP/s, and the decode tokens
    # sharing its steps tipped it to 1.01x: "the ceiling is wrong, recalibrate").
    over = {k: v for k, v in (("flops", of_flops), ("bandwidth", of_bw)) if v > 1.0}
    peak = {"flops": of_flops * hw.achievable_flops(dep.compute_dtype) / dep.peak_flops,
            "bandwidth": of_bw * hw.achievable_bandwidth / dep.peak_bandwidth
            if dep.peak_bandwidth else 0.0}
    past = {k: peak[k] for k in over if peak[k] > 1.0 + PEAK_TOLERANCE}
    if past:  # with the other phase's FLOPs in its steps, past the peak: impossible too
        return "unknown", None, _exceeded(est, dep, phase, past), None
    of_flops, of_bw = min(of_flops, 1.0), min(of_bw, 1.0)
    found = Utilization(
        mfu=ph.flops_utilization, mbu=ph.bandwidth_utilization,
        shared_step_flops_share=shared / (ph.flops + shared) if shared else 0.0,
        arithmetic_intensity=ph.arithmetic_intensity, ridge=dep.ridge,
        of_achievable_flops=of_flops, of_achievable_bandwidth=of_bw, over_achievable=over or None)
    return ("compute" if of_flops >= of_bw else "memory_bandwidth"), found.used, found, None


def _exceeded(est: RooflineEstimate, dep: Deployment, phase: str,
              ratios: dict[str, float]) -> CeilingExceeded:
    """A rate past a peak, and what ``ceiling.blame`` says is wrong (the worst ratio)."""
    what, ratio = max(ratios.items(), key=lambda kv: kv[1])
    found = ceiling.blame(est, dep, phase, what, ratio)
    return CeilingExceeded(ratios, found.points_to, found.text,
                           getattr(est, phase).arithmetic_intensity)


def decide(est: RooflineEstimate, dep: Deployment | None, previous: Verdict | None = None,
           diagnose=None, slo: Attainment | None = None) -> Verdict | None:
    """The verdict for one estimate, with hysteresis against ``previous``; ``diagnose``,
    called with the phase decided, gives its cause (``cause.diagnose`` bound to the
    window's columns and the engine's state) or None; ``slo``, the window's objectives
    (``slo_verdict.attainment``), ranks the phase by misses first (rule 5).

    Without a deployment (a model with no roofline configured) the phase is still
    decided; the resource is then ``capacity`` for a dominant queue, ``frontend`` for
    a dominant preprocess, else ``unknown``.
    """
    shares = est.phase_time_share
    if not shares:
        return None
    phase, by_misses, share_margin = _phase(shares, slo, previous)
    found = _resource(est, dep, phase, previous)
    resource = found.resource
    evidence = Evidence(phase_time_share=shares, requests=est.requests, slo=slo,
                        decode_batch_size=est.decode_batch_size, roofline=found.roofline,
                        unavailable=found.unavailable, step=found.step,
                        view="client" if est.client_view else None,
                        engine_prefill=est.inputs.get("prefill_interval") == ENGINE_PREFILL)
    confidence = _confidence(est, share_margin, found.margin)
    cause = diagnose(phase) if diagnose is not None else None
    if cause is None or cause.name == "compute_saturated":  # objectives know better
        cause = slo_interference(slo, phase) or cause
    if cause is not None and cause.resource is not None:
        resource = cause.resource
    if resource == "unknown":
        confidence = round(confidence * RULES.unknown, 3)
    level = ("high" if confidence >= RULES.high else
             "medium" if confidence >= RULES.medium else "low")
    levers = (cause.levers if cause is not None and cause.levers else
              _levers(phase, resource, found.step, dep))
    verdict = Verdict(phase=phase, resource=resource, confidence=confidence,
                      confidence_level=level, evidence=evidence, levers=levers, cause=cause,
                      lead=slo_lead(slo, by_misses),
                      view="client" if est.client_view else "engine")
    verdict.text = _text(verdict, dep)
    return verdict


def _phase(shares: dict[str, float], slo: Attainment | None, previous: Verdict | None
           ) -> tuple[str, str | None, float]:
    """(the phase, the phase the objectives' misses ranked or None, the margin over the
    runner-up as confidence takes it): rules 5 and 1, with hysteresis."""
    by_misses = slo_rank(slo, shares, previous, HYSTERESIS)
    phase = by_misses or max(shares, key=shares.get)
    if by_misses is None and previous is not None and previous.phase in shares and \
            phase != previous.phase and shares[phase] < shares[previous.phase] + HYSTERESIS:
        phase = previous.phase
    ranked = slo.missed_by_phase if by_misses else shares
    runner_up = max((v for k, v in ranked.items() if k != phase), default=0.0)
    margin = max(0.0, min(1.0, (ranked[phase] - runner_up) / RULES.margin_scale))
    return phase, by_misses, margin


@dataclass(frozen=True)
class _Resource:
    """What limits a phase before its cause is known (``_resource``)."""

    resource: str
    margin: float  # how far the use is from the bound, as confidence takes it
    roofline: Roofline | None = None
    unavailable: str | None = None
    step: DecodeStep | None = None


def _resource(est: RooflineEstimate, dep: Deployment | None, phase: str,
              previous: Verdict | None) -> _Resource:
    """Rule 2: the resource by the phase, else by the roofline, with hysteresis."""
    if phase in WAITING:
        return _Resource(WAITING[phase], 1.0)
    if dep is None:
        return _Resource("unknown", 0.0)
    # time to first token (the client's view) against the prompts' prefill: the
    # prefill estimate, over arrival to first token
    roof = "prefill" if phase == "ttft" else phase
    resource, used, found, unavailable = _utilization(est, dep, roof)
    if resource == "unknown" and roof in est.inputs:
        unavailable = est.inputs[roof].detail
    step = DecodeStep.of(est) if phase == "decode" else None
    margin = 0.0
    if used is not None:
        bound = BOUND_FRACTION
        if previous is not None and previous.phase == phase:
            if previous.resource == resource:
                bound -= HYSTERESIS
            elif previous.resource == "overhead":
                bound += HYSTERESIS
        if used < bound:
            resource = "overhead"
        margin = min(1.0, abs(used - BOUND_FRACTION) / RULES.margin_scale)
    return _Resource(resource, margin, found, unavailable, step)


def _confidence(est: RooflineEstimate, share_margin: float, util_margin: float) -> float:
    """Rule 3: the sample size, the margins over the thresholds, the inputs' quality."""
    steps = est.inputs.get("decode_steps")
    inputs = 1.0 if steps is None or steps.label == "token_gaps" else RULES.tpot_inputs
    sample = min(1.0, est.requests / MIN_REQUESTS_FOR_FULL_CONFIDENCE)
    floor = RULES.floor
    return round(sample * inputs * (floor + (1 - floor) * share_margin) *
                 (floor + (1 - floor) * util_margin), 3)


def _text(v: Verdict, dep: Deployment | None) -> str:
    """The verdict's sentences in order: the objectives', the cause's (a saturated
    compute's after), the verdict's, the client view's note."""
    text = describe(v.phase, v.resource, v.evidence, dep)
    cause = v.cause
    if cause is not None and cause.name == "compute_saturated":
        text = f"{text} {cause.text}."
    elif cause is not None and cause.name != "frontend":
        text = f"{cause.text}. {text}"
    if v.view == "client":
        text = f"{text} {ENGINE_PREFILL_NOTE if v.evidence.engine_prefill else CLIENT_NOTE}"
    if v.lead:
        text = f"{v.lead} {text}"
    return text


def _levers(phase: str, resource: str, step: DecodeStep | None,
            dep: Deployment | None = None) -> tuple[str, ...]:
    """The (phase, resource) levers, or an overhead-bound decode's as its step tells
    (``decode_step.overhead_levers``), in the words of the hardware (``for_hardware``)."""
    if (phase, resource) == ("decode", "overhead"):
        told = overhead_levers(step)
        if told is not None:
            return for_hardware(told, dep)
    return for_hardware(LEVERS.get((phase, resource), ()), dep)


# On a CPU (a calibrated profile measured there) the GPU-only levers are no levers:
# dropped, or said as what they stand for there.
CPU_LEVERS = {"CUDA graphs": None, "faster GPUs": "faster hardware (a GPU)",
              "higher-bandwidth GPUs": "higher-bandwidth memory (a GPU)"}


def for_hardware(levers: tuple[str, ...], dep: Deployment | None) -> tuple[str, ...]:
    """``levers`` as they apply to ``dep``'s hardware: on a CPU, no CUDA graphs."""
    if dep is None or not dep.hardware.cpu:
        return levers
    out = (CPU_LEVERS.get(lv, lv.removeprefix("CUDA graphs, ")) for lv in levers)
    return tuple(lv for lv in out if lv)
