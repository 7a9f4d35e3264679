"""Where a tapped request goes: ``Tap``'s record callback, over a ``PhasewatchClient``
(``phasewatch tap``) or into batches for the exporter's trace join in the same process
(``phasewatch serve --tap-upstream``)."""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections import Counter

from phasewatch.aggregation.sink import RequestSink
from phasewatch.requests.record import SOURCE_TAP, RequestBatch, RequestRecord

log = logging.getLogger(__name__)


def client_recorder(client):
    """``Tap``'s record callback over a ``PhasewatchClient``."""
    def record(model: str, kwargs: dict, seen=None) -> None:
        client.record(model, **kwargs)
    return record


class BufferedRecorder(ABC):
    """A ``Tap`` record callback that gathers what ``_item`` makes of each record and
    hands it on with ``_send`` every ``interval`` seconds, from a thread of its own,
    never from the tap's event loop. Past ``max_buffer`` waiting records, or after
    ``close()``, a record is dropped and counted; ``stats`` has the client's keys
    (sent, accepted, rejected, dropped_<reason>), so ``tallies`` reads either. A
    subclass sets what ``_send`` needs before calling ``__init__`` (the thread starts
    there)."""

    def __init__(self, interval: float, max_buffer: int, name: str):
        self._interval, self._max = interval, max_buffer
        self._items: list = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.stats: Counter = Counter()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @abstractmethod
    def _item(self, model: str, kwargs: dict, seen):
        """What is buffered for one record; None when it cannot be (counted there)."""

    @abstractmethod
    def _send(self, items: list) -> None:
        """Hand ``items`` on, counting what became of them in ``stats``."""

    def __call__(self, model: str, kwargs: dict, seen=None) -> None:
        item = self._item(model, kwargs, seen)
        if item is None:
            return
        with self._lock:
            if self._closed.is_set() or len(self._items) >= self._max:
                self.stats["dropped_closed" if self._closed.is_set()
                           else "dropped_buffer_full"] += 1
                return
            self._items.append(item)

    def _run(self) -> None:
        while not self._closed.wait(self._interval):
            self.flush()
        self.flush()

    def flush(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        if items:
            self._send(items)

    def close(self, timeout: float = 10.0) -> None:
        """Hand over what is waiting, then drop (and count) what comes after."""
        self._closed.set()
        self._thread.join(timeout)


class BatchRecorder(BufferedRecorder):
    """``Tap``'s record callback inside ``phasewatch serve`` (``--tap-upstream``): records
    go to ``sink`` (the exporter's trace join, in front of its aggregator) as one batch
    every ``interval`` seconds (``BufferedRecorder``)."""

    def __init__(self, sink: RequestSink, engine: str, interval: float = 0.25,
                 max_buffer: int = 100_000):
        self._sink, self._engine = sink, engine
        super().__init__(interval, max_buffer, "pw-tap-records")

    def _item(self, model: str, kwargs: dict, seen) -> tuple:
        return RequestRecord(model, **kwargs).row(self._engine)

    def _send(self, rows: list) -> None:
        try:
            result = self._sink.ingest(RequestBatch.from_rows(rows, source=SOURCE_TAP),
                                       "tap")
        except Exception:  # a bug here must not stop the tap: the records are counted
            log.exception("handing the tap's records to the exporter failed")
            self.stats["dropped_invalid"] += len(rows)
            return
        self.stats["sent"] += len(rows)
        self.stats["accepted"] += result.accepted
        self.stats["rejected"] += len(rows) - result.accepted
