"""The cause under the verdict's resource: why the dominant phase is slow, from what
the engine itself knows, and the levers that fit that cause.

The phase and the resource say *where* the time goes; the cause says *why*, and it
is what picks the lever (docs/verdict.md, "The cause"). On a real vLLM with a full KV
cache the roofline alone saw decode steps full of prefill FLOPs and offered FP8; the
FLOPs were preempted requests being recomputed, and the fix is KV-cache memory. So
the engine's own state decides first, the roofline after:

======================  ================================================================
cause                   evidence (engine state; in brackets the records-only fallback)
======================  ================================================================
kv_cache                preemptions in the window (with the share of FLOPs that redid
                        preempted prompts), or requests waiting while KV-cache usage is
                        at ``KV_FULL`` [the KV footprint of the requests in
                        flight reaches ``KV_FULL`` of the memory left after the weights]
preemption_recompute    preemptions while the KV cache was not seen full (priority
                        preemption, or a cache that fills between scrapes): compute
                        spent redoing preempted work
concurrency_limit       requests wait while running stays pinned at its maximum (the
                        engine's gauge, else the records' time at the gauge's maximum:
                        ``_running_from_records``) and the KV cache has room (usage
                        under ``KV_ROOM``) [the same from the requests in the engine at
                        each moment]
imbalance               (across pods of one model) some pods queue while others do not
prefill_interference    decode steps shared with prefill chunks are slower: a line
                        fitted through each decode's TPOT against the share of its decode
                        time that overlapped others' prefills gives a step sharing with
                        prefill ``INTERFERENCE_SLOWDOWN`` x one that does not, losing
                        ``INTERFERENCE_LOST`` of decode time (without a fit: most of the
                        FLOPs in decode's steps are prefill's)
compute_saturated       none of the above and the engine is busy (``BUSY``): the phase's
                        own work simply fills the machine
frontend                the time goes before the engine's queue (the API server)
======================  ================================================================

A cause may change the resource: a full KV cache, a slot limit and an imbalance are
``capacity`` whatever phase dominates (the phase's time goes to waiting for memory or
a slot, not to arithmetic). An idle engine (busy under ``BUSY``) gets no cause; the
verdict tells how idle it was. The thresholds are data here and nowhere else.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import numpy as np

from phasewatch.aggregation.columns import WindowColumns
from phasewatch.roofline import cause_text as words
from phasewatch.roofline import model_costs
from phasewatch.roofline.cause_limits import LIMITS, Limits
from phasewatch.roofline.engine_metrics import EngineRates
from phasewatch.roofline.engine_state import EngineState
from phasewatch.roofline.estimate import Deployment, RooflineEstimate
from phasewatch.roofline.intervals import (
    SlowdownFit,
    UpTo,
    decode_slowdown,
    prefill_start,
    sorted_near,
    union_length,
)

# the thresholds, and how far each moves for the cause in place (cause_limits)
KV_FULL, KV_ROOM, KV_PREEMPT_FULL = LIMITS.kv_full, LIMITS.kv_room, LIMITS.kv_preempt_full
PINNED, WAITING, BUSY = LIMITS.pinned, LIMITS.waiting, LIMITS.busy
INTERFERENCE_LOST = LIMITS.interference_lost
# vLLM's default share of accelerator memory it takes (SGLang's --mem-fraction-static
# is about the same): the records-only KV estimate assumes it for every engine
GPU_MEMORY_UTILIZATION = 0.9


@dataclass(frozen=True)
class CauseRule:
    """What a cause is, whoever finds it: its title (the banner's and the headline's
    words), the resource it makes the verdict's (None: the roofline's stands) and the
    levers that fit it (empty: the (phase, resource) ones)."""
    title: str
    resource: str | None
    levers: tuple[str, ...]


CAUSES: dict[str, CauseRule] = {
    "kv_cache": CauseRule(
        "KV cache full", "capacity",
        ("FP8 KV cache (vLLM --kv-cache-dtype fp8)",
         "a larger KV share of memory (vLLM --gpu-memory-utilization, SGLang "
         "--mem-fraction-static)",
         "a shorter --max-model-len", "fewer concurrent sequences (--max-num-seqs)",
         "prefix caching (--enable-prefix-caching) for shared prompt prefixes",
         "more replicas or GPUs (tensor parallelism adds KV memory)")),
    "preemption_recompute": CauseRule(
        "Preempted requests recomputed", None,
        ("more KV-cache memory so fewer requests are preempted (FP8 KV cache, "
         "--gpu-memory-utilization)", "fewer concurrent sequences (--max-num-seqs)",
         "priority scheduling only where it pays (vLLM --scheduling-policy)")),
    "concurrency_limit": CauseRule(
        "Slot limit", "capacity",
        ("a larger --max-num-seqs (SGLang --max-running-requests, TGI "
         "--max-batch-size, llama.cpp --parallel): the KV cache has room",
         "a larger --max-num-batched-tokens (TGI --max-batch-total-tokens)")),
    "imbalance": CauseRule(
        "Load imbalance", "capacity",
        ("a load- or KV-cache-aware router (llm-d's inference scheduler, the "
         "SGLang router) instead of round robin",
         "session affinity only where prefix reuse pays for it")),
    "prefill_interference": CauseRule(
        "Prefill interference", None,
        ("a smaller prefill chunk budget (vLLM --max-num-batched-tokens, SGLang "
         "--chunked-prefill-size)", "disaggregated prefill/decode",
         "scheduling priority for decodes")),
    "compute_saturated": CauseRule("Engine busy", None, ()),
    "frontend": CauseRule("API server", None, ()),
}


@dataclass
class Cause:
    name: str
    text: str  # in words with numbers: "KV cache full: 32 preemptions in 30 s at 100% usage"
    source: str  # engine_metrics | records
    evidence: dict = field(default_factory=dict)

    @property
    def resource(self) -> str | None:
        return CAUSES[self.name].resource

    @property
    def levers(self) -> tuple[str, ...]:
        return CAUSES[self.name].levers


_pct = words.pct


def busy_share(cols: WindowColumns, lo: float, hi: float) -> float | None:
    """Share of [lo, hi] in which the engine had a request in prefill or decode (in the
    client's view, with no scheduling time: from its arrival)."""
    if hi <= lo:
        return None
    opened, client = prefill_start(cols)
    start = np.fmin(opened, cols.first_token_at)
    end = np.fmax(cols.last_token_at, cols.first_token_at)
    if not (~np.isnan(start) & ~np.isnan(end)).any():
        return None  # (a NaN end or start is no interval: union_length leaves it out)
    return union_length(start, end, lo, hi, sorted_near(
        start, cols.order("arrival" if client else "scheduled_at"))) / (hi - lo)


def in_engine(cols: WindowColumns, dep: Deployment | None, lo: float, hi: float,
              points: int = 200, level: float | None = None) -> EngineState:
    """From the records alone, at ``points`` moments of [lo, hi]: requests in the engine
    (scheduled, not yet finished) and, with a deployment whose memory is known, the KV
    footprint of their contexts against the memory left after the weights (a request
    holds its prompt from its schedule on, plus the tokens decoded so far, growing
    evenly from its first token to its last).

    Sums over sorted start and end times (O(n log n), no request x moment matrix): at
    t, a sum over the requests in the engine is the sum over those started by t less
    the sum over those finished by t."""
    sched, first, last = cols.scheduled_at, cols.first_token_at, cols.last_token_at
    start = np.fmin(sched, first)
    ok = ~np.isnan(start) & ~np.isnan(last) & (last > lo) & (start < hi)
    if not ok.any() or hi <= lo:
        return EngineState()
    t = np.linspace(lo, hi, points)
    s, e = start[ok], last[ok]
    f = np.where(np.isnan(first), last, first)[ok]
    started, ended = UpTo(s, t), UpTo(e, t)
    running = started.index - ended.index
    at_max = running >= running.max()
    out = {"max_running": int(running.max()),
           "running_at_max_share": float(at_max.mean()) if running.max() else 0.0}
    waiting = _waiting(cols, t)
    if waiting is not None and running.max() and waiting.mean() >= WAITING_MOMENTS:
        # a slot limit is running at the maximum *while requests wait*: over those moments
        # only. Requests still waiting or running at the range's end are invisible alike
        # (no record yet), so the share does not sag toward the end as the plain one does
        out.update(running_at_max_share=float(at_max[waiting].mean()),
                   running_read_over="waiting", waiting_moment_share=float(waiting.mean()))
    if level:  # the share of moments at or above a level read elsewhere (the engine's)
        out["running_at_level_share"] = float((running >= level).mean())
    hw = dep.hardware if dep is not None else None
    if hw is None or not hw.memory_bytes:
        return EngineState(**out)
    prompt = np.maximum(cols.prompt[ok], 0).astype(float)
    rate = np.where(e > f, np.maximum(cols.output[ok], 0) / np.maximum(e - f, 1e-12), 0.0)
    held = started.sum(prompt) - ended.sum(prompt)
    # decoded so far by those decoding at t: sum of rate x (t - first) over first <= t < last
    decoding = UpTo(f, t)
    decoded = (t * (decoding.sum(rate) - ended.sum(rate))
               - (decoding.sum(rate * f) - ended.sum(rate * f)))
    room = hw.memory_bytes * GPU_MEMORY_UTILIZATION - model_costs.weight_bytes(dep.model)
    if room > 0:
        footprint = (held + decoded) * model_costs.kv_bytes_per_token(dep.model) / room
        out.update(max_kv_usage=float(footprint.max()), mean_kv_usage=float(footprint.mean()))
    return EngineState(**out)


FILLED = 0.9  # busy this much of the window: the engine's own work fills it
WAITING_MOMENTS = 0.2  # share of moments with a request seen waiting, to read over them


def _waiting(cols: WindowColumns, t: np.ndarray) -> np.ndarray | None:
    """At each moment of ``t``, whether a request was waiting in the engine's queue (from
    its scheduling less its queue time to its scheduling); None where no record has both."""
    sched, queue = cols.scheduled_at, cols.queue
    ok = ~np.isnan(sched) & ~np.isnan(queue) & (queue > 0)
    if not ok.any():
        return None
    begun, ended = UpTo(sched[ok] - queue[ok], t), UpTo(sched[ok], t)
    return (begun.index - ended.index) > 0


def _kv_cache(state: EngineState, window: float, source: str, lim: Limits = LIMITS
              ) -> Cause | None:
    pre = state.preemptions or 0.0
    top = state.max_kv_usage
    waiting = (state.waiting_share or 0.0) >= lim.waiting
    evidence = state.evidence("preemptions", "max_kv_usage", "mean_kv_usage", "mean_waiting",
                              "kv_capacity_tokens")
    if pre > 0 and (top is None or top >= lim.kv_preempt_full):
        return Cause("kv_cache", words.kv_cache(pre, words.seconds(window), top), source,
                     evidence)
    if pre > 0:
        return Cause("preemption_recompute",
                     words.preemption_recompute(pre, words.seconds(window), top), source,
                     evidence)
    if top is not None and top >= lim.kv_full and (waiting or source == "records"):
        return Cause("kv_cache", words.kv_cache(0.0, words.seconds(window), top,
                                                state.mean_waiting,
                                                records=source == "records"),
                     source, evidence)
    return None


def _running_from_records(state: EngineState, cols: WindowColumns, lo: float, hi: float
                          ) -> EngineState:
    """The engine's state with the share of the time running sat at the engine's own
    maximum read from the records (requests from their schedule to their last token).

    vLLM's ``num_requests_running`` is the scheduler's count after a step, kept until the
    next step ends. Where a batch of equal requests finishes together, the next step
    prefills the requests admitted in their place, and for the whole of that (long)
    step the gauge reads what was left of the batch: on the real vLLM under a slot limit
    (``--max-num-seqs 8``, 24 streams; tests/real/test_real_vllm_verdict.py) a scrape every
    second read 1 running and 15 waiting in 60 % of the scrapes of some runs, while the
    engine ran 8 whenever anything waited. The gauge's maximum is still the slot count;
    the records say how much of the time it was held."""
    top = state.max_running
    seen = in_engine(cols, None, lo, hi, level=top) if top else EngineState()
    if seen.running_at_level_share is None:
        return state
    return replace(state, running_at_max_share=seen.running_at_level_share,
                   engine_running_at_max_share=state.running_at_max_share,
                   running_read_from="records")


def _concurrency_limit(state: EngineState, source: str, lim: Limits = LIMITS
                       ) -> Cause | None:
    waiting = source == "records" or (state.waiting_share or 0.0) >= lim.waiting
    top, pinned = state.max_running, state.running_at_max_share or 0.0
    kv = state.max_kv_usage
    if not (waiting and top and pinned >= lim.pinned and (kv is None or kv < lim.kv_room)):
        return None
    limit = state.configured_max_running
    if kv is None and not (limit and top >= limit):
        return None  # pinned, but by slots or by KV memory? neither is known
    text = words.slot_limit(top, kv, pinned, state.running_read_over == "waiting", limit,
                            state.running_read_from == "records", state.mean_waiting)
    evidence = state.evidence(
        "max_running", "running_at_max_share", "mean_waiting", "max_kv_usage",
        "configured_max_running", "waiting_by_reason", "running_read_from",
        "running_read_over", "waiting_moment_share", "engine_running_at_max_share")
    if state.running_read_from == "records":  # the gauge's own share beside it, if unknown
        evidence.setdefault("engine_running_at_max_share", None)
    return Cause("concurrency_limit", text, source, evidence)


def _interference(est: RooflineEstimate, fit: SlowdownFit | None, lim: Limits = LIMITS
                  ) -> Cause | None:
    if est.prefill is None or est.decode is None:
        return None
    shared = est.shared_step_flops.get("decode", 0.0)
    share = shared / (est.decode.flops + shared) if shared else 0.0
    overlap = shared / est.prefill.flops * est.prefill.busy_seconds if est.prefill.flops else 0
    evidence = {"prefill_flops_share_of_decode_steps": share,
                "decode_time_shared_with_prefill": overlap / est.decode.busy_seconds}
    if fit is not None:  # measured per request, not from the estimate
        evidence["decode_time_shared_with_prefill"] = fit.decode_time_shared
    shared_time = evidence["decode_time_shared_with_prefill"]
    if fit is not None:
        evidence.update(asdict(fit))
        lost = shared_time * (1.0 - 1.0 / fit.slowdown) if fit.slowdown > 1 else 0.0
        evidence["decode_time_lost"] = lost
        if fit.slowdown < lim.interference_slowdown or lost < lim.interference_lost:
            return None
        how = (f"a decode step shared with prefill takes {fit.slowdown:.1f}x one that is not "
               f"(TPOT {fit.tpot_sharing_every_step * 1e3:.1f} ms vs "
               f"{fit.tpot_without_prefill * 1e3:.1f} ms)")
    elif (share >= lim.interference_flops and shared_time >= lim.interference_shared
          and not est.client_view):  # there, "prefill" runs from arrival: the queue too
        how = f"{_pct(share)} of the FLOPs in decode's steps are other requests' prefill"
    else:
        return None
    return Cause("prefill_interference",
                 f"Prefill interference: {how}, in {_pct(shared_time)} of decode time",
                 "records", evidence)


def diagnose(phase: str, est: RooflineEstimate, dep: Deployment | None,
             cols: WindowColumns, engine: EngineRates | None, fit: SlowdownFit | None = None,
             busy: float | None = None, held: str | None = None) -> Cause | None:
    """The cause for a verdict on ``phase`` (see the module docstring).

    ``engine`` is the engine's own state over the window (None when it is not scraped or
    the scrapes failed: the records stand in, and the cause says ``source: records``);
    ``fit``, ``decode_slowdown``'s fit: TPOT while sharing steps with prefills
    against TPOT without, and ``busy``, ``busy_share`` (each computed here when not
    given); ``held``, the cause the verdict on this phase holds now, whose thresholds
    move in its favour (``cause_limits.HOLD``).
    """
    lim = LIMITS.holding(held)
    lo, hi = est.range_start, est.range_end
    window = hi - lo
    if busy is None:
        busy = busy_share(cols, lo, hi)
    if phase == "preprocess":
        return Cause("frontend", words.FRONTEND, "records", {})
    if phase == "kv_transfer":
        return None
    if engine is not None and engine.samples >= 2:
        state, source = EngineState.of(engine), "engine_metrics"
    else:
        state, source = in_engine(cols, dep, lo, hi), "records"
    if phase in ("queue", "decode", "prefill", "ttft"):
        cause = _kv_cache(state, window, source, lim)
        if cause is not None:
            return _with_recompute(cause, est)
    # time to first token (the client's view) holds the queue: a slot limit where the
    # engine's own gauges say so (the records alone cannot tell waiting from a slow
    # prefill there)
    if phase == "queue" or (phase == "ttft" and source == "engine_metrics"):
        cause = _concurrency_limit(state, source, lim)
        if cause is None and source == "engine_metrics":
            cause = _concurrency_limit(_running_from_records(state, cols, lo, hi), source,
                                       lim)
        if cause is not None:
            return cause
    if phase == "decode":
        cause = _interference(est, fit if fit is not None else decode_slowdown(cols, lo, hi),
                              lim)
        if cause is not None:
            return cause
    if phase == "ttft" and source == "records":
        return None  # the records cannot tell waiting from a busy engine there
    if busy is not None and busy >= lim.busy:
        # what was looked for and not found: prefill interference only slows decode
        seen = [*(["full KV cache"] if state.max_kv_usage is not None else []),
                "slot limit", *(["prefill interference"] if phase == "decode" else [])]
        ruled_out = (", ".join(seen[:-1]) + " or " + seen[-1]) if len(seen) > 1 else seen[0]
        unknown = " (KV-cache usage unknown)" if state.max_kv_usage is None else ""
        # "fills it" only where it does; at 64 % a third of the window is idle
        pace = ("its own work fills it" if busy >= FILLED else
                f"its own work, no limit, sets the pace, with {_pct(1 - busy)} of the window "
                "idle")
        return Cause("compute_saturated", f"Engine busy {_pct(busy)} of the window, with "
                     f"no {ruled_out} seen{unknown}: {pace}", source, {"busy_share": busy})
    return None


def _with_recompute(cause: Cause, est: RooflineEstimate) -> Cause:
    """The share of the FLOPs done in the range that redid preempted requests' prompts
    (``engine_view.with_recompute``: the engine's preemptions x the mean prompt)."""
    total = sum(p["flops"] for p in est.inferred.values())
    if est.recompute_flops > 0 and total > 0:
        share = est.recompute_flops / total
        cause.evidence["recompute_flops_share"] = share
        cause.text += f"; ~{_pct(share)} of the FLOPs redo preempted requests' prompts"
    return cause
