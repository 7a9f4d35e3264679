"""A bounded waiting room: entries by key, each waiting for the rest of its request until
a deadline, oldest first.

The three joins wait in one: the stream join (``ingest.lifecycle``: events of one request
id), the trace join (``aggregation.tracejoin``: a tap's row and the engine's) and the
root spans of an engine that pairs them (``ingest.adapters.sglang``). Each takes an entry
out when it is complete; ``sweep`` hands over the rest whose deadline has passed
(``expired``) and the oldest past ``max_size`` (``capacity``), and the join counts them
under its own metric. The room holds no lock: its join's guards it.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Generic, NamedTuple, TypeVar

V = TypeVar("V")

EXPIRED = "expired"  # its deadline passed
CAPACITY = "capacity"  # the oldest, past max_size


class Leaving(NamedTuple, Generic[V]):
    """An entry the room let go, and why (``EXPIRED`` or ``CAPACITY``)."""

    key: str
    value: V
    reason: str


class Room(Generic[V]):
    """Entries by key in the order they came, each held ``hold`` seconds (``clock``'s)
    unless its deadline is moved (``hold_until``); at most ``max_size`` of them after a
    ``sweep`` or a ``make_room``.

    A sweep looks at the entries that are due, not at all of them: the deadlines of the
    entries never moved run in the order they came (a queue, due ones at its front);
    a moved one (the stream join moves every finished request's) leaves the queue for
    a heap of deadlines. What a moved or taken entry leaves in the heap is passed over
    when it comes up, and dropped when the heap is rebuilt (past twice its entries)."""

    def __init__(self, hold: float, max_size: int,
                 clock: Callable[[], float] = time.monotonic):
        self.hold, self.max_size, self._clock = hold, max_size, clock
        self._entries: OrderedDict[str, V] = OrderedDict()  # oldest first
        # key -> (its deadline, its place: the order it came in), never moved (a dict
        # keeps the order its keys came in) ...
        self._queue: dict[str, tuple[float, int]] = {}
        self._moved: dict[str, tuple[float, int]] = {}  # ... and moved (hold_until)
        self._heap: list[tuple[float, int, str]] = []  # the moved: soonest first
        self._places = itertools.count()
        # the joins' hot path (every event or row looks its key up): the dict's own get
        self.get: Callable[[str], V | None] = self._entries.get

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def values(self) -> Iterator[V]:
        return iter(self._entries.values())

    def put(self, key: str, value: V, now: float | None = None) -> V:
        """Hold ``value`` under a new ``key`` until ``now`` (default: the clock) + ``hold``;
        returns ``value``. Evicts nothing: ``make_room`` first, or ``sweep`` after."""
        if key in self._entries:
            raise ValueError(f"{key!r} is already waiting: take it out first")
        self._queue[key] = ((self._clock() if now is None else now) + self.hold,
                            next(self._places))
        self._entries[key] = value
        return value

    def take(self, key: str) -> V:
        """Take ``key``'s entry out (it is complete); ``KeyError`` if none waits."""
        value = self._entries.pop(key)
        if self._queue.pop(key, None) is None:
            del self._moved[key]
        return value

    def hold_until(self, key: str, deadline: float) -> None:
        """Move ``key``'s deadline (its place, and so the eviction order, stays)."""
        if key not in self._entries:
            raise KeyError(key)
        slot = self._queue.pop(key, None) or self._moved[key]
        if deadline == slot[0] and key in self._moved:
            return
        self._moved[key] = (deadline, slot[1])
        heap = self._heap
        if len(heap) > 2 * len(self._moved) + 64:  # mostly items passed over: rebuilt
            heap[:] = [(d, p, k) for k, (d, p) in self._moved.items() if k != key]
            heapq.heapify(heap)
        heapq.heappush(heap, (deadline, slot[1], key))

    def make_room(self) -> list[Leaving[V]]:
        """Evict the oldest until one more entry fits (``CAPACITY``)."""
        return self._evict(max(self.max_size - 1, 0))

    def sweep(self, now: float | None = None) -> list[Leaving[V]]:
        """Take out, oldest first, the entries whose deadline is ``now`` (default: the
        clock) or before (``EXPIRED``; every one at ``now`` = inf) and the oldest past
        ``max_size`` (``CAPACITY``)."""
        now = self._clock() if now is None else now
        due = []
        for key, (deadline, place) in self._queue.items():  # the due ones: at the front
            if deadline > now:
                break
            due.append((place, key))
        out = [(place, key, self.take(key)) for place, key in due]
        heap, moved = self._heap, self._moved
        if heap and heap[0][0] <= now:
            while heap and heap[0][0] <= now:
                deadline, place, key = heapq.heappop(heap)
                if moved.get(key) == (deadline, place):  # else taken, or moved again
                    out.append((place, key, self.take(key)))
            out.sort(key=lambda d: d[0])  # the order they came in
        return [Leaving(key, value, EXPIRED) for _, key, value in out] + \
            self._evict(self.max_size)

    def _evict(self, keep: int) -> list[Leaving[V]]:
        """The oldest entries past ``keep``, taken out (``CAPACITY``)."""
        out = []
        while len(self._entries) > keep:
            key, value = self._entries.popitem(last=False)
            if self._queue.pop(key, None) is None:
                del self._moved[key]
            out.append(Leaving(key, value, CAPACITY))
        return out
