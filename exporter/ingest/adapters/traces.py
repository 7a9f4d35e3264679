"""Child spans of a request, held by trace id until the request's own span arrives.

Some servers put a request's timeline in child spans rather than on the request span:
TGI's ``queued`` and one ``send_generation`` per token (the only first-token time it
sends), SGLang's ``prefill_waiting``, ``prefill_forward`` and one ``decode_loop`` per
step. A span ends after its children, and a batch processor exports a process's spans
in the order they end, so children from the request span's own process reach the
exporter in the same export or an earlier one (TGI's router). Children from another
process (SGLang's scheduler, under the tokenizer's root) may come later: those roots
wait for them (``adapters.sglang.PendingRoots``). ``TraceParts`` keeps what the
adapters need of them (a few times per span, never attributes or text) per trace
until the request span takes them.

Bounded: at most ``max_traces`` traces and ``max_parts`` parts in all; past either the
oldest trace is dropped and counted (``evicted``), as are the parts of traces whose
request span never comes (an aborted request, a trace that is not a request). Parts
are keyed by span id, so a retried export that repeats child spans adds nothing.
"""

from __future__ import annotations

import threading
from collections import OrderedDict


class TraceParts:
    def __init__(self, max_traces: int = 65536, max_parts: int = 1_000_000):
        self.max_traces, self.max_parts = max_traces, max_parts
        # trace id -> kind -> span id -> value
        self._traces: OrderedDict[bytes, dict[str, dict[bytes, object]]] = OrderedDict()
        self._parts = 0
        self._lock = threading.Lock()
        self.evicted_traces = 0  # read (and reset) by the receiver, which counts them
        self.evicted_parts = 0

    def add(self, trace_id: bytes, kind: str, span_id: bytes, value) -> None:
        """Remember ``value`` (a time, a tuple of times) of one child span."""
        with self._lock:
            trace = self._traces.get(trace_id)
            if trace is None:
                trace = self._traces[trace_id] = {}
            parts = trace.setdefault(kind, {})
            if span_id not in parts:
                self._parts += 1
            parts[span_id] = value
            while self._traces and (len(self._traces) > self.max_traces
                                    or self._parts > self.max_parts):
                _, old = self._traces.popitem(last=False)
                n = sum(len(p) for p in old.values())
                self._parts -= n
                self.evicted_traces += 1
                self.evicted_parts += n

    def take(self, trace_id: bytes) -> dict[str, list]:
        """Every part remembered for ``trace_id``, by kind (values in span-id order is
        meaningless: callers sort), forgetting them. Empty when there are none."""
        with self._lock:
            trace = self._traces.pop(trace_id, None)
            if trace is None:
                return {}
            self._parts -= sum(len(p) for p in trace.values())
        return {kind: list(parts.values()) for kind, parts in trace.items()}

    def take_raw(self, trace_id: bytes) -> dict[str, dict[bytes, object]]:
        """As ``take``, keeping each part's span id: kind -> span id -> value."""
        with self._lock:
            trace = self._traces.pop(trace_id, None)
            if trace is None:
                return {}
            self._parts -= sum(len(p) for p in trace.values())
        return trace

    def peek_raw(self, trace_id: bytes) -> dict[str, dict[bytes, object]]:
        """As ``take_raw``, leaving the parts in place (copies)."""
        with self._lock:
            trace = self._traces.get(trace_id)
            return {} if trace is None else {k: dict(p) for k, p in trace.items()}

    def drain_evictions(self) -> tuple[int, int]:
        """(traces, parts) dropped since the last call."""
        with self._lock:
            out = (self.evicted_traces, self.evicted_parts)
            self.evicted_traces = self.evicted_parts = 0
        return out

    def __len__(self) -> int:
        with self._lock:
            return len(self._traces)
