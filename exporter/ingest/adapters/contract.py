"""The contract every span adapter keeps: what it claims, how its spans become rows, and
what more it can do, declared as data (``Capabilities``) that the OTLP ingest reads.

An adapter is a module (PEP 544: a module may implement a protocol), one per span shape:
``ENGINE`` (the rows' engine label), ``CAPABILITIES``, ``matches(span)`` (is this one of
my request spans?) and ``convert(span, ctx)`` (a ``record.ROW_FIELDS`` row, or
``Rejected``). A Protocol rather than an ABC because the adapters are modules of
functions and constants that tests and the tap's OTLP exporter read directly
(``vllm.convert``, ``tap.attributes``): a class per engine would add an instance and a
``self`` to each, and change nothing the ingest can check. What an adapter declares in
``CAPABILITIES`` it must provide (the matching protocol below); ``AdapterRegistry``
checks both ways when it is built, so the ingest never probes with ``hasattr``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


class Rejected(ValueError):
    """A span that looks like a request but cannot be used: counted with ``reason``
    (``phasewatch_ingest_rejected_total{reason}``) and named in ``partial_success``."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True)
class Capabilities:
    """What an adapter does beyond ``matches`` and ``convert`` (all off by default)."""

    # ``convert_many(spans, ctx)``: a whole export's spans at once, column by column
    converts_many: bool = False
    # span name -> the attribute keys ``convert_many`` reads: ``otlp.spans.walk`` extracts
    # just those for spans of that name (a request span known by its name)
    extract: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # ``remember(span, parts)``: child spans that hold part of a request's timeline,
    # kept by trace (``traces.TraceParts``) until the request span takes them
    remembers: bool = False
    # ``decode_step(span)``: (start ns, end ns, requests) of an engine's decode forward
    decode_steps: bool = False
    # ``waiting_room(hold)``: its request spans wait there for spans of other processes
    # (another role, stage spans) and are counted when complete or after ``hold`` s
    pairs_roots: bool = False
    # its rows' side in the trace join (``record.SOURCE_*``) when not the engine's, with
    # ``join_key(span)`` their join key (the stream tap's own records)
    source: int | None = None


@runtime_checkable
class SpanAdapter(Protocol):
    """One span shape's adapter (module docstring)."""

    ENGINE: str
    CAPABILITIES: Capabilities

    def matches(self, span) -> bool:
        """Whether ``span`` (an ``otlp.spans.SpanView``) is one of its request spans."""

    def convert(self, span, ctx) -> tuple:
        """A ``record.ROW_FIELDS`` tuple (times in integer ns); raises ``Rejected``."""


class ConvertsMany(Protocol):
    def convert_many(self, spans: list, ctx) -> tuple:
        """(a ``RequestBatch`` of the accepted spans with ``origin.span_columns``, the
        reason of every span in order, ``""`` = accepted): ``convert``'s values."""


class Remembers(Protocol):
    def remember(self, span, parts) -> bool:
        """Keep what a request needs of a child span in ``parts``; True if it was one."""


class ReadsDecodeSteps(Protocol):
    def decode_step(self, span) -> tuple[int, int, int] | None:
        """(start ns, end ns, requests in the forward), or None for another span."""


class ReleasedRequest(Protocol):
    """One request a waiting room lets go: its row, KV transfer in seconds (NaN = none),
    its request spans (the client-facing one first), protocol and outcome (complete,
    waited, capacity)."""

    row: tuple
    kv_transfer: float
    spans: list
    protocol: str
    outcome: str


class WaitingRoom(Protocol):
    """Request spans waiting for the rest of their request (``pairs_roots``). Bounded."""

    def __len__(self) -> int: ...

    def park(self, spans: list, protocol: str) -> list[str]:
        """Check and hold request spans; the reason each was refused ("" = held)."""

    def ready(self, ctx, traces=(), force: bool = False) -> list[ReleasedRequest]:
        """The requests complete now (those of ``traces`` checked), past their wait (all
        with ``force``) or past capacity."""


class PairsRoots(Protocol):
    def waiting_room(self, hold: float = ...) -> WaitingRoom:
        """A new waiting room whose requests wait at most ``hold`` seconds (a default of
        the adapter's own when not given)."""


class HasOwnSide(Protocol):
    def join_key(self, span) -> str:
        """The trace join key of a row from ``span`` (``record.RequestRecord.trace_parent``)."""


# each capability flag and the function an adapter declaring it provides (the protocols above)
CAPABILITY_FUNCTIONS = {"converts_many": "convert_many", "remembers": "remember",
                        "decode_steps": "decode_step", "pairs_roots": "waiting_room",
                        "source": "join_key"}
