"""A simulated engine whose scenario can be switched while it runs (the demo's switch).

One client (phasewatch gRPC or an OTLP sink) carries every finished request; a
switch stops the running engine between steps and starts the new scenario's at
the current wall time, so the exporter sees the workload change live. Each run
gets its own request-id prefix (sim-0-..., sim-1-...), so ids never repeat.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

from phasewatch.sim.scenarios import scenario

log = logging.getLogger("phasewatch")


class SwitchableLoad:
    def __init__(self, first: str, record: Callable, time_scale: float,
                 build_options: dict | None = None, duration: float = math.inf):
        scenario(first)  # unknown names fail here, not in the thread
        self.current = first
        self._record = record
        self._time_scale = time_scale
        self._options = build_options or {}
        self._deadline = time.monotonic() + duration
        self._stop = threading.Event()
        self._switched = threading.Event()
        self._lock = threading.Lock()
        self.runs = 0
        self._thread = threading.Thread(target=self._loop, name="demo-sim", daemon=True)

    def start(self) -> SwitchableLoad:
        self._thread.start()
        return self

    def switch(self, name: str) -> None:
        scenario(name)  # raises ValueError for an unknown name
        with self._lock:
            if name == self.current:
                return
            self.current = name
        log.info("demo: switching the simulated workload to %s", name)
        self._switched.set()

    def _loop(self) -> None:
        while not self._stop.is_set() and time.monotonic() < self._deadline:
            self._switched.clear()
            with self._lock:
                name = self.current
            options = {**self._options, "seed": self._options.get("seed", 0) + self.runs}
            engine = scenario(name).build(name=f"sim-{self.runs}", **options)
            self.runs += 1
            remaining = (self._deadline - time.monotonic()) * self._time_scale
            engine.run(remaining, on_finish=self._record, time_scale=self._time_scale,
                       should_stop=lambda: self._stop.is_set() or self._switched.is_set())

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
