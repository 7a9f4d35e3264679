"""The stream tap's record and the engine's own, joined into one request.

``phasewatch tap`` sends what the client saw of a request (arrival, every chunk, the
end, usage, finish reason) and the ``traceparent`` it sent upstream; the engine's span
of the same request (vLLM's ``llm_request``, SGLang's root, TGI's ``generate``) is a
child of that traceparent's span. Rows of the two sides with the same
``trace_parent`` ("<trace id>-<span id>": the tap's injected span, the engine span's
trace and parent) are one request, counted once with ``source`` = joined:

* arrival, first token, last token, finish, the emissions (ITL) and their tokens: the
  tap's, as the client saw them (TTFT is the client's);
* queued (else the engine's own arrival) and scheduled: the engine's, so preprocess
  runs from the tap to the engine's queue (the hop in, templating, tokenisation), then
  queue and prefill (to the first token the client saw), decode to the last;
* tokens: the engine's counts where it has them (output tokens per sequence), the
  tap's otherwise (cached prompt tokens, which vLLM's span lacks); the finish reason the
  client saw; the engine's request id, engine name, KV transfer and pod;
* weight: the tap's (1): the tap records every request it passes, so a joined request
  counts once even when the engine's trace was sampled (its span's weight is 1/p: the
  requests it stands for include the tap-only ones counted beside it).

A request with n > 1 sequences has one row per choice on the tap's side and one span
per sequence on the engine's, with the same traceparent: they are paired in order of
their last token.

Rows wait for their other side at most ``wait`` seconds (the engine's span exporter
batches, typically every 1-5 s; the tap's client every 0.25 s), in a bounded table; past
the wait, or when the table is full, a row is counted alone (source tap or engine).

A row waits only while its other side is answering, so a tap with no engine tracing
behind it, or an engine with no tap in front, is counted at once (outcomes
``tap_only_no_engine``, ``engine_only_no_tap``), not after the wait:

* expected: a tap's record waits once an engine has been seen tracing (any OTLP
  export with spans other than a tap's own: ``engine_exported``; vLLM exports its
  start-up spans as it loads) or an
  engine row with trace context has come; an engine's span once a tap's record has
  been seen, or when it inherited the tap's tracestate member (``phasewatch=tap``: it
  came through a tap, so its record is coming, even before any was seen);
* answering: a side stops waiting once its rows have waited in vain (counted alone
  after the whole wait) over ``horizon`` seconds (default max(60 s, 6 x ``wait``))
  with nothing of the other side in between, and waits again as soon as the other side
  sends anything. Silence is judged by rows that waited in vain, not by the clock: a
  quiet server whose engine answers each request keeps joining, and so does one whose
  last request before an idle hour was aborted (vLLM sends no span for it).

At start no engine has been seen. An engine that exports its start-up spans (vLLM) is
seen before the first request and every request joins. Otherwise (the exporter started
after them, an engine that sends none) the tap's records are counted at once until the
engine's first export arrives (vLLM exports every 1-5 s), and the engine spans of those
first requests, arriving after, are dropped as ``late``: each such request is counted
once, from the tap alone. From then on tap records wait and join.
A row arriving after its request was counted without it is dropped, counted as
``late``: a request is never counted twice; a further sequence of a request counted
alone is counted alone too, under the same outcome.
Rows without a traceparent (an engine span with no parent: a request that did not come
through the tap) pass straight through. Every outcome is counted in
``phasewatch_trace_join_requests_total{outcome}``.

The receiver's reply counts a waiting row as accepted; whether it is then rejected (a
bad row) is counted under protocol ``trace_join`` when it is released.

``TraceJoin`` is a ``sink.RequestSink`` in front of another (the aggregator). Held rows
stay columns: the rows of a batch that may wait are taken out as one small batch with
its own strings, a waiting row is a place in it, and released rows are gathered back
into one batch (the joined pairs column by column).
"""

from __future__ import annotations

import re
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from phasewatch.aggregation.sink import IngestResult, RequestSink
from phasewatch.aggregation.waiting_room import CAPACITY, Room
from phasewatch.requests.record import (
    SOURCE_ENGINE,
    SOURCE_JOINED,
    SOURCE_TAP,
    BatchBuilder,
    RequestBatch,
    concat,
)

_KEY = re.compile(r"[0-9a-f]{32}-[0-9a-f]{16}")
PROTOCOL = "trace_join"  # released rows are ingested under this protocol


@dataclass(frozen=True, eq=False, slots=True)
class Held:
    """One held row: row ``i`` of ``part``, the rows of the batch it came in that may wait
    (with their own strings, so the batch itself is not kept alive)."""

    part: RequestBatch
    i: int
    protocol: str

    @property
    def last(self) -> int:  # pairing order: the last token, else the finish
        return int(self.part.last_token[self.i]) or int(self.part.finish[self.i])

    @property
    def choice(self) -> int:
        return int(self.part.choice[self.i])


