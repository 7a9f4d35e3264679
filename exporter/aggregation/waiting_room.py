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
    ``sweep`` or a ``make_room``."""

    def __init__(self, hold: float, max_size: int,
                 clock: Callable[[], float] = time.monotonic):
        self.hold, self.max_size, self._clock = hold, max_size, clock
        self._entries: OrderedDict[str, V] = OrderedDict()  # oldest first
        self._deadlines: dict[str, float] = {}
        # deadlines run in the entries' order until one is moved: then a sweep looks at all
        self._in_order = True
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
        self._deadlines[key] = (self._clock() if now is None else now) + self.hold
        self._entries[key] = value
        return value

    def take(self, key: str) -> V:
        """Take ``key``'s entry out (it is complete); ``KeyError`` if none waits."""
        del self._deadlines[key]
        return self._entries.pop(key)

    def hold_until(self, key: str, deadline: float) -> None:
        """Move ``key``'s deadline (its place, and so the eviction order, stays)."""
        if key not in self._entries:
            raise KeyError(key)
        self._deadlines[key] = deadline
        self._in_order = False

    def make_room(self) -> list[Leaving[V]]:
        """Evict the oldest until one more entry fits (``CAPACITY``)."""
        return self._evict(max(self.max_size - 1, 0))

    def sweep(self, now: float | None = None) -> list[Leaving[V]]:
        """Take out, oldest first, the entries whose deadline is ``now`` (default: the
        clock) or before (``EXPIRED``; every one at ``now`` = inf) and the oldest past
        ``max_size`` (``CAPACITY``)."""
        now = self._clock() if now is None else now
        deadlines = self._deadlines
        if self._in_order:  # the due ones are at the front
            due = []
            for key in self._entries:
                if deadlines[key] > now:
                    break
                due.append(key)
        else:
            due = [k for k in self._entries if deadlines[k] <= now]
        out = [Leaving(k, self.take(k), EXPIRED) for k in due]
        return out + self._evict(self.max_size)

    def _evict(self, keep: int) -> list[Leaving[V]]:
        """The oldest entries past ``keep``, taken out (``CAPACITY``)."""
        out = []
        while len(self._entries) > keep:
            key, value = self._entries.popitem(last=False)
            del self._deadlines[key]
            out.append(Leaving(key, value, CAPACITY))
        return out
