"""Any span following the OpenTelemetry GenAI semantic conventions (a gateway, a client
library, another server): token usage (old and new names), the model, finish reasons
and ``gen_ai.response.time_to_first_chunk``.

The span covers the request: arrival = span start, finish = span end, first token
= start + time to first chunk. Nothing marks the last token or the scheduling, so
decode, queue and prefill are left out (and counted as unavailable), not guessed.
"""

from __future__ import annotations

from phasewatch.ingest.adapters.attributes import after, count, first_reason, seconds, text
from phasewatch.ingest.adapters.contract import Capabilities
from phasewatch.ingest.adapters.rows import row

ENGINE = "otel"
CAPABILITIES = Capabilities()  # one span per request, nothing more
USAGE = ("gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens",
         "gen_ai.usage.prompt_tokens", "gen_ai.usage.completion_tokens")


def matches(span) -> bool:
    a = span.attributes
    return any(k in a for k in USAGE) or "gen_ai.response.time_to_first_chunk" in a


def convert(span, ctx) -> tuple:
    a = span.attributes
    arrival = span.start_ns or None
    return row(
        ctx.model_for(span, text(a, "gen_ai.response.model", "gen_ai.request.model")), ENGINE,
        first_reason(a.get("gen_ai.response.finish_reasons")),
        text(a, "gen_ai.response.id", "gen_ai.request.id"), arrival, None,
        after(arrival, seconds(a, "gen_ai.response.time_to_first_chunk")), None,
        span.end_ns or None,
        count(a, "gen_ai.usage.input_tokens", "gen_ai.usage.prompt_tokens"),
        count(a, "gen_ai.usage.cache_read.input_tokens", "gen_ai.usage.cached_tokens"),
        count(a, "gen_ai.usage.output_tokens", "gen_ai.usage.completion_tokens"))
