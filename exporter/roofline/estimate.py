"""The roofline estimator: bytes and FLOPs each phase moved, from request records alone.

Input: the rolling window's columns for one (model, engine) and the deployment it
runs on. Output: per phase (prefill, decode) the FLOPs and bytes moved, the busy
time they were moved in, achieved FLOP/s and bytes/s, utilization of the peaks
(MFU, MBU), arithmetic intensity; the estimated decode batch size and step time;
phase time shares; and which inputs each figure came from.

How each figure is inferred (cost formulas in ``model_costs``):

* **Range.** The sender's own clock, not the exporter's: ``window_seconds`` ending
  at ``hi``, a little before the newest request end. Requests still running are
  invisible until they finish, so the last moments before the newest end look
  emptier than they were; ``hi`` lags the newest end by the 90th percentile of
  in-engine time (capped so the range keeps at least half the data it could
  have), and the estimator reads requests from up to ``LOOKBACK_SPANS`` windows
  back so that requests overlapping the range's start are known.
* **Busy time** of a phase = length of the union of its intervals
  (``[scheduled, first_token]`` for prefill, ``[first_token, last_token]`` for
  decode) clipped to the range: the time the engine had at least one request in
  that phase. A client's view has no scheduled time: its prefill runs from arrival, or
  the engine's own mean prefill (its /metrics) before the first token.
* **Work** of a phase: each request's work (FLOPs, KV bytes, steps) is spread
  evenly over its phase interval and only the part inside the range counts, so
  a long request straddling the range's start is neither counted whole nor lost.
* **Decode batch size** (mean concurrent decodes while decoding) = decode
  interval time inside the range / decode busy time: the overlap of intervals.
* **Decode steps** (engine steps with decode tokens in them) in the range. Tokens per
  request are the number of inter-token gaps when emission times were sent (an
  engine step that emits several tokens, as with speculative decoding, is one
  gap), else ``output_tokens - 1`` (TPOT). A step gives one token to each of the c
  requests decoding in it, so steps = the sum of every request's tokens x 1/c, each
  request's tokens spread over its decode time and c read from the decode intervals
  at each moment; a step that also completes a prefill (it ends at a first-token
  time) counts once on its own (``intervals.decode_step_count``). Busy time over the
  mean TPOT counted a long step with few decodes beside it as several. **Decode step
  time** = busy / steps.
* **Decode bytes** = weights once per step (for MoE: the experts that step's batch
  routes to) + per decode step each sequence's KV cache at its context, summed
  exactly per request as ``steps x (prompt + output / 2)`` context tokens.
* **Prefill FLOPs** = per request ``2 x active params x uncached prompt tokens``
  plus causal attention over cached + uncached positions (``model_costs``).
* **Prefill bytes** = weights once per prefill step + the KV cache written and
  read. Prefill steps = distinct first-token times (requests whose prefill
  completed in the same step share one) + the extra chunks of prompts longer than
  ``max_batched_tokens``.
* A step that carries both decode tokens and a prefill chunk counts toward both
  phases' busy time and reads the weights for both: each phase's intensity is
  what that phase needs from the hardware. The time both phases ran together
  (``|P| + |D| - |P or D|``) gives ``shared_step_flops``: the other phase's
  FLOPs done inside a phase's steps, which the verdict needs.
* MoE weight reads use the mean batch; a batch varying step to step overstates the
  distinct experts a little (concave in the batch): a few % in the simulator's.
* **Range fallback**: while the data is younger than the lag (just after start, sparse
  traffic), a phase missing from the lagged range runs it to the newest request end
  (``inputs["range"] = "to_newest_request"``).
* **Sampled traces** (``weight`` = 1/p per record, ``requests.sampling``): the records
  are a sample of the requests, so the work is weighted (each record's FLOPs, bytes,
  tokens, decode time and prefill chunks count w times: unbiased totals; unweighted, a
  10 % sample undercounts the work 10x). The union of the sample's intervals misses the
  time only unsampled requests ran, so busy time is estimated (``busy_time``) and the
  prefill steps seen (distinct first-token times) are scaled by busy over that union.

Utilizations are against the datasheet's dense peaks x GPUs (the vendors' figures in
``catalog/hardware.json``); the measured ceilings (``phasewatch calibrate`` or the
catalog) are reported beside them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from phasewatch.aggregation.columns import WindowColumns
from phasewatch.aggregation.window import ReportedSteps, phase_time_shares
from phasewatch.roofline import model_costs
from phasewatch.roofline.catalog import HardwareSpec, ModelSpec
from phasewatch.roofline.inputs import (
    CLIENT_CACHED,
    CLIENT_PREFILL,
    CLIENT_VIEW,
    ENGINE_PREFILL,
    Inputs,
    InputSource,
    unavailable,
)
from phasewatch.roofline.intervals import (
    SAME_STEP_SECONDS,
    analysis_range,
    busy_time,
    decodes,
    inside_fraction,
    prefill_start,
    reported_steps,
    sorted_near,
    step_by_batch,
)
from phasewatch.roofline.step_count import decode_step_count, prefill_steps

LOOKBACK_SPANS = 3  # how far back (in ranges) the estimator reads requests


@dataclass(frozen=True)
class Deployment:
    """One served model: its architecture and the hardware (x GPUs) it runs on."""

    served_name: str
    model: ModelSpec
    hardware: HardwareSpec  # ceilings already multiplied by the GPU count
    compute_dtype: str = "bf16"
    max_batched_tokens: int = 8192  # the engine's prefill chunk (vLLM V1 online default)
    tensor_parallel: int = 1
    model_source: str = "catalog"
    hardware_source: str = "catalog"

    @property
    def peak_bandwidth(self) -> float:
        return self.hardware.bandwidth or (self.hardware.measured_bandwidth or 0.0)

    @property
    def peak_flops(self) -> float:
        return (self.hardware.peak_flops(self.compute_dtype)
                or self.hardware.measured_flops.get(self.compute_dtype, 0.0))

    @property
    def ridge(self) -> float:
        """FLOPs per byte where the bandwidth slope meets the compute ceiling."""
        return self.peak_flops / self.peak_bandwidth if self.peak_bandwidth else math.inf


@dataclass
class PhaseEstimate:
    busy_seconds: float
    flops: float
    bytes: float
    achieved_flops_per_second: float
    achieved_bytes_per_second: float
    flops_utilization: float | None  # MFU, of the datasheet peak
    bandwidth_utilization: float | None  # MBU
    arithmetic_intensity: float
    requests: int
    source: str = "inferred"
    # achieved / datasheet ceiling where it is over 1: the ceiling is wrong (another
    # dtype's, another part's); the utilization is then not given
    ceiling_exceeded: dict[str, float] = field(default_factory=dict)
    weight_bytes: float = 0.0  # the weights' part of ``bytes`` (read once per step)


@dataclass
class RooflineEstimate:
    model: str
    engine: str
    range_start: float  # sender clock, Unix seconds
    range_end: float
    range_end_lag_seconds: float  # how far the range ends before the newest request end
    requests: int  # requests that finished inside the range
    prefill: PhaseEstimate | None
    decode: PhaseEstimate | None
    decode_batch_size: float | None
    decode_step_seconds: float | None
    phase_time_share: dict[str, float] | None
    inputs: Inputs = field(default_factory=dict)
    # FLOPs of the other phase performed inside this phase's busy time (mixed steps)
    shared_step_flops: dict[str, float] = field(default_factory=dict)
    # per phase, the FLOPs and bytes inferred from the records, kept when the engine's
    # own counters replace them (the two side by side: how far inference is off)
    inferred: dict[str, dict[str, float]] = field(default_factory=dict)
    recompute_flops: float = 0.0  # of decode's, redone for preempted requests
    # a decode step at the roofline, at the window's batch: the larger of its bytes at the
    # achievable bandwidth and its FLOPs at the achievable FLOP/s; and the weights' part
    decode_step_roofline_seconds: float | None = None
    decode_step_weights_seconds: float | None = None
    # how the step moves with the batch (``intervals.step_by_batch``), None unknown
    decode_step_by_batch: dict | None = None

    @property
    def client_view(self) -> bool:
        """The window holds the client's view alone (a stream tap's records)."""
        return bool(self.phase_time_share) and "ttft" in self.phase_time_share

    def as_dict(self) -> dict:
        return {**asdict(self), "inputs": {k: str(v) for k, v in self.inputs.items()}}


def phase_estimate(dep: Deployment, busy: float, flops: float, nbytes: float, n: int,
                   source: str = "inferred", weight_bytes: float = 0.0) -> PhaseEstimate:
    """Achieved rates, utilizations and intensity of ``flops``/``nbytes`` over ``busy``."""
    fps = flops / busy
    bps = nbytes / busy
    mfu = fps / dep.peak_flops if dep.peak_flops else None
    mbu = bps / dep.peak_bandwidth if dep.peak_bandwidth else None
    exceeded = {k: v for k, v in (("flops", mfu), ("bandwidth", mbu)) if v is not None and v > 1}
    return PhaseEstimate(
        busy_seconds=busy, flops=flops, bytes=nbytes, achieved_flops_per_second=fps,
        achieved_bytes_per_second=bps,
        flops_utilization=None if "flops" in exceeded else mfu,
        bandwidth_utilization=None if "bandwidth" in exceeded else mbu,
        arithmetic_intensity=flops / nbytes if nbytes else math.inf, requests=n, source=source,
        ceiling_exceeded=exceeded, weight_bytes=weight_bytes)


def _weights(c: WindowColumns, rows: np.ndarray) -> np.ndarray:
    """The requests each of ``rows`` stands for (1 where no weight is known)."""
    return np.nan_to_num(c.weight[rows], nan=1.0)


def _decode(dep: Deployment, c: WindowColumns, lo: float, hi: float, inputs: Inputs,
            steps: ReportedSteps | None = None):
    m = dep.model
    reported = reported_steps(steps, lo, hi)
    if reported is not None:  # the engine's own steps: the requests in each forward
        inputs["decode_batch"] = InputSource("engine_decode_steps")
    # without a decode estimate the engine's batch and step are still reported
    none = (None, *reported) if reported is not None else (None, None, None)
    first, last = c.first_token_at, c.last_token_at
    timed = ~np.isnan(first) & ~np.isnan(last) & (last > lo) & (first < hi)
    ok = timed & (c.steps > 0) & (c.prompt >= 0) & (c.output > 1)
    if not ok.any():
        inputs["decode"] = unavailable(
            "no first and last token times" if not timed.any() else
            "prompt tokens unknown (each step reads the KV cache of the whole context)"
            if not (timed & (c.prompt >= 0)).any() else
            "no request with more than one output token")
        return none
    first, last, w = first[ok], last[ok], _weights(c, ok)
    n_tokens, prompt, out = c.steps[ok].astype(float), c.prompt[ok], c.output[ok]
    by_first = c.order_within("first_token_at", ok)
    busy, _ = busy_time(first, last, w, lo, hi, by_first)
    f = inside_fraction(first, last, lo, hi) * w  # the part inside, of the requests it is
    duration = (last - first) * f
    if busy <= 0 or duration.sum() <= 0:
        inputs["decode"] = unavailable("decode intervals have no length in the range")
        return none
    timed = c.timed[ok]
    inputs["decode_steps"] = InputSource("token_gaps" if timed.all() else
                                         "tpot" if not timed.any() else "token_gaps+tpot")
    if reported is not None:
        batch, step = reported
        n_steps = busy / step
    else:
        inputs["decode_batch"] = InputSource("overlapping_decode_intervals")
        batch = duration.sum() / busy
        # sampled: 1/c of a sample's count is biased (a sample of 1 in 10 decoding
        # reads c = 10 where 3 were); the busy time estimated from it is not
        n_steps = (decode_step_count(first, last, n_tokens, *prefill_steps(c), lo, hi,
                                     by_first, c.order_within("last_token_at", ok))
                   if np.all(w == 1.0) else 0.0)
        if n_steps <= 0:  # busy time over the mean TPOT
            n_steps = busy * (n_tokens * f).sum() / duration.sum()
        step = busy / n_steps
    context = n_tokens * (prompt + out / 2.0) * f  # context tokens read over the decode steps
    kv = model_costs.kv_bytes_per_token(m) * context.sum()
    weights = n_steps * float(model_costs.weight_bytes_read(m, batch))
    tokens = (out - 1) * f
    flops = 2.0 * m.active_params * tokens.sum() + model_costs.attention_flops_per_context_token(
        m) * float((context * (out - 1) / n_tokens).sum())
    return phase_estimate(dep, busy, flops, weights + kv, int(ok.sum()),
                          weight_bytes=weights), batch, step


def _prefill(dep: Deployment, c: WindowColumns, lo: float, hi: float, inputs: Inputs,
             start: tuple[np.ndarray, bool], engine_prefill: float | None):
    m = dep.model
    (sched, client), first = start, c.first_token_at
    timed = ~np.isnan(sched) & ~np.isnan(first) & (first >= lo) & (sched <= hi)
    uncached_col = c.uncached
    if client:  # the prompt's own cache hits are unknown: every token computed
        inputs["prefill_interval"] = ENGINE_PREFILL if engine_prefill else CLIENT_PREFILL
        unknown = (uncached_col < 0) & (c.prompt >= 0)
        if (unknown & timed).any():
            inputs["cached_tokens"] = CLIENT_CACHED
            uncached_col = np.where(unknown, c.prompt, uncached_col)
    ok = timed & (uncached_col >= 0)
    if not ok.any():
        inputs["prefill"] = unavailable(
            ("no arrival and first-token times" if client else
             "no scheduled and first-token times") if not timed.any() else
            "prompt tokens unknown" if (c.prompt[timed] < 0).all() else
            "cached prompt tokens unknown (the server does not say how many prompt tokens "
            "its prefix cache served; for vLLM give --engine-metrics-url for its hit rate)")
        return None
    sched, first, w = sched[ok], first[ok], _weights(c, ok)
    busy, union = busy_time(sched, first, w, lo, hi,
                            None if client else c.order_within("scheduled_at", ok))
    if busy <= 0:
        inputs["prefill"] = unavailable("prefill intervals have no length in the range")
        return None
    f = inside_fraction(sched, first, lo, hi) * w  # the part inside, of the requests it is
    uncached = uncached_col[ok].astype(float)
    cached = np.maximum(c.prompt[ok], 0) - uncached
    flops = float(np.sum(model_costs.prefill_flops(m, uncached, cached) * f))
    inside = (first >= lo) & (first <= hi)
    completions = len(np.unique(np.round(first[inside] / SAME_STEP_SECONDS)))
    if busy != union:  # sampled: the steps only unsampled requests completed in are unseen
        completions *= busy / union
    chunks = float((np.maximum(np.ceil(uncached / dep.max_batched_tokens) - 1, 0) * f).sum())
    n_steps = max(completions + chunks, 1.0)
    weights = n_steps * float(model_costs.weight_bytes_read(m, (uncached * f).sum() / n_steps))
    kv = model_costs.kv_bytes_per_token(m) * float(((uncached + cached) * f).sum())
    inputs["prefill_steps"] = InputSource("distinct_first_token_times+chunks")
    return phase_estimate(dep, busy, flops, weights + kv, int(ok.sum()), weight_bytes=weights)


def _shares(c: WindowColumns, sel: np.ndarray) -> dict[str, float] | None:
    """``window.phase_time_shares`` without the phases no request reports; None when
    there is nothing to share."""
    shares = phase_time_shares(c.phases(), sel)
    if shares["queue"] is None and shares["ttft"] is None:
        return None
    return {k: v for k, v in shares.items() if v is not None}


def _overlap(c: WindowColumns, lo: float, hi: float, prefill: PhaseEstimate | None,
             decode: PhaseEstimate | None, start: tuple[np.ndarray, bool]) -> float:
    """Seconds both phases ran (chunked prefill): |P| + |D| - |P or D|, the union from one
    interval a request (its phases meet at its first token: the same union and busy)."""
    if prefill is None or decode is None:
        return 0.0
    w = _weights(c, np.ones(len(c.end_at), dtype=bool))
    first, (starts, client) = c.first_token_at, start
    opened = np.where(starts <= first, starts, first)
    both, _ = busy_time(opened, np.fmax(first, c.last_token_at), w, lo, hi,
                        sorted_near(opened, c.order("arrival" if client else "scheduled_at")))
    return max(prefill.busy_seconds + decode.busy_seconds - both, 0.0)


def _estimate_in(cols: WindowColumns, dep: Deployment | None, lo: float, hi: float,
                 model: str, engine: str, steps: ReportedSteps | None = None,
                 engine_prefill: float | None = None) -> RooflineEstimate:
    end = cols.end_at
    inputs: Inputs = {}
    decode = batch = step = prefill = None
    shared: dict[str, float] = {}
    if dep is None:
        inputs["roofline"] = InputSource("no deployment configured for this model")
    else:
        decode, batch, step = _decode(dep, cols, lo, hi, inputs, steps)
        start = prefill_start(cols, engine_prefill)  # (the prompts' shares, once)
        prefill = _prefill(dep, cols, lo, hi, inputs, start, engine_prefill)
        overlap = _overlap(cols, lo, hi, prefill, decode, start)
        if overlap > 0:
            # the other phase's FLOPs done inside this phase's steps, its work taken
            # as spread evenly over its own busy time
            shared = {"decode": prefill.flops * overlap / prefill.busy_seconds,
                      "prefill": decode.flops * overlap / decode.busy_seconds}
    in_range = (end >= lo) & (end <= hi)
    inferred = {name: {"flops": p.flops, "bytes": p.bytes, "weight_bytes": p.weight_bytes}
                for name, p in (("prefill", prefill), ("decode", decode)) if p is not None}
    shares = _shares(cols, in_range)
    if shares is not None and "ttft" in shares:
        inputs["phases"] = CLIENT_VIEW
    roof = _step_roofline(dep, decode, step, shared.get("decode", 0.0))
    return RooflineEstimate(
        model=model, engine=engine, range_start=lo, range_end=hi,
        range_end_lag_seconds=float(np.nanmax(end)) - hi, requests=int(in_range.sum()),
        prefill=prefill, decode=decode, decode_batch_size=batch, decode_step_seconds=step,
        phase_time_share=shares, inputs=inputs,
        shared_step_flops=shared, inferred=inferred,
        decode_step_roofline_seconds=roof[0], decode_step_weights_seconds=roof[1],
        decode_step_by_batch=step_by_batch(cols.first_token_at, cols.last_token_at,
                                           cols.steps.astype(float), lo, hi,
                                           overlaps=decodes(cols)[1])
        if decode is not None else None)


def _step_roofline(dep: Deployment | None, decode: PhaseEstimate | None,
                   step: float | None, shared_flops: float) -> tuple[float | None, float | None]:
    """(a decode step at the roofline, the weights' part of it): the window's mean step's
    bytes at the achievable bandwidth, or its FLOPs (a prefill chunk's sharing it
    included) at the achievable FLOP/s, whichever takes longer; None without a decode
    estimate."""
    if dep is None or decode is None or not step or decode.busy_seconds <= 0:
        return None, None
    steps = decode.busy_seconds / step
    hw = dep.hardware
    bandwidth = hw.achievable_bandwidth
    flops = hw.achievable_flops(dep.compute_dtype) if dep.peak_flops else 0.0
    if not bandwidth:
        return None, None
    memory = decode.bytes / steps / bandwidth
    compute = (decode.flops + shared_flops) / steps / flops if flops else 0.0
    return max(memory, compute), decode.weight_bytes / steps / bandwidth


def estimate(cols: WindowColumns, dep: Deployment | None, window_seconds: float,
             model: str = "", engine: str = "", steps: ReportedSteps | None = None,
             engine_prefill: float | None = None) -> RooflineEstimate | None:
    """Roofline figures for one label set's columns (see the module docstring).

    ``cols`` are ``RollingWindow.columns()`` arrays restricted to one label set, read
    ``LOOKBACK_SPANS`` ranges back; ``steps``, ``RollingWindow.steps()`` of the same
    label set: decode steps the engine reported (TGI), whose sizes are the decode batch
    when any fall in the range; ``engine_prefill``, the engine's mean prefill seconds for
    a client's view (``prefill_start``). Without a deployment only the range and the
    phase time shares are filled in. None with nothing to estimate from (no request end
    times, or a range of zero length).
    """
    bounds = analysis_range(cols, window_seconds)
    if bounds is None or bounds[1] <= bounds[0]:
        return None
    est = _estimate_in(cols, dep, *bounds, model, engine, steps, engine_prefill)
    newest = float(np.nanmax(cols.end_at))
    if dep is not None and (est.decode is None or est.prefill is None) and newest > bounds[1]:
        lo = max(newest - window_seconds, bounds[0])
        wider = _estimate_in(cols, dep, lo, newest, model, engine, steps, engine_prefill)
        if (wider.decode is not None) + (wider.prefill is not None) > (
                est.decode is not None) + (est.prefill is not None):
            wider.inputs["range"] = InputSource("to_newest_request")
            return wider
    return est
