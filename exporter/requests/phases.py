"""Split finished requests into their phases: one pure, vectorised function.

Interval endpoints (docs/metrics.md, "Phases and metrics"):

* preprocess  = queued      - arrival   templating, tokenisation, hand-off to the engine
* queue       = scheduled   - queued    the engine's own queue (from arrival when queued
                                        is unknown, as senders before ``queued`` mean it)
* prefill     = first_token - scheduled (- kv_transfer, when known)
* kv_transfer = the batch's ``kv_transfer`` column: a disaggregated request's KV cache
                sent from the prefill server, between prefill and first token
* ttft        = first_token - arrival
* decode      = last_token  - first_token
* tpot        = decode / (output_tokens - 1)             only when output_tokens > 1
* itl         = every gap between consecutive emissions  (pooled, as vLLM's benchmark)
* e2e         = finish      - arrival
* decode_tps  = (output_tokens - 1) / decode             tokens after the first, per second
* prefill_spt = prefill / (prompt_tokens - cached_prompt_tokens), only when both are known

A value that cannot be derived honestly is NaN and counted in ``unavailable`` as
(phase, reason); it is never invented: unknown cached prompt tokens leave
``prefill_spt`` out rather than be taken as 0 (vLLM caches prefixes by default and
does not say how many). A request whose data contradicts itself (clocks out of
order, negative counts or gaps, more emissions than tokens, token times that
disagree with first/last token) is rejected whole and counted in ``rejected`` by
reason.

Two clocks. vLLM measures arrival, first token and finish on its API server's wall
clock, but queued, scheduled and last token are engine-core monotonic differences,
which its adapter hangs off the first token so that every duration equals vLLM's
own. The two timelines meet only at the first token: a time of one chain may land a
few ms on the wrong side of a time of the other (the last token after the finish,
when the frontend handled the first output later than the last). A batch says how
much such disagreement it may carry (``RequestBatch.clock_skew_tolerance_ns``); within
it the request is kept, the cross-chain intervals (preprocess, and queue measured
from arrival) are floored at 0, and the absorbed disagreement is reported per row in
``clock_skew``. Senders with one clock (tolerance 0) are held to the strict order.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from phasewatch.requests.gaps import row_sums
from phasewatch.requests.record import NS, RequestBatch

# Columns in the order a consistent request's clocks must follow.
CLOCK_ORDER = ("arrival", "queued", "scheduled", "first_token", "last_token", "finish")
# The two chains of a two-clock record (module docstring): pairs within one chain are
# held to the strict order, pairs across them only to the batch's skew tolerance.
FRONTEND_CHAIN = frozenset({"arrival", "first_token", "finish"})
ENGINE_CHAIN = frozenset({"queued", "scheduled", "first_token", "last_token"})
# first_token + sum(gaps) may differ from last_token by float32 rounding of the gaps
# and by the sender's clock resolution; more than this is a contradiction.
GAP_SUM_TOLERANCE_S = 1e-3
GAP_SUM_TOLERANCE_REL = 1e-3

PHASES = ("preprocess", "queue", "prefill", "kv_transfer", "ttft", "decode", "tpot", "itl", "e2e",
          "decode_tps", "prefill_spt")


@dataclass
class Phases:
    """Derived values, one per batch row (NaN = unavailable or rejected)."""

    kept: np.ndarray  # bool per row: False = rejected
    preprocess: np.ndarray
    queue: np.ndarray
    prefill: np.ndarray
    kv_transfer: np.ndarray
    ttft: np.ndarray
    decode: np.ndarray
    tpot: np.ndarray
    e2e: np.ndarray
    decode_tps: np.ndarray
    prefill_spt: np.ndarray
    uncached_prompt_tokens: np.ndarray  # int64, -1 unknown
    itl: np.ndarray  # pooled gaps (s, float32 or float64) of kept requests, row by row
    itl_counts: np.ndarray  # gaps in ``itl`` per row (0 for rejected rows)
    clock_skew: np.ndarray  # seconds of two-clock disagreement absorbed per row (0 = none)
    # ITL per token: each gap spread evenly over the tokens of the emission ending it
    # (a gap of 30 ms ending a 3-token chunk is 3 tokens of 10 ms), row by row, and
    # how many values per row (0: unavailable or rejected). None when no request of the
    # batch gave tokens per emission: then it is ``itl`` less the rows marked in
    # ``token_itl_left_out`` (emissions of several tokens, how many each unknown).
    token_itl: np.ndarray | None = None
    token_itl_counts: np.ndarray | None = None
    token_itl_left_out: np.ndarray | None = None
    gap_sums: np.ndarray | None = None  # float64 seconds of each row's gaps
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


def _disorder(batch: RequestBatch) -> tuple[np.ndarray, np.ndarray]:
    """Rows whose known times are out of order, and the two-clock disagreement (s) that
    rows within the batch's tolerance carry (module docstring)."""
    n = len(batch)
    tolerance = int(batch.clock_skew_tolerance_ns)
    disorder = np.zeros(n, dtype=bool)
    skew = np.zeros(n, dtype=np.int64)
    present = [c for c in CLOCK_ORDER if getattr(batch, c).any()]  # an absent column: no pairs
    for i, a_name in enumerate(present):
        a = getattr(batch, a_name)
        for b_name in present[i + 1:]:
            b = getattr(batch, b_name)
            late = np.where((a != 0) & (b != 0), a - b, 0)  # > 0: b lands before a
            cross = not ({a_name, b_name} <= FRONTEND_CHAIN or {a_name, b_name} <= ENGINE_CHAIN)
            if cross and tolerance:
                disorder |= late > tolerance
                skew = np.maximum(skew, late)
            else:
                disorder |= late > 0
    return disorder, np.where(disorder, 0, np.maximum(skew, 0)) / NS


