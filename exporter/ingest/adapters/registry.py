"""``AdapterRegistry``: the adapters one OTLP ingest asks, in order, and what it asks them
(``classify``, ``remember``, ``decode_step``, the keys ``walk`` extracts, the waiting
room). Built from modules that keep ``contract.SpanAdapter``; each is checked once, here:
what it declares in ``CAPABILITIES`` it provides, and what it provides it declares."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from types import MappingProxyType

from phasewatch.ingest.adapters.contract import (
    CAPABILITY_FUNCTIONS,
    SpanAdapter,
    WaitingRoom,
)


def check(adapter) -> None:
    """Raise ``ValueError`` naming what ``adapter`` lacks to keep the contract."""
    name = getattr(adapter, "__name__", repr(adapter))
    if not isinstance(adapter, SpanAdapter):
        missing = [m for m in ("ENGINE", "CAPABILITIES", "matches", "convert")
                   if not hasattr(adapter, m)]
        raise ValueError(f"{name} is not a span adapter: it lacks {', '.join(missing)} "
                         "(ingest.adapters.contract.SpanAdapter)")
    caps = adapter.CAPABILITIES
    for flag, function in CAPABILITY_FUNCTIONS.items():
        declared = getattr(caps, flag) not in (False, None)
        provided = callable(getattr(adapter, function, None))
        if declared and not provided:
            raise ValueError(f"{name} declares {flag} in its CAPABILITIES but has no "
                             f"{function}() (ingest.adapters.contract)")
        if provided and not declared:
            raise ValueError(f"{name} has {function}() but does not declare {flag} in its "
                             "CAPABILITIES: the ingest would never call it")
    if caps.extract and not caps.converts_many:
        raise ValueError(f"{name} declares extract keys without converts_many: only "
                         "convert_many reads SpanView.values")


class AdapterRegistry:
    """Adapters most specific first: a span is the first one's that ``matches`` it."""

    def __init__(self, *adapters: SpanAdapter):
        for a in adapters:
            check(a)
        self.adapters = adapters
        self._remembering = tuple(a for a in adapters if a.CAPABILITIES.remembers)
        self._stepping = tuple(a for a in adapters if a.CAPABILITIES.decode_steps)
        pairing = [a for a in adapters if a.CAPABILITIES.pairs_roots]
        if len(pairing) > 1:  # one waiting room: one join_wait, one pending gauge
            raise ValueError("only one adapter may pair roots (pairs_roots), got "
                             + ", ".join(a.__name__ for a in pairing))
        self._pairing = pairing[0] if pairing else None
        extract: dict[str, tuple[str, ...]] = {}
        for a in adapters:
            for span_name, keys in a.CAPABILITIES.extract.items():
                if extract.setdefault(span_name, keys) != keys:
                    raise ValueError(f"two adapters extract different keys from "
                                     f"{span_name!r} spans")
        # span name -> the keys ``otlp.spans.walk`` extracts for its adapter
        self.extract: Mapping[str, tuple[str, ...]] = MappingProxyType(extract)

    def __iter__(self) -> Iterator[SpanAdapter]:
        return iter(self.adapters)

    def classify(self, span) -> SpanAdapter | None:
        """The adapter of a request span, or None for a span that is not a request."""
        for adapter in self.adapters:
            if adapter.matches(span):
                return adapter
        return None

    def remember(self, span, parts) -> bool:
        """Keep what a request needs from one of its child spans; True if ``span`` was one."""
        return any(a.remember(span, parts) for a in self._remembering)

    def decode_step(self, span) -> tuple[str, int, int, int] | None:
        """(engine, start ns, end ns, requests) when ``span`` is an engine's decode step."""
        for a in self._stepping:
            step = a.decode_step(span)
            if step is not None:
                return (a.ENGINE, *step)
        return None

    def waiting_room(self, hold: float | None = None) -> WaitingRoom:
        """The waiting room of the adapter that pairs roots (an empty one if none does),
        whose requests wait ``hold`` seconds at most (None: the adapter's default)."""
        if self._pairing is None:
            return NoWaiting()
        return self._pairing.waiting_room() if hold is None else self._pairing.waiting_room(hold)


class NoWaiting:
    """The waiting room of a registry with no adapter that pairs roots: always empty."""

    def __len__(self) -> int:
        return 0

    def park(self, spans: list, protocol: str) -> list[str]:
        raise ValueError("no adapter of this registry pairs roots")

    def ready(self, ctx, traces=(), force: bool = False) -> list:
        return []
