"""The verdict in words: its headline (``headline``), its sentences (``describe``: the
phase's share of request time and what limits it, from ``evidence.Evidence``), and the names
the sentences use for phases, resources and the achievable ceilings' basis. The rules that
decide the verdict are in ``verdict``.
"""

from __future__ import annotations

from phasewatch.roofline.cause import CAUSES
from phasewatch.roofline.decode_step import step_sentence
from phasewatch.roofline.estimate import Deployment
from phasewatch.roofline.evidence import Evidence, Utilization

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
        return f"{phase_name(phase)}: {CAUSES[cause].title}"
    if resource == "capacity":
        return "Queue: requests wait for capacity"
    if resource == "frontend":
        return "Preprocess: the API server is the bottleneck"
    if resource == "interconnect":
        return "KV transfer: the prefill-to-decode link is the bottleneck"
    return f"{phase_name(phase)} is {RESOURCE_WORDS.get(resource, resource)}"


# said after a verdict made from the client's view alone
CLIENT_NOTE = ("(From the client's view: a stream tap's records, no engine spans; time to "
               "first token holds the queue and the prefill undivided.)")
ENGINE_PREFILL_NOTE = ("(From the client's view: a stream tap's records, no engine spans; "
                       "each prefill timed by the engine's own mean prefill, from its "
                       "/metrics.)")


def _pct(x: float) -> str:
    return f"{x:.0%}"


def describe(phase: str, resource: str, e: Evidence, dep: Deployment | None) -> str:
    """One or two plain sentences: the verdict (``phase``, ``resource``) and its
    evidence."""
    shares = e.phase_time_share
    head = f"{phase_name(phase)} takes {_pct(shares[phase])} of request time"
    if resource in ("capacity", "frontend", "interconnect"):
        return _waiting(phase, resource, head, shares)
    if resource == "unknown":
        return _unknown(head, e, dep)
    u = e.utilization
    tail = _roofline_tail(phase, u, dep, e.engine_prefill)
    step = step_sentence(e.step, resource == "overhead") if phase == "decode" else ""
    if resource == "overhead":
        return _overhead(phase, head, u, step, tail, e.engine_prefill)
    return f"{_bound(phase, resource, head, u, dep)}. {step}{tail}"


def _waiting(phase: str, resource: str, head: str, shares: dict[str, float]) -> str:
    """A phase whose time goes to waiting, not to the GPU: for a slot or KV-cache memory
    (capacity), in the API server (frontend), on the prefill-to-decode link."""
    if resource == "capacity":
        if phase == "ttft":
            return (f"{head}: its time goes to waiting for KV-cache memory or a slot, not to "
                    f"prefill arithmetic (decode {_pct(shares['decode'])}).")
        if phase != "queue":
            return (f"{head}: its time goes to waiting for KV-cache memory or a slot, not "
                    f"to arithmetic (queue {_pct(shares['queue'])}).")
        return (f"{head}: requests wait for a free slot, so the service lacks capacity "
                f"(prefill {_pct(shares['prefill'])}, decode {_pct(shares['decode'])}).")
    if resource == "frontend":
        return (f"{head}: the time goes before the engine's queue (templating, "
                "tokenisation, the hand-off to the engine, the first output's trip back), "
                f"so the API server's CPU limits it, not the GPU (engine queue "
                f"{_pct(shares['queue'])}, prefill {_pct(shares['prefill'])}, decode "
                f"{_pct(shares['decode'])}).")
    return (f"{head}: a disaggregated request's KV cache travels from the prefill "
            "server to the decode server, so the link between them limits time to "
            f"first token, not either GPU (prefill {_pct(shares['prefill'])}, decode "
            f"{_pct(shares['decode'])}).")


