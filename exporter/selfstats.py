"""Counters about phasewatch itself: what was received, rejected, dropped and why.

Every drop or rejection anywhere in the exporter goes through ``SelfStats.inc`` with
a reason, and ``phasewatch.publish.metrics`` exposes them as ``phasewatch_ingest_*`` series;
their names, HELP texts and labels are the catalog's (``phasewatch.catalog``).
"""

from __future__ import annotations

import threading
from collections import Counter

from phasewatch import catalog

# name -> family: the self-counters of the catalog (phasewatch.catalog.SELF_COUNTERS)
SELF_METRICS: dict[str, catalog.Family] = {f.name: f for f in catalog.SELF_COUNTERS}


class SelfStats:
    """Thread-safe counters keyed by (metric name, label values)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: Counter = Counter()

    def inc(self, name: str, value: float = 1, **labels: str) -> None:
        if name not in SELF_METRICS:
            raise ValueError(f"unknown self-metric {name!r}")
        expected = SELF_METRICS[name].labels
        if tuple(labels) != expected:
            raise ValueError(f"{name} takes labels {expected}, got {tuple(labels)}")
        if value:
            with self._lock:
                self._values[(name, tuple(labels.values()))] += value

    def get(self, name: str, **labels: str) -> float:
        with self._lock:
            return self._values[(name, tuple(labels.values()))]

    def snapshot(self) -> dict[tuple[str, tuple[str, ...]], float]:
        with self._lock:
            return dict(self._values)
