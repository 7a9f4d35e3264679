"""What every receiver hands its requests to: a ``RequestSink``, and what it gets back.

A receiver (the phasewatch gRPC service, the lifecycle join, the OTLP path, the stream
tap's recorder) builds a ``RequestBatch`` with every column it knows filled (the pod
when ``label_names`` has ``pod``, the traceparent a request came with, whether it came
through a tap, who saw it) and hands it to ``ingest``; the reply says how many rows
were accepted and why the others were rejected. The exporter's sink is the trace join
(``tracejoin.TraceJoin``) in front of the aggregator (``aggregate.Aggregator``); both
are sinks, so a receiver never asks which one it holds.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from phasewatch.requests.record import RequestBatch
from phasewatch.selfstats import SelfStats


@dataclass
class IngestResult:
    """A batch's reply: rows accepted (a row held for a join counts as accepted), the
    rejected ones by reason, and which rows were kept (bool per row; None: none)."""

    accepted: int
    rejected: Counter
    kept: np.ndarray | None = None


class RequestSink(Protocol):
    """Where a receiver's batches go (module docstring)."""

    @property
    def stats(self) -> SelfStats:
        """The self-metrics the receiver counts its own outcomes in."""
        ...

    @property
    def label_names(self) -> tuple[str, ...]:
        """The labels the series are split by ("model", "engine", with "pod" and/or
        "source" where configured): a receiver fills the ``pod`` column only when
        ``pod`` is one of them."""
        ...

    def ingest(self, batch: RequestBatch, protocol: str) -> IngestResult:
        """Count ``batch`` (or hold rows of it for a join), under ``protocol``. Thread-safe;
        never raises on bad rows."""
        ...

    def add_steps(self, steps: list[tuple]) -> None:
        """Engine-reported decode steps: (model, engine, pod, start ns, end ns,
        requests) each."""
        ...

    def engine_exported(self) -> None:
        """An engine's trace export arrived (whatever its spans): an engine traces, so a
        join waits for its spans. Nothing to a sink that joins nothing."""
        ...