def _unknown(head: str, e: Evidence, dep: Deployment | None) -> str:
    """Why the hardware use is not given: a wrong model, a rate past a peak, no roofline,
    or not enough data."""
    if e.mismatch is not None:
        return f"{head}; its hardware use is not given: {e.mismatch}."
    if e.ceiling_exceeded is not None:
        return (f"{head}; its hardware use is not given: {e.ceiling_exceeded.blame} "
                "(ceiling_exceeded).")
    if dep is None:
        return (f"{head}. No roofline is configured for this model: set --model and "
                "--hardware to see what limits it.")
    why = e.unavailable if e.unavailable is not None else "not enough data yet"
    return f"{head}; its hardware use cannot be estimated: {why}."


def _roofline_tail(phase: str, u: Utilization, dep: Deployment, engine_prefill: bool) -> str:
    """MBU and MFU against the peaks, the intensity against the ridge. Two bases, said as
    such: "achievable" (measured, or the datasheet x a typical efficiency) decides the
    verdict; MBU and MFU are against the datasheet peaks."""
    hw = dep.hardware
    over = "the engine's mean prefill" if engine_prefill else "arrival to first token"
    whose = (f"The prompts' prefill over {over}: MBU" if phase == "ttft"
             else f"{phase_name(phase)}'s MBU")
    return (f"{whose} {_pct(u.mbu)} and MFU {_pct(u.mfu)} of the "
            f"{'datasheet' if hw.datasheet else 'measured'} peaks of {hw.name} x{hw.gpus}, "
            f"at {u.arithmetic_intensity:.0f} "
            f"FLOPs/byte against a ridge of {u.ridge:.0f}.")


def _overhead(phase: str, head: str, u: Utilization, step: str, tail: str,
              engine_prefill: bool = False) -> str:
    """Far below both ceilings: where the time goes instead."""
    if phase == "ttft" and engine_prefill:
        return (f"{head} and is {RESOURCE_WORDS['overhead']}: the prompts' prefill at the "
                f"roofline explains {_pct(u.used)} of the engine's own prefill time (its "
                "queue took less), so the time goes to its per-step overhead, not to "
                f"prefill arithmetic. {tail}")
    if phase == "ttft":
        return (f"{head} and is {RESOURCE_WORDS['overhead']}: the prompts' prefill at the "
                f"roofline explains {_pct(u.used)} of it, so the time goes to waiting, the "
                "server's front end or its per-step overhead, not to prefill arithmetic; "
                "the client's view cannot tell which (the engine's /metrics, "
                f"--engine-metrics-url, shows its queue). {tail}")
    why = ("so time goes to scheduling, launches and small batches" if not step else
           "so time goes to the server's own work per step (scheduling, launches, "
           "the host's code), not the hardware's arithmetic or memory traffic")
    return (f"{head} and is {RESOURCE_WORDS['overhead']}: it is far below both "
            f"ceilings, {why}. {step}{tail}")


def _bound(phase: str, resource: str, head: str, u: Utilization,
           dep: Deployment) -> str:
    """Compute- or memory-bandwidth-bound: the share of the achievable ceiling used, the
    other ceiling's where material, and the other phase's FLOPs sharing its steps."""
    compute = resource == "compute"
    used = u.of_achievable_flops if compute else u.of_achievable_bandwidth
    other = u.of_achievable_bandwidth if compute else u.of_achievable_flops
    what = "FLOP/s" if compute else "memory bandwidth"
    text = f"{head} and is {RESOURCE_WORDS[resource]}: it uses {_pct(used)} of the "
    text += f"achievable {what} ({ACHIEVABLE_BASIS[achievable_source(dep)]})"
    beyond = (u.over_achievable or {}).get("flops" if compute else "bandwidth")
    if beyond:
        text += (f", {beyond:.2f}x the figure taken as achievable: it runs at that "
                 "ceiling")
    if other >= 0.25:
        text += f", and {_pct(other)} of the achievable {'bandwidth' if compute else 'FLOP/s'}"
    if u.of_achievable_flops >= 0.25 and u.shared_step_flops_share >= 0.25:
        mixed = "prefill chunks" if phase == "decode" else "decode tokens"
        text += (f" ({_pct(u.shared_step_flops_share)} of the FLOPs in its steps are "
                 f"{mixed} sharing them)")
    return text
