"""vLLM's ``llm_request`` spans: the latency adapter (``latency.py``) under vLLM's span
name and engine label (V1 0.33: ``vllm/v1/engine/output_processor.py``; older V0).

One span per finished request, started at the request's arrival. Latencies are
float seconds: ``time_to_first_token`` (first token - arrival),
``time_in_model_prefill`` (first token - scheduled), ``time_in_model_decode``
(last token - first token), ``time_in_queue`` (scheduled - queued), ``e2e``.
Scheduled is taken as first token - prefill when both are sent (exact), else
arrival + time in queue (V0, which sends no prefill/decode split).
V1 sends no model name: ``AdapterContext.model_for`` names it.
"""

from __future__ import annotations

from phasewatch.ingest.adapters.contract import Capabilities
from phasewatch.ingest.adapters.latency import LATENCY_KEYS, latency_batch, latency_row

ENGINE = "vllm"
SPAN_NAME = "llm_request"
# converted a whole export at a time, ``walk`` reading just the latency keys of its spans
CAPABILITIES = Capabilities(converts_many=True, extract={SPAN_NAME: LATENCY_KEYS})


def matches(span) -> bool:
    return span.name == SPAN_NAME


def convert(span, ctx) -> tuple:
    return latency_row(span, ctx, ENGINE)


def convert_many(spans, ctx):
    """``convert`` for a whole export at once (``latency_batch``)."""
    return latency_batch(spans, ctx, ENGINE)
