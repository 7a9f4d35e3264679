"""Objectives (SLOs) counted per label set: every accepted request met, missed or unknown.

The aggregator hands each batch here with its phases and label-set rows; the
objectives of a label set are its model's (``requests.objectives.ObjectivesByModel``),
with thresholds per prompt-length class where the objectives override one (each request
judged against its prompt's class's). Counted exactly per request
(``requests.objectives.judge``), never read off histogram buckets. What is kept, per
label set: requests by (objective, outcome), good requests (every objective set met),
and misses by (objective, the phase that took the largest part); the rolling window gets
per-row columns (``window_columns``) for goodput over it. A request whose trace was
sampled counts as the requests it stands for (``RequestBatch.weight``), as in
``phasewatch_requests_total``, so goodput and attainment read against the same total.
"""

from __future__ import annotations

import threading

import numpy as np

from phasewatch.requests.buckets import prompt_class_codes
from phasewatch.requests.objectives import (
    CLASSES,
    MISS_PHASES,
    OBJECTIVES,
    OUTCOMES,
    Judged,
    Objectives,
    ObjectivesByModel,
    judge,
)
from phasewatch.requests.phases import Phases
from phasewatch.requests.record import RequestBatch

N_OBJ, N_OUT, N_PH = len(OBJECTIVES), len(OUTCOMES), len(MISS_PHASES)
N_CLS = len(CLASSES) + 1  # threshold rows per label set: prompt classes, then unknown
# the rolling window's columns per request: good, then (objective, outcome) flags
WINDOW_COLUMNS = 1 + N_OBJ * N_OUT


class SloCounts:
    """Running counts per label set; ``objectives`` maps a model label to its objectives."""

    def __init__(self, objectives: ObjectivesByModel):
        self.objectives = objectives
        self._lock = threading.Lock()
        # per label set and prompt_class_codes code, seconds (NaN: not set)
        self._thresholds = np.zeros((0, N_CLS, N_OBJ))
        # weighted counts (float: a sampled request counts 1/p)
        self._outcomes = np.zeros((0, N_OBJ, N_OUT))
        self._good = np.zeros(0)
        self._missed = np.zeros((0, N_OBJ, N_PH))
        self._seen = np.zeros(0, dtype=bool)  # label sets with objectives and requests
        self._models: list[str] = []  # the model label of each label set with thresholds
        self._objectives: list[Objectives] = []  # and its objectives

    def retarget(self, objectives: ObjectivesByModel) -> None:
        """Judge requests from now on against ``objectives`` (the demo's scenario switch);
        the counts so far stay as they were judged."""
        with self._lock:
            self.objectives = objectives
            if self._models:
                self._objectives = [objectives.for_model(m) for m in self._models]
                self._thresholds = np.stack([o.class_array() for o in self._objectives])

    def thresholds(self, pairs: list[tuple], n_ls: int) -> np.ndarray:
        """[n_ls, prompt classes + 1, objectives] seconds of each label set (NaN: not set),
        grown as new label sets appear (a label set's model never changes)."""
        have = self._thresholds.shape[0]
        if have < n_ls:
            models = [p[0] for p in pairs[have:n_ls]]
            new = [self.objectives.for_model(m) for m in models]
            self._thresholds = np.concatenate(
                [self._thresholds, np.stack([o.class_array() for o in new])])
            self._models += models
            self._objectives += new
        return self._thresholds[:n_ls]

    def add(self, batch: RequestBatch, ph: Phases, ls: np.ndarray, pairs: list[tuple],
            n_ls: int) -> Judged | None:
        """Judge the batch's kept rows; None when no label set of theirs has objectives."""
        with self._lock:
            limits = self.thresholds(pairs, n_ls)
        rows = limits[ls, prompt_class_codes(batch.prompt_tokens)]
        kept = ph.kept
        if not (kept[:, None] & ~np.isnan(rows)).any():
            return None
        j = judge(batch, ph, np.where(kept[:, None], rows, np.nan))
        k_ls, w = ls[kept], batch.weight[kept]
        outcome, phase = j.outcome[kept], j.phase[kept]
        outcomes = np.zeros((n_ls, N_OBJ, N_OUT))
        missed = np.zeros((n_ls, N_OBJ, N_PH))
        for i in range(N_OBJ):
            on = outcome[:, i] >= 0
            outcomes[:, i] = np.bincount(k_ls[on] * N_OUT + outcome[on, i], weights=w[on],
                                         minlength=n_ls * N_OUT).reshape(n_ls, N_OUT)
            hit = phase[:, i] >= 0
            missed[:, i] = np.bincount(k_ls[hit] * N_PH + phase[hit, i], weights=w[hit],
                                       minlength=n_ls * N_PH).reshape(n_ls, N_PH)
        good_rows = j.good[kept]
        good = np.bincount(k_ls[good_rows], weights=w[good_rows], minlength=n_ls)
        seen = np.bincount(k_ls[(outcome >= 0).any(axis=1)], minlength=n_ls) > 0
        with self._lock:
            self._grow(n_ls)
            self._outcomes[:n_ls] += outcomes
            self._missed[:n_ls] += missed
            self._good[:n_ls] += good
            self._seen[:n_ls] |= seen
        return j

    def _grow(self, n: int) -> None:
        extra = n - len(self._good)
        if extra > 0:
            def pad(a: np.ndarray) -> np.ndarray:
                return np.concatenate([a, np.zeros((extra, *a.shape[1:]), a.dtype)])
            self._outcomes, self._missed = pad(self._outcomes), pad(self._missed)
            self._good, self._seen = pad(self._good), pad(self._seen)

    def snapshot(self) -> SloSnapshot:
        with self._lock:
            n = len(self._good)
            return SloSnapshot(self._objectives[:n], self._outcomes.copy(),
                               self._good.copy(), self._missed.copy(), self._seen.copy())


class SloSnapshot:
    """A copy of the counts: rows are label-set indexes; ``seen`` marks the label sets
    with objectives that have been judged."""

    def __init__(self, objectives: list[Objectives], outcomes, good, missed, seen):
        self._objectives, self.outcomes, self.good = objectives, outcomes, good
        self.missed, self.seen = missed, seen

    def rows(self) -> list[int]:
        return np.flatnonzero(self.seen).tolist()

    def objectives(self, i: int) -> Objectives:
        """Label set ``i``'s objectives, as its requests are judged against them now."""
        return self._objectives[i]


def window_columns(j: Judged) -> np.ndarray:
    """[rows, WINDOW_COLUMNS] per-request flags for the rolling window: good, then one
    per (objective, outcome)."""
    n = len(j.good)
    out = np.zeros((n, WINDOW_COLUMNS))
    out[:, 0] = j.good
    for i in range(N_OBJ):
        for o in range(N_OUT):
            out[:, 1 + i * N_OUT + o] = j.outcome[:, i] == o
    return out
