"""Span adapters: each turns one server's request spans into the one request record.

``ADAPTERS`` is the registry: one line per span shape, most specific first. Each adapter
is a module keeping ``contract.SpanAdapter`` (its engine label, ``matches``, ``convert``
and its ``CAPABILITIES``); the OTLP ingest asks the registry and names no engine. To add
an engine: write its module (``vllm.py`` is the smallest: the latency adapter under its
span name) and add it here, before ``genai``, the catch-all.

The stream tap's own records can come as spans too (``tap``: a tap in a fleet sends them
through the OpenTelemetry Collector); their rows are the trace join's tap side.

``classify`` picks the adapter per span by what the span carries (its name and
attributes), never by a flag, so one exporter can take vLLM, TGI, SGLang and any
GenAI-instrumented gateway at once. Spans no adapter claims are not requests
(vLLM's ``Load weights``, TGI's batch spans) and are ignored, not counted as errors.
"""

from __future__ import annotations

from phasewatch.ingest.adapters import genai, sglang, tap, tgi, vllm
from phasewatch.ingest.adapters.context import AdapterContext
from phasewatch.ingest.adapters.contract import Capabilities, Rejected, SpanAdapter
from phasewatch.ingest.adapters.registry import AdapterRegistry

ADAPTERS = AdapterRegistry(
    tap,  # the stream tap's records (a GenAI span too: before genai)
    vllm,
    sglang,
    tgi,
    genai,  # any span with GenAI usage attributes: last
)

classify = ADAPTERS.classify
remember = ADAPTERS.remember
decode_step = ADAPTERS.decode_step

__all__ = ["ADAPTERS", "AdapterContext", "AdapterRegistry", "Capabilities", "Rejected",
           "SpanAdapter", "classify", "decode_step", "remember"]
