"""Split finished requests into queue, prefill and decode: one pure, vectorised function.

Interval endpoints (product.md, "The request record and its phases"):

* queue       = scheduled   - arrival
* prefill     = first_token - scheduled
* ttft        = first_token - arrival
* decode      = last_token  - first_token
* tpot        = decode / (output_tokens - 1)             only when output_tokens > 1
* itl         = every gap between consecutive emissions  (pooled, as vLLM's benchmark)
* e2e         = finish      - arrival
* decode_tps  = (output_tokens - 1) / decode             tokens after the first, per second
* prefill_spt = prefill / (prompt_tokens - cached_prompt_tokens)

A value that cannot be derived honestly is NaN and counted in ``unavailable`` as
(phase, reason); it is never invented. A request whose data contradicts itself
(clocks out of order, negative counts or gaps, more emissions than tokens, token
times that disagree with first/last token) is rejected whole and counted in
``rejected`` by reason. Unknown cached prompt tokens are taken as 0: servers that
do not report prefix-cache hits are treated as having none.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from exporter.gaps import row_sums
from exporter.record import NS, RequestBatch

# Columns in the order a consistent request's clocks must follow.
CLOCK_ORDER = ("arrival", "scheduled", "first_token", "last_token", "finish")
# first_token + sum(gaps) may differ from last_token by float32 rounding of the gaps
# and by the sender's clock resolution; more than this is a contradiction.
GAP_SUM_TOLERANCE_S = 1e-3
GAP_SUM_TOLERANCE_REL = 1e-3

PHASES = ("queue", "prefill", "ttft", "decode", "tpot", "itl", "e2e", "decode_tps",
          "prefill_spt")


@dataclass
class Phases:
    """Derived values, one per batch row (NaN = unavailable or rejected)."""

    kept: np.ndarray  # bool per row: False = rejected
    queue: np.ndarray
    prefill: np.ndarray
    ttft: np.ndarray
    decode: np.ndarray
    tpot: np.ndarray
    e2e: np.ndarray
    decode_tps: np.ndarray
    prefill_spt: np.ndarray
    uncached_prompt_tokens: np.ndarray  # int64, -1 unknown
    itl: np.ndarray  # pooled gaps (s, float32 or float64) of kept requests, row by row
    itl_counts: np.ndarray  # gaps in ``itl`` per row (0 for rejected rows)
    rejected: Counter = field(default_factory=Counter)  # reason -> requests
    unavailable: Counter = field(default_factory=Counter)  # (phase, reason) -> requests


def _interval(end: np.ndarray, start: np.ndarray) -> np.ndarray:
    ok = (end != 0) & (start != 0)
    out = np.full(end.shape, np.nan)
    out[ok] = (end[ok] - start[ok]) / NS
    return out


def _count_missing(unavailable: Counter, phase: str, kept: np.ndarray,
                   reasons: list[tuple[str, np.ndarray]]) -> None:
    """Attribute each kept row lacking ``phase`` to the first reason that applies."""
    remaining = kept.copy()
    for reason, mask in reasons:
        hit = remaining & mask
        n = int(hit.sum())
        if n:
            unavailable[(phase, reason)] += n
        remaining &= ~mask


def _rejections(batch: RequestBatch, gap_sums, bad_gap_rows) -> tuple[np.ndarray, Counter]:
    """Rows whose data contradicts itself, by the first failing check."""
    n = len(batch)
    checks: list[tuple[str, np.ndarray]] = []
    counts = (batch.prompt_tokens, batch.cached_prompt_tokens, batch.output_tokens)
    checks.append(("negative_token_count", np.logical_or.reduce([c < -1 for c in counts])))
    checks.append(("cached_exceeds_prompt",
                   (batch.prompt_tokens >= 0) & (batch.cached_prompt_tokens > batch.prompt_tokens)))
    times = [getattr(batch, c) for c in CLOCK_ORDER]
    disorder = np.zeros(n, dtype=bool)
    neg_time = np.zeros(n, dtype=bool)
    for i, a in enumerate(times):
        neg_time |= a < 0
        for b in times[i + 1:]:
            disorder |= (a != 0) & (b != 0) & (b < a)
    checks.append(("negative_timestamp", neg_time))
    checks.append(("clock_order", disorder))
    checks.append(("bad_token_gap", bad_gap_rows))
    checks.append(("token_gaps_exceed_output",
                   (batch.output_tokens >= 0) & (batch.gap_counts > np.maximum(
                       batch.output_tokens - 1, 0))))
    both = (batch.first_token != 0) & (batch.last_token != 0) & (batch.gap_counts > 0)
    span = (batch.last_token - batch.first_token) / NS
    tol = GAP_SUM_TOLERANCE_S + GAP_SUM_TOLERANCE_REL * np.abs(span)
    checks.append(("token_times_inconsistent", both & (np.abs(gap_sums - span) > tol)))

    rejected = Counter()
    bad = np.zeros(n, dtype=bool)
    for reason, mask in checks:
        new = mask & ~bad
        if new.any():
            rejected[reason] += int(new.sum())
            bad |= new
    return ~bad, rejected


def split_phases(batch: RequestBatch) -> Phases:
    """Derive every phase of every request of ``batch``. Pure: no I/O, no state."""
    gap_sums, bad_gap_rows = row_sums(batch.token_gaps, batch.gap_counts)
    kept, rejected = _rejections(batch, gap_sums, bad_gap_rows)

    arrival, scheduled = batch.arrival, batch.scheduled
    first, last, finish = batch.first_token, batch.last_token, batch.finish
    out_tok = batch.output_tokens
    queue = _interval(scheduled, arrival)
    prefill = _interval(first, scheduled)
    ttft = _interval(first, arrival)
    decode = _interval(last, first)
    e2e = _interval(finish, arrival)

    multi = out_tok > 1
    with np.errstate(divide="ignore", invalid="ignore"):
        steps = np.where(multi, out_tok - 1, 0).astype(float)
        tpot = np.where(multi, decode / steps, np.nan)
        decode_tps = np.where(multi & (decode > 0), steps / decode, np.nan)
        cached = np.maximum(batch.cached_prompt_tokens, 0)
        uncached = np.where(batch.prompt_tokens >= 0, batch.prompt_tokens - cached, -1)
        prefill_spt = np.where(uncached > 0, prefill / uncached, np.nan)

    values = dict(queue=queue, prefill=prefill, ttft=ttft, decode=decode, tpot=tpot, e2e=e2e,
                  decode_tps=decode_tps, prefill_spt=prefill_spt)
    for v in values.values():
        v[~kept] = np.nan

    unavailable: Counter = Counter()
    no = {c: getattr(batch, c) == 0 for c in CLOCK_ORDER}
    unknown_out = out_tok < 0
    single = out_tok == 1
    no_decode = no["first_token"] | no["last_token"]
    _count_missing(unavailable, "queue", kept & np.isnan(queue),
                   [("no_arrival", no["arrival"]), ("no_scheduled", no["scheduled"])])
    _count_missing(unavailable, "prefill", kept & np.isnan(prefill),
                   [("no_scheduled", no["scheduled"]), ("no_first_token", no["first_token"])])
    _count_missing(unavailable, "ttft", kept & np.isnan(ttft),
                   [("no_arrival", no["arrival"]), ("no_first_token", no["first_token"])])
    _count_missing(unavailable, "decode", kept & np.isnan(decode),
                   [("no_first_token", no["first_token"]), ("no_last_token", no["last_token"])])
    _count_missing(unavailable, "e2e", kept & np.isnan(e2e),
                   [("no_arrival", no["arrival"]), ("no_finish", no["finish"])])
    for name, v in (("tpot", tpot), ("decode_tps", decode_tps)):
        _count_missing(unavailable, name, kept & np.isnan(v), [
            ("output_tokens_unknown", unknown_out), ("single_output_token", single),
            ("no_output_tokens", out_tok == 0), ("no_decode_interval", no_decode),
            ("zero_decode_time", decode == 0)])
    _count_missing(unavailable, "prefill_spt", kept & np.isnan(prefill_spt), [
        ("no_prefill_interval", np.isnan(prefill)), ("prompt_tokens_unknown", uncached < 0),
        ("fully_cached_prompt", uncached == 0)])
    _count_missing(unavailable, "itl", kept & (batch.gap_counts == 0), [
        ("single_output_token", single), ("no_output_tokens", out_tok == 0),
        ("no_token_times", np.ones(len(batch), dtype=bool))])

    if kept.all():
        itl, itl_counts = batch.token_gaps, batch.gap_counts
    else:
        itl = batch.token_gaps[np.repeat(kept, batch.gap_counts)]
        itl_counts = np.where(kept, batch.gap_counts, 0)
    return Phases(
        kept=kept, uncached_prompt_tokens=uncached.astype(np.int64), itl=itl,
        itl_counts=itl_counts, rejected=rejected, unavailable=unavailable, **values,
    )
