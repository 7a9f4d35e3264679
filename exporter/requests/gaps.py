"""Token gaps, the bulk of every batch (~200 per request): checked and counted in few passes.

A batch of 1,000 requests carries ~200,000 gaps, so every numpy pass over them
costs about as much as all the per-request work together. Two functions do all
the per-gap work:

* ``row_sums`` gives each request's gap sum (one ``np.add.reduceat``) and flags
  requests holding a NaN, infinite or negative gap, with per-gap work only when a
  whole-batch check (sum finite, minimum >= 0) says there is one;
* ``GapBins.count`` bins the gaps of the kept requests once, into a fine
  log-linear index (1,024 bins per octave, read straight from the float bits as
  HDR Histogram and DDSketch do), and derives from that one histogram the exact
  Prometheus ITL buckets, the native histogram's exponential buckets and the
  rolling window's coarser bins.

Exactness: the window's bins are unions of 64 fine bins (their edges coincide by
construction). A Prometheus bound (``le``, inclusive) falls inside a fine bin for
at most a few dozen of the ~27,000 bins; only the gaps in those bins are placed
one by one with ``searchsorted``. The result equals ``np.searchsorted(bounds,
gaps, side="left")`` for every gap, float32 (as sent on the wire) or float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from phasewatch.requests.buckets import LogLinearIndex

FINE_MANTISSA_BITS = 10
_F64_TO_F32_EXPONENT = (1023 - 127) << FINE_MANTISSA_BITS  # rebias float32 exponents
# Above this many (series x fine bins) a per-gap lookup beats one wide histogram.
_MAX_DENSE_CELLS = 1 << 21


def row_sums(gaps: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-row sum of its gaps (float64) and per-row 'has a NaN, infinite or negative
    gap'; ``counts[i]`` gaps belong to row i, in order. Bad gaps add 0 to the sum."""
    n = len(counts)
    sums = np.zeros(n)
    bad = np.zeros(n, dtype=bool)
    if gaps.size == 0:
        return sums, bad
    has = counts > 0
    starts = (np.cumsum(counts) - counts)[has]
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf: found just below
        sums[has] = np.add.reduceat(gaps, starts, dtype=np.float64)
    if np.isfinite(sums).all() and gaps.min() >= 0:  # the usual case: nothing to find
        return sums, bad
    row = np.repeat(np.arange(n), counts)
    bad_gap = ~np.isfinite(gaps) | (gaps < 0)
    bad[row[bad_gap]] = True
    clean = np.where(bad_gap, 0.0, gaps)
    sums[has] = np.add.reduceat(clean, starts, dtype=np.float64)
    return sums, bad


@dataclass
class GapCounts:
    """One batch's gaps counted per batch-local series: ``series[j]`` is the label-set
    index of row j of ``buckets`` (Prometheus, last column +Inf), ``sums`` and
    ``window`` (the rolling window's bins)."""

    series: np.ndarray
    buckets: np.ndarray  # int64 [len(series), len(bounds) + 1]
    sums: np.ndarray  # float64 [len(series)]
    window: np.ndarray  # int64 [len(series), window.size]
    # int64 [len(series), len(native_bounds) + 1] (last column: above the top), or
    # [len(series), 0] without native bounds
    native: np.ndarray


