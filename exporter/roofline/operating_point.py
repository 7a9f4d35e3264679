"""The window's operating point the levers' predictions start from, and the shape of a
prediction (``lever_effects``, ``kv_lever``).

``OperatingPoint`` holds the window's means over the estimate's range: the arrivals and
finishes, the requests in the system (and whether the clients are a closed loop: as
many arrive as finish over one stretch, and the number in the system stays put), the
decode batch and step, the request's parts, the prompts the range computed, and the
engine's own KV, slot and waiting figures where it publishes them. ``Prediction`` is
one lever's effect: the figures now, the figures predicted, how far past the fitted
range it reaches, its basis and its notes, in words and as a dict.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from phasewatch.aggregation.columns import WindowColumns
from phasewatch.roofline import step_model
from phasewatch.roofline.intervals import UpTo, evenly_spaced

MAX_PROMPTS = 4096
CLOSED_LOOP_CV = 0.25  # requests in the system vary less than this: closed-loop clients
# or the time from an arrival back to the last finish before it is under this share of
# the same from evenly spaced moments (``arrival_lag``): clients that send on an answer.
# Equal requests in a closed loop finish in cohorts, and the number in the system swings
# with them: CI's 24 streams at 8 slots varied 25 % on a host 3.1x slower than the
# reference and were taken for open arrivals (at 16 slots a queue of 0.008 s predicted,
# 0.45 s measured). Open arrivals, Poisson at 0.8-0.95 of 8 slots, read 0.85-1.2;
# closed loops answered within a tenth of a service time read 0.05-0.6
FOLLOW = 0.5
# the figures a prediction's sentence names: key, words, unit, scale
FIGURE_WORDS = (("batch", "batch", "", 1.0), ("queue_seconds", "queue", " s", 1.0),
                ("ttft_seconds", "TTFT", " s", 1.0), ("e2e_seconds", "e2e", " s", 1.0),
                ("tpot_seconds", "TPOT", " ms", 1e3),
                ("itl_p50_seconds", "ITL p50", " ms", 1e3),
                ("itl_p99_seconds", "ITL p99", " ms", 1e3),
                ("itl_max_seconds", "longest ITL", " ms", 1e3),
                ("output_tokens_per_second", "output", " tokens/s", 1.0),
                ("kv_usage", "KV cache", " %", 100.0),
                ("kv_capacity_tokens", "KV capacity", " tokens", 1.0))


def _num(x: float) -> str:
    """Three significant figures, thousands grouped, no exponent."""
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


@dataclass(frozen=True)
class Prediction:
    """One lever's predicted effect: ``now`` the operating point's figures and
    ``predicted`` the same after the change; ``reach`` how far past the fitted range
    the prediction goes (1: inside it)."""

    lever: str
    setting: str
    now: dict[str, float]
    predicted: dict[str, float]
    reach: float
    basis: str
    notes: tuple[str, ...] = field(default=())

    @property
    def confidence(self) -> str:
        return ("inside the fitted range" if self.reach <= 1.0 else
                f"{self.reach:.1f}x past the fitted range")

    @property
    def text(self) -> str:
        """In words: "--max-num-seqs 96: batch 63.3 -> 94.9, TPOT 16.6 -> 22.1 ms, output
        3,859 -> 4,321 tokens/s, ... (predicted, 1.4x past the fitted range)"."""
        parts = []
        for key, what, unit, scale in FIGURE_WORDS:
            if key in self.predicted and key in self.now:
                parts.append(f"{what} {_num(self.now[key] * scale)} -> "
                             f"{_num(self.predicted[key] * scale)}{unit}")
        tail = "; ".join(self.notes)
        return (f"{self.setting}: {', '.join(parts)}{'; ' + tail if tail else ''} "
                f"(predicted, {self.confidence})")

    def as_dict(self) -> dict:
        return {"lever": self.lever, "setting": self.setting, "kind": "predicted",
                "text": self.text,
                "now": self.now, "predicted": self.predicted, "reach": self.reach,
                "confidence": self.confidence, "basis": self.basis, "notes": list(self.notes)}


