"""Bounded label sets: (model, engine) pairs mapped to dense indices, with a cap.

Past ``max_series`` distinct pairs, or for a value longer than ``max_value_len``,
the model becomes ``__overflow__`` and the replacement is counted, so a flood of
distinct names cannot grow memory or Prometheus cardinality without bound.
"""

from __future__ import annotations

import threading

import numpy as np

from exporter.record import RequestBatch
from exporter.selfstats import SelfStats

OVERFLOW = "__overflow__"
UNKNOWN = "unknown"


class LabelSets:
    def __init__(self, stats: SelfStats, max_series: int = 256, max_value_len: int = 200):
        if max_series < 2:
            raise ValueError(f"max_series must be at least 2, got {max_series}")
        self._stats = stats
        self._max = max_series
        self._max_len = max_value_len
        self._lock = threading.Lock()
        self._index: dict[tuple[str, str], int] = {}
        self._pairs: list[tuple[str, str]] = []

    def __len__(self) -> int:
        return len(self._pairs)

    def pairs(self) -> list[tuple[str, str]]:
        with self._lock:
            return list(self._pairs)

    def _lookup(self, model: str, engine: str, rows: int) -> int:
        model = model or UNKNOWN
        engine = engine or UNKNOWN
        if len(engine) > self._max_len:
            self._stats.inc("phasewatch_ingest_label_overflow_total", rows, label="engine",
                            reason="too_long")
            engine = OVERFLOW
        if len(model) > self._max_len:
            self._stats.inc("phasewatch_ingest_label_overflow_total", rows, label="model",
                            reason="too_long")
            model = OVERFLOW
        key = (model, engine)
        overflowed = False
        with self._lock:
            idx = self._index.get(key)
            if idx is None and len(self._pairs) >= self._max - 1:
                # One slot stays reserved for the overflow pair itself.
                overflowed = True
                key = (OVERFLOW, OVERFLOW)
                idx = self._index.get(key)
            if idx is None:
                idx = len(self._pairs)
                self._pairs.append(key)
                self._index[key] = idx
        if overflowed:
            self._stats.inc("phasewatch_ingest_label_overflow_total", rows, label="model",
                            reason="too_many_series")
        return idx

    def rows(self, batch: RequestBatch) -> np.ndarray:
        """Label-set index of every row; a Python step per distinct pair, not per row."""
        n_str = len(batch.strings)
        pair = batch.model.astype(np.int64) * n_str + batch.engine
        uniq, inverse, counts = np.unique(pair, return_inverse=True, return_counts=True)
        lut = np.fromiter(
            (self._lookup(batch.strings[c // n_str], batch.strings[c % n_str], int(k))
             for c, k in zip(uniq.tolist(), counts.tolist(), strict=True)),
            dtype=np.int64, count=len(uniq))
        return lut[inverse]
