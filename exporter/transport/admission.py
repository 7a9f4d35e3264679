"""The ingest gate every receiver passes before it decodes a payload.

Like the OpenTelemetry Collector's memory limiter in front of a bounded queue:

* at most ``max_in_flight`` calls are being decoded and ingested at once, across
  every receiver, holding at most ``max_in_flight_bytes`` of payload (one call is
  always let through when nothing else is in flight, so a single large but legal
  batch cannot be refused forever);
* none is admitted while the process's resident memory is over the soft limit
  (``memory_limit`` less a spike allowance); over it the gate asks the collector
  and the C allocator to give memory back, at most once a second.

A refused call is answered with its protocol's retryable error (gRPC
``UNAVAILABLE`` with ``RetryInfo``, HTTP 503 with ``Retry-After``), so the client
keeps the data and sends it again; each refusal is counted in
``phasewatch_ingest_refused_total{protocol,reason}``. Nothing is queued here: the
bounded queue is the receivers' own worker pools, which a refusal never waits on.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
import threading
import time
from collections.abc import Callable

from phasewatch.selfstats import SelfStats

log = logging.getLogger(__name__)
RETRY_AFTER_SECONDS = 1  # what the refusal tells clients to wait
SPIKE_FRACTION = 0.2  # the soft limit is 80% of the limit, as the OTel memory limiter's default
RSS_SAMPLE_SECONDS = 0.05
RELIEF_SECONDS = 1.0
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int:
    """This process's resident set size (Linux ``/proc/self/statm``); 0 where unknown."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def container_memory_limit() -> int:
    """The cgroup (v2, else v1) memory limit of this container in bytes; 0 if none."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # v1 says "no limit" with a huge number
            return int(text)
    return 0


def _malloc_trim() -> Callable[[], None]:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return lambda: None
    return lambda: trim(0)


class Refused(Exception):
    """Raised by ``Admission.admit``: the caller answers with its retryable error."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class Admission:
    def __init__(self, stats: SelfStats, max_in_flight: int = 8,
                 max_in_flight_bytes: int = 256 << 20, memory_limit: int = 0,
                 rss: Callable[[], int] = resident_bytes, clock=time.monotonic):
        if max_in_flight < 1 or max_in_flight_bytes < 1 or memory_limit < 0:
            raise ValueError("max_in_flight and max_in_flight_bytes must be positive, "
                             "memory_limit not negative")
        self._stats = stats
        self.max_in_flight, self.max_in_flight_bytes = max_in_flight, max_in_flight_bytes
        self.memory_limit = memory_limit
        self.soft_limit = int(memory_limit * (1 - SPIKE_FRACTION))
        self._rss, self._clock = rss, clock
        self._lock = threading.Lock()
        self._calls = self._bytes = 0
        self._rss_at = -1e18
        self._last_rss = 0
        self._relief_at = -1e18
        self._trim = _malloc_trim()
        self._since: dict[int, float] = {}  # each admitted call's thread: when it came in

    # ---- gauges --------------------------------------------------------------
    def in_flight(self) -> int:
        return self._calls

    def in_flight_bytes(self) -> int:
        return self._bytes

    def memory(self) -> int:
        """Resident bytes, sampled at most every 50 ms."""
        now = self._clock()
        if now - self._rss_at >= RSS_SAMPLE_SECONDS:
            self._last_rss, self._rss_at = self._rss(), now
        return self._last_rss

    # ---- the gate ------------------------------------------------------------
    def _over_memory(self) -> str:
        if not self.memory_limit or self.memory() < self.soft_limit:
            return ""
        self._relieve()
        return (f"phasewatch is over its memory soft limit ({self.soft_limit >> 20} MiB of "
                f"{self.memory_limit >> 20} MiB); retry later")

    def check_memory(self, protocol: str) -> None:
        """Raise ``Refused`` (counted) while memory is over the soft limit."""
        message = self._over_memory()
        if message:
            self._stats.inc("phasewatch_ingest_refused_total", protocol=protocol,
                            reason="memory")
            raise Refused("memory", message)

    def admit(self, protocol: str, nbytes: int) -> None:
        """Take a slot for a call carrying ``nbytes`` of payload, or raise ``Refused``
        (counted). Every admitted call must be followed by ``release(nbytes)``."""
        self.check_memory(protocol)
        with self._lock:
            if self._calls and self._calls >= self.max_in_flight:
                reason = "in_flight"
                message = (f"phasewatch is ingesting {self.max_in_flight} calls already; "
                           "retry later")
            elif self._calls and self._bytes + nbytes > self.max_in_flight_bytes:
                reason = "in_flight_bytes"
                message = (f"phasewatch holds {self._bytes >> 20} MiB of payload in flight; "
                           "retry later")
            else:
                self._calls += 1
                self._bytes += nbytes
                self._since[threading.get_ident()] = self._clock()
                return
        self._stats.inc("phasewatch_ingest_refused_total", protocol=protocol, reason=reason)
        raise Refused(reason, message)

    def release(self, nbytes: int) -> None:
        with self._lock:
            self._calls -= 1
            self._bytes -= nbytes
            self._since.pop(threading.get_ident(), None)

    def oldest_call_seconds(self) -> float:
        """How long the call admitted longest ago has been in flight (0: none is): a
        receiver that holds an export past its client's deadline shows here
        (``app_loops.Loops``'s --stall-dump)."""
        with self._lock:
            oldest = min(self._since.values(), default=None)
        return 0.0 if oldest is None else self._clock() - oldest

    def _relieve(self) -> None:
        """Over the soft limit: collect garbage and hand free heap back to the OS."""
        now = self._clock()
        if now - self._relief_at < RELIEF_SECONDS:
            return
        self._relief_at = now
        gc.collect()
        self._trim()
        self._rss_at = -1e18  # measure again on the next call
        log.warning("memory %d MiB over the soft limit %d MiB: refusing ingest until it "
                    "drops", self._rss() >> 20, self.soft_limit >> 20)
