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
from phasewatch.roofline.decode_step import DecodeStep, overhead_levers, step_sentence
from phasewatch.roofline.estimate import Deployment, RooflineEstimate
from phasewatch.roofline.slo_verdict import Attainment
from phasewatch.roofline.slo_verdict import interference_cause as slo_interference
from phasewatch.roofline.slo_verdict import lead as slo_lead
from phasewatch.roofline.slo_verdict import rank as slo_rank

BOUND_FRACTION = RULES.bound
PEAK_TOLERANCE = RULES.peak_tolerance
HYSTERESIS = RULES.hysteresis
MIN_REQUESTS_FOR_FULL_CONFIDENCE = RULES.full_confidence_requests
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

RESOURCE_WORDS = {"compute": "compute-bound", "memory_bandwidth": "memory-bandwidth-bound",
                   "capacity": "capacity-bound", "frontend": "frontend-bound",
                   "interconnect": "interconnect-bound",
                   "overhead": "overhead-bound",
                   "unknown": "of unknown limit"}

# What "achievable" rests on, by ``achievable_source``.
ACHIEVABLE_BASIS = {"calibrated": "measured here by phasewatch calibrate",
                    "published": "as measured on real parts",
                    "typical_efficiency": "the datasheet x a typical efficiency"}


def achievable_source(dep: Deployment) -> str:
    """Where the achievable ceilings come from: ``calibrated`` (a profile measured by
    ``phasewatch calibrate``), ``published`` (measurements on real parts, from the
    catalog), else ``typical_efficiency`` (the datasheet x a typical efficiency)."""
    return ("calibrated" if dep.hardware_source == "profile" else
            "published" if dep.hardware.measured_bandwidth else "typical_efficiency")


def phase_name(phase: str) -> str:
    """A phase as a sentence starts with it: "Prefill", "KV transfer", "Time to first
    token" (the client's view: preprocess, queue and prefill undivided)."""
    return {"kv_transfer": "KV transfer", "ttft": "Time to first token"}.get(
        phase, phase.capitalize())


def headline(phase: str, resource: str, cause: str | None = None) -> str:
    """The verdict in three or four words, e.g. "Decode is memory-bandwidth-bound",
    "Queue: KV cache full"."""
    if cause in ("kv_cache", "concurrency_limit", "imbalance", "preemption_recompute",
                 "prefill_interference"):
        from phasewatch.roofline.cause import CAUSES

        return f"{phase_name(phase)}: {CAUSES[cause].title}"
    if resource == "capacity":
        return "Queue: requests wait for capacity"
    if resource == "frontend":
        return "Preprocess: the API server is the bottleneck"
    if resource == "interconnect":
        return "KV transfer: the prefill-to-decode link is the bottleneck"
    return f"{phase_name(phase)} is {RESOURCE_WORDS.get(resource, resource)}"


@dataclass
class Verdict:
    phase: str
    resource: str
    confidence: float
    confidence_level: str
    evidence: dict = field(default_factory=dict)
    levers: tuple[str, ...] = ()
    text: str = ""
    cause: Cause | None = None
    lead: str = ""  # the objectives' sentence the text starts with ("" without objectives)
    view: str = "engine"  # "client": from a stream tap's records alone (no engine spans)
    step: DecodeStep | None = None  # a decode's step against the roofline's (evidence too)

    @property
    def headline(self) -> str:
        return headline(self.phase, self.resource, self.cause.name if self.cause else None)

    def prepend(self, sentence: str) -> None:
        """Put ``sentence`` at the front of the text, after the objectives' sentence."""
        body = self.text[len(self.lead):].lstrip() if self.lead and \
            self.text.startswith(self.lead) else self.text
        self.text = " ".join(x for x in (self.lead, sentence, body) if x)


