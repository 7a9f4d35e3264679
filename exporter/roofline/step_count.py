"""The engine's steps counted from the requests, for the roofline estimator
(``estimate``): the steps that completed a prefill (their ends are first-token times,
``prefill_steps``) and the steps with decode tokens in them (``decode_step_count``), over
one timeline of the decodes and those steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from phasewatch.aggregation.columns import WindowColumns, time_order
from phasewatch.roofline.intervals import SAME_STEP_SECONDS, prefix_sums, sorted_near

COUNT_MASK = (1 << 21) - 1  # one of the running counts packed in ``decode_step_count``


def prefill_steps(c: WindowColumns) -> tuple[np.ndarray, np.ndarray]:
    """The engine steps that completed a prefill: their ends (the distinct first-token
    times, sorted; requests whose first tokens are within ``SAME_STEP_SECONDS`` completed
    in one step) and how long each took at most (the shortest [scheduled, first token]
    of the requests completed in it)."""
    sched, first = c.scheduled_at, c.first_token_at
    seen = ~np.isnan(sched) & ~np.isnan(first) & (first >= sched)
    key = np.round(first[seen] / SAME_STEP_SECONDS)
    order = c.order_within("first_token_at", seen)  # (rounding keeps the order)
    key, took = key[order], (first[seen] - sched[seen])[order]
    if not len(key):
        return key, took
    new = np.concatenate([[0], np.flatnonzero(np.diff(key)) + 1])  # each step's first
    return key[new] * SAME_STEP_SECONDS, np.minimum.reduceat(took, new)


def decode_step_count(first: np.ndarray, last: np.ndarray, n_tokens: np.ndarray,
                       ends: np.ndarray, took: np.ndarray, lo: float, hi: float,
                       by_first: np.ndarray | None = None, by_last: np.ndarray | None = None
                       ) -> float:
    """Engine steps with decode tokens in them over [lo, hi], from the requests' tokens.

    Every request decoding when a step runs gets one token from it, so a step is 1/c of
    each of the c requests decoding in it: steps = sum over requests of their tokens'
    1/c. A request's n tokens are taken as spread evenly over its decode time and c is
    read at each moment from the decode intervals (all requests seen: with sampled
    records ``estimate._decode`` counts busy time over the mean TPOT instead). A
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
    first-token time to mark them. On the real vLLM the steps came out 0.85-0.97x
    vLLM's there (within 1 % in the other workloads); where the engine counts its steps,
    ``engine_view.with_engine_steps`` reads decode's weights at its count.
    ``by_first``, ``by_last``: the requests by first and by last token, where the caller
    has them (the timeline then merges sorted runs)."""
    n, k = len(first), len(ends)
    if max(n, k) >= COUNT_MASK:  # (beyond any window's capacity) the caller's fallback
        return 0.0
    tl = _Timeline.of(first, last, ends, took, lo, hi, by_first, by_last)
    b, e = tl.where[:n], tl.where[n:2 * n]  # each request's first and last token
    # the steps with decode tokens in them: decodes went on through their end
    shared = tl.decoding[tl.where[2 * n + k:2 * n + 2 * k]] > 0
    steps = float((shared & (ends >= lo) & (ends <= hi)).sum())
    own = np.minimum(tl.done[e] - tl.done[b], n_tokens)  # of a request's tokens, from them
    return steps + _decode_only_steps(tl, b, e, n_tokens - own, n_tokens, lo, hi)


@dataclass(frozen=True)
class _Timeline:
    """Every moment the decodes and the steps that completed a prefill change, in time
    order (``decode_step_count``), with the running counts after each."""

    t: np.ndarray
    decoding: np.ndarray  # requests decoding
    prefilling: np.ndarray  # steps that completed a prefill, running
    done: np.ndarray  # those steps ended so far
    where: np.ndarray  # each event's place in time order, by the order given

    @classmethod
    def of(cls, first: np.ndarray, last: np.ndarray, ends: np.ndarray, took: np.ndarray,
           lo: float, hi: float, by_first: np.ndarray | None = None,
           by_last: np.ndarray | None = None) -> _Timeline:
        """A decode begins (+1 decoding) or ends (-1); a step that completed a prefill
        begins (+1 prefilling) or ends (-1; at its end less SAME_STEP_SECONDS / 2, so
        that the step that completed a request's own prefill, whose end is its
        first-token time rounded, falls before its decode); then ``lo`` and ``hi``.
        Times of one binary exponent (Unix seconds) are sorted as integers in one pass
        (``columns.time_order``), equal times in the order above; others, with the
        requests' orders, are taken as four runs in time order (first tokens and last
        tokens by those orders, the prefill steps' starts sorted on their own, their ends
        as given, sorted) and merged (``sorted_near``), equal times in that order too. A
        decode's start then comes before its end."""
        n, k = len(first), len(ends)
        # (no count goes below 0 even for a moment: a decode ends after it begins, a step
        # that prefilled lasted at least SAME_STEP_SECONDS)
        t = np.concatenate([first, np.maximum(last, first),
                            ends - np.maximum(took, SAME_STEP_SECONDS),
                            ends - SAME_STEP_SECONDS / 2, [lo, hi]])
        # the three running counts in one integer, 21 bits each: decoding, prefilling, and
        # the prefill steps ended so far (one cumulative sum instead of three)
        delta = np.zeros(len(t), dtype=np.int64)
        delta[:n], delta[n:2 * n] = 1, -1
        delta[2 * n:2 * n + k], delta[2 * n + k:2 * n + 2 * k] = 1 << 21, (1 << 42) - (1 << 21)
        at = time_order(t)  # (Unix times: one sort, ties in the events' order)
        if at is None:
            at = np.argsort(t) if by_first is None or by_last is None else sorted_near(
                t, np.concatenate([by_first, n + by_last, 2 * n + np.argsort(t[2 * n:2 * n + k]),
                                   np.arange(2 * n + k, len(t))]))
        counts = np.cumsum(delta[at])
        where = np.empty(len(t), dtype=np.intp)
        where[at] = np.arange(len(t))
        return cls(t[at], counts & COUNT_MASK, (counts >> 21) & COUNT_MASK, counts >> 42,
                   where)