def _rejections(batch: RequestBatch, gap_sums, bad_gap_rows, known):
    """Rows whose data contradicts itself, by the first failing check; and the absorbed
    two-clock disagreement per row."""
    n = len(batch)
    checks: list[tuple[str, np.ndarray]] = []
    counts = (batch.prompt_tokens, batch.cached_prompt_tokens, batch.output_tokens)
    checks.append(("negative_token_count", np.logical_or.reduce([c < -1 for c in counts])))
    checks.append(("cached_exceeds_prompt",
                   (batch.prompt_tokens >= 0) & (batch.cached_prompt_tokens > batch.prompt_tokens)))
    neg_time = np.zeros(n, dtype=bool)
    for c in CLOCK_ORDER:
        neg_time |= getattr(batch, c) < 0
    disorder, skew = _disorder(batch)
    checks.append(("negative_timestamp", neg_time))
    checks.append(("clock_order", disorder))
    checks.append(("bad_token_gap", bad_gap_rows))
    checks.append(("token_gaps_exceed_output",
                   (batch.output_tokens >= 0) & (batch.gap_counts > np.maximum(
                       batch.output_tokens - 1, 0))))
    if known is not None:
        bad_counts, exceed = _token_count_checks(batch, known)
        checks.append(("bad_token_counts", bad_counts))
        checks.append(("token_counts_exceed_output", exceed))
    both = (batch.first_token != 0) & (batch.last_token != 0) & (batch.gap_counts > 0)
    span = (batch.last_token - batch.first_token) / NS
    # two clocks: emissions timed by the engine, first/last token by the frontend
    tol = (GAP_SUM_TOLERANCE_S + GAP_SUM_TOLERANCE_REL * np.abs(span)
           + batch.clock_skew_tolerance_ns / NS)
    checks.append(("token_times_inconsistent", both & (np.abs(gap_sums - span) > tol)))

    rejected = Counter()
    bad = np.zeros(n, dtype=bool)
    for reason, mask in checks:
        new = mask & ~bad
        if new.any():
            rejected[reason] += int(new.sum())
            bad |= new
    return ~bad, rejected, skew


def _known_token_counts(batch: RequestBatch) -> np.ndarray | None:
    """Per row: how many of its gaps came with the tokens of the emission ending them
    (None when no request of the batch gave any)."""
    gt = batch.gap_tokens
    if gt is None or not gt.any():
        return None
    owner = np.repeat(np.arange(len(batch)), batch.gap_counts)
    return np.bincount(owner, weights=gt > 0, minlength=len(batch))