def _utilization(est: RooflineEstimate, dep: Deployment, phase: str):
    """(candidate resource, share of busy time the two resources explain, evidence).

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
        return "unknown", None, {"model_mismatch": wrong,
                                 "arithmetic_intensity": ph.arithmetic_intensity}
    if ph is not None and ph.ceiling_exceeded:  # over the datasheet (or the profile's) peak
        what, ratio = max(ph.ceiling_exceeded.items(), key=lambda kv: kv[1])
        found = ceiling.blame(est, dep, phase, what, ratio)
        return "unknown", None, {"ceiling_exceeded": dict(ph.ceiling_exceeded),
                                 "ceiling_points_to": found.points_to,
                                 "ceiling_blame": found.text,
                                 "arithmetic_intensity": ph.arithmetic_intensity}
    if ph is not None and not dep.peak_flops:
        return "unknown", None, {"unavailable": (
            f"{dep.hardware.name} has no {dep.compute_dtype} FLOP/s ceiling: run `phasewatch "
            f"calibrate` where torch is importable, or set --compute-dtype")}
    if ph is None or ph.flops_utilization is None or ph.bandwidth_utilization is None:
        return "unknown", None, {}
    hw = dep.hardware
    shared = est.shared_step_flops.get(phase, 0.0)
    of_flops = (ph.flops + shared) / ph.busy_seconds / hw.achievable_flops(dep.compute_dtype)
    of_bw = ph.achieved_bytes_per_second / hw.achievable_bandwidth
    evidence = {"mfu": ph.flops_utilization, "mbu": ph.bandwidth_utilization,
                "shared_step_flops_share": shared / (ph.flops + shared) if shared else 0.0,
                "arithmetic_intensity": ph.arithmetic_intensity, "ridge": dep.ridge}
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
        what, ratio = max(past.items(), key=lambda kv: kv[1])
        found = ceiling.blame(est, dep, phase, what, ratio)
        return "unknown", None, {"ceiling_exceeded": past, "ceiling_points_to":
                                 found.points_to, "ceiling_blame": found.text,
                                 "arithmetic_intensity": ph.arithmetic_intensity}
    if over:
        evidence["over_achievable"] = over
    of_flops, of_bw = min(of_flops, 1.0), min(of_bw, 1.0)
    evidence.update(of_achievable_flops=of_flops, of_achievable_bandwidth=of_bw)
    return ("compute" if of_flops >= of_bw else "memory_bandwidth"), of_flops + of_bw, evidence


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
    by_misses = slo_rank(slo, shares, previous, HYSTERESIS)
    phase = by_misses or max(shares, key=shares.get)
    if by_misses is None and previous is not None and previous.phase in shares and \
            phase != previous.phase and shares[phase] < shares[previous.phase] + HYSTERESIS:
        phase = previous.phase
    ranked = slo.missed_by_phase if by_misses else shares
    runner_up = max((v for k, v in ranked.items() if k != phase), default=0.0)
    evidence: dict = {"phase_time_share": shares, "requests": est.requests}
    step = None
    if slo is not None:
        evidence["slo"] = slo.as_dict()
    if est.decode_batch_size is not None:
        evidence["decode_batch_size"] = est.decode_batch_size
    if phase == "queue":
        resource, used, util_margin = "capacity", None, 1.0
    elif phase == "preprocess":
        resource, used, util_margin = "frontend", None, 1.0
    elif phase == "kv_transfer":
        resource, used, util_margin = "interconnect", None, 1.0
    elif dep is None:
        resource, util_margin = "unknown", 0.0
    else:
        # time to first token (the client's view) against the prompts' prefill: the
        # prefill estimate, over arrival to first token
        roof = "prefill" if phase == "ttft" else phase
        resource, used, detail = _utilization(est, dep, roof)
        evidence.update(detail)
        if resource == "unknown" and roof in est.inputs:
            evidence["unavailable"] = est.inputs[roof].detail
        if phase == "decode":
            step = DecodeStep.of(est)
            evidence.update(step.evidence())
        util_margin = 0.0
        if used is not None:
            bound = BOUND_FRACTION
            if previous is not None and previous.phase == phase:
                if previous.resource == resource:
                    bound -= HYSTERESIS
                elif previous.resource == "overhead":
                    bound += HYSTERESIS
            if used < bound:
                resource = "overhead"
            util_margin = min(1.0, abs(used - BOUND_FRACTION) / RULES.margin_scale)
    share_margin = max(0.0, min(1.0, (ranked[phase] - runner_up) / RULES.margin_scale))
    steps = est.inputs.get("decode_steps")
    inputs = 1.0 if steps is None or steps.label == "token_gaps" else RULES.tpot_inputs
    sample = min(1.0, est.requests / MIN_REQUESTS_FOR_FULL_CONFIDENCE)
    floor = RULES.floor
    confidence = round(sample * inputs * (floor + (1 - floor) * share_margin) *
                       (floor + (1 - floor) * util_margin), 3)
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
              _levers(phase, resource, step, dep))
    verdict = Verdict(phase=phase, resource=resource, confidence=confidence,
                      confidence_level=level, evidence=evidence, levers=levers, cause=cause,
                      lead=slo_lead(slo, by_misses),
                      view="client" if est.client_view else "engine", step=step)
    if verdict.view == "client":
        evidence["view"] = "client"
    verdict.text = describe(verdict, dep)
    if cause is not None and cause.name == "compute_saturated":
        verdict.text = f"{verdict.text} {cause.text}."
    elif cause is not None and cause.name != "frontend":
        verdict.text = f"{cause.text}. {verdict.text}"
    if verdict.view == "client":
        verdict.text = f"{verdict.text} {CLIENT_NOTE}"
    if verdict.lead:
        verdict.text = f"{verdict.lead} {verdict.text}"
    return verdict


# said after a verdict made from the client's view alone
CLIENT_NOTE = ("(From the client's view: a stream tap's records, no engine spans; time to "
               "first token holds the queue and the prefill undivided.)")
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


def _pct(x: float) -> str:
    return f"{x:.0%}"


def describe(v: Verdict, dep: Deployment | None) -> str:
    """One or two plain sentences: the verdict and its evidence."""
    e = v.evidence
    share = e["phase_time_share"][v.phase]
    head = f"{phase_name(v.phase)} takes {_pct(share)} of request time"
    shares = e["phase_time_share"]
    if v.resource == "capacity":
        if v.phase == "ttft":
            return (f"{head}: its time goes to waiting for KV-cache memory or a slot, not to "
                    f"prefill arithmetic (decode {_pct(shares['decode'])}).")
        if v.phase != "queue":
            return (f"{head}: its time goes to waiting for KV-cache memory or a slot, not "
                    f"to arithmetic (queue {_pct(shares['queue'])}).")
        return (f"{head}: requests wait for a free slot, so the service lacks capacity "
                f"(prefill {_pct(shares['prefill'])}, decode {_pct(shares['decode'])}).")
    if v.resource == "frontend":
        return (f"{head}: the time goes before the engine's queue (templating, "
                "tokenisation, the hand-off to the engine, the first output's trip back), "
                f"so the API server's CPU limits it, not the GPU (engine queue "
                f"{_pct(shares['queue'])}, prefill {_pct(shares['prefill'])}, decode "
                f"{_pct(shares['decode'])}).")
    if v.resource == "interconnect":
        return (f"{head}: a disaggregated request's KV cache travels from the prefill "
                "server to the decode server, so the link between them limits time to "
                f"first token, not either GPU (prefill {_pct(shares['prefill'])}, decode "
                f"{_pct(shares['decode'])}).")
    if v.resource == "unknown":
        if "model_mismatch" in e:
            return f"{head}; its hardware use is not given: {e['model_mismatch']}."
        if "ceiling_exceeded" in e:
            return (f"{head}; its hardware use is not given: {e['ceiling_blame']} "
                    "(ceiling_exceeded).")
        if dep is None:
            return (f"{head}. No roofline is configured for this model: set --model and "
                    "--hardware to see what limits it.")
        why = v.evidence.get("unavailable", "not enough data yet")
        return f"{head}; its hardware use cannot be estimated: {why}."
    hw = dep.hardware
    # two bases, said as such: "achievable" (measured, or the datasheet x a typical
    # efficiency) decides the verdict; MBU and MFU are against the datasheet peaks
    whose = ("The prompts' prefill over arrival to first token: MBU" if v.phase == "ttft"
             else f"{phase_name(v.phase)}'s MBU")
    tail = (f"{whose} {_pct(e['mbu'])} and MFU {_pct(e['mfu'])} of the "
            f"{'datasheet' if hw.datasheet else 'measured'} peaks of {hw.name} x{hw.gpus}, "
            f"at {e['arithmetic_intensity']:.0f} "
            f"FLOPs/byte against a ridge of {e['ridge']:.0f}.")
    step = step_sentence(v.step, v.resource == "overhead") if v.phase == "decode" else ""
    if v.resource == "overhead" and v.phase == "ttft":
        used = e["of_achievable_flops"] + e["of_achievable_bandwidth"]
        return (f"{head} and is {RESOURCE_WORDS['overhead']}: the prompts' prefill at the "
                f"roofline explains {_pct(used)} of it, so the time goes to waiting, the "
                "server's front end or its per-step overhead, not to prefill arithmetic; "
                "the client's view cannot tell which (the engine's /metrics, "
                f"--engine-metrics-url, shows its queue). {tail}")
    if v.resource == "overhead":
        why = ("so time goes to scheduling, launches and small batches" if not step else
               "so time goes to the server's own work per step (scheduling, launches, "
               "the host's code), not the hardware's arithmetic or memory traffic")
        return (f"{head} and is {RESOURCE_WORDS['overhead']}: it is far below both "
                f"ceilings, {why}. {step}{tail}")
    compute = v.resource == "compute"
    used = e["of_achievable_flops"] if compute else e["of_achievable_bandwidth"]
    other = e["of_achievable_bandwidth"] if compute else e["of_achievable_flops"]
    what = "FLOP/s" if compute else "memory bandwidth"
    text = f"{head} and is {RESOURCE_WORDS[v.resource]}: it uses {_pct(used)} of the "
    text += f"achievable {what} ({ACHIEVABLE_BASIS[achievable_source(dep)]})"
    beyond = e.get("over_achievable", {}).get("flops" if compute else "bandwidth")
    if beyond:
        text += (f", {beyond:.2f}x the figure taken as achievable: it runs at that "
                 "ceiling")
    if other >= 0.25:
        text += f", and {_pct(other)} of the achievable {'bandwidth' if compute else 'FLOP/s'}"
    if e["of_achievable_flops"] >= 0.25 and e.get("shared_step_flops_share", 0) >= 0.25:
        mixed = "prefill chunks" if v.phase == "decode" else "decode tokens"
        text += (f" ({_pct(e['shared_step_flops_share'])} of the FLOPs in its steps are "
                 f"{mixed} sharing them)")
    return f"{text}. {step}{tail}"