def _decode_only_steps(tl: _Timeline, b: np.ndarray, e: np.ndarray, spread: np.ndarray,
                       n_tokens: np.ndarray, lo: float, hi: float) -> float:
    """The steps the requests' ``spread`` tokens (those not in a step that completed a
    prefill) make over [lo, hi], each spread evenly over its request's decode time
    outside those steps: a step is 1/c of each of the c requests decoding in it. A
    request that decoded only through prefill steps spreads all ``n_tokens`` over its
    whole decode."""
    t = tl.t
    dt = np.diff(t)
    step_share = dt / np.maximum(tl.decoding[:-1], 1)  # a step is 1/c of each decode in it
    # in the range only (t is sorted: the moments before lo, and those whose next is past hi)
    step_share[:np.searchsorted(t, lo)] = 0.0
    step_share[max(int(np.searchsorted(t, hi, side="right")) - 1, 0):] = 0.0
    decode_only = tl.prefilling[:-1] == 0  # outside the steps that completed a prefill

    def across(x: np.ndarray, rows: np.ndarray | slice = slice(None)) -> np.ndarray:
        """``x`` summed over the decode interval of each request (of ``rows``)"""
        total = prefix_sums(x)
        return total[e[rows]] - total[b[rows]]

    alone = across(dt * decode_only)
    tokens = spread * across(step_share * decode_only) / np.maximum(alone, 1e-12)
    through = alone <= 1e-9  # decoded only through prefill steps: over its whole time
    if through.any():
        tokens[through] = n_tokens[through] * across(step_share, through) / np.maximum(
            t[e[through]] - t[b[through]], 1e-12)
    return float(tokens.sum())
