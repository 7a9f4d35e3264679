"""vLLM ``llm_request`` spans (references.md section 1: V1 0.33 and the older V0).

One span per finished request, started at the request's arrival. Latencies are
float seconds: ``time_to_first_token`` (first token - arrival),
``time_in_model_prefill`` (first token - scheduled), ``time_in_model_decode``
(last token - first token), ``time_in_queue`` (scheduled - queued), ``e2e``.
Scheduled is taken as first token - prefill when both are sent (exact), else
arrival + time in queue (V0, which sends no prefill/decode split).
V1 sends no model name: ``AdapterContext.model_for`` names it.
"""

from __future__ import annotations

from exporter.adapters.common import Rejected, after, count, first_reason, row, seconds, text

ENGINE = "vllm"
SPAN_NAME = "llm_request"


def matches(span) -> bool:
    return span.name == SPAN_NAME


def convert(span, ctx) -> tuple:
    a = span.attributes
    ttft = seconds(a, "gen_ai.latency.time_to_first_token")
    e2e = seconds(a, "gen_ai.latency.e2e")
    queue = seconds(a, "gen_ai.latency.time_in_queue")
    prefill = seconds(a, "gen_ai.latency.time_in_model_prefill")
    decode = seconds(a, "gen_ai.latency.time_in_model_decode")
    if ttft is None and e2e is None:
        raise Rejected("no_latency_attributes", "llm_request without time_to_first_token or e2e")
    arrival = span.start_ns or None
    first = after(arrival, ttft)
    scheduled = (first - round(prefill * 1e9) if first is not None and prefill is not None
                 else after(arrival, queue))
    return row(
        ctx.model_for(span, text(a, "gen_ai.response.model", "gen_ai.request.model")), ENGINE,
        first_reason(a.get("gen_ai.response.finish_reasons")), text(a, "gen_ai.request.id"),
        arrival, scheduled, first, after(first, decode),
        after(arrival, e2e) if e2e is not None else span.end_ns or None,
        count(a, "gen_ai.usage.prompt_tokens", "gen_ai.usage.input_tokens"),
        count(a, "gen_ai.usage.cached_tokens", "gen_ai.usage.cache_read.input_tokens"),
        count(a, "gen_ai.usage.completion_tokens", "gen_ai.usage.output_tokens"))
