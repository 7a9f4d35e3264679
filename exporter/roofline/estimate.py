"""The roofline estimator: bytes and FLOPs each phase moved, from request records alone.

Input: the rolling window's columns for one (model, engine) and the deployment it
runs on. Output: per phase (prefill, decode) the FLOPs and bytes moved, the busy
time they were moved in, achieved FLOP/s and bytes/s, utilization of the peaks
(MFU, MBU), arithmetic intensity; the estimated decode batch size and step time;
phase time shares; and which inputs each figure came from.

How each figure is inferred (cost formulas in ``model_costs``):

* **Range.** The sender's own clock, not the exporter's: ``span`` seconds ending
  at ``hi``, a little before the newest request end. Requests still running are
  invisible until they finish, so the last moments before the newest end look
  emptier than they were; ``hi`` lags the newest end by the 90th percentile of
  in-engine time (capped so the range keeps at least half the data it could
  have), and the estimator reads requests from up to ``LOOKBACK_SPANS`` windows
  back so that requests overlapping the range's start are known.
* **Busy time** of a phase = length of the union of its intervals
  (``[scheduled, first_token]`` for prefill, ``[first_token, last_token]`` for
  decode) clipped to the range: the time the engine had at least one request in
  that phase.
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
  time) counts once on its own (``_decode_step_count``). Busy time over the mean TPOT
  counted a long step with few decodes beside it as several. **Decode step time** =
  busy / steps.
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
* MoE weight reads use the mean batch; with a batch that varies step to step this
  overstates the distinct experts a little (the expected count is concave in the
  batch), a few percent in the simulator's small-batch scenarios.
* **Range fallback**: while the data is younger than the lag (just after start,
  sparse traffic), a phase can be missing from the lagged range; the range then
  runs to the newest request end (``inputs["range"] = "to_newest_request"``).
* **Sampled traces** (``weight`` = 1/p per record, ``requests.sampling``): the records
  are a sample of the requests, so the work is weighted (each record's FLOPs, bytes,
  tokens, decode time and prefill chunks count w times: unbiased totals; unweighted, a
  10 % sample undercounts the work 10x). The union of the sample's intervals misses the
  time only unsampled requests ran, so busy time is estimated (``busy_time``) and the
  prefill steps seen (distinct first-token times) are scaled by busy over that union.
  With every weight 1 nothing changes.

Utilizations are against the datasheet's dense peaks x GPUs (the vendors' figures in
``catalog/hardware.json``); the measured ceilings (``phasewatch calibrate`` or the
catalog) are reported beside them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from phasewatch.aggregation.window import phase_time_shares
from phasewatch.roofline import model_costs
from phasewatch.roofline.catalog import HardwareSpec, ModelSpec

# Requests whose first tokens are this close together completed prefill in the same
# engine step (real engines stamp a whole step's outputs with one time).
SAME_STEP_SECONDS = 1e-4
LOOKBACK_SPANS = 3  # how far back (in ranges) the estimator reads requests
RANGE_END_QUANTILE = 0.9
COUNT_MASK = (1 << 21) - 1  # one of the running counts packed in ``_decode_step_count``


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
    inputs: dict[str, str] = field(default_factory=dict)
    # FLOPs of the other phase performed inside this phase's busy time (mixed steps)
    shared_step_flops: dict[str, float] = field(default_factory=dict)
    # per phase, the FLOPs and bytes inferred from the records, kept when the engine's
    # own counters replace them (the two side by side: how far inference is off)
    inferred: dict[str, dict[str, float]] = field(default_factory=dict)
    recompute_flops: float = 0.0  # of decode's, redone for preempted requests

    def as_dict(self) -> dict:
        return asdict(self)


def union_length(starts: np.ndarray, ends: np.ndarray, lo: float, hi: float) -> float:
    """Length of the union of intervals [starts, ends] clipped to [lo, hi]."""
    s, e = np.clip(starts, lo, hi), np.clip(ends, lo, hi)
    keep = e > s
    if not keep.any():
        return 0.0
    order = np.argsort(s[keep])  # any order of equal starts gives the same union
    s, e = s[keep][order], e[keep][order]
    reach = np.maximum.accumulate(e)
    before = np.concatenate(([s[0]], reach[:-1]))  # furthest end of earlier intervals
    return float(np.maximum(reach - np.maximum(before, s), 0.0).sum())


def busy_time(starts: np.ndarray, ends: np.ndarray, w: np.ndarray, lo: float,
              hi: float) -> tuple[float, float]:
    """(busy seconds, the intervals' union) inside [lo, hi]. With every weight 1 (all
    requests seen) busy is the union. With sampled records the union only bounds it from
    below, and busy is estimated as D^2 / Q: D = sum(w d) the phase time summed over the
    requests and Q = integral of c^2 dt (c: requests in the phase at t), both estimated
    without bias from the sample (Q as the integral of the weighted count squared, less its
    sampling variance sum(w (w - 1) d)). By Cauchy-Schwarz D^2 / Q <= busy, equal where c
    is constant while busy (a steady load); kept between the union and the range."""
    union = union_length(starts, ends, lo, hi)
    if not len(w) or np.all(w == 1.0):
        return union, union
    s, e = np.clip(starts, lo, hi), np.clip(ends, lo, hi)
    inside = e > s  # (not NaN, and some of it in the range)
    s, e, w = s[inside], e[inside], w[inside]
    d = e - s
    t = np.concatenate([s, e])
    order = np.argsort(t, kind="stable")
    level = np.cumsum(np.concatenate([w, -w])[order])[:-1]  # weighted count between events
    q = float((level ** 2 * np.diff(t[order])).sum() - (w * (w - 1.0) * d).sum())
    busy = float((w * d).sum()) ** 2 / q if q > 0 else union
    return min(max(busy, union), hi - lo), union


def inside_fraction(starts: np.ndarray, ends: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """Share of each interval inside [lo, hi]; a zero-length one counts if it lies inside."""
    length = ends - starts
    clipped = np.clip(ends, lo, hi) - np.clip(starts, lo, hi)
    with np.errstate(divide="ignore", invalid="ignore"):
        f = np.where(length > 0, clipped / length, ((starts >= lo) & (starts <= hi)) * 1.0)
    return np.clip(f, 0.0, 1.0)


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


def _weights(c: dict, rows: np.ndarray) -> np.ndarray:
    """The requests each of ``rows`` stands for (1 where the columns carry no weight)."""
    w = c.get("weight")
    return np.ones(int(rows.sum())) if w is None else np.nan_to_num(w[rows], nan=1.0)


def _reported_steps(steps: dict | None, lo: float, hi: float):
    """(mean requests per step, mean step seconds) of the engine's own decode steps in
    [lo, hi] (TGI's), each weighted by its fraction inside; None without any."""
    if steps is None or not len(steps["start"]):
        return None
    s, e, size = steps["start"], steps["end"], steps["size"]
    inside = (e > lo) & (s < hi) & (size > 0) & (e > s)
    if not inside.any():
        return None
    f = inside_fraction(s[inside], e[inside], lo, hi)
    if f.sum() <= 0:
        return None
    return (float((size[inside] * f).sum() / f.sum()),
            float(((e - s)[inside] * f).sum() / f.sum()))


def _prefill_steps(c: dict) -> tuple[np.ndarray, np.ndarray]:
    """The engine steps that completed a prefill: their ends (the distinct first-token
    times, sorted; requests whose first tokens are within ``SAME_STEP_SECONDS`` completed
    in one step) and how long each took at most (the shortest [scheduled, first token]
    of the requests completed in it)."""
    sched, first = c["scheduled_at"], c["first_token_at"]
    seen = ~np.isnan(sched) & ~np.isnan(first) & (first >= sched)
    key = np.round(first[seen] / SAME_STEP_SECONDS)
    order = np.argsort(key)
    key, took = key[order], (first[seen] - sched[seen])[order]
    if not len(key):
        return key, took
    new = np.concatenate([[0], np.flatnonzero(np.diff(key)) + 1])  # each step's first
    return key[new] * SAME_STEP_SECONDS, np.minimum.reduceat(took, new)


def _decode_step_count(first: np.ndarray, last: np.ndarray, n_tokens: np.ndarray,
                       ends: np.ndarray, took: np.ndarray, lo: float, hi: float) -> float:
    """Engine steps with decode tokens in them over [lo, hi], from the requests' tokens.

    Every request decoding when a step runs gets one token from it, so a step is 1/c of
    each of the c requests decoding in it: steps = sum over requests of their tokens'
    1/c. A request's n tokens are taken as spread evenly over its decode time and c is
    read at each moment from the decode intervals (all requests seen: with sampled
    records ``_decode`` counts busy time over the mean TPOT instead). A
    step that also completes a prefill (it ends at a first-token time, and lasted at
    most the shortest [scheduled, first token] of the requests it completed) counts once
    on its own, and the requests decoding through it spread their other tokens over the
    rest of their decode time.

    Decode busy time over the mean TPOT counted a long step with few requests decoding
    beside it as several: the step that prefills a finished batch's replacements beside
    the one request left of it (vLLM under --max-num-seqs: 1.09-1.23x the steps vLLM
    ran), many prompts' prefill beside a few decodes. The count from tokens and
    concurrency holds however long a step lasts where every request in it spreads its
    tokens alike (a stall of the host). Known limit, under KV pressure: a preempted
    request's decode interval holds the time it waited to be scheduled again, and c
    counts it as decoding then; the steps that recompute preempted prompts have no
    first-token time to mark them. On the real vLLM the steps came out 0.94-0.97x
    vLLM's there (within 1 % in the other workloads)."""
    # every moment something changes, in time order: a decode begins (+1 decoding) or
    # ends (-1); a step that completed a prefill begins (+1 prefilling) or ends (-1; at
    # its end less SAME_STEP_SECONDS / 2, so that the step that completed a request's own
    # prefill, whose end is its first-token time rounded, falls before its decode)
    n, k = len(first), len(ends)
    if max(n, k) >= COUNT_MASK:  # (beyond any window's capacity) the caller's fallback
        return 0.0
    # (no count goes below 0 even for a moment: a decode ends after it begins, a step
    # that prefilled lasted at least SAME_STEP_SECONDS)
    t = np.concatenate([first, np.maximum(last, first), ends - np.maximum(took, SAME_STEP_SECONDS),
                        ends - SAME_STEP_SECONDS / 2, [lo, hi]])
    # the three running counts in one integer, 21 bits each: decoding, prefilling, and
    # the prefill steps ended so far (one cumulative sum instead of three)
    delta = np.zeros(len(t), dtype=np.int64)
    delta[:n], delta[n:2 * n] = 1, -1
    delta[2 * n:2 * n + k], delta[2 * n + k:2 * n + 2 * k] = 1 << 21, (1 << 42) - (1 << 21)
    at = np.argsort(t)
    t = t[at]
    counts = np.cumsum(delta[at])
    decoding = counts & COUNT_MASK
    prefilling = (counts >> 21) & COUNT_MASK
    where = np.empty(len(t), dtype=np.intp)
    where[at] = np.arange(len(t))  # each event's place in time order
    b, e = where[:n], where[n:2 * n]  # each request's first and last token
    # the steps with decode tokens in them: decodes went on through their end
    shared = decoding[where[2 * n + k:2 * n + 2 * k]] > 0
    steps = float((shared & (ends >= lo) & (ends <= hi)).sum())
    done = counts >> 42
    own = np.minimum(done[e] - done[b], n_tokens)  # of a request's tokens, from them
    seg = np.diff(t)
    seg[prefilling[:-1] > 0] = 0.0  # the decode time outside steps that prefilled
    kept = np.zeros(len(t))
    np.cumsum(seg, out=kept[1:])
    seg /= np.maximum(decoding[:-1], 1)  # 1/c of a step
    seg[(t[:-1] < lo) | (t[1:] > hi)] = 0.0  # in the range only
    share = np.zeros(len(t))
    np.cumsum(seg, out=share[1:])
    alone, part = kept[e] - kept[b], share[e] - share[b]
    tokens = (n_tokens - own) * part / np.maximum(alone, 1e-12)
    through = alone <= 1e-9  # decoded only through prefill steps: over its whole time
    if through.any():
        seg = np.diff(t) / np.maximum(decoding[:-1], 1)
        seg[(t[:-1] < lo) | (t[1:] > hi)] = 0.0
        whole = np.zeros(len(t))
        np.cumsum(seg, out=whole[1:])
        tokens[through] = (n_tokens[through] * (whole[e] - whole[b])[through]
                           / np.maximum(t[e] - t[b], 1e-12)[through])
    return steps + float(tokens.sum())


def _decode(dep: Deployment, c: dict, lo: float, hi: float, inputs: dict,
            steps: dict | None = None):
    m = dep.model
    reported = _reported_steps(steps, lo, hi)
    if reported is not None:  # the engine's own steps: the requests in each forward
        inputs["decode_batch"] = "engine_decode_steps"
    # without a decode estimate the engine's batch and step are still reported
    none = (None, *reported) if reported is not None else (None, None, None)
    first, last = c["first_token_at"], c["last_token_at"]
    timed = ~np.isnan(first) & ~np.isnan(last) & (last > lo) & (first < hi)
    ok = timed & (c["steps"] > 0) & (c["prompt"] >= 0) & (c["output"] > 1)
    if not ok.any():
        inputs["decode"] = "unavailable: " + (
            "no first and last token times" if not timed.any() else
            "prompt tokens unknown (each step reads the KV cache of the whole context)"
            if not (timed & (c["prompt"] >= 0)).any() else
            "no request with more than one output token")
        return none
    first, last, w = first[ok], last[ok], _weights(c, ok)
    n_tokens, prompt, out = c["steps"][ok].astype(float), c["prompt"][ok], c["output"][ok]
    busy, _ = busy_time(first, last, w, lo, hi)
    f = inside_fraction(first, last, lo, hi) * w  # the part inside, of the requests it is
    duration = (last - first) * f
    if busy <= 0 or duration.sum() <= 0:
        inputs["decode"] = "unavailable: decode intervals have no length in the range"
        return none
    timed = c["timed"][ok]
    inputs["decode_steps"] = ("token_gaps" if timed.all() else
                              "tpot" if not timed.any() else "token_gaps+tpot")
    if reported is not None:
        batch, step = reported
        n_steps = busy / step
    else:
        inputs["decode_batch"] = "overlapping_decode_intervals"
        batch = duration.sum() / busy
        # sampled: 1/c of a sample's count is biased (a sample of 1 in 10 decoding
        # reads c = 10 where 3 were); the busy time estimated from it is not
        n_steps = (_decode_step_count(first, last, n_tokens, *_prefill_steps(c), lo, hi)
                   if np.all(w == 1.0) else 0.0)
        step = busy / n_steps if n_steps > 0 else duration.sum() / (n_tokens * f).sum()
        n_steps = busy / step
    context = n_tokens * (prompt + out / 2.0) * f  # context tokens read over the decode steps
    kv = model_costs.kv_bytes_per_token(m) * context.sum()
    weights = n_steps * float(model_costs.weight_bytes_read(m, batch))
    tokens = (out - 1) * f
    flops = 2.0 * m.active_params * tokens.sum() + model_costs.attention_flops_per_context_token(
        m) * float((context * (out - 1) / n_tokens).sum())
    return phase_estimate(dep, busy, flops, weights + kv, int(ok.sum()),
                          weight_bytes=weights), batch, step


def _prefill(dep: Deployment, c: dict, lo: float, hi: float, inputs: dict):
    m = dep.model
    sched, first = c["scheduled_at"], c["first_token_at"]
    timed = ~np.isnan(sched) & ~np.isnan(first) & (first >= lo) & (sched <= hi)
    ok = timed & (c["uncached"] >= 0)
    if not ok.any():
        inputs["prefill"] = "unavailable: " + (
            "no scheduled and first-token times" if not timed.any() else
            "prompt tokens unknown" if (c["prompt"][timed] < 0).all() else
            "cached prompt tokens unknown (the server does not say how many prompt tokens "
            "its prefix cache served; for vLLM give --engine-metrics-url for its hit rate)")
        return None
    sched, first, w = sched[ok], first[ok], _weights(c, ok)
    busy, union = busy_time(sched, first, w, lo, hi)
    if busy <= 0:
        inputs["prefill"] = "unavailable: prefill intervals have no length in the range"
        return None
    f = inside_fraction(sched, first, lo, hi) * w  # the part inside, of the requests it is
    uncached = c["uncached"][ok].astype(float)
    cached = np.maximum(c["prompt"][ok], 0) - uncached
    flops = float(np.sum(model_costs.prefill_flops(m, uncached, cached) * f))
    inside = (first >= lo) & (first <= hi)
    completions = len(np.unique(np.round(first[inside] / SAME_STEP_SECONDS)))
    if busy != union:  # sampled: the steps only unsampled requests completed in are unseen
        completions *= busy / union
    chunks = float((np.maximum(np.ceil(uncached / dep.max_batched_tokens) - 1, 0) * f).sum())
    n_steps = max(completions + chunks, 1.0)
    weights = n_steps * float(model_costs.weight_bytes_read(m, (uncached * f).sum() / n_steps))
    kv = model_costs.kv_bytes_per_token(m) * float(((uncached + cached) * f).sum())
    inputs["prefill_steps"] = "distinct_first_token_times+chunks"
    return phase_estimate(dep, busy, flops, weights + kv, int(ok.sum()), weight_bytes=weights)


def _shares(c: dict, sel: np.ndarray) -> dict[str, float] | None:
    """``window.phase_time_shares`` without the phases no request reports; None when
    there is nothing to share."""
    shares = phase_time_shares(c, sel)
    if shares["queue"] is None:
        return None
    return {k: v for k, v in shares.items() if v is not None}


def analysis_range(cols: dict[str, np.ndarray], span: float) -> tuple[float, float] | None:
    """[lo, hi] on the sender's clock (see the module docstring), or None without data."""
    end = cols["end_at"]
    has_end = ~np.isnan(end)
    if not has_end.any():
        return None
    newest, oldest = float(end[has_end].max()), float(end[has_end].min())
    start = np.fmin(cols["scheduled_at"], cols["first_token_at"])[has_end]
    in_engine = (end[has_end] - start)[~np.isnan(start)]
    lag = float(np.quantile(in_engine, RANGE_END_QUANTILE)) if in_engine.size else 0.0
    hi = max(newest - lag, oldest + 0.5 * min(span, newest - oldest))
    return max(hi - span, oldest), hi


def _overlap(c: dict, lo: float, hi: float, prefill: PhaseEstimate | None,
             decode: PhaseEstimate | None) -> float:
    """Seconds in which both phases ran (steps carrying decode tokens and a prefill
    chunk, under chunked prefill): |P| + |D| - |P or D|."""
    if prefill is None or decode is None:
        return 0.0
    w = _weights(c, np.ones(len(c["end_at"]), dtype=bool))
    both, _ = busy_time(np.concatenate([c["scheduled_at"], c["first_token_at"]]),
                        np.concatenate([c["first_token_at"], c["last_token_at"]]),
                        np.concatenate([w, w]), lo, hi)
    return max(prefill.busy_seconds + decode.busy_seconds - both, 0.0)


def _estimate_in(cols: dict, dep: Deployment | None, lo: float, hi: float, model: str,
                 engine: str, steps: dict | None = None) -> RooflineEstimate:
    end = cols["end_at"]
    inputs: dict[str, str] = {}
    decode = batch = step = prefill = None
    shared: dict[str, float] = {}
    if dep is None:
        inputs["roofline"] = "no deployment configured for this model"
    else:
        decode, batch, step = _decode(dep, cols, lo, hi, inputs, steps)
        prefill = _prefill(dep, cols, lo, hi, inputs)
        overlap = _overlap(cols, lo, hi, prefill, decode)
        if overlap > 0:
            # the other phase's FLOPs done inside this phase's steps, its work taken
            # as spread evenly over its own busy time
            shared = {"decode": prefill.flops * overlap / prefill.busy_seconds,
                      "prefill": decode.flops * overlap / decode.busy_seconds}
    in_range = (end >= lo) & (end <= hi)
    inferred = {name: {"flops": p.flops, "bytes": p.bytes, "weight_bytes": p.weight_bytes}
                for name, p in (("prefill", prefill), ("decode", decode)) if p is not None}
    return RooflineEstimate(
        model=model, engine=engine, range_start=lo, range_end=hi,
        range_end_lag_seconds=float(np.nanmax(end)) - hi, requests=int(in_range.sum()),
        prefill=prefill, decode=decode, decode_batch_size=batch, decode_step_seconds=step,
        phase_time_share=_shares(cols, in_range), inputs=inputs,
        shared_step_flops=shared, inferred=inferred)


def estimate(cols: dict[str, np.ndarray], dep: Deployment | None, span: float,
             model: str = "", engine: str = "", steps: dict | None = None
             ) -> RooflineEstimate | None:
    """Roofline figures for one label set's columns (see the module docstring).

    ``cols`` are ``RollingWindow.columns()`` arrays restricted to one label set,
    read ``LOOKBACK_SPANS`` ranges back; ``steps``, ``RollingWindow.steps()`` of the
    same label set: decode steps the engine reported (TGI), whose sizes are the decode
    batch when any fall in the range. Without a deployment only the range and
    the phase time shares are filled in. Returns None when there is nothing to
    estimate from (no request end times, or a range of zero length).

    While the data is still younger than the lag (just after start, or with sparse
    traffic), the lagged range can miss a phase entirely; the range then runs to
    the newest request end instead, and ``inputs["range"]`` says so.
    """
    bounds = analysis_range(cols, span)
    if bounds is None or bounds[1] <= bounds[0]:
        return None
    est = _estimate_in(cols, dep, *bounds, model, engine, steps)
    newest = float(np.nanmax(cols["end_at"]))
    if dep is not None and (est.decode is None or est.prefill is None) and newest > bounds[1]:
        wider = _estimate_in(cols, dep, max(newest - span, bounds[0]), newest, model, engine,
                             steps)
        if (wider.decode is not None) + (wider.prefill is not None) > (
                est.decode is not None) + (est.prefill is not None):
            wider.inputs["range"] = "to_newest_request"
            return wider
    return est
