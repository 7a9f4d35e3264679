"""Aggregation state: histograms and counters per label set, fed a batch at a time.

``Aggregator`` is a ``sink.RequestSink``: ``ingest`` is where every receiver's
``RequestBatch`` ends (through the trace join). Work is split so no lock is held
across a batch: phases, bucketing and ``np.bincount`` run unlocked; the lock only
guards adding the small per-series arrays into the running totals. Readers (the Prometheus
collector, the JSON API) take ``snapshot()`` copies. Nothing here knows about
Prometheus or protobuf. Histograms count every accepted request once; request and token
counters (and the objectives' counts) count a request whose trace was sampled as the
requests it stands for (``RequestBatch.weight``: 1 / its sampling probability).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from phasewatch import catalog
from phasewatch.aggregation.labels import LabelSets
from phasewatch.aggregation.sink import IngestResult
from phasewatch.aggregation.slo import SloCounts
from phasewatch.aggregation.window import RollingWindow
from phasewatch.requests import buckets, native
from phasewatch.requests.buckets import WINDOW_INDEX
from phasewatch.requests.gaps import GapBins, GapCounts
from phasewatch.requests.objectives import ObjectivesByModel
from phasewatch.requests.phases import Phases, split_phases
from phasewatch.requests.record import FINISH_REASONS, NS, RequestBatch, finish_reason_codes
from phasewatch.selfstats import SelfStats

PHASE_NAMES = ("preprocess", "queue", "prefill", "kv_transfer", "decode")
TOKEN_KINDS = ("prompt", "cached_prompt", "output")
PROMPT_CLASS_LABELS = (*(label for _, label in buckets.PROMPT_CLASSES),
                       buckets.PROMPT_CLASS_UNKNOWN)


@dataclass(frozen=True)
class HistogramSpec:
    """One histogram: its buckets and an optional extra label (sub-dimension)."""

    key: str
    buckets: buckets.BucketSet
    sub_label: str | None = None
    sub_values: tuple[str, ...] = ("",)
    # also kept as a native histogram (phasewatch.requests.native), for the latency figures
    # whose percentiles people compare with their benchmarks
    native: native.NativeLayout | None = None


# the values of each family's own label (a histogram's sub-dimension, a counter's kind)
LABEL_VALUES = {"prompt_class": PROMPT_CLASS_LABELS, "phase": PHASE_NAMES,
                "kind": TOKEN_KINDS, "finish_reason": FINISH_REASONS}


def _spec(key: str, family: catalog.Family) -> HistogramSpec:
    """The histogram the catalog describes: its buckets, its own label (if any) and a
    native layout around the buckets where the catalog publishes one."""
    sub = family.labels[0] if family.labels else None
    return HistogramSpec(key, family.buckets, sub, LABEL_VALUES[sub] if sub else ("",),
                         native.NativeLayout.around(family.buckets) if family.native else None)


HISTOGRAMS = tuple(_spec(key, f) for key, f in catalog.HISTOGRAMS.items())
COUNTERS = {key: (f.labels[0], LABEL_VALUES[f.labels[0]])
            for key, f in catalog.COUNTERS.items()}


class _Histogram:
    """Bucket counts [series, buckets+1] (last column = +Inf) and sums [series]."""

    def __init__(self, spec: HistogramSpec):
        self.spec = spec
        self.edges = spec.buckets.array()
        self.bucket_of = buckets.Bucketer(self.edges, *(
            () if spec.native is None else (spec.native.bounds,)))
        self.k = len(spec.sub_values)
        self.counts = np.zeros((0, len(self.edges) + 1), dtype=np.int64)
        self.sums = np.zeros(0)
        self.native = None if spec.native is None else native.NativeCounts()

    def partial(self, series: np.ndarray, values: np.ndarray, n_series: int):
        """Counts, sums and native counts (or None) of one batch (unlocked). NaN values
        are skipped."""
        ok = ~np.isnan(values)
        series, values = series[ok], values[ok]
        nb = len(self.edges) + 1
        # A value equal to a bound falls in that bound's bucket (Prometheus "le").
        found = self.bucket_of.every(values)
        flat = series * nb + found[0]
        counts = np.bincount(flat, minlength=n_series * nb).reshape(n_series, nb)
        sums = np.bincount(series, weights=values, minlength=n_series)
        part = (None if self.spec.native is None
                else native.count(self.spec.native, series, values, n_series, found[1]))
        return counts, sums, part

    def add(self, counts: np.ndarray, sums: np.ndarray,
            part: native.Partial | None = None) -> None:
        if part is not None and self.native is not None:
            self.native.add(part)
        n = counts.shape[0]
        if n > self.counts.shape[0]:
            grown = np.zeros((n, self.counts.shape[1]), dtype=np.int64)
            grown[: self.counts.shape[0]] = self.counts
            self.counts = grown
            self.sums = np.concatenate([self.sums, np.zeros(n - len(self.sums))])
        self.counts[:n] += counts
        self.sums[:n] += sums


@dataclass
class Snapshot:
    """A consistent copy of the aggregation state, for readers."""

    label_sets: list[tuple]
    label_names: tuple[str, ...]  # ("model", "engine"), with "pod" and/or "source"
    histograms: dict[str, tuple[HistogramSpec, np.ndarray, np.ndarray]]
    counters: dict[str, np.ndarray]  # [series, k]
    # key -> (first column, counts [rows, columns]) of the native histograms; rows as
    # the classic counts' rows
    natives: dict[str, tuple[int, np.ndarray]] = field(default_factory=dict)


class Aggregator:
    """The last ``sink.RequestSink``: counts every batch it is handed."""

    def __init__(self, stats: SelfStats | None = None, *, max_series: int = 256,
                 window: RollingWindow | None = None, clock=time.time,
                 pod_label: bool = False, max_pods: int = 64, source_label: bool = False,
                 model_names=None, objectives: ObjectivesByModel | None = None):
        self.stats = stats or SelfStats()
        self.labels = LabelSets(self.stats, max_series=max_series, pod_label=pod_label,
                                max_pods=max_pods, source_label=source_label,
                                model_names=model_names)
        self.window = window or RollingWindow(clock=clock)
        self._lock = threading.Lock()
        self._hists = {s.key: _Histogram(s) for s in HISTOGRAMS}
        # token gaps are binned once for the ITL histogram and the window together
        itl = self._hists["itl"]
        self._itl_bins = GapBins(itl.edges, WINDOW_INDEX, itl.spec.native.bounds)
        self._counters = {k: np.zeros((0, len(v))) for k, (_, v) in COUNTERS.items()}
        # latency objectives (--slo), counted per request; None without any
        self.slo = SloCounts(objectives) if objectives else None
        if self.slo is not None:
            self.window.objectives = lambda key: self.slo.objectives.for_model(key[0])

    @property
    def label_names(self) -> tuple[str, ...]:
        return self.labels.names

    def engine_exported(self) -> None:
        """Nothing: the aggregator joins nothing (``RequestSink``)."""

    def ingest(self, batch: RequestBatch, protocol: str) -> IngestResult:
        """Count one batch of finished requests. Thread-safe; never raises on bad rows.
        Its ``pod`` column is read when the pod label is on (central mode)."""
        n = len(batch)
        self.stats.inc("phasewatch_ingest_requests_total", n, protocol=protocol)
        if n == 0:
            return IngestResult(0, Counter())
        ph = split_phases(batch)
        for reason, c in ph.rejected.items():
            self.stats.inc("phasewatch_ingest_rejected_total", c, protocol=protocol,
                           reason=reason)
        for (phase, reason), c in ph.unavailable.items():
            self.stats.inc("phasewatch_phase_unavailable_total", c, phase=phase, reason=reason)
        kept = ph.kept
        accepted = int(kept.sum())
        self.stats.inc("phasewatch_ingest_accepted_total", accepted, protocol=protocol)
        if not accepted:
            return IngestResult(0, ph.rejected, kept)

        ls = self.labels.rows(batch)
        n_ls = len(self.labels)
        left = ph.token_itl_left_out
        # per token, when no request gave its tokens per emission: the gaps of the rows
        # whose emissions are one token each, counted in the same pass
        gaps, token_gaps = self._itl_bins.count(
            ph.itl, ls, ph.itl_counts, left if left is not None and left.any() else None,
            ph.gap_sums)
        partials = self._partials(batch, ph, ls, n_ls, gaps, token_gaps)
        tokens = self._token_counts(batch, kept, ls, n_ls)
        reasons = finish_reason_codes(batch)
        # requests (and tokens) count each row as the requests it stands for (its trace
        # was sampled: ``RequestBatch.weight``); sampled_requests each once, as received
        cell = ls[kept] * len(FINISH_REASONS) + reasons[kept]
        sampled = np.bincount(cell, minlength=n_ls * len(FINISH_REASONS)).reshape(n_ls, -1)
        requests = np.bincount(cell, weights=batch.weight[kept],
                               minlength=n_ls * len(FINISH_REASONS)).reshape(n_ls, -1)
        with self._lock:
            for key, (counts, sums, part) in partials.items():
                self._hists[key].add(counts, sums, part)
            for key, delta in (("tokens", tokens), ("requests", requests),
                               ("sampled_requests", sampled)):
                self._counters[key] = _grow_rows(self._counters[key], n_ls)
                self._counters[key][:n_ls] += delta
        judged = (None if self.slo is None
                  else self.slo.add(batch, ph, ls, self.labels.pairs(), n_ls))
        self.window.add(batch, ph, ls, n_ls, reasons, gaps, judged)
        return IngestResult(accepted, ph.rejected, ph.kept)

    def add_steps(self, steps: list[tuple]) -> None:
        """Engine-reported decode steps: (model, engine, pod, start ns, end ns, requests)
        each, into the window for the roofline's decode batch."""
        ls = np.array([self.labels.index(m, e, p) for m, e, p, *_ in steps], dtype=np.int64)
        cols = np.array([s[3:] for s in steps], dtype=np.float64).reshape(-1, 3)
        self.window.add_steps(ls, cols[:, 0] / NS, cols[:, 1] / NS, cols[:, 2])

    def _partials(self, batch: RequestBatch, ph: Phases, ls: np.ndarray, n_ls: int,
                  gaps: GapCounts, token_gaps: GapCounts | None):
        pc = buckets.prompt_class_codes(batch.prompt_tokens)
        k_pc = len(PROMPT_CLASS_LABELS)
        h = self._hists
        # observed for every kept request of a two-clock batch (0 = the clocks agreed)
        two_clocks = ph.kept if batch.clock_skew_tolerance_ns else np.zeros(len(ls), bool)
        skew = np.where(two_clocks, ph.clock_skew, np.nan)
        out = {
            "ttft": h["ttft"].partial(ls * k_pc + pc, ph.ttft, n_ls * k_pc),
            "tpot": h["tpot"].partial(ls, ph.tpot, n_ls),
            "e2e": h["e2e"].partial(ls, ph.e2e, n_ls),
            "itl": _gap_partial(gaps, n_ls),
            "prefill_spt": h["prefill_spt"].partial(ls, ph.prefill_spt, n_ls),
            "decode_tps": h["decode_tps"].partial(ls, ph.decode_tps, n_ls),
            "clock_skew": h["clock_skew"].partial(ls, skew, n_ls),
        }
        if ph.token_itl is None:  # per emission, less the rows of multi-token emissions
            out["itl_per_token"] = (out["itl"] if token_gaps is None
                                    else _gap_partial(token_gaps, n_ls))
        else:
            out["itl_per_token"] = h["itl_per_token"].partial(
                np.repeat(ls, ph.token_itl_counts), ph.token_itl, n_ls)
        k = len(PHASE_NAMES)
        series = np.concatenate([ls * k + i for i in range(k)])
        values = np.concatenate([getattr(ph, name) for name in PHASE_NAMES])
        out["phase"] = h["phase"].partial(series, values, n_ls * k)
        return out

    @staticmethod
    def _token_counts(batch: RequestBatch, kept: np.ndarray, ls: np.ndarray, n_ls: int):
        cols = (batch.prompt_tokens, batch.cached_prompt_tokens, batch.output_tokens)
        out = np.zeros((n_ls, len(cols)))
        once = kept & ~batch.prompt_shared  # a shared prompt was counted with its first sequence
        for j, col in enumerate(cols):
            known = (once if j < 2 else kept) & (col >= 0)
            out[:, j] = np.bincount(ls[known], weights=col[known] * batch.weight[known],
                                    minlength=n_ls)
        return out

    def snapshot(self) -> Snapshot:
        with self._lock:
            hists = {k: (h.spec, h.counts.copy(), h.sums.copy()) for k, h in self._hists.items()}
            natives = {k: h.native.copy() for k, h in self._hists.items() if h.native}
            counters = {k: v.copy() for k, v in self._counters.items()}
        return Snapshot(self.labels.pairs(), self.labels.names, hists, counters, natives)


