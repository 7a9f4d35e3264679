"""Each collector on /metrics runs guarded, as node_exporter's ``collector.go`` runs
each of its collectors: a collector that raises drops its own families only, the page
still answers, and ``phasewatch_scrape_collector_success{collector}`` (1/0) and
``phasewatch_scrape_collector_duration_seconds{collector}`` say which part failed.
A failure is logged with its traceback once per failure streak, not once per scrape.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import CollectorRegistry

from phasewatch import catalog

log = logging.getLogger(__name__)
T = TypeVar("T")


def collector_name(collector) -> str:
    """What a collector publishes: its ``scrape_name``, else its class's name without
    ``Collector`` (``RooflineCollector`` -> ``roofline``)."""
    name = getattr(collector, "scrape_name", None)
    if name:
        return name
    return type(collector).__name__.removesuffix("Collector").lower() or "collector"


class ScrapeBoard:
    """Each collector's outcome and duration in the latest scrape."""

    def __init__(self):
        self._lock = threading.Lock()
        self._last: dict[str, tuple[bool, float]] = {}
        self._failing: set[str] = set()

    def run(self, name: str, fn: Callable[[], T], fallback: T) -> T:
        """``fn()``, timed and recorded under ``name``; ``fallback`` if it raised."""
        t0 = time.perf_counter()
        try:
            out, ok = fn(), True
        except Exception:
            out, ok = fallback, False
        took = time.perf_counter() - t0
        with self._lock:
            self._last[name] = (ok, took)
            first = not ok and name not in self._failing
            if ok:
                if name in self._failing:
                    log.info("collector %s recovered", name)
                self._failing.discard(name)
            else:
                self._failing.add(name)
        if first:
            log.exception("collector %s failed; its families are left off /metrics "
                          "until it recovers", name)
        return out

    def families(self) -> Iterator[Metric]:
        with self._lock:
            last = sorted(self._last.items())
        s, d = catalog.SCRAPE_COLLECTOR_SUCCESS, catalog.SCRAPE_COLLECTOR_DURATION
        ok = GaugeMetricFamily(s.name, s.help, labels=list(s.labels))
        took = GaugeMetricFamily(d.name, d.help, labels=list(d.labels))
        for name, (good, seconds) in last:
            ok.add_metric([name], 1.0 if good else 0.0)
            took.add_metric([name], seconds)
        yield ok
        yield took


class _Guarded:
    """One collector, its families gathered whole before any is yielded."""

    def __init__(self, name: str, collector, board: ScrapeBoard):
        self.name, self.collector, self._board = name, collector, board

    def collect(self) -> Iterator[Metric]:
        return iter(self._board.run(self.name, lambda: list(self.collector.collect()), []))


class GuardedRegistry(CollectorRegistry):
    """A registry whose collectors each run guarded (``ScrapeBoard``), followed on the
    page by the two scrape families. ``board`` is shared with the parts of the page
    rendered outside the registry (the hot request families)."""

    def __init__(self, board: ScrapeBoard | None = None):
        super().__init__()
        self.board = board or ScrapeBoard()
        self._guards: dict[int, _Guarded] = {}

    def register(self, collector) -> None:
        guard = _Guarded(collector_name(collector), collector, self.board)
        super().register(guard)
        self._guards[id(collector)] = guard

    def unregister(self, collector) -> None:
        super().unregister(self._guards.pop(id(collector)))

    def collect(self) -> Iterator[Metric]:
        yield from super().collect()
        yield from self.board.families()