def _token_count_checks(batch: RequestBatch, known: np.ndarray
                        ) -> tuple[np.ndarray, np.ndarray]:
    """Per row: its per-emission token counts are unusable (below 1, beyond int32, or
    given for some of its emissions only), or claim more tokens after the first
    emission than its output tokens allow."""
    n = len(batch)
    owner = np.repeat(np.arange(n), batch.gap_counts)
    gt = batch.gap_tokens
    broken = np.bincount(owner, weights=(gt < 0) | (gt >= 1 << 31), minlength=n) > 0
    bad = broken | ((known > 0) & (known < batch.gap_counts))
    total = np.bincount(owner, weights=np.where(gt > 0, gt, 0), minlength=n)
    exceed = (batch.output_tokens >= 0) & (known > 0) & (total > batch.output_tokens - 1)
    return bad, exceed


def _token_itl(batch: RequestBatch, kept: np.ndarray, itl_counts: np.ndarray,
               known: np.ndarray | None, unavailable: Counter):
    """ITL per token as ``Phases`` holds it: (token_itl, token_itl_counts,
    token_itl_left_out). Requests that gave their tokens per emission have each gap
    spread over the tokens of the emission ending it; a request whose emissions are one
    token each (gaps = output tokens - 1) is its per-emission ITL; the others
    (emissions of several tokens, how many each unknown) are left out and counted.
    When no request of the batch gave counts, the values are ``itl`` less the rows left
    out (counted in the same pass over the gaps: ``GapBins.count``), so none are made."""
    out_tok, gaps_n = batch.output_tokens, batch.gap_counts
    with_gaps = kept & (gaps_n > 0)
    has_counts = np.zeros(len(batch), bool) if known is None else known > 0
    missing = with_gaps & ~has_counts & (gaps_n != out_tok - 1)
    _count_missing(unavailable, "itl_per_token", missing, [
        ("output_tokens_unknown", out_tok < 0), ("token_counts_unknown", np.ones_like(kept))])
    if known is None:
        return None, np.where(missing, 0, itl_counts), missing
    keep_gap = np.repeat(with_gaps & ~missing, gaps_n)
    gaps = np.asarray(batch.token_gaps, dtype=np.float64)[keep_gap]
    k = np.where(batch.gap_tokens > 0, batch.gap_tokens, 1)[keep_gap]
    per_row = np.bincount(np.repeat(np.arange(len(batch)), gaps_n)[keep_gap], weights=k,
                          minlength=len(batch)).astype(np.int64)
    return np.repeat(gaps / k, k), per_row, None


def split_phases(batch: RequestBatch) -> Phases:
    """Derive every phase of every request of ``batch``. Pure: no I/O, no state."""
    gap_sums, bad_gap_rows = row_sums(batch.token_gaps, batch.gap_counts)
    known = _known_token_counts(batch)
    kept, rejected, skew = _rejections(batch, gap_sums, bad_gap_rows, known)
    values, uncached = _intervals(batch)
    for v in values.values():
        v[~kept] = np.nan
    unavailable = _unavailable(batch, kept, values, uncached)
    if kept.all():
        itl, itl_counts = batch.token_gaps, batch.gap_counts
    else:
        itl = batch.token_gaps[np.repeat(kept, batch.gap_counts)]
        itl_counts = np.where(kept, batch.gap_counts, 0)
    token_itl, token_itl_counts, token_itl_left_out = _token_itl(
        batch, kept, itl_counts, known, unavailable)
    return Phases(
        kept=kept, uncached_prompt_tokens=uncached.astype(np.int64), itl=itl,
        itl_counts=itl_counts, clock_skew=np.where(kept, skew, 0.0), rejected=rejected,
        unavailable=unavailable, token_itl=token_itl, token_itl_counts=token_itl_counts,
        token_itl_left_out=token_itl_left_out, gap_sums=gap_sums, **values,
    )


