"""The exporter's background threads (``Loops``): the sweeper of the joins' waiting rooms,
the roofline's updates and one scraper per engine's /metrics. Each counts what it did
(``phasewatch_sweeps_total``, ``phasewatch_roofline_updates_total``) and times its last
success; a failure is logged and counted, never the end of its loop. They stop on the
exporter's stop event and are joined (``join``)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from phasewatch import catalog
from phasewatch.roofline.engine_metrics import EngineMetricsSource
from phasewatch.selfstats import SelfStats

log = logging.getLogger("phasewatch")
# a tick of a loop this late, or an update this long, is logged (see _roofline_loop)
STALL_NOTICE = 2.0
SWEEP_INTERVAL = 1.0  # seconds between two sweeps of the joins' waiting rooms


class Sweepable(Protocol):
    def sweep(self) -> object: ...


def log_long_update(took: float, cpu: float, notice: float, interval: float) -> None:
    """Log an update that took ``notice`` seconds or more. Where the whole process had
    the CPU for under half of it, the process was not scheduled (stopped, a frozen VM, a
    starved host) for the rest, which is said as a late tick is; otherwise the update
    itself was slow."""
    if took < notice:
        return
    if took - cpu >= max(notice, took / 2):
        log.warning("phasewatch ran %.1f s late (a %g s roofline tick): this process was "
                    "not scheduled during the roofline update, so the figures average "
                    "over that gap", took - cpu, interval)
    else:
        log.warning("the roofline update took %.1f s (%.1f s of CPU; --roofline-interval "
                    "%g s)", took, cpu, interval)


class Loops:
    """The background threads, made here and started by ``start``. ``joins``: (the
    sweeps' join label, the join's name in a log line, the join) for each waiting room
    swept every SWEEP_INTERVAL; ``update``: the roofline's update, every
    ``roofline_interval``; ``sources``: the engines' /metrics, each scraped as often by
    a thread of its own."""

    def __init__(self, stop: threading.Event, stats: SelfStats, clock: Callable[[], float],
                 roofline_interval: float, update: Callable[[], None],
                 joins: Sequence[tuple[str, str, Sweepable]],
                 sources: Sequence[EngineMetricsSource]):
        self._stop, self._stats, self._clock = stop, stats, clock
        self._interval, self._update, self._joins = roofline_interval, update, tuple(joins)
        self.roofline_ok_at = 0.0  # the last roofline update that succeeded (Unix time)
        # each join's last sweep that succeeded (Unix time; 0: none yet)
        self.sweep_ok_at = {join: 0.0 for join, _, _ in self._joins}
        self.sweeper = threading.Thread(target=self._sweep_loop, name="pw-sweep", daemon=True)
        self.roofline = threading.Thread(target=self._roofline_loop, name="pw-roofline",
                                         daemon=True)
        # one scraper per engine URL, apart from the verdict's updates: a saturated
        # engine answers its /metrics slowly (seconds, on a loaded host), which must
        # neither hold the verdict back nor, with a short timeout, lose exactly the
        # scrapes that show the full KV cache
        self.scrapers = [threading.Thread(target=self._scrape_loop, args=(source,),
                                          name=f"pw-engine-{i}", daemon=True)
                         for i, source in enumerate(sources)]

    def threads(self) -> list[threading.Thread]:
        return [self.sweeper, self.roofline, *self.scrapers]

    def start(self) -> None:
        for thread in self.threads():
            thread.start()

    def join(self, timeout: float) -> None:
        """Join the threads started (they saw the stop event), all within ``timeout``
        seconds; one still running past it is logged."""
        deadline = time.monotonic() + timeout
        for thread in self.threads():
            if thread.ident is not None:  # started
                thread.join(max(deadline - time.monotonic(), 0.0))
                if thread.is_alive():
                    log.warning("%s did not stop within %g s", thread.name, timeout)

    def sweep(self) -> None:
        """Each join's waiting room lets go of what waited long enough; each sweep is
        counted by its outcome, and one that raises leaves the others to theirs."""
        for join, name, part in self._joins:
            try:
                part.sweep()
            except Exception:  # a bug here must not kill the sweeper silently
                log.exception("%s sweep failed", name)
                self._stats.inc(catalog.SWEEPS.name, join=join, outcome="error")
            else:
                self._stats.inc(catalog.SWEEPS.name, join=join, outcome="ok")
                self.sweep_ok_at[join] = self._clock()

    def _sweep_loop(self) -> None:
        while not self._stop.wait(SWEEP_INTERVAL):
            self.sweep()

    def _scrape_loop(self, source: EngineMetricsSource) -> None:
        """Scrape ``source`` every --roofline-interval; a scrape that takes longer delays
        the next, as Prometheus does (never two at once against one engine)."""
        interval = self._interval
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                source.poll()
            except Exception:  # a bug here must not stop the scrapes silently
                log.exception("engine metrics scrape of %s failed", source.url)
            self._stop.wait(max(interval - (time.monotonic() - began), 0.0))

    def _roofline_loop(self) -> None:
        """Update the roofline and verdict every --roofline-interval. A tick that comes
        STALL_NOTICE seconds or more late (the process was not scheduled: a paused or
        starved host, or a thread holding the interpreter) is logged, and so is an
        update that took that long: rates and the verdict average over such a gap, and
        exports and engine scrapes waited through it."""
        interval = self._interval
        notice = max(STALL_NOTICE, interval)
        due = time.monotonic() + interval
        while not self._stop.wait(max(due - time.monotonic(), 0.0)):
            late = time.monotonic() - due
            if late >= notice:
                log.warning("phasewatch ran %.1f s late (a %g s roofline tick): this process "
                            "was not scheduled, so the figures average over that gap",
                            late, interval)
            began, cpu = time.monotonic(), time.process_time()
            try:
                self._update()
            except Exception:  # keep estimating on the next tick; never kill the loop
                log.exception("roofline update failed")
                self._stats.inc(catalog.ROOFLINE_UPDATES.name, outcome="error")
            else:
                self._stats.inc(catalog.ROOFLINE_UPDATES.name, outcome="ok")
                self.roofline_ok_at = self._clock()
            log_long_update(time.monotonic() - began, time.process_time() - cpu,
                            notice, interval)
            due = time.monotonic() + interval
