"""Time arithmetic on request intervals, for the roofline estimator (``estimate``).

The range an estimate reads (``analysis_range``); the union of intervals clipped to a
range (the busy time of a phase), that busy time estimated from sampled records, the
share of each interval inside a range; the decode steps the engine reported itself
(TGI; those counted from the requests are ``step_count``'s); where a prefill interval
starts (``prefill_start``: its arrival in the client's view); how the decode step moves
with the batch (``step_by_batch``, over the window's decodes as ``decodes`` holds them
once a tick); and decodes against others' prefills (``decode_shared_with_prefill``,
``decode_slowdown``). A sort a caller has (``WindowColumns.order``) is taken where
given, not made again.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from phasewatch.aggregation.columns import WindowColumns
from phasewatch.aggregation.window import ReportedSteps

# Requests whose first tokens are this close together completed prefill in the same
# engine step (real engines stamp a whole step's outputs with one time).
SAME_STEP_SECONDS = 1e-4
RANGE_END_QUANTILE = 0.9  # (``analysis_range``)
FIT_ROWS = 4096  # requests a line is fitted through at most (``evenly_spaced``)


def evenly_spaced(rows: np.ndarray, at_most: int = FIT_ROWS) -> np.ndarray:
    """``rows`` (indices, in the window's order) thinned to at most ``at_most``, evenly
    spaced: a line through 4,096 requests is as good as one through all of them."""
    if len(rows) <= at_most:
        return rows
    return rows[np.linspace(0, len(rows) - 1, at_most).astype(np.intp)]


def sorted_near(x: np.ndarray, hint: np.ndarray) -> np.ndarray:
    """``np.argsort(x)`` where ``hint`` (a permutation: the order of another column)
    puts ``x`` nearly in order already: a stable sort of ``x`` taken in that order,
    which merges its few runs instead of sorting it whole."""
    return hint[np.argsort(x[hint], kind="stable")]


def union_length(starts: np.ndarray, ends: np.ndarray, lo: float, hi: float,
                 order: np.ndarray | None = None) -> float:
    """Length of the union of intervals [starts, ends] clipped to [lo, hi]; ``order``,
    the intervals by start where the caller has it (``WindowColumns.order_within``)."""
    s, e = np.clip(starts, lo, hi), np.clip(ends, lo, hi)
    keep = e > s
    if not keep.any():
        return 0.0
    # (clipping keeps the order; any order of equal starts gives the same union)
    order = np.flatnonzero(keep)[np.argsort(s[keep])] if order is None else order[keep[order]]
    s, e = s[order], e[order]
    reach = np.maximum.accumulate(e)
    before = np.concatenate(([s[0]], reach[:-1]))  # furthest end of earlier intervals
    return float(np.maximum(reach - np.maximum(before, s), 0.0).sum())


def busy_time(starts: np.ndarray, ends: np.ndarray, w: np.ndarray, lo: float,
              hi: float, order: np.ndarray | None = None) -> tuple[float, float]:
    """(busy seconds, the intervals' union) inside [lo, hi]. With every weight 1 (all
    requests seen) busy is the union. With sampled records the union only bounds it from
    below, and busy is estimated as D^2 / Q: D = sum(w d) the phase time summed over the
    requests and Q = integral of c^2 dt (c: requests in the phase at t), both estimated
    without bias from the sample (Q as the integral of the weighted count squared, less its
    sampling variance sum(w (w - 1) d)). By Cauchy-Schwarz D^2 / Q <= busy, equal where c
    is constant while busy (a steady load); kept between the union and the range.
    ``order``: as ``union_length``'s."""
    union = union_length(starts, ends, lo, hi, order)
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


def analysis_range(cols: WindowColumns, window_seconds: float
                   ) -> tuple[float, float] | None:
    """[lo, hi] on the sender's clock (``estimate``'s module docstring), or None
    without data."""
    end = cols.end_at
    if not (has_end := ~np.isnan(end)).any():
        return None
    newest, oldest = float(end[has_end].max()), float(end[has_end].min())
    start = np.fmin(cols.scheduled_at, cols.first_token_at)[has_end]
    in_engine = (end[has_end] - start)[~np.isnan(start)]
    lag = float(np.quantile(in_engine, RANGE_END_QUANTILE)) if in_engine.size else 0.0
    hi = max(newest - lag, oldest + 0.5 * min(window_seconds, newest - oldest))
    return max(hi - window_seconds, oldest), hi


def inside_fraction(starts: np.ndarray, ends: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """Share of each interval inside [lo, hi]; a zero-length one counts if it lies inside."""
    length = ends - starts
    clipped = np.clip(ends, lo, hi) - np.clip(starts, lo, hi)
    with np.errstate(divide="ignore", invalid="ignore"):
        f = np.where(length > 0, clipped / length, ((starts >= lo) & (starts <= hi)) * 1.0)
    return np.clip(f, 0.0, 1.0)


def moment_places(at: np.ndarray, t: np.ndarray) -> np.ndarray:
    """``np.searchsorted(t, at, side="left")`` (the first moment of the sorted ``t`` at
    or after each time; NaN: past them all), by arithmetic where ``t`` is evenly spaced
    (``np.linspace``): each time's place guessed from the spacing and set right by one
    comparison either side, a few passes over ``at`` instead of a binary search for each
    (5x faster at 100,000 times among 200 moments). Every moment within a quarter of the
    spacing of its place on the even grid keeps each guess within one of the true place,
    so the two comparisons make it exact; moments further off fall back to the search."""
    n = len(t)
    if n < 2 or not t[-1] > t[0]:
        return np.searchsorted(t, at, side="left")
    spacing = (t[-1] - t[0]) / (n - 1)
    if not np.abs(t - (t[0] + spacing * np.arange(n))).max() <= 0.25 * spacing:
        return np.searchsorted(t, at, side="left")  # (or NaN among the moments)
    with np.errstate(invalid="ignore"):
        guess = np.ceil((at - t[0]) / spacing)
    np.clip(guess, 1, n, out=guess)  # (0 is reached by the first comparison: -inf too)
    guess[np.isnan(guess)] = n
    place = guess.astype(np.intp)
    after, before = np.r_[t, np.inf], np.r_[-np.inf, t]  # t[place], t[place - 1]
    place -= at <= before[place]
    place += at > after[place]
    return place


class UpTo:
    """Sums of per-request values over the requests whose time ``at`` is <= each moment
    of ``t`` (sorted; ``cause.in_engine``'s and ``operating_point``'s few hundred): each
    time placed among the moments (``moment_places``), then the values summed per place
    and accumulated, with no sort of the requests (``index``: how many)."""

    def __init__(self, at: np.ndarray, t: np.ndarray):
        self._place, self._n = moment_places(at, t), len(t)
        self.index = np.cumsum(np.bincount(self._place, minlength=self._n + 1))[:self._n]

    def sum(self, values: np.ndarray) -> np.ndarray:
        return np.cumsum(np.bincount(self._place, weights=values,
                                     minlength=self._n + 1))[:self._n]


def reported_steps(steps: ReportedSteps | None, lo: float, hi: float):
    """(mean requests per step, mean step seconds) of the engine's own decode steps in
    [lo, hi] (TGI's), each weighted by its fraction inside; None without any."""
    if steps is None or not len(steps.start):
        return None
    s, e, size = steps.start, steps.end, steps.size
    inside = (e > lo) & (s < hi) & (size > 0) & (e > s)
    if not inside.any():
        return None
    f = inside_fraction(s[inside], e[inside], lo, hi)
    if f.sum() <= 0:
        return None
    return (float((size[inside] * f).sum() / f.sum()),
            float(((e - s)[inside] * f).sum() / f.sum()))


def prefill_start(c: WindowColumns, engine_prefill: float | None = None
                  ) -> tuple[np.ndarray, bool]:
    """Where each request's prefill interval starts: its scheduling, or, where no request
    of the window has one (the client's view: a tap's records), its arrival (True); with
    ``engine_prefill`` (the engine's own mean prefill seconds, from its /metrics) that
    mean, scaled by the request's prompt tokens over the window's mean (a compute-bound
    prefill takes time in proportion), before its first token, not before its arrival."""
    sched, arrival = c.scheduled_at, c.arrival
    if (~np.isnan(sched)).any() or np.isnan(arrival).all():
        return sched, False
    if not engine_prefill:
        return arrival, True
    tokens = np.where(c.uncached >= 0, c.uncached, c.prompt).astype(float)
    tokens[tokens <= 0] = np.nan
    known = ~np.isnan(tokens)
    share = np.where(known, tokens / tokens[known].mean(), 1.0) if known.any() else 1.0
    return np.maximum(arrival, c.first_token_at - engine_prefill * share), True


class Overlaps:
    """Intervals [starts, ends), sorted once: ``integral`` gives, for each [a, b], the
    integral over it of the weights of the intervals open at each moment, from the
    sorted ends and the sums of the weights before each query (no interval x interval
    matrix)."""

    def __init__(self, starts: np.ndarray, ends: np.ndarray, by_start: np.ndarray | None
                 = None, by_end: np.ndarray | None = None):
        """``by_start``, ``by_end``: the intervals' orders where the caller has them.
        Times are kept from the earliest start (``_t0``): the sums of weights x times
        cancel, and from a Unix epoch they would keep ~1e-16 of 1.8e9 s x the weights."""
        self._os = np.argsort(starts) if by_start is None else by_start
        self._oe = np.argsort(ends) if by_end is None else by_end
        self._fs, self._ls = starts[self._os], ends[self._oe]
        self._t0 = float(self._fs[0]) if len(self._fs) and np.isfinite(self._fs[0]) else 0.0
        if self._t0:
            self._fs, self._ls = self._fs - self._t0, self._ls - self._t0

    def integral(self, weights: np.ndarray | None, a: np.ndarray, b: np.ndarray
                 ) -> np.ndarray:
        return self.integrals([weights], a, b)[0]

    def integrals(self, weights: list[np.ndarray | None], a: np.ndarray, b: np.ndarray
                  ) -> list[np.ndarray]:
        """``integral`` for each of ``weights`` over the same [a, b] (None: 1 for every
        interval, the count open). The queries are sorted once and placed among the
        sorted starts and ends; each weight is summed only up to those places
        (``sums_before``: a few thousand queries, not a cumulative sum of every
        interval)."""
        both = np.concatenate([a, b])
        order = np.argsort(both)  # sorted queries: searchsorted's fast path
        q = both[order] - self._t0
        i = np.searchsorted(self._fs, q, side="right")  # (non-decreasing, as q)
        j = np.searchsorted(self._ls, q, side="right")
        out = []
        for w in weights:
            if w is None:  # the count of starts and of ends before each query
                cws, cwe = i.astype(float), j.astype(float)
                cfs, cle = sums_before(self._fs, i), sums_before(self._ls, j)
            else:
                ws, we = w[self._os], w[self._oe]
                cws, cwe = sums_before(ws, i), sums_before(we, j)
                cfs, cle = sums_before(ws * self._fs, i), sums_before(we * self._ls, j)
            upto = np.empty(len(q))  # from -inf to each query
            upto[order] = (cws * q - cfs) - (cwe * q - cle)
            out.append(upto[len(a):] - upto[:len(a)])
        return out


def prefix_sums(x: np.ndarray) -> np.ndarray:
    """0 then the cumulative sums of ``x``."""
    out = np.empty(len(x) + 1)
    out[0] = 0.0
    np.cumsum(x, out=out[1:])
    return out


def sums_before(x: np.ndarray, places: np.ndarray) -> np.ndarray:
    """``prefix_sums(x)[places]`` for non-decreasing ``places`` (each 0..len(x)), from
    the sums of ``x`` between successive distinct places (``np.add.reduceat``, one pass
    over ``x``) accumulated over those few. At 1,000 places among 100,000 values 0.15 ms
    against the cumulative sum's 0.39; at the step model's 8,192 about even alone, and
    9.4 against 10.3 ms for ``Overlaps.integrals`` of a count and a weight then a weight
    (on the AMD 2-core host)."""
    n = len(x)
    if not len(places):
        return np.zeros(0)
    new = np.empty(len(places), dtype=bool)  # each distinct place's first
    new[0] = True
    np.not_equal(places[1:], places[:-1], out=new[1:])
    distinct = places[new]
    inner = distinct[(distinct > 0) & (distinct < n)]
    totals = np.zeros(len(inner) + 2)  # the sums before 0, each inner place, and n
    if n:
        np.cumsum(np.add.reduceat(x, np.r_[0, inner]), out=totals[1:])
    at = np.searchsorted(inner, distinct) + (distinct > 0)  # (n: past every inner place)
    return totals[at][np.cumsum(new) - 1]


def decodes(cols: WindowColumns) -> tuple[np.ndarray, Overlaps]:
    """(the requests that decoded: first and last token known, the last after the first;
    their decode intervals as ``Overlaps``), made once for the columns (``memo``): the
    batch each decode saw, read by ``step_by_batch`` and the step model alike."""
    def make() -> tuple[np.ndarray, Overlaps]:
        first, last = cols.first_token_at, cols.last_token_at
        both = ~np.isnan(first) & ~np.isnan(last) & (last > first)
        return both, Overlaps(first[both], last[both], cols.order_within("first_token_at", both),
                              cols.order_within("last_token_at", both))
    return cols.memo("decodes", make)


def decoding_beside(first: np.ndarray, last: np.ndarray, a: np.ndarray, b: np.ndarray,
                    overlaps: Overlaps | None = None) -> np.ndarray:
    """For each [a, b]: the mean number of the intervals [first, last] open over it (the
    requests decoding then, one whose interval it is included): the integral of the open
    count over [a, b] / (b - a) (``Overlaps``; ``overlaps``: those intervals' where the
    caller has them)."""
    overlaps = Overlaps(first, last) if overlaps is None else overlaps
    return overlaps.integral(None, a, b) / (b - a)


def step_by_batch(first: np.ndarray, last: np.ndarray, steps: np.ndarray, lo: float,
                  hi: float, min_requests: int = 8, overlaps: Overlaps | None = None
                  ) -> dict | None:
    """How the decode step moves with the batch in [lo, hi], from the records: per request
    decoding inside it, its mean step (decode time / steps) against the mean number of
    requests decoding beside it (``decoding_beside``); a least-squares line through them,
    read at the 10th and 90th percentile of the batch. A step that stays flat while the
    batch grows is a per-step cost the batch does not change (the server's own work per
    step); one that rises with it is traffic that grows with the batch (the KV cache).
    The line goes through at most ``FIT_ROWS`` of those requests (``evenly_spaced``),
    each one's batch read against every decode (``overlaps``: theirs, ``decodes``, where
    the caller has them). None with fewer than ``min_requests`` requests or a batch that
    barely varies."""
    both = ~np.isnan(first) & ~np.isnan(last) & (last > first)
    ok = both & (steps > 0) & (first >= lo) & (last <= hi)
    requests = int(ok.sum())
    if requests < min_requests:
        return None
    rows = evenly_spaced(np.flatnonzero(ok))
    a, b = first[rows], last[rows]
    batch = decoding_beside(first[both], last[both], a, b, overlaps)  # beside every decode
    step = (b - a) / steps[rows]
    low, high = np.quantile(batch, [0.1, 0.9])
    if high < 1.5 * low or high - low < 1.0:
        return None
    slope, base = np.polyfit(batch, step, 1)
    at_low, at_high = base + slope * low, base + slope * high
    if at_low <= 0:
        return None
    return {"batch_low": float(low), "batch_high": float(high), "step_low": float(at_low),
            "step_high": float(at_high), "growth": float(at_high / at_low),
            "requests": requests}


def _prefill_cover(cols: WindowColumns):
    """The length of the union of the window's prefill intervals (scheduled to first
    token) before each time ``t``, as a function; None without two prefills."""
    sched, first = cols.scheduled_at, cols.first_token_at
    pre = ~np.isnan(sched) & ~np.isnan(first) & (first > sched)
    if pre.sum() < 2:
        return None
    s, e = sched[pre], first[pre]
    order = cols.order_within("scheduled_at", pre)
    s, e = s[order], np.maximum.accumulate(e[order])
    starts = np.r_[True, s[1:] > e[:-1]]  # merge into disjoint intervals
    ms, me = s[starts], np.r_[e[np.flatnonzero(starts)[1:] - 1], e[-1]]
    cum = prefix_sums(me - ms)

    def covered(t):
        i = np.searchsorted(ms, t, side="right")
        inside = np.clip(t - ms[np.maximum(i - 1, 0)], 0,
                         (me - ms)[np.maximum(i - 1, 0)]) * (i > 0)
        return cum[np.maximum(i - 1, 0)] * (i > 0) + inside
    return covered


def decode_shared_with_prefill(cols: WindowColumns) -> np.ndarray:
    """Per request, the share of its decode interval (first to last token) during which
    some request of the window was prefilling; NaN without a decode interval or without
    two prefills to tell from."""
    first, last = cols.first_token_at, cols.last_token_at
    out = np.full(len(first), np.nan)
    covered = _prefill_cover(cols)
    dec = ~np.isnan(first) & ~np.isnan(last) & (last > first)
    if covered is not None and dec.any():
        a, b = first[dec], last[dec]
        out[dec] = (covered(b) - covered(a)) / (b - a)
    return out


@dataclass(frozen=True)
class SlowdownFit:
    """``decode_slowdown``'s line: TPOT of a decode that shares no step with a prefill
    and of one that shares every step, over the decodes fitted, and the share of their
    decode time that ran beside prefills. The cause's evidence as ``asdict`` gives it."""

    tpot_without_prefill: float
    tpot_sharing_every_step: float
    slowdown: float  # the second over the first
    decodes_fitted: int
    decode_time_shared: float


def decode_slowdown(cols: WindowColumns, lo: float, hi: float) -> SlowdownFit | None:
    """How much slower decoding runs while other requests prefill, from the records: per
    request, the share of its decode interval that overlaps someone's prefill and its
    TPOT; a least-squares line TPOT = a + b x share gives the TPOT of a decode that
    shares every step, (a + b), against one that shares none, (a). None when the shares
    do not spread enough to fit (every decode overlaps prefills alike)."""
    first, last = cols.first_token_at, cols.last_token_at
    steps = cols.steps.astype(float)
    dec = ~np.isnan(first) & ~np.isnan(last) & (last > first) & (steps > 0) & (
        first >= lo) & (last <= hi)
    covered = _prefill_cover(cols)
    if covered is None or dec.sum() < 8:
        return None
    a, b = first[dec], last[dec]
    share = (covered(b) - covered(a)) / (b - a)
    tpot = (b - a) / steps[dec]
    if np.ptp(share) < 0.2:
        return None
    slope, base = np.polyfit(share, tpot, 1)
    if base <= 0:
        return None
    return SlowdownFit(float(base), float(base + slope), float((base + slope) / base),
                       int(dec.sum()), float((share * (b - a)).sum() / (b - a).sum()))
