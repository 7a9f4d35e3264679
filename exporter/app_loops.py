"""The exporter's background threads (``Loops``): the sweeper of the joins' waiting rooms,
the roofline's updates, one reader per engine's /metrics and for the GPU counters, and the
beat of the joins' clock.
Each counts what it did (``phasewatch_sweeps_total``, ``phasewatch_roofline_updates_total``)
and times its last success; a failure is logged and counted, never the end of its loop.
They stop on the exporter's stop event and are joined (``join``)."""

from __future__ import annotations

import faulthandler
import io
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from phasewatch import catalog
from phasewatch.hostpressure import HostCounters, HostPressure, explain
from phasewatch.selfstats import SelfStats

log = logging.getLogger("phasewatch")
# a tick of a loop this late, or an update this long, is logged (see _roofline_loop)
STALL_NOTICE = 2.0
SWEEP_INTERVAL = 1.0  # seconds between two sweeps of the joins' waiting rooms
# what faulthandler raises where stderr has no file descriptor to write to (--stall-dump)
NO_STDERR = (RuntimeError, ValueError, OSError, io.UnsupportedOperation)


class Sweepable(Protocol):
    def sweep(self) -> object: ...


class Pollable(Protocol):
    """A source read on the roofline's timer (an engine's /metrics, the GPU counters)."""

    def poll(self) -> object: ...


def _and(why: str) -> str:
    return f"; {why}" if why else ""


def log_long_update(took: float, cpu: float, notice: float, interval: float,
                    why: str = "") -> None:
    """Log an update that took ``notice`` seconds or more. Where the whole process had
    the CPU for under half of it, the process was not scheduled (stopped, a frozen VM, a
    starved host) for the rest, which is said as a late tick is, with ``why``: what the
    host's counters say of it (``hostpressure.explain``); otherwise the update itself
    was slow."""
    if took < notice:
        return
    if took - cpu >= max(notice, took / 2):
        log.warning("phasewatch ran %.1f s late (a %g s roofline tick): this process was "
                    "not scheduled during the roofline update, so the figures average "
                    "over that gap%s", took - cpu, interval, _and(why))
    else:
        log.warning("the roofline update took %.1f s (%.1f s of CPU; --roofline-interval "
                    "%g s)", took, cpu, interval)


# Engine scrapes at a fixed period alias with an engine in lock step: 24 closed-loop
# streams of equal requests at 8 slots finish a wave of 8 about every second, vLLM's
# running gauge dips between a wave's end and the next one's prefill, and scrapes every
# 1.0 s read it at the same phase of each wave (a full make test: the gauge at its
# maximum in 23 % of the scrapes against 99.5 % of the time by the requests' own times,
# the decode batch read as 3.5 for 7). Gaps drawn within +-JITTER of the interval land at
# every phase, so the mean over a window is the gauge's time average.
JITTER = 0.5


def scrape_gap(interval: float, took: float, rng: random.Random) -> float:
    """Seconds to wait after a scrape that took ``took``: the interval, drawn within
    +-JITTER of it, less the scrape's own time (at least 0)."""
    return max(interval * rng.uniform(1.0 - JITTER, 1.0 + JITTER) - took, 0.0)


class Beating(Protocol):
    """A clock whose readings on a beat of its own tell a stall (``RunningClock``)."""

    def run(self, stop: threading.Event) -> None: ...