@dataclass(frozen=True)
class OperatingPoint:
    """The window's figures the predictions start from (means over [lo, hi])."""

    seconds: float
    arrival_rate: float  # requests per second
    finish_rate: float
    in_system: float  # requests arrived and not finished, on average
    in_system_cv: float
    batch: float  # decoding sequences per step
    step: float  # decode step seconds (the estimate's)
    output: float  # mean output tokens
    prefill: float  # mean prefill seconds
    queue: float  # mean queue seconds
    ttft: float
    e2e: float  # mean request seconds, arrival to the response's end
    prefill_per_step: float  # prompt tokens a decode step carries, on average
    prompt_max: float  # the longest prompt computed (uncached; the whole where unknown)
    prompt: float  # the mean prompt computed
    kv_usage: float | None = None
    kv_capacity_tokens: float | None = None
    limit: float | None = None  # the slot limit the engine ran at
    # the prompt tokens computed of each request prefilled in the range (at most
    # MAX_PROMPTS, evenly picked), and how many prefills the range ran a second
    prompts: tuple[float, ...] = ()
    prefills_per_second: float = 0.0
    arrivals_per_finish: float = 1.0  # over one stretch whose requests have all but ended
    # the engine's own: requests waiting (for a slot or KV memory, preempted ones
    # included), on average over its scrapes, and preemptions a second
    waiting: float | None = None
    preemptions_per_second: float | None = None
    # a request's prefill against the prompt tokens of the requests whose first token
    # came in its step (its group, itself included): fixed seconds and seconds a token
    # (``prefill_groups``), None where the groups' sizes barely vary
    group_prefill: tuple[float, float] | None = None
    lengths_cv: float = 1.0  # the larger of the prompts' and outputs' variation
    arrival_lag: float = 1.0  # (``FOLLOW``) 1 for arrivals that do not heed the finishes
    # the prefill seconds (scheduled to first token) of the requests of ``prompts``, in
    # their order (NaN where unknown)
    prefills: tuple[float, ...] = ()

    @property
    def closed_loop(self) -> bool:
        """As many arrive as finish over one stretch, and either the number in the system
        stays put or the arrivals come on the heels of the finishes (``FOLLOW``)."""
        return (self.finish_rate > 0 and abs(self.arrivals_per_finish - 1.0) <= 0.15
                and (self.in_system_cv < CLOSED_LOOP_CV or self.arrival_lag < FOLLOW))

    @property
    def preprocess(self) -> float:
        """Seconds a request spends before the engine: its TTFT less its queue and
        prefill (a larger slot limit or KV cache leaves it as it was)."""
        return max(self.ttft - self.queue - self.prefill, 0.0)

    @property
    def decoding(self) -> float:
        """Seconds a request spends from its first token to its end, on average."""
        return max(self.e2e - self.ttft, 0.0)

    @property
    def service(self) -> float:
        """Seconds a request holds a slot: its prefill and its decode steps."""
        return self.prefill + max(self.output - 1.0, 0.0) * self.step

    def described(self) -> dict:
        """``figures`` and what the predictions read of the clients (the JSON API's
        ``operating_point``)."""
        return {**self.figures(), "in_system": self.in_system,
                "in_system_cv": self.in_system_cv, "arrival_rate": self.arrival_rate,
                "arrivals_per_finish": self.arrivals_per_finish,
                "arrival_lag": self.arrival_lag, "closed_loop": self.closed_loop,
                "prompt_tokens": self.prompt, "output_tokens": self.output,
                "lengths_cv": self.lengths_cv, "limit": self.limit,
                "kv_capacity_tokens": self.kv_capacity_tokens, "waiting": self.waiting}

    def figures(self) -> dict[str, float]:
        return {"batch": self.batch, "step_seconds": self.step, "queue_seconds": self.queue,
                "ttft_seconds": self.ttft, "tpot_seconds": self.step, "e2e_seconds": self.e2e,
                "output_tokens_per_second": self.finish_rate * self.output,
                **({"kv_usage": self.kv_usage} if self.kv_usage is not None else {})}


def _mean(x: np.ndarray) -> float:
    """``np.nanmean`` (the same sum, so the same figure), 0 where every value is NaN."""
    known = ~np.isnan(x)
    n = np.count_nonzero(known)
    return float(np.where(known, x, 0.0).sum() / n) if n else 0.0


def _cv(x: np.ndarray) -> float:
    return float(x.std() / x.mean()) if x.size and x.mean() > 0 else 1.0


def prefill_groups(first: np.ndarray, prefill: np.ndarray, tokens: np.ndarray, step: float,
                   order: np.ndarray | None = None) -> tuple[float, float] | None:
    """A prefill step carries the prompts of every request whose first token it gives,
    and lasts the longer the more tokens they hold. Requests whose first tokens came
    less than half a step apart are one group; a least-squares line through
    (the group's prompt tokens, each request's prefill), over at most
    ``intervals.FIT_ROWS`` requests evenly spaced in time, gives the fixed seconds and the
    seconds a token. None where the groups' tokens barely vary (step_model.SPREAD) or
    the line does not rise. ``order``: the requests by first token, where the caller
    has it."""
    if first.size < 4 or step <= 0:
        return None
    order = np.argsort(first) if order is None else order
    group = np.cumsum(np.r_[True, np.diff(first[order]) > 0.5 * step])
    held = np.bincount(group, weights=tokens[order])[group]  # each request's group's tokens
    rows = evenly_spaced(np.arange(len(held)))
    held, took = held[rows], prefill[order][rows]
    lo, hi = np.quantile(held, [0.1, 0.9])
    if hi - lo < step_model.SPREAD * held.mean():
        return None
    slope, fixed = np.polyfit(held, took, 1)
    return (max(float(fixed), 0.0), float(slope)) if slope > 0 else None


