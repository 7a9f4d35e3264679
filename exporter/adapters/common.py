"""What every span adapter shares: typed attribute reads, the model rule, the row shape.

A span that looks like a request but cannot be used raises ``Rejected(reason)``;
the receiver counts it and reports it in ``partial_success``. Rows are
``record.ROW_FIELDS`` tuples with integer Unix nanosecond times.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

NS = 1_000_000_000


class Rejected(ValueError):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def seconds(attrs: dict, key: str) -> float | None:
    """A latency attribute in seconds: a finite, non-negative number, or absent."""
    v = attrs.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise Rejected("bad_attribute_type", f"{key} must be a number, got {type(v).__name__}")
    if not math.isfinite(v):
        raise Rejected("bad_attribute_value", f"{key} is {v}")
    if v < 0:
        raise Rejected("negative_duration", f"{key} = {v}")
    return float(v)


def count(attrs: dict, *keys: str) -> int | None:
    """A token count from the first of ``keys`` present: a non-negative integer."""
    for key in keys:
        v = attrs.get(key)
        if v is None:
            continue
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise Rejected("bad_attribute_type",
                           f"{key} must be an integer, got {type(v).__name__}")
        if v < 0:
            raise Rejected("negative_token_count", f"{key} = {v}")
        return v
    return None


def text(attrs: dict, *keys: str) -> str:
    for key in keys:
        v = attrs.get(key)
        if isinstance(v, str) and v:
            return v
    return ""


def first_reason(value) -> str:
    """A finish reason from a string, a list of strings, or a JSON list in a string."""
    if isinstance(value, list):
        return str(value[0]) if value else ""
    if isinstance(value, str) and value.startswith("["):
        import json

        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            return value
        return str(parsed[0]) if isinstance(parsed, list) and parsed else ""
    return value if isinstance(value, str) else ""


def after(t: int | None, s: float | None) -> int | None:
    """``t`` (ns) plus ``s`` seconds, or None when either is unknown."""
    if t is None or s is None:
        return None
    return t + round(s * NS)


@dataclass
class AdapterContext:
    """Configuration the adapters consult: how to name the model of a span.

    The model is, in order: the span's own ``gen_ai.response.model`` /
    ``gen_ai.request.model``; the resource's ``service.name`` looked up in
    ``service_models`` (``--otlp-model-map svc=model,...``); ``default_model``
    (``--default-model``, else the one configured roofline model); the resource's
    ``service.name`` unless it is the SDK's ``unknown_service`` placeholder; else
    ``unknown``. vLLM V1 sets no model attribute, so one of the later rules names it.
    """

    default_model: str = ""
    service_models: dict[str, str] = field(default_factory=dict)
    tgi_links: object = None  # adapters.tgi.TgiLinks, set by the receiver

    def model_for(self, span, attribute_model: str = "") -> str:
        if attribute_model:
            return attribute_model
        service = span.resource.get("service.name")
        service = service if isinstance(service, str) else ""
        if service in self.service_models:
            return self.service_models[service]
        if self.default_model:
            return self.default_model
        if service and not service.startswith("unknown_service"):
            return service
        return "unknown"


# Servers derive each latency attribute from the same few timestamps, but each float
# is rounded on its own: e2e and prefill + decode may disagree by a few nanoseconds.
# Within this much, a later time that lands before an earlier one is the same instant.
ROUNDING_NS = 1000


def row(model: str, engine: str, finish_reason: str, request_id: str, arrival, scheduled,
        first_token, last_token, finish, prompt, cached, output) -> tuple:
    times = [arrival, scheduled, first_token, last_token, finish]
    latest = None
    for i, t in enumerate(times):
        if t is None:
            continue
        if latest is not None and latest - ROUNDING_NS <= t < latest:
            times[i] = t = latest
        latest = t if latest is None else max(latest, t)
    return (model, engine, finish_reason, request_id, *times, prompt, cached, output, None)


def latency_row(span, ctx: AdapterContext, engine: str) -> tuple:
    """A row from the ``gen_ai.latency.*`` attributes vLLM and SGLang share (float seconds
    from the span's start = arrival). Scheduled is first token - prefill when both are
    sent (exact), else arrival + ``time_in_queue`` when that is (vLLM V0)."""
    a = span.attributes
    ttft = seconds(a, "gen_ai.latency.time_to_first_token")
    e2e = seconds(a, "gen_ai.latency.e2e")
    queue = seconds(a, "gen_ai.latency.time_in_queue")
    prefill = seconds(a, "gen_ai.latency.time_in_model_prefill")
    decode = seconds(a, "gen_ai.latency.time_in_model_decode")
    if ttft is None and e2e is None:
        raise Rejected("no_latency_attributes", f"{span.name!r} without time_to_first_token "
                       "or e2e")
    arrival = span.start_ns or None
    first = after(arrival, ttft)
    scheduled = (first - round(prefill * NS) if first is not None and prefill is not None
                 else after(arrival, queue))
    return row(
        ctx.model_for(span, text(a, "gen_ai.response.model", "gen_ai.request.model")), engine,
        first_reason(a.get("gen_ai.response.finish_reasons")), text(a, "gen_ai.request.id"),
        arrival, scheduled, first, after(first, decode),
        after(arrival, e2e) if e2e is not None else span.end_ns or None,
        count(a, "gen_ai.usage.prompt_tokens", "gen_ai.usage.input_tokens"),
        count(a, "gen_ai.usage.cached_tokens", "gen_ai.usage.cache_read.input_tokens"),
        count(a, "gen_ai.usage.completion_tokens", "gen_ai.usage.output_tokens"))