class Loops:
    """The background threads, made here and started by ``start``. ``joins``: (the
    sweeps' join label, the join's name in a log line, the join) for each waiting room
    swept every SWEEP_INTERVAL; ``update``: the roofline's update, every
    ``roofline_interval``; ``sources``: the engines' /metrics and the GPU counters, each
    read as often by a thread of its own."""

    def __init__(self, stop: threading.Event, stats: SelfStats, clock: Callable[[], float],
                 roofline_interval: float, update: Callable[[], None],
                 joins: Sequence[tuple[str, str, Sweepable]],
                 sources: Sequence[Pollable], beat: Beating | None = None,
                 stall_dump: float = 0.0, oldest_call: Callable[[], float] | None = None):
        self._stop, self._stats, self._clock = stop, stats, clock
        # --stall-dump: seconds without a roofline tick, or an ingest call in flight
        # (``oldest_call``: Admission.oldest_call_seconds), before every thread's stack
        # is dumped (``_arm_stall_dump``, ``_dump_a_held_call``); 0: never
        self._stall_dump, self._oldest_call = stall_dump, oldest_call
        self._call_dumped = False  # the call held now was dumped already
        # the host's counters, read as each tick ends: a late tick's stretch explained
        self._host = HostPressure()
        self._host_at = HostCounters()
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
        # the joins' clock's beat (``aggregation.running_clock``), where there is one
        self.beat = [threading.Thread(target=beat.run, args=(stop,), name="pw-clock",
                                      daemon=True)] if beat is not None else []

    def threads(self) -> list[threading.Thread]:
        return [self.sweeper, self.roofline, *self.scrapers, *self.beat]

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

    def _scrape_loop(self, source: Pollable) -> None:
        """Scrape ``source`` every --roofline-interval on average, each gap drawn within
        JITTER of it (``scrape_gap``); a scrape that takes longer delays the next, as
        Prometheus does (never two at once against one engine)."""
        rng = random.Random()
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                source.poll()
            except Exception:  # a bug here must not stop the scrapes silently
                log.exception("scrape of %s failed", getattr(source, "url", source))
            self._stop.wait(scrape_gap(self._interval, time.monotonic() - began, rng))

    def _roofline_loop(self) -> None:
        """Update the roofline and verdict every --roofline-interval. A tick that comes
        STALL_NOTICE seconds or more late (the process was not scheduled: a paused or
        starved host, or a thread holding the interpreter) is logged, and so is an
        update that took that long: rates and the verdict average over such a gap, and
        exports and engine scrapes waited through it."""
        interval = self._interval
        notice = max(STALL_NOTICE, interval)
        due = time.monotonic() + interval
        self._host_at = self._host.read()
        self._arm_stall_dump()
        try:
            while not self._stop.wait(max(due - time.monotonic(), 0.0)):
                self._tick(due, notice)
                due = time.monotonic() + interval
                self._arm_stall_dump()
                self._dump_a_held_call()
        finally:
            if self._stall_dump:
                faulthandler.cancel_dump_traceback_later()

    def _arm_stall_dump(self) -> None:
        """--stall-dump: (re)arm faulthandler's watchdog, a C thread that needs no
        interpreter, to write every thread's stack to stderr if the loop has not come
        round within ``stall_dump`` seconds (the tick's wait and its update); each tick
        arms it afresh, so a stall is dumped once. Where stderr has no file descriptor
        (an exporter inside a host program that replaced it) it is said once and off."""
        if not self._stall_dump:
            return
        try:
            faulthandler.dump_traceback_later(self._stall_dump + self._interval)
        except NO_STDERR as e:
            log.warning("--stall-dump is off: faulthandler cannot write to this process's "
                        "stderr (%s)", e)
            self._stall_dump = 0.0

    def _dump_a_held_call(self) -> None:
        """--stall-dump: an ingest call in flight that long (a receiver's thread held on
        something while this loop runs: the exporter answers its clients late, and an
        engine's exporter drops the batch past its deadline) is logged with every
        thread's stack, once for each such stretch."""
        if not self._stall_dump or self._oldest_call is None:
            return
        held = self._oldest_call()
        if held < self._stall_dump:
            self._call_dumped = False
        elif not self._call_dumped:
            self._call_dumped = True
            log.warning("an ingest call has been in flight for %.1f s; every thread's stack "
                        "follows (--stall-dump)", held)
            try:
                faulthandler.dump_traceback(all_threads=True)
            except NO_STDERR as e:
                log.warning("no stacks: faulthandler cannot write to stderr (%s)", e)

    def _tick(self, due: float, notice: float) -> None:
        """One roofline tick, ``due`` then (time.monotonic). A late one is said with what
        the host's counters say of the stretch since the last tick ended."""
        interval = self._interval
        late = time.monotonic() - due
        counters = self._host.read()
        if late >= notice:
            log.warning("phasewatch ran %.1f s late (a %g s roofline tick): this process "
                        "was not scheduled, so the figures average over that gap%s",
                        late, interval, _and(explain(self._host_at, counters)))
        began, cpu = time.monotonic(), time.process_time()
        try:
            self._update()
        except Exception:  # keep estimating on the next tick; never kill the loop
            log.exception("roofline update failed")
            self._stats.inc(catalog.ROOFLINE_UPDATES.name, outcome="error")
        else:
            self._stats.inc(catalog.ROOFLINE_UPDATES.name, outcome="ok")
            self.roofline_ok_at = self._clock()
        took, self._host_at = time.monotonic() - began, self._host.read()
        log_long_update(took, time.process_time() - cpu, notice, interval,
                        explain(counters, self._host_at) if took >= notice else "")
