"""Prometheus native histograms: exponential buckets that keep percentiles within 5%.

Classic ``le`` buckets put ``histogram_quantile`` as far off as the bucket is wide
(18-21% for e2e between 2.5, 5, 10 and 15 s). A native histogram of schema 4 has 16
buckets per doubling, bucket ``k`` holding ``(2**((k-1)/16), 2**(k/16)]``, so any
bucket is 4.4% wide: whichever sample a quantile falls on, Prometheus's answer lies
in that sample's bucket, within 4.4% of it. Prometheus keeps one series per label
set however many buckets are filled, and reads them from the protobuf exposition
(``phasewatch.publish.exposition``) when started with ``--enable-feature=native-histograms``
(2.40+; a scrape setting in 3.x).

Counts are kept dense per series over a window of bucket indexes that grows to the
values seen (``NativeCounts``), so memory follows the spread of the data, not the
layout's whole range. Each histogram's range (``NativeLayout``) reaches four
doublings below and above its classic buckets; values at or below the bottom go to
the zero bucket, values above the top are counted in the top bucket (a classic
histogram puts them in +Inf).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from phasewatch.requests.buckets import Bucketer, BucketSet

SCHEMA = 4
PER_DOUBLING = 1 << SCHEMA
# gaps of up to this many empty buckets are written as zero deltas inside a span
# rather than as a new span (a span costs two varints, a zero delta one byte)
_SPAN_GAP = 2


class NativeLayout:
    """Bucket indexes ``kmin .. kmax`` of one histogram. Column 0 of a count row is the
    zero bucket (values <= ``zero_threshold`` = 2**(kmin/16)); column ``c >= 1`` is
    bucket ``kmin + c``."""

    def __init__(self, kmin: int, kmax: int):
        if kmax <= kmin:
            raise ValueError(f"need kmin < kmax, got {kmin}, {kmax}")
        self.kmin, self.kmax = kmin, kmax
        self.bounds = np.exp2(np.arange(kmin, kmax + 1) / PER_DOUBLING)
        self.zero_threshold = float(self.bounds[0])
        self.columns = len(self.bounds)
        self._bucketer = Bucketer(self.bounds)

    @classmethod
    def around(cls, buckets: BucketSet, margin_doublings: int = 4) -> NativeLayout:
        """The range of a classic bucket set, ``margin_doublings`` wider on both sides."""
        lo = math.floor(math.log2(buckets.bounds[0]) * PER_DOUBLING)
        hi = math.ceil(math.log2(buckets.bounds[-1]) * PER_DOUBLING)
        margin = margin_doublings * PER_DOUBLING
        return cls(lo - margin, hi + margin)

    def column(self, values: np.ndarray) -> np.ndarray:
        """Column of each value (non-NaN): 0 for the zero bucket, the top column for
        values above the top bound."""
        return np.minimum(self._bucketer(values), self.columns - 1)


@dataclass
class Partial:
    """One batch's counts: ``counts[series, j]`` for columns ``lo + j``."""

    counts: np.ndarray
    lo: int


def count(layout: NativeLayout, series: np.ndarray, values: np.ndarray,
          n_series: int, cols: np.ndarray | None = None) -> Partial:
    """Counts of one batch per series over the columns it touches (``cols``: the
    values' bucket indexes among ``layout.bounds``, when already found). NaN values
    must have been left out."""
    if values.size == 0:
        return Partial(np.zeros((n_series, 0), np.int64), 0)
    cols = layout.column(values) if cols is None else np.minimum(cols, layout.columns - 1)
    lo, hi = int(cols.min()), int(cols.max())
    width = hi - lo + 1
    flat = series * width + (cols - lo)
    counts = np.bincount(flat, minlength=n_series * width).reshape(n_series, width)
    return Partial(counts, lo)


def trim(counts: np.ndarray) -> Partial:
    """``counts`` over all of a layout's columns, cut to the columns holding any."""
    used = np.flatnonzero(counts.any(axis=0))
    if used.size == 0:
        return Partial(np.zeros((counts.shape[0], 0), np.int64), 0)
    lo, hi = int(used[0]), int(used[-1])
    return Partial(counts[:, lo:hi + 1], lo)


class NativeCounts:
    """Running counts [series, columns lo .. lo+width) that grow to what is added."""

    def __init__(self):
        self.counts = np.zeros((0, 0), np.int64)
        self.lo = 0

    def add(self, part: Partial) -> None:
        rows, width = part.counts.shape
        if width == 0:
            return
        have_rows, have_width = self.counts.shape
        lo = min(self.lo, part.lo) if have_width else part.lo
        hi = max(self.lo + have_width, part.lo + width) if have_width else part.lo + width
        if rows > have_rows or lo != self.lo or hi - lo != have_width:
            grown = np.zeros((max(rows, have_rows), hi - lo), np.int64)
            grown[:have_rows, self.lo - lo:self.lo - lo + have_width] = self.counts
            self.counts, self.lo = grown, lo
        self.counts[:rows, part.lo - self.lo:part.lo - self.lo + width] += part.counts

    def copy(self) -> tuple[int, np.ndarray]:
        return self.lo, self.counts.copy()


def encode(layout: NativeLayout, counts: np.ndarray, lo: int
           ) -> list[tuple[int, list[tuple[int, int]], list[int]]]:
    """Every series' counts (rows of ``counts``, columns ``lo ..``) as Prometheus writes a
    native histogram: zero-bucket count, spans (offset, length) and the deltas between
    listed buckets. Runs of filled buckets are joined across gaps of at most
    ``_SPAN_GAP`` empty ones. All rows at once: a scrape encodes ~1,000 series."""
    rows, width = counts.shape
    zero = (counts[:, 0] if lo == 0 and width else np.zeros(rows, np.int64)).tolist()
    first = 1 if lo == 0 else 0  # column 0 is the zero bucket
    r, c = np.nonzero(counts[:, first:])  # row by row, columns ascending
    if r.size == 0:
        return [(z, [], []) for z in zero]
    c = c + first
    new = np.ones(len(r), bool)
    new[1:] = (r[1:] != r[:-1]) | (np.diff(c) > _SPAN_GAP + 1)
    starts = np.flatnonzero(new)
    ends = np.append(starts[1:] - 1, len(r) - 1)
    span_row, span_start, span_end = r[starts], c[starts], c[ends]
    length = span_end - span_start + 1
    row_first = np.ones(len(starts), bool)
    row_first[1:] = span_row[1:] != span_row[:-1]
    prev_end = np.append(0, span_end[:-1])
    offset = np.where(row_first, layout.kmin + lo + span_start, span_start - prev_end - 1)
    # every listed bucket (the filled ones and the gaps inside spans), row by row
    span_of = np.repeat(np.arange(len(starts)), length)
    within = np.arange(int(length.sum())) - np.repeat(np.cumsum(length) - length, length)
    listed_row = span_row[span_of]
    values = counts[listed_row, span_start[span_of] + within]
    deltas = np.diff(values, prepend=0)
    first_listed = np.ones(len(values), bool)
    first_listed[1:] = listed_row[1:] != listed_row[:-1]
    deltas[first_listed] = values[first_listed]
    at_span = np.searchsorted(span_row, np.arange(rows + 1)).tolist()
    at_listed = np.searchsorted(listed_row, np.arange(rows + 1)).tolist()
    pairs = list(zip(offset.tolist(), length.tolist(), strict=True))
    deltas = deltas.tolist()
    return [(zero[i], pairs[at_span[i]:at_span[i + 1]], deltas[at_listed[i]:at_listed[i + 1]])
            for i in range(rows)]
