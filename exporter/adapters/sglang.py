"""SGLang root request spans, named ``"{role} Req {rid[:8]}"`` (references.md section 1).

The role is empty in unified mode, so the name may start with a space. Latencies
are seconds: ``time_to_first_token``, ``time_in_model_prefill``,
``time_in_model_decode``, ``e2e`` (no time in queue: scheduled = first token -
prefill). Finish reasons come as a JSON list in a string.
"""

from __future__ import annotations

import re

from exporter.adapters.common import Rejected, after, count, first_reason, row, seconds, text

ENGINE = "sglang"
_NAME = re.compile(r"(^|\s)Req [0-9A-Za-z_-]{1,64}$")


def matches(span) -> bool:
    return _NAME.search(span.name) is not None and any(
        k.startswith("gen_ai.latency.") for k in span.attributes)


def convert(span, ctx) -> tuple:
    a = span.attributes
    ttft = seconds(a, "gen_ai.latency.time_to_first_token")
    e2e = seconds(a, "gen_ai.latency.e2e")
    prefill = seconds(a, "gen_ai.latency.time_in_model_prefill")
    decode = seconds(a, "gen_ai.latency.time_in_model_decode")
    if ttft is None and e2e is None:
        raise Rejected("no_latency_attributes", "SGLang request span without TTFT or e2e")
    arrival = span.start_ns or None
    first = after(arrival, ttft)
    scheduled = first - round(prefill * 1e9) if first is not None and prefill is not None \
        else None
    return row(
        ctx.model_for(span, text(a, "gen_ai.response.model", "gen_ai.request.model")), ENGINE,
        first_reason(a.get("gen_ai.response.finish_reasons")), text(a, "gen_ai.request.id"),
        arrival, scheduled, first, after(first, decode),
        after(arrival, e2e) if e2e is not None else span.end_ns or None,
        count(a, "gen_ai.usage.prompt_tokens", "gen_ai.usage.input_tokens"),
        count(a, "gen_ai.usage.cached_tokens", "gen_ai.usage.cache_read.input_tokens"),
        count(a, "gen_ai.usage.completion_tokens", "gen_ai.usage.output_tokens"))
