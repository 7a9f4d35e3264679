"""Join streamed lifecycle events into finished request records, with bounded state.

Servers that report as they go send ARRIVED, SCHEDULED, FIRST_TOKEN, TOKENS and
FINISHED events keyed by request id, possibly out of order, duplicated (a resent
stream) or never finished (a crashed request). The joiner:

* keeps at most ``max_pending`` requests; past it the oldest is evicted (counted);
* completes a request once FINISHED, ARRIVED, SCHEDULED and the first token are
  in and, when FINISHED says how many emissions there were, all of them are in;
  a server that never sends some of these has its requests completed after the
  grace period instead;
* completes a finished-but-incomplete request after ``grace`` seconds with what it
  has (missing phases are then counted unavailable by the phase split, not invented);
* evicts a request never finished after ``ttl`` seconds (counted);
* remembers ``max_completed`` recently completed ids so late duplicates are counted,
  not turned into phantom pending requests.

Each event field is taken once: a repeat with the same value is a duplicate, a
different value a conflict (the first value is kept). Token emissions carry their
index, so repeats and reordering of TOKENS events are harmless.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from phasewatch.aggregation.sink import RequestSink
from phasewatch.aggregation.waiting_room import Room
from phasewatch.requests.record import RequestBatch

PROTOCOL = "lifecycle"  # completed requests are ingested under this protocol


class EventKind(enum.Enum):
    ARRIVED = 1
    SCHEDULED = 2
    FIRST_TOKEN = 3
    TOKENS = 4
    FINISHED = 5
    QUEUED = 6  # optional: the engine took the request in (after the API server's work)

    # members are singletons compared by identity: hash them by identity too, in C
    # (Enum's own __hash__ is Python, run for every event's dict lookup)
    __hash__ = object.__hash__


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs 1.5 us against
class LifecycleEvent:   # 0.4, per event decoded. Nothing changes an event once made.
    request_id: str
    kind: EventKind
    time_unix_nano: int = 0
    model: str = ""
    prompt_tokens: int | None = None
    cached_prompt_tokens: int | None = None
    first_emission_index: int = 0
    token_times_unix_nano: tuple[int, ...] = ()
    token_counts: tuple[int, ...] = ()  # aligned with the emissions' times; () = unknown
    output_tokens: int | None = None
    finish_reason: str = ""
    emission_count: int = 0
    last_token_unix_nano: int = 0


_COUNTS = frozenset({"prompt_tokens", "cached_prompt_tokens", "output_tokens"})
_TIME_FIELD = {EventKind.ARRIVED: "arrival", EventKind.QUEUED: "queued",
               EventKind.SCHEDULED: "scheduled", EventKind.FINISHED: "finish"}


@dataclass
class _Pending:
    engine: str
    model: str = ""
    arrival: int = 0
    queued: int = 0
    scheduled: int = 0
    finish: int = 0
    last_token: int = 0
    prompt_tokens: int | None = None
    cached_prompt_tokens: int | None = None
    output_tokens: int | None = None
    finish_reason: str = ""
    emission_count: int = 0
    finished_at: float | None = None
    emissions: dict[int, int] = field(default_factory=dict)
    emission_tokens: dict[int, int] | None = None  # where senders said (made when one does)

    def complete(self, expect_queued: bool = False) -> bool:
        """Every event a full report has is in: no need to wait for the grace period.
        ``expect_queued``: its sender reports QUEUED (an optional event), so wait for it."""
        if self.finished_at is None or not self.arrival or not self.scheduled:
            return False
        if expect_queued and not self.queued:
            return False
        if self.emission_count:
            return len(self.emissions) >= self.emission_count
        return 0 in self.emissions

    def row(self, request_id: str) -> tuple:
        """This request as a ``record.ROW_FIELDS`` tuple with times in integer ns."""
        times: list[int] = []
        if self.emissions:
            idx = sorted(self.emissions)
            contiguous = idx[-1] == len(idx) - 1
            all_in = self.emission_count == 0 or len(idx) >= self.emission_count
            if contiguous and all_in:
                times = [self.emissions[i] for i in idx]
        last = self.last_token or (times[-1] if times and self.emission_count else 0)
        if times and last and times[-1] != last:
            times = []  # the tail of the emissions never arrived: no gaps, rather than wrong ones
        # tokens per emission where every emission after the first has its count (the
        # first's is not needed: its gap is TTFT's)
        counts = None
        if times and self.emission_tokens is not None and all(
                i in self.emission_tokens for i in range(1, len(times))):
            counts = [self.emission_tokens.get(i, 1) for i in range(len(times))]
        return (self.model, self.engine, self.finish_reason, request_id, self.arrival,
                self.queued, self.scheduled, self.emissions.get(0, 0), last, self.finish,
                self.prompt_tokens, self.cached_prompt_tokens, self.output_tokens, times,
                counts)


class LifecycleJoiner:
    def __init__(self, sink: RequestSink, *, ttl: float = 600.0, grace: float = 5.0,
                 max_pending: int = 100_000, max_completed: int = 100_000,
                 clock=time.monotonic):
        """Completed requests go to ``sink`` (protocol ``lifecycle``); its ``stats`` count
        the events' outcomes."""
        if ttl <= 0 or grace < 0 or grace > ttl:
            raise ValueError(f"need 0 <= grace <= ttl and ttl > 0 (got grace={grace}, ttl={ttl})")
        self._sink = sink
        self._stats = sink.stats
        self.ttl, self.grace = ttl, grace
        self._max_completed = max_completed
        self._clock = clock
        self._lock = threading.Lock()
        # each request waits ``ttl`` seconds for FINISHED, then ``grace`` for the rest
        self._pending: Room[_Pending] = Room(ttl, max_pending, clock)
        self._completed: OrderedDict[str, None] = OrderedDict()
        # engines that have sent a QUEUED event: their requests wait for theirs
        self._sends_queued: set[str] = set()

    def pending_count(self) -> int:
        with self._lock:
            return len(self._pending)

    def _outcome(self, outcome: str, n: int = 1) -> None:
        self._stats.inc("phasewatch_ingest_lifecycle_events_total", n, outcome=outcome)

    def add(self, engine: str, events: list[LifecycleEvent]) -> int:
        """Apply events; completed requests go to the sink as one batch. Returns completed."""
        done: list[tuple] = []
        outcomes: Counter = Counter()
        now = self._clock()
        with self._lock:
            for e in events:
                outcomes[self._apply(engine, e, now)] += 1
                if e.kind is EventKind.QUEUED and e.time_unix_nano:
                    self._sends_queued.add(engine)
                p = self._pending.get(e.request_id)
                if p is not None and p.complete(p.engine in self._sends_queued):
                    done.append(self._pop(e.request_id))
        for outcome, n in outcomes.items():
            self._outcome(outcome, n)
        if done:
            self._sink.ingest(RequestBatch.from_rows(done, times_in_ns=True), PROTOCOL)
        return len(done)

    def _apply(self, engine: str, e: LifecycleEvent, now: float) -> str:
        if not e.request_id:
            return "rejected_no_request_id"
        if e.request_id in self._completed:
            return "late_duplicate"
        p = self._pending.get(e.request_id)
        if p is None:
            if evicted := len(self._pending.make_room()):
                self._stats.inc("phasewatch_ingest_dropped_total", evicted,
                                reason="lifecycle_capacity")
            p = self._pending.put(e.request_id, _Pending(engine=engine), now)
        outcomes = [self._take(p, "model", e.model or "")]
        for name in ("prompt_tokens", "cached_prompt_tokens"):
            outcomes.append(self._take(p, name, getattr(e, name)))
        time_field = _TIME_FIELD.get(e.kind)
        if time_field is not None:
            outcomes.append(self._take(p, time_field, e.time_unix_nano))
        if e.kind is EventKind.FIRST_TOKEN:
            outcomes.append(self._emission(p, 0, e.time_unix_nano))
            self._token_counts(p, 0, e.token_counts)
        elif e.kind is EventKind.TOKENS:
            outcomes += self._emissions(p, e.first_emission_index, e.token_times_unix_nano)
            self._token_counts(p, e.first_emission_index, e.token_counts)
        elif e.kind is EventKind.FINISHED:
            for name in ("output_tokens", "finish_reason", "emission_count",
                         "last_token"):
                value = e.last_token_unix_nano if name == "last_token" else getattr(e, name)
                outcomes.append(self._take(p, name, value))
            if p.finished_at is None:
                p.finished_at = now
                self._pending.hold_until(e.request_id, now + self.grace)
        for o in ("conflict", "joined", "duplicate"):
            if o in outcomes:
                return o
        return "rejected_empty"

    @staticmethod
    def _token_counts(p: _Pending, first: int, counts) -> None:
        """Tokens of emissions ``first``, ``first + 1``, ... (the first value sent for an
        emission is kept)."""
        if not counts:
            return
        if p.emission_tokens is None:
            p.emission_tokens = {}
        for i, c in enumerate(counts):
            p.emission_tokens.setdefault(first + i, int(c))

    @staticmethod
    def _take(p: _Pending, name: str, value) -> str:
        # 0 is absent for a time or an emission count, but a real token count
        if value is None or value == "" or (value == 0 and name not in _COUNTS):
            return "empty"
        current = getattr(p, name)
        if current is None or current == "" or (current == 0 and name not in _COUNTS):
            setattr(p, name, value)
            return "joined"
        return "duplicate" if current == value else "conflict"

    @classmethod
    def _emissions(cls, p: _Pending, first: int, times) -> list[str]:
        """``_emission`` for ``times`` at ``first``, ``first + 1``, ...: one dict update when
        they are all new and non-zero (a stream's usual TOKENS event), else one by one."""
        indices = range(first, first + len(times))
        if times and 0 not in times and p.emissions.keys().isdisjoint(indices):
            p.emissions.update(zip(indices, times, strict=True))
            return ["joined"]
        return [cls._emission(p, i, t) for i, t in zip(indices, times, strict=True)]

    @staticmethod
    def _emission(p: _Pending, index: int, t: int) -> str:
        if not t:
            return "empty"
        if index in p.emissions:
            return "duplicate" if p.emissions[index] == t else "conflict"
        p.emissions[index] = t
        return "joined"

    def _pop(self, request_id: str) -> tuple:
        return self._completed_row(request_id, self._pending.take(request_id))

    def _completed_row(self, request_id: str, p: _Pending) -> tuple:
        self._completed[request_id] = None
        if len(self._completed) > self._max_completed:
            self._completed.popitem(last=False)
        return p.row(request_id)

    def sweep(self) -> int:
        """Complete finished requests past the grace period, evict unfinished past the TTL."""
        now = self._clock()
        done: list[tuple] = []
        evicted = 0
        with self._lock:
            for rid, p, _ in self._pending.sweep(now):  # none past capacity: add makes room
                if p.finished_at is not None:
                    done.append(self._completed_row(rid, p))
                    self._outcome("completed_incomplete")
                else:
                    evicted += 1
        if evicted:
            self._stats.inc("phasewatch_ingest_dropped_total", evicted,
                            reason="lifecycle_unfinished_ttl")
        if done:
            self._sink.ingest(RequestBatch.from_rows(done, times_in_ns=True), PROTOCOL)
        return evicted