def _spread(series: np.ndarray, counts: np.ndarray, sums: np.ndarray, n_ls: int):
    """Batch-local per-series counts and sums as rows of all ``n_ls`` label sets."""
    full = np.zeros((n_ls, counts.shape[1]), dtype=np.int64)
    full[series] = counts
    full_sums = np.zeros(n_ls)
    full_sums[series] = sums
    return full, full_sums


def _gap_partial(g: GapCounts, n_ls: int):
    """One batch's counted gaps as a histogram's partial: counts, sums, native counts."""
    return (*_spread(g.series, g.buckets, g.sums, n_ls), _native_rows(g.series, g.native, n_ls))


def _native_rows(series: np.ndarray, counts: np.ndarray, n_ls: int) -> native.Partial:
    """Batch-local native counts (last column: above the top bound, counted in the
    top bucket), cut to the columns used, as rows of all ``n_ls`` label sets."""
    counts = counts.copy()
    counts[:, -2] += counts[:, -1]
    part = native.trim(counts[:, :-1])
    full = np.zeros((n_ls, part.counts.shape[1]), dtype=np.int64)
    full[series] = part.counts
    return native.Partial(full, part.lo)


def _grow_rows(a: np.ndarray, n: int) -> np.ndarray:
    if a.shape[0] >= n:
        return a
    grown = np.zeros((n, a.shape[1]), dtype=a.dtype)
    grown[: a.shape[0]] = a
    return grown
