"""A monotonic clock that stands still while this process does not run.

The joins hold one side of a request for a while waiting for the other (the trace
join: a tap's row for the engine's spans). Where the whole exporter stalls (a paused
VM, a starved or swapping host, a thread holding the interpreter), the other side's
exports wait through the stall in the receivers' queues, or time out and are retried by
the engine's exporter; on the plain clock the rows that waited through it were out of
time the moment the process ran again, and the sweep declared their other side missing
before the queued exports got in (the tracker's CI: a phasewatch not scheduled for
28.8 s, exports past their 10 s deadline). On this clock a stall is taken out: a row
waits its time of the exporter running.

A stall is seen as a gap between two readings longer than ``gap``: a thread of its own
(``run``) reads the clock every ``beat`` seconds, so that whenever any thread of this
process runs, a reading is at most ``beat`` old, and a longer gap means none ran. The
seconds stalled are kept (``stalled``) and the longest (``longest``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class RunningClock:
    def __init__(self, clock: Callable[[], float] = time.monotonic, beat: float = 0.1,
                 gap: float = 1.0):
        if gap <= beat:
            raise ValueError(f"gap ({gap} s) must be longer than the beat ({beat} s)")
        self._clock, self.beat, self.gap = clock, beat, gap
        self._last = clock()
        self.stalled = 0.0  # seconds taken out, in all
        self.longest = 0.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        now = self._clock()
        if now - self._last > self.gap:  # rare: a stall just ended
            with self._lock:
                lost = now - self._last - self.beat
                if lost > self.gap - self.beat:  # (another thread took it out already)
                    self.stalled += lost
                    self.longest = max(self.longest, lost)
                    self._last = now
        elif now > self._last:
            self._last = now
        return now - self.stalled

    def run(self, stop: threading.Event) -> None:
        """The beat, until ``stop`` is set (the time before it is no stall): the body of
        the exporter's thread for it (``app_loops.Loops``)."""
        self._last = max(self._last, self._clock())
        while not stop.wait(self.beat):
            self()