def gather(rows: list[Held]) -> RequestBatch:
    """Held rows, in order, as one batch (a table of just their strings): each part's
    rows taken once, then put in order."""
    taken: dict[int, tuple[RequestBatch, list[int]]] = {}  # id(part) -> (part, its rows)
    where = []  # per row: (id(part), its place among that part's taken rows)
    for r in rows:
        mine = taken.setdefault(id(r.part), (r.part, []))[1]
        where.append((id(r.part), len(mine)))
        mine.append(r.i)
    first, at = {}, 0  # id(part) -> where its rows start in the concatenation
    for key, (_, mine) in taken.items():
        first[key], at = at, at + len(mine)
    whole = concat([part.take(np.array(mine, dtype=np.int64)) for part, mine in taken.values()])
    return whole.take(np.array([first[key] + j for key, j in where], dtype=np.int64))


def joined(pairs: list[tuple[Held, Held]]) -> RequestBatch:
    """One request from each (tap's row, engine's row), by the module docstring's rules:
    the engine's columns but for those below."""
    n = len(pairs)
    both = gather([t for t, _ in pairs] + [e for _, e in pairs])
    tap, engine = both.take(np.arange(n)), both.take(np.arange(n, 2 * n))

    def first(a: RequestBatch, b: RequestBatch, *columns: str) -> dict:
        """``a``'s value of each column where it has one (not 0), else ``b``'s."""
        return {k: np.where(getattr(a, k) != 0, getattr(a, k), getattr(b, k)) for k in columns}

    counts = {k: np.where(getattr(engine, k) >= 0, getattr(engine, k), getattr(tap, k))
              for k in ("prompt_tokens", "cached_prompt_tokens", "output_tokens")}
    # the emissions of the tap (what the client saw) where it has any
    use_tap = (tap.gap_counts > 0) | (engine.gap_counts == 0)
    gaps = both.take(np.where(use_tap, np.arange(n), np.arange(n, 2 * n)))
    return BatchBuilder(n, strings=both.strings).columns(
        **{k: getattr(engine, k) for k in ("engine", "request_id", "trace_parent",
                                             "scheduled", "kv_transfer")},
        **first(tap, engine, "arrival", "first_token", "last_token", "finish", "finish_reason",
                "model"), **first(engine, tap, "pod"), **counts,
        queued=np.where(engine.queued != 0, engine.queued, engine.arrival),
        choice=tap.choice, weight=tap.weight, source=np.full(n, SOURCE_JOINED),
    ).gaps(gaps.token_gaps, gaps.gap_counts, gaps.gap_tokens).tolerance(
        both.clock_skew_tolerance_ns).build()


@dataclass
class _Waiting:
    tap: list[Held] = field(default_factory=list)
    engine: list[Held] = field(default_factory=list)