def _intervals(batch: RequestBatch) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Every request's phase intervals and per-token figures (``Phases``' float fields,
    NaN where unknown), and its uncached prompt tokens (-1 unknown)."""
    arrival, queued, scheduled = batch.arrival, batch.queued, batch.scheduled
    first, last, finish = batch.first_token, batch.last_token, batch.finish
    out_tok = batch.output_tokens
    # cross-chain intervals: floored at 0 (a disagreement within the tolerance, in skew)
    preprocess = np.maximum(_interval(queued, arrival), 0.0)
    queue = np.where(queued != 0, _interval(scheduled, queued),
                     np.maximum(_interval(scheduled, arrival), 0.0))
    kv_transfer = np.where(batch.kv_transfer >= 0, batch.kv_transfer, np.nan)
    prefill = _interval(first, scheduled) - np.nan_to_num(kv_transfer)
    decode = _interval(last, first)

    multi = out_tok > 1
    with np.errstate(divide="ignore", invalid="ignore"):
        steps = np.where(multi, out_tok - 1, 0).astype(float)
        cached = batch.cached_prompt_tokens
        uncached = np.where((batch.prompt_tokens >= 0) & (cached >= 0),
                            batch.prompt_tokens - cached, -1)
        # a further sequence of a parallel-sampling request reads the prompt its first
        # sequence already put in the KV cache
        uncached = np.where(batch.prompt_shared & (batch.prompt_tokens >= 0), 0, uncached)
        values = dict(preprocess=preprocess, queue=queue, prefill=prefill,
                      kv_transfer=kv_transfer, ttft=_interval(first, arrival),
                      decode=decode, tpot=np.where(multi, decode / steps, np.nan),
                      e2e=_interval(finish, arrival),
                      decode_tps=np.where(multi & (decode > 0), steps / decode, np.nan),
                      prefill_spt=np.where(uncached > 0, prefill / uncached, np.nan))
    return values, uncached


def _unavailable(batch: RequestBatch, kept: np.ndarray, values: dict[str, np.ndarray],
                 uncached: np.ndarray) -> Counter:
    """Why each kept request lacks each figure it lacks: (figure, reason) -> count."""
    unavailable: Counter = Counter()
    out_tok = batch.output_tokens
    no = {c: getattr(batch, c) == 0 for c in CLOCK_ORDER}
    unknown_out = out_tok < 0
    single = out_tok == 1
    no_decode = no["first_token"] | no["last_token"]
    for name, reasons in (
            ("preprocess", [("no_arrival", no["arrival"]), ("no_queued", no["queued"])]),
            ("queue", [("no_scheduled", no["scheduled"]), ("no_arrival", no["arrival"])]),
            ("prefill", [("no_scheduled", no["scheduled"]),
                         ("no_first_token", no["first_token"])]),
            ("ttft", [("no_arrival", no["arrival"]), ("no_first_token", no["first_token"])]),
            ("decode", [("no_first_token", no["first_token"]),
                        ("no_last_token", no["last_token"])]),
            ("e2e", [("no_arrival", no["arrival"]), ("no_finish", no["finish"])])):
        _count_missing(unavailable, name, kept & np.isnan(values[name]), reasons)
    for name in ("tpot", "decode_tps"):
        _count_missing(unavailable, name, kept & np.isnan(values[name]), [
            ("output_tokens_unknown", unknown_out), ("single_output_token", single),
            ("no_output_tokens", out_tok == 0), ("no_decode_interval", no_decode),
            ("zero_decode_time", values["decode"] == 0)])
    _count_missing(unavailable, "prefill_spt", kept & np.isnan(values["prefill_spt"]), [
        ("no_prefill_interval", np.isnan(values["prefill"])),
        ("prompt_tokens_unknown", batch.prompt_tokens < 0),
        ("prompt_shared", batch.prompt_shared),
        ("cached_tokens_unknown", batch.cached_prompt_tokens < 0),
        ("fully_cached_prompt", uncached == 0)])
    _count_missing(unavailable, "itl", kept & (batch.gap_counts == 0), [
        ("single_output_token", single), ("no_output_tokens", out_tok == 0),
        ("no_token_times", np.ones(len(batch), dtype=bool))])
    return unavailable
