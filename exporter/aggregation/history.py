"""Recent history of the window summary, for the dashboard's time series.

The JSON API's summary is a snapshot; a live chart needs the last few minutes of
it. ``SummaryHistory.record()`` runs on the roofline timer (never on ingest) and
keeps, per label set, a fixed ring of ``points`` samples of the figures the
dashboard plots, as float32. Memory is ``points x len(FIELDS) x 4`` bytes per label
set, and label sets are capped, so it is bounded whatever the load.

Served as ``GET /api/v1/history?seconds=S`` in columns::

    {"interval_seconds": 2.0, "series": [{"model": "Llama-3.1-8B", "engine": "vllm",
      "at": [1764000000.0, ...], "ttft_p50": [0.061, ...], ...}]}
"""

from __future__ import annotations

import math
import threading

import numpy as np

from phasewatch.requests.objectives import OBJECTIVES

# (column, path into one summary row): the figures the dashboard's time series plot.
FIELDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("request_rate", ("request_rate",)),
    ("prompt_tokens_per_second", ("prompt_tokens_per_second",)),
    ("output_tokens_per_second", ("output_tokens_per_second",)),
    ("ttft_p50", ("ttft_seconds", "p50")),
    ("ttft_p95", ("ttft_seconds", "p95")),
    ("itl_p50", ("itl_seconds", "p50")),
    ("itl_p95", ("itl_seconds", "p95")),
    ("tpot_p50", ("tpot_seconds", "p50")),
    ("tpot_p95", ("tpot_seconds", "p95")),
    ("e2e_p50", ("e2e_seconds", "p50")),
    ("e2e_p95", ("e2e_seconds", "p95")),
    ("preprocess_share", ("phase_time_share", "preprocess")),
    ("queue_share", ("phase_time_share", "queue")),
    ("prefill_share", ("phase_time_share", "prefill")),
    ("kv_transfer_share", ("phase_time_share", "kv_transfer")),
    ("ttft_share", ("phase_time_share", "ttft")),  # the client's view: ttft and decode
    ("decode_share", ("phase_time_share", "decode")),
    # with objectives (--slo): goodput, the share of requests that met every objective
    # set, and each objective's attainment (NaN where not set)
    ("goodput", ("slo", "goodput")),
    ("good_ratio", ("slo", "good_ratio")),
    *((f"{o}_attainment", ("slo", "objectives", o, "attainment")) for o in OBJECTIVES),
)


def _lookup(row: dict, path: tuple[str, ...]) -> float:
    v = row
    for k in path:
        v = v.get(k) if isinstance(v, dict) else None
    return math.nan if v is None else float(v)


class SummaryHistory:
    def __init__(self, points: int = 300):
        if points < 2:
            raise ValueError(f"history points must be at least 2, got {points}")
        self.points = points
        self._lock = threading.Lock()
        self._series: dict[tuple, _Ring] = {}

    def record(self, summary: dict) -> None:
        """Append one sample per label set in ``summary`` (``RollingWindow.summary()``)."""
        at = float(summary["generated_at"])
        with self._lock:
            for row in summary["models"]:
                key = (row["model"], row["engine"], row.get("pod"), row.get("source"))
                ring = self._series.get(key)
                if ring is None:
                    ring = self._series[key] = _Ring(self.points)
                ring.append(at, [_lookup(row, path) for _, path in FIELDS])

    def series(self, since: float) -> list[dict]:
        """Columns of every label set's samples taken at or after ``since``."""
        with self._lock:
            items = [(key, ring.read(since)) for key, ring in self._series.items()]
        out = []
        for (model, engine, pod, source), (at, values) in items:
            if not at.size:
                continue
            entry = {"model": model, "engine": engine, **({"pod": pod} if pod else {}),
                     **({"source": source} if source else {}), "at": at.tolist()}
            for j, (name, _) in enumerate(FIELDS):
                col = values[:, j].astype(np.float64)
                entry[name] = [None if math.isnan(x) else x for x in col.tolist()]
            out.append(entry)
        return out


class _Ring:
    def __init__(self, points: int):
        self.at = np.full(points, np.nan)
        self.values = np.full((points, len(FIELDS)), np.nan, dtype=np.float32)
        self.head = 0

    def append(self, at: float, values: list[float]) -> None:
        self.at[self.head] = at
        self.values[self.head] = values
        self.head = (self.head + 1) % len(self.at)

    def read(self, since: float) -> tuple[np.ndarray, np.ndarray]:
        order = (self.head + np.arange(len(self.at))) % len(self.at)  # oldest first
        at, values = self.at[order], self.values[order]
        keep = ~np.isnan(at) & (at >= since)
        return at[keep], values[keep]