class TraceJoin:
    """A ``RequestSink`` in front of another (the aggregator): rows that may have another
    side wait here, the rest (and what a join completes) go on at once; ``sweep()``
    releases the rows whose wait is over (the exporter calls it every second)."""

    def __init__(self, downstream: RequestSink, *, wait: float = 10.0,
                 max_pending: int = 20_000, remember: int = 100_000,
                 horizon: float | None = None, clock=time.monotonic):
        self._next = downstream
        self._waiting: Room[_Waiting] = Room(wait, max_pending, clock)  # by key, oldest first
        self.horizon = max(60.0, 6 * wait) if horizon is None else horizon
        # counted requests are remembered (to drop a late other side) this long, at most
        # ``remember`` of them (~0.2 kB each): a side later than that is counted alone
        self._remember, self._forget = remember, max(60.0, 6 * wait)
        self._clock = clock
        self._lock = threading.Lock()
        # counted keys -> (when, SOURCE_JOINED or the side counted alone, its outcome)
        self._done: OrderedDict[str, tuple[float, int, str]] = OrderedDict()
        # whether each side has ever sent a row with trace context (neither at start),
        # and when its rows that waited in vain first and last did so since the other
        # side last sent anything (None: none since)
        self._seen = {SOURCE_TAP: False, SOURCE_ENGINE: False}
        self._in_vain: dict[int, tuple[float, float] | None] = {SOURCE_TAP: None,
                                                                SOURCE_ENGINE: None}

    @property
    def wait(self) -> float:
        """Seconds a row waits for its other side (0: no join)."""
        return self._waiting.hold

    @property
    def max_pending(self) -> int:
        """Requests waiting at most: past it the oldest is counted alone (capacity)."""
        return self._waiting.max_size

    @max_pending.setter
    def max_pending(self, value: int) -> None:
        self._waiting.max_size = value

    @property
    def stats(self):
        return self._next.stats

    @property
    def label_names(self) -> tuple[str, ...]:
        return self._next.label_names

    def add_steps(self, steps: list[tuple]) -> None:
        self._next.add_steps(steps)  # not requests: nothing to join

    def pending_count(self) -> int:
        with self._lock:
            return sum(len(w.tap) + len(w.engine) for w in self._waiting.values())

    def ingest(self, batch: RequestBatch, protocol: str) -> IngestResult:
        """Hold the rows that may have another side; ingest the rest (and any row this
        completes) now. Never raises on bad rows. An engine row that is ``tapped`` (its
        span carries the tap's tracestate member, so its tap record is coming) waits even
        before any tap has been seen (the first requests' spans can come first)."""
        if self.wait <= 0 or not batch.trace_parent.any():
            return self._next.ingest(batch, protocol)
        now = self._clock()
        keys = [batch.strings[i] for i in batch.trace_parent.tolist()]
        sides = batch.source.tolist()
        # the rows that may wait, with their own strings (so the batch is not kept)
        may_wait = [i for i, key in enumerate(keys)
                    if key and sides[i] != SOURCE_JOINED and _KEY.fullmatch(key)]
        part = concat([batch.take(np.array(may_wait, dtype=np.int64))])
        in_part = dict(zip(may_wait, range(len(may_wait)), strict=True))
        outcomes: Counter = Counter()
        with self._lock:
            held, late, release = self._hold(keys, sides, batch.tapped.tolist(), now,
                                             outcomes,
                                             lambda i: Held(part, in_part[i], protocol))
            release += self._expire(now, outcomes)
        self._count(outcomes)
        result = self._pass_on(batch, protocol, held, late)
        self._release(release)
        return result

    def engine_exported(self) -> None:
        """An engine's trace export arrived, whatever its spans (vLLM exports a dozen
        start-up spans as it loads, before any request): an engine traces, so a tap's
        records wait for its spans from the first request on. Not an answer: only spans
        with trace context keep tap records waiting (``horizon``)."""
        with self._lock:
            self._seen[SOURCE_ENGINE] = True

    def sweep(self) -> int:
        """Release the rows whose wait is over; how many requests were counted."""
        outcomes: Counter = Counter()
        with self._lock:
            release = self._expire(self._clock(), outcomes)
        self._count(outcomes)
        self._release(release)
        return len(release)

    def flush(self) -> int:
        """Count every waiting row now, alone (the exporter is stopping: nothing is
        left uncounted); how many requests."""
        outcomes: Counter = Counter()
        with self._lock:
            release = self._expire(float("inf"), outcomes)
        self._count(outcomes)
        self._release(release)
        return len(release)

    # ---- under the lock --------------------------------------------------------
    def _hold(self, keys: list[str], sides: list[int], tapped: list[bool], now: float,
              outcomes: Counter, row: Callable[[int], Held]
              ) -> tuple[np.ndarray, np.ndarray, list]:
        """Each row of a batch by its trace key (``keys``, ``sides``, ``tapped``: the
        batch's columns): one whose other side is expected waits (``row(i)``, held), one
        whose request was counted without it is late (held and dropped), the rest go on
        alone, each counted in ``outcomes``; then the requests the batch completed are
        taken out and paired. (held, late, what to release)."""
        held = np.zeros(len(keys), dtype=bool)
        late = np.zeros(len(keys), dtype=bool)  # dropped: counted without them
        touched: dict[str, _Waiting] = {}
        self._arrived({sides[i] for i, key in enumerate(keys)
                       if key and _KEY.fullmatch(key)})
        for i, key in enumerate(keys):
            side = sides[i]
            if not key or side == SOURCE_JOINED:
                continue
            if not _KEY.fullmatch(key):
                outcomes["bad_trace_parent"] += 1  # counted, and the row goes on alone
                continue
            w = self._waiting.get(key)
            done = self._done.get(key) if w is None else None
            if done is not None:
                if done[1] != side:  # its request was counted without it
                    outcomes["late"] += 1
                    held[i] = late[i] = True
                else:  # a further sequence of a request counted alone: alone too
                    outcomes[done[2]] += 1
                continue
            if w is None and not self._expects(side, tapped[i]):
                alone = "tap_only_no_engine" if side == SOURCE_TAP else "engine_only_no_tap"
                outcomes[alone] += 1
                self._counted(key, now, side, alone)  # the other side is not sending
                continue
            if w is None:
                w = self._waiting.put(key, _Waiting(), now)
            (w.tap if side == SOURCE_TAP else w.engine).append(row(i))
            held[i] = True
            touched[key] = w
        release: list = []
        for key, w in touched.items():  # once all of the batch's rows are in
            # complete: every choice the tap saw (0..n-1), and as many engine sequences
            if w.tap and len(w.tap) == len(w.engine) == 1 + max(r.choice for r in w.tap):
                self._waiting.take(key)
                release += self._pair(key, w, outcomes, now)
        return held, late, release

    def _arrived(self, sides: set[int]) -> None:
        """Rows with trace context of ``sides`` arrived: each side is seen, and answers
        the other's rows."""
        for side in sides & {SOURCE_TAP, SOURCE_ENGINE}:
            self._seen[side] = True
            self._in_vain[SOURCE_ENGINE if side == SOURCE_TAP else SOURCE_TAP] = None

    def _expects(self, side: int, tapped: bool) -> bool:
        """Whether a new row of ``side`` waits for the other side: the other side is
        expected (seen once, or the row came through a tap) and is answering (the
        side's rows have not waited in vain over ``horizon`` seconds since it last
        sent anything)."""
        other = SOURCE_ENGINE if side == SOURCE_TAP else SOURCE_TAP
        if not (self._seen[other] or (side == SOURCE_ENGINE and tapped)):
            return False
        vain = self._in_vain[side]
        return vain is None or vain[1] - vain[0] < self.horizon

    def _expire(self, now: float, outcomes: Counter) -> list:
        """Rows whose wait is over, and the oldest past ``max_pending`` (capacity)."""
        out = []
        for key, w, reason in self._waiting.sweep(now):
            out += self._pair(key, w, outcomes, now, capacity=reason == CAPACITY)
        while self._done and (len(self._done) > self._remember
                              or next(iter(self._done.values()))[0] < now - self._forget):
            self._done.popitem(last=False)
        return out

    def _pair(self, key: str, w: _Waiting, outcomes: Counter, now: float,
              capacity: bool = False) -> list:
        """Pair the sides' rows in order of their last token: (tap, engine) pairs to join,
        and the rest, alone."""
        taps = sorted(w.tap, key=lambda r: r.last)
        engines = sorted(w.engine, key=lambda r: r.last)
        n = min(len(taps), len(engines))
        out: list = list(zip(taps[:n], engines[:n], strict=True))
        outcomes["joined"] += n
        for rest, alone in ((taps[n:], "tap_only"), (engines[n:], "engine_only")):
            outcomes["capacity" if capacity else alone] += len(rest)
            out += rest
        side = SOURCE_JOINED if n else SOURCE_TAP if taps else SOURCE_ENGINE
        self._counted(key, now, side, "joined" if n else "capacity" if capacity
                      else "tap_only" if taps else "engine_only")
        if not n and not capacity and now < float("inf"):  # (flush: stopping, no evidence)
            vain = self._in_vain[side]  # waited in vain: evidence the other side is quiet
            self._in_vain[side] = (vain[0] if vain else now, now)
        return out

    def _counted(self, key: str, now: float, side: int, outcome: str) -> None:
        """Remember that ``key``'s request was counted, joined or by ``side`` alone
        (under ``outcome``): the other side, coming later, is late (a further sequence
        of the same side is counted alone too, under the same outcome)."""
        self._done[key] = (now, side, outcome)
        self._done.move_to_end(key)

    # ---- outside the lock ------------------------------------------------------
    def _pass_on(self, batch: RequestBatch, protocol: str, held: np.ndarray,
                 late: np.ndarray) -> IngestResult:
        """Ingest the rows not held now; the result counts the held rows accepted (they
        will be, alone or joined) but the late ones (dropped)."""
        passed = ~held
        result = IngestResult(0, Counter(), np.ones(len(batch), dtype=bool))
        if passed.any():
            r = self._next.ingest(batch.take(passed), protocol)
            result.rejected = r.rejected
            result.accepted = r.accepted
            result.kept[passed] = r.kept if r.kept is not None else False
        result.accepted += int((held & ~late).sum())
        result.kept[held] = ~late[held]
        return result

    def _count(self, outcomes: Counter) -> None:
        for outcome, n in outcomes.items():
            if n:
                self.stats.inc("phasewatch_trace_join_requests_total", n, outcome=outcome)

    def _release(self, rows: list) -> None:
        """Count released rows: the joined pairs as one batch (protocol ``trace_join``),
        the rows alone as one batch per protocol they came in, in order."""
        batches: dict[tuple[bool, str], list] = {}  # (pairs?, protocol) -> rows
        for r in rows:
            pair = isinstance(r, tuple)
            batches.setdefault((pair, PROTOCOL if pair else r.protocol), []).append(r)
        for (pairs, protocol), rs in batches.items():
            self._next.ingest(joined(rs) if pairs else gather(rs), protocol)