def operating_point(cols: WindowColumns, lo: float, hi: float, batch: float, step: float,
                    kv_usage: float | None, kv_capacity: float | None,
                    limit: float | None, waiting: float | None = None,
                    preemptions_per_second: float | None = None) -> OperatingPoint | None:
    """The operating point over [lo, hi] from the records (and the engine's figures
    given); None without finished requests in it."""
    span = hi - lo
    end = cols.end_at
    done = ~np.isnan(end) & (end >= lo) & (end <= hi)
    if span <= 0 or not done.any():
        return None
    # the requests that finished in the range arrived at this rate (those that arrived in
    # it and wait have no record: under a growing queue, the range's arrivals are none)
    came = cols.arrival[done & ~np.isnan(cols.arrival)]
    arrival_rate = (len(came) - 1) / float(np.ptp(came)) if len(came) > 1 and np.ptp(came) \
        > 0 else float(done.sum()) / span
    a, e = cols.arrival, end
    known = ~np.isnan(a) & ~np.isnan(e)
    # requests in the system at each t: arrived less finished. Those still running at hi
    # have no record yet, so t stops where all but 5 % that were in by then had finished
    stay = (e - a)[done & known]
    settled = hi - float(np.quantile(stay, 0.95)) if stay.size else hi
    t = np.linspace(lo, max(settled, lo + 0.5 * span), 100)
    count = (UpTo(a[known], t).index - UpTo(e[known], t).index).astype(float)
    arrived, ended = (int(((x >= lo) & (x <= t[-1])).sum()) for x in (a, e))  # that stretch
    first = cols.first_token_at
    computed, pre = step_model.prefilled(cols)
    tokens = float(computed[pre & done].sum())
    mean_count = float(count.mean())
    inside = pre & (first >= lo) & (first <= hi)
    took = computed[inside]
    ok = inside & ~np.isnan(cols.prefill)
    outputs = cols.output[done]
    outputs = outputs[outputs > 0].astype(float)
    picked = (slice(None) if len(took) <= MAX_PROMPTS else
              np.linspace(0, len(took) - 1, MAX_PROMPTS).astype(int))
    sample, prefills = took[picked], cols.prefill[inside][picked]
    return OperatingPoint(
        span, arrival_rate, float(done.sum()) / span, mean_count,
        float(count.std() / mean_count) if mean_count else 0.0, batch, step,
        float(outputs.mean()) if outputs.size else 0.0,
        _mean(cols.prefill[done]), _mean(cols.queue[done]), _mean(cols.ttft[done]),
        _mean(cols.e2e[done]),
        tokens / span * max(step, 0.0),
        float(computed[pre].max()) if pre.any() else 0.0,
        _mean(np.where(pre & done, computed, np.nan)), kv_usage,
        kv_capacity, limit, tuple(sample.tolist()),
        float(len(took)) / span, arrived / ended if ended else 0.0, waiting,
        preemptions_per_second,
        prefill_groups(first[ok], cols.prefill[ok], computed[ok], step,
                       cols.order_within("first_token_at", ok)),
        max(_cv(outputs), _cv(computed[pre & done])), arrival_lag(a, e, lo, t[-1]),
        tuple(prefills.astype(float).tolist()))


def arrival_lag(arrival: np.ndarray, end: np.ndarray, lo: float, hi: float) -> float:
    """The median time from an arrival in [lo, hi] back to the last finish before it,
    over the same from evenly spaced moments there (``FOLLOW``): about 1 for arrivals
    that do not heed the finishes, under it for clients that send on an answer; 1 with
    too few of either to tell. Over the range's last ``MAX_PROMPTS`` arrivals at most
    (a stretch, so that each arrival keeps the finishes before it)."""
    came = arrival[(arrival >= lo) & (arrival <= hi)]
    if len(came) > MAX_PROMPTS:
        lo = float(np.partition(came, len(came) - MAX_PROMPTS)[len(came) - MAX_PROMPTS])
        came = came[came >= lo]
    ends = np.sort(end[(end >= 2.0 * lo - hi) & (end <= hi)])  # (NaN neither)
    if len(came) < 20 or len(ends) < 20 or hi <= lo:
        return 1.0

    def back(t: np.ndarray) -> np.ndarray:
        i = np.searchsorted(ends, t, side="right") - 1
        return (t - ends[np.maximum(i, 0)])[i >= 0]

    at_arrivals, anywhere = back(came), back(np.linspace(lo, hi, 400))
    if not at_arrivals.size or not anywhere.size or np.median(anywhere) <= 0:
        return 1.0
    return float(np.median(at_arrivals) / np.median(anywhere))
