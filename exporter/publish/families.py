"""The hot families: the aggregator's histograms and counters as a scrape shows them.

``Exposure`` merges what a scrape carries of the aggregation (prompt classes, coarse
buckets); ``walk`` is the one pass over a snapshot's families that every format writes
from: ``HotCollector`` and ``HotText`` (``phasewatch.publish.metrics``) and ``HotProto``
(``phasewatch.publish.exposition``). Names, HELP texts and label names come from the
catalog (``phasewatch.catalog``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np

from phasewatch import catalog
from phasewatch.aggregation.aggregate import COUNTERS, HistogramSpec, Snapshot
from phasewatch.requests.buckets import BucketSet


def coarse(bounds: BucketSet) -> BucketSet:
    """The 1-2-5 bounds of a bucket set (1, 2 or 5 times a power of ten) and its top one."""
    def one_two_five(b: float) -> bool:
        mantissa = b / 10 ** math.floor(math.log10(b))
        return any(math.isclose(mantissa, m, rel_tol=1e-9) for m in (1, 2, 5, 10))
    kept = tuple(b for b in bounds.bounds[:-1] if one_two_five(b)) + bounds.bounds[-1:]
    return replace(bounds, bounds=kept)


@dataclass(frozen=True)
class Exposure:
    """What /metrics shows of the aggregation: every label set's histograms, with the
    prompt-length split of TTFT (``--prompt-class-label``) and the classic buckets in
    full or coarse (``--classic-buckets``). The aggregation keeps everything; this only
    merges what a scrape carries, exactly (a coarse bucket is the sum of the fine ones
    it covers; TTFT without classes the sum over classes, native buckets too)."""

    prompt_class_label: bool = True
    classic_buckets: str = "full"

    def apply(self, snap: Snapshot) -> Snapshot:
        if self.prompt_class_label and self.classic_buckets == "full":
            return snap
        hists, natives = dict(snap.histograms), dict(snap.natives)
        for key, (spec, counts, sums) in snap.histograms.items():
            if not self.prompt_class_label and spec.sub_label == "prompt_class":
                k = len(spec.sub_values)
                counts, sums = _merge_rows(counts, k), _merge_rows(sums[:, None], k)[:, 0]
                if key in natives:
                    lo, ncounts = natives[key]
                    natives[key] = (lo, _merge_rows(ncounts, k))
                spec = replace(spec, sub_label=None, sub_values=("",))
            if self.classic_buckets == "coarse":
                fine = spec.buckets
                spec = replace(spec, buckets=coarse(fine))
                cols = [fine.bounds.index(b) for b in spec.buckets.bounds]
                cum = np.cumsum(counts, axis=1)[:, [*cols, -1]]
                counts = np.diff(cum, axis=1, prepend=0)
            hists[key] = (spec, counts, sums)
        return replace(snap, histograms=hists, natives=natives)


def _merge_rows(a: np.ndarray, k: int) -> np.ndarray:
    """Rows ``i*k .. i*k+k-1`` summed into row ``i`` (a sub-label's values merged)."""
    rows = -(-a.shape[0] // k) * k
    padded = np.zeros((rows, a.shape[1]), dtype=a.dtype)
    padded[: a.shape[0]] = a
    return padded.reshape(rows // k, k, a.shape[1]).sum(axis=1)


def row_labels(spec, pairs: list[tuple], row: int) -> list[str]:
    """The label values of a histogram's count row: its label set's, then its
    sub-label's (prompt class, phase) where it has one."""
    pair = pairs[row // len(spec.sub_values)]
    return [*pair, spec.sub_values[row % len(spec.sub_values)]] if spec.sub_label else list(pair)


def counter_cells(key: str, arr: np.ndarray) -> list[tuple[int, int]]:
    """Which (label set, value) cells a counter shows: token kinds always, finish reasons
    once seen."""
    return [(i, j) for i in range(arr.shape[0]) for j in range(arr.shape[1])
            if key == "tokens" or arr[i, j]]


@dataclass
class HistogramRows:
    """One histogram family of a snapshot: the rows (series) with observations."""

    family: catalog.Family
    spec: HistogramSpec
    names: list[str]  # label names: the label set's, then the sub-label where there is one
    rows: list[int]  # count rows with observations
    labels: list[list[str]]  # each row's label values, in ``names`` order
    cum: np.ndarray  # cumulative bucket counts per count row; the last column the count
    sums: np.ndarray
    native: tuple[int, np.ndarray] | None  # (first column, counts) where kept


@dataclass
class CounterCells:
    """One counter family of a snapshot: its cells' label values and values."""

    family: catalog.Family
    names: list[str]
    cells: list[tuple[list[str], float]]


def walk(snap: Snapshot) -> Iterator[HistogramRows | CounterCells]:
    """The snapshot's histograms, then its counters, in the page's order."""
    pairs, base = snap.label_sets, list(snap.label_names)
    for spec, counts, sums in snap.histograms.values():
        cum = np.cumsum(counts, axis=1)
        rows = np.flatnonzero(cum[:, -1]).tolist()
        yield HistogramRows(catalog.HISTOGRAMS[spec.key], spec,
                            base + ([spec.sub_label] if spec.sub_label else []), rows,
                            [row_labels(spec, pairs, row) for row in rows], cum, sums,
                            snap.natives.get(spec.key) if spec.native is not None else None)
    for key, (label, values) in COUNTERS.items():
        arr = snap.counters[key]
        if key == "sampled_requests" and np.array_equal(arr, snap.counters["requests"]):
            continue  # every weight 1 so far (nothing sampled): the page is as without it
        yield CounterCells(catalog.COUNTERS[key], [*base, label],
                           [([*pairs[i], values[j]], float(arr[i, j]))
                            for i, j in counter_cells(key, arr)])
