"""SGLang root request spans, named ``"{role} Req {rid[:8]}"`` (references.md section 1).

The role is empty in unified mode, so the name may start with a space. Latencies
are seconds: ``time_to_first_token``, ``time_in_model_prefill``,
``time_in_model_decode``, ``e2e`` (no time in queue: scheduled = first token -
prefill). Finish reasons come as a JSON list in a string.
"""

from __future__ import annotations

import re

from exporter.adapters.common import latency_batch, latency_row

ENGINE = "sglang"
_NAME = re.compile(r"(^|\s)Req [0-9A-Za-z_-]{1,64}$")


def matches(span) -> bool:
    return _NAME.search(span.name) is not None and any(
        k.startswith("gen_ai.latency.") for k in span.attributes)


def convert(span, ctx) -> tuple:
    return latency_row(span, ctx, ENGINE)


def convert_many(spans, ctx):
    """``convert`` for a whole export at once (``latency_batch``)."""
    return latency_batch(spans, ctx, ENGINE)
