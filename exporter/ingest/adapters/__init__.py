"""Span adapters: each turns one server's request spans into the one request record.

The stream tap's own records can come as spans too (``tap``: a tap in a fleet sends them
through the OpenTelemetry Collector); their rows are the trace join's tap side.

``classify`` picks the adapter per span by what the span carries (its name and
attributes), never by a flag, so one exporter can take vLLM, TGI, SGLang and any
GenAI-instrumented gateway at once. Spans no adapter claims are not requests
(vLLM's ``Load weights``, TGI's batch spans) and are ignored, not counted as errors.
"""

from __future__ import annotations

from phasewatch.ingest.adapters import genai, sglang, tap, tgi, vllm
from phasewatch.ingest.adapters.common import AdapterContext, Rejected

ADAPTERS = (tap, vllm, sglang, tgi, genai)  # most specific first (a tap's span is GenAI too)
# adapters whose request's timeline is in child spans (``traces.TraceParts``)
WITH_CHILD_SPANS = tuple(a for a in ADAPTERS if hasattr(a, "remember"))
CHILD_SPAN_NAMES = frozenset(n for a in WITH_CHILD_SPANS for n in a.CHILD_SPANS)
# adapters that read engine steps (the requests in each forward) from their own spans
WITH_STEPS = tuple(a for a in ADAPTERS if hasattr(a, "decode_step"))

__all__ = ["ADAPTERS", "AdapterContext", "Rejected", "classify", "decode_step", "remember"]


def remember(span, parts) -> bool:
    """Keep what a request needs from one of its child spans; True if ``span`` was one."""
    if span.name not in CHILD_SPAN_NAMES and "Scheduler" not in span.name:
        return False  # (SGLang's scheduler thread spans carry its host and pid in the name)
    return any(a.remember(span, parts) for a in WITH_CHILD_SPANS)


def decode_step(span) -> tuple[str, int, int, int] | None:
    """(engine, start ns, end ns, requests) when ``span`` is an engine's decode step."""
    for a in WITH_STEPS:
        step = a.decode_step(span)
        if step is not None:
            return (a.ENGINE, *step)
    return None


def classify(span):
    """The adapter module for a request span, or None for a span that is not a request."""
    for adapter in ADAPTERS:
        if adapter.matches(span):
            return adapter
    return None