def _runs(lut: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where each run of equal values of a non-decreasing ``lut`` starts, and its value."""
    starts = np.flatnonzero(np.diff(lut, prepend=lut[0] - 1))
    return starts, lut[starts]


class _Placement:
    """Where the fine bins fall among one set of bounds (``le``, inclusive): the bound
    index of each fine bin, and which bins straddle a bound (their gaps are placed one
    by one). Underflow -> index 0, overflow -> len(bounds)."""

    def __init__(self, bounds: np.ndarray, lo: np.ndarray, hi: np.ndarray):
        if not (bounds[0] >= lo[0] and bounds[-1] < hi[-1]):
            raise ValueError("bounds must lie inside the window index's range")
        self.bounds = bounds
        self.nb = len(bounds) + 1
        first = np.searchsorted(bounds, lo, side="left")
        last = np.searchsorted(bounds, hi, side="left")
        self.bucket = np.concatenate([[0], first, [len(bounds)]]).astype(np.int64)
        self.straddle = np.concatenate([[False], first != last, [False]])
        self.straddle_bins = np.flatnonzero(self.straddle)
        # the bucket index never decreases along the fine bins: each bucket's fine bins
        # are one run, summed by one reduceat
        self.run_starts, self.run_buckets = _runs(self.bucket)

    def straddlers(self, gaps: np.ndarray, fine: np.ndarray, local: np.ndarray | None,
                   among: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The gaps lying in a fine bin that straddles one of these bounds, looked for
        ``among`` the given gap positions (those in any set's straddling bins), and the
        (series, bucket) cell each belongs to, placed by searchsorted."""
        at = among[self.straddle.take(fine[among])]
        exact = np.searchsorted(self.bounds, gaps[at].astype(np.float64), side="left")
        return at, (exact if local is None else local[at] * self.nb + exact)

    def from_dense(self, dense: np.ndarray, straddlers, only: np.ndarray | None = None
                   ) -> np.ndarray:
        """Counts [series, nb] from the fine histogram ``dense`` [series, fine bins] of
        the gaps (those flagged in ``only``, when given); ``straddlers``: a callable
        giving ``self.straddlers(...)`` of those gaps (``_Straddlers.of``), called only
        when a straddling bin holds any."""
        s, nb = dense.shape[0], self.nb
        spread = dense.copy()
        spread[:, self.straddle_bins] = 0
        out = np.zeros((s, nb), dtype=np.int64)
        out[:, self.run_buckets] = np.add.reduceat(spread, self.run_starts, axis=1)
        if dense[:, self.straddle_bins].any():
            at, cell = straddlers()
            if only is not None:
                cell = cell[only[at]]
            out += np.bincount(cell, minlength=out.size).reshape(out.shape)
        return out

    def per_gap(self, gaps: np.ndarray, fine: np.ndarray, local: np.ndarray,
                s: int) -> np.ndarray:
        """Counts [series, nb], looking each gap's bucket up directly."""
        bucket = self.bucket.take(fine)
        straddle = self.straddle.take(fine)
        bucket[straddle] = np.searchsorted(self.bounds, gaps[straddle], side="left")
        return np.bincount(local * self.nb + bucket, minlength=s * self.nb).reshape(s, -1)


class _Straddlers:
    """The gaps in straddling fine bins of one ``GapBins.count`` call, found on first
    need: one pass for every placement's straddling bins, then each placement's own
    among them, kept for the next ``from_dense`` over the same gaps."""

    def __init__(self, gaps, fine, local, straddle_any: np.ndarray):
        self._args = (gaps, fine, local)
        self._straddle_any = straddle_any
        self._any: np.ndarray | None = None
        self._found: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def of(self, placement: _Placement):
        def get() -> tuple[np.ndarray, np.ndarray]:
            if self._any is None:
                self._any = np.flatnonzero(self._straddle_any.take(self._args[1]))
            key = id(placement)
            if key not in self._found:
                self._found[key] = placement.straddlers(*self._args, self._any)
            return self._found[key]
        return get


class GapBins:
    """Count gaps into Prometheus buckets ``bounds`` and the bins of ``window`` at once,
    and into ``native_bounds`` (a native histogram's bucket bounds) when given."""

    def __init__(self, bounds: np.ndarray, window: LogLinearIndex,
                 native_bounds: np.ndarray | None = None):
        sub = FINE_MANTISSA_BITS - (52 - window.shift)
        if sub < 0:
            raise ValueError("the window index is finer than the fine index")
        self.bounds = np.asarray(bounds, dtype=np.float64)
        self.window = window
        self._sub = sub
        self._shift64 = 52 - FINE_MANTISSA_BITS
        self._shift32 = 23 - FINE_MANTISSA_BITS
        # fine bin k (1 .. size-2) holds the values whose float64 bits >> shift64 are
        # base + k - 1: exactly the window's bins split 2**sub ways
        self._base = window.base << sub
        top = (window.top << sub) | ((1 << sub) - 1)
        self.size = top - self._base + 3
        raw = np.arange(self._base, top + 1, dtype=np.int64)
        lo = (raw << self._shift64).view(np.float64)
        hi = (((raw + 1) << self._shift64) - 1).view(np.float64)
        self._classic = _Placement(self.bounds, lo, hi)
        self.native_bounds = None if native_bounds is None else np.asarray(
            native_bounds, dtype=np.float64)
        self._native = (None if self.native_bounds is None
                        else _Placement(self.native_bounds, lo, hi))
        self._window_of = np.concatenate(
            [[0], (np.arange(len(raw)) >> sub) + 1, [window.size - 1]]).astype(np.int64)
        self._window_runs = _runs(self._window_of)
        self._straddle_any = self._classic.straddle | (
            False if self._native is None else self._native.straddle)

    def index(self, gaps: np.ndarray) -> np.ndarray:
        """Fine bin of each gap (float32 or float64; negative values land in bin 0)."""
        if gaps.dtype == np.float32:
            raw = (gaps.view(np.int32) >> self._shift32) + (_F64_TO_F32_EXPONENT
                                                            - self._base + 1)
        else:
            g = np.ascontiguousarray(gaps, dtype=np.float64)
            raw = (g.view(np.int64) >> self._shift64) - (self._base - 1)
        return np.clip(raw, 0, self.size - 1, out=raw)

    def count(self, gaps: np.ndarray, row_series: np.ndarray, row_counts: np.ndarray,
              leave_out: np.ndarray | None = None, row_sums: np.ndarray | None = None
              ) -> tuple[GapCounts, GapCounts | None]:
        """Count ``gaps`` (non-negative, finite) of which ``row_counts[i]`` belong to a
        row of label set ``row_series[i]``. With ``leave_out`` (bool per row) and
        ``row_sums`` (each row's gaps summed), also the counts of the other rows' gaps
        alone (the window's bins left empty), from the same pass."""
        nb = len(self.bounds) + 1
        nn = 0 if self._native is None else self._native.nb
        used = np.unique(row_series[row_counts > 0])
        s = len(used)
        if gaps.size == 0 or s == 0:
            empty = GapCounts(used, np.zeros((s, nb), np.int64), np.zeros(s),
                              np.zeros((s, self.window.size), np.int64),
                              np.zeros((s, nn), np.int64))
            return empty, (None if leave_out is None else empty)
        fine = self.index(gaps)
        keep = None if leave_out is None else np.repeat(~leave_out, row_counts)
        if s == 1:
            local = None
            sums = np.array([gaps.sum(dtype=np.float64)])
        else:
            local = np.repeat(np.searchsorted(used, row_series), row_counts)
            sums = np.bincount(local, weights=gaps, minlength=s)
        left = (None if keep is None
                else _sums(row_series, used, leave_out, row_sums, row_counts))
        if s * self.size <= _MAX_DENSE_CELLS:
            (buckets, window, native), part = self._dense(gaps, fine, local, keep, s)
        else:  # many series in one batch: look each gap's bucket and bin up directly
            if local is None:
                local = np.zeros(gaps.size, dtype=np.int64)
            (buckets, window, native), part = self._per_gap(gaps, fine, local, keep, s)
        return (GapCounts(used, buckets, sums, window, native),
                None if part is None else GapCounts(used, part[0], left, part[1], part[2]))

    def _dense(self, gaps: np.ndarray, fine: np.ndarray, local: np.ndarray | None,
               keep: np.ndarray | None, s: int) -> tuple[tuple, tuple | None]:
        """``count``'s bins for few series: one dense (series x fine bucket) histogram,
        folded into the classic, window and native bins; with ``keep``, the classic and
        native bins of the kept gaps alone. Returns (buckets, window, native) and that
        part's (buckets, empty window, native) or None."""
        keys = fine if local is None else local * self.size + fine
        dense = np.bincount(keys, minlength=s * self.size).reshape(s, self.size)
        found = _Straddlers(gaps, fine, local, self._straddle_any)
        buckets = self._classic.from_dense(dense, found.of(self._classic))
        native = (np.zeros((s, 0), np.int64) if self._native is None
                  else self._native.from_dense(dense, found.of(self._native)))
        window = np.zeros((s, self.window.size), dtype=np.int64)
        window[:, self._window_runs[1]] = np.add.reduceat(dense, self._window_runs[0], axis=1)
        if keep is None:
            return (buckets, window, native), None
        kept = dense - np.bincount(keys[~keep], minlength=s * self.size).reshape(s, self.size)
        return (buckets, window, native), (
            self._classic.from_dense(kept, found.of(self._classic), keep),
            np.zeros((s, self.window.size), np.int64),
            native if self._native is None
            else self._native.from_dense(kept, found.of(self._native), keep))

    def _per_gap(self, gaps: np.ndarray, fine: np.ndarray, local: np.ndarray,
                 keep: np.ndarray | None, s: int) -> tuple[tuple, tuple | None]:
        """``count``'s bins for many series: each gap's bucket looked up and binned
        directly (a dense histogram would be too large); as ``_dense`` returns them."""
        buckets = self._classic.per_gap(gaps, fine, local, s)
        native = (np.zeros((s, 0), np.int64) if self._native is None
                  else self._native.per_gap(gaps, fine, local, s))
        w = self.window.size
        window = np.bincount(local * w + self._window_of.take(fine),
                             minlength=s * w).reshape(s, w)
        if keep is None:
            return (buckets, window, native), None
        return (buckets, window, native), (
            self._classic.per_gap(gaps[keep], fine[keep], local[keep], s),
            np.zeros((s, w), np.int64),
            native if self._native is None
            else self._native.per_gap(gaps[keep], fine[keep], local[keep], s))


def _sums(row_series: np.ndarray, used: np.ndarray, leave_out: np.ndarray,
          row_sums: np.ndarray, row_counts: np.ndarray) -> np.ndarray:
    """Per series: the summed gaps of the rows not left out, from the rows' sums."""
    take = ~leave_out & (row_counts > 0)
    return np.bincount(np.searchsorted(used, row_series[take]), weights=row_sums[take],
                       minlength=len(used))
