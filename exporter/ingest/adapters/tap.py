"""The stream tap's records as OTLP spans: the shape ``phasewatch tap --otlp-endpoint``
sends (``attributes``) and reads back here (``convert``).

A tap in a fleet sends its records through the OpenTelemetry Collector, whose
load-balancing exporter (``routing_key: traceID``) routes each to the replica that holds
the engine's spans of the same trace, where the trace join pairs them. One span per
choice of a request:

* trace and span id: the ``traceparent`` the tap sent upstream, so the engine's request
  span is this span's child (the trace reads caller -> tap -> engine in Jaeger or Tempo);
  a further choice (n > 1) is a child span of the first, ``phasewatch.choice`` >= 1;
* kind CLIENT (the tap calls the server), name ``{gen_ai.operation.name} {model}``, start
  = the request's arrival at the tap, end = its last byte;
* the OpenTelemetry GenAI attributes any tracing backend reads: ``gen_ai.operation.name``,
  ``gen_ai.request.model``, ``gen_ai.usage.input_tokens`` / ``output_tokens`` /
  ``cache_read.input_tokens``, ``gen_ai.response.finish_reasons``,
  ``gen_ai.response.time_to_first_chunk`` (seconds);
* phasewatch's own: ``phasewatch.source`` = ``tap`` (what makes it this adapter's),
  ``phasewatch.engine`` (the records' engine label, ``--engine``), and every emission's
  time as nanoseconds after the span's start (``phasewatch.emission_offsets_ns``) with
  the tokens each carried where the server said (``phasewatch.emission_tokens``): ITL
  per emission and per token, as the gRPC path has them.

The row's join key (``record.RequestRecord.trace_parent``) is the tap's injected span:
the span itself for the first choice, its parent for a further one.
"""

from __future__ import annotations

from phasewatch.ingest.adapters.attributes import count, first_reason, seconds, text
from phasewatch.ingest.adapters.contract import Capabilities, Rejected
from phasewatch.ingest.adapters.rows import row
from phasewatch.requests.record import NS, SOURCE_TAP

ENGINE = "tap"
SOURCE = SOURCE_TAP  # the rows' side in the trace join
CAPABILITIES = Capabilities(source=SOURCE)  # its rows are the join's tap side (``join_key``)
MARK = "phasewatch.source"
OPERATIONS = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion"}
MAX_EMISSIONS = 1 << 20  # one span's emission times: a million tokens is already absurd


# its spans' names (``tap.otlp_out.to_span``: "{operation} {model}"): read before the
# mark, since the mark of a span whose attributes are decoded lazily (vLLM's
# llm_request, every one of an engine's exports) would decode them all (issue 41: a
# third of the OTLP ingest's time)
NAME_PREFIXES = tuple(f"{operation} " for operation in OPERATIONS.values())


def matches(span) -> bool:
    return span.name.startswith(NAME_PREFIXES) and span.attributes.get(MARK) == "tap"


def attributes(model: str, record: dict, engine: str, operation: str) -> dict:
    """The span attributes of one tap record (``PhasewatchClient.record`` keywords,
    times in Unix seconds); the span starts at ``record["arrival"]``."""
    start = record["arrival"]
    out: dict = {MARK: "tap", "phasewatch.engine": engine, "gen_ai.operation.name": operation,
                 "gen_ai.request.model": model}
    for key, field in (("gen_ai.usage.input_tokens", "prompt_tokens"),
                       ("gen_ai.usage.cache_read.input_tokens", "cached_prompt_tokens"),
                       ("gen_ai.usage.output_tokens", "output_tokens")):
        if record.get(field) is not None:
            out[key] = int(record[field])
    if record.get("finish_reason"):
        out["gen_ai.response.finish_reasons"] = [record["finish_reason"]]
    if record.get("first_token") is not None:
        out["gen_ai.response.time_to_first_chunk"] = record["first_token"] - start
    times = record.get("token_times")
    if times:
        start_ns = round(start * NS)
        out["phasewatch.emission_offsets_ns"] = [round(t * NS) - start_ns for t in times]
        if record.get("token_counts"):
            out["phasewatch.emission_tokens"] = [int(n) for n in record["token_counts"]]
    if record.get("choice"):
        out["phasewatch.choice"] = int(record["choice"])
    return out


def join_key(span) -> str:
    """The tap's injected traceparent ("<trace id>-<span id>"): the span's own id, or its
    parent's for a further choice."""
    choice = span.attributes.get("phasewatch.choice") or 0
    own = span.parent_span_id if choice else span.span_id
    return f"{span.trace_id.hex()}-{own.hex()}" if len(own) == 8 and any(own) else ""


def convert(span, ctx) -> tuple:
    a = span.attributes
    start, end = span.start_ns, span.end_ns
    offsets = a.get("phasewatch.emission_offsets_ns")
    times = None
    if offsets is not None:
        if (not isinstance(offsets, list) or len(offsets) > MAX_EMISSIONS
                or not all(type(o) is int and 0 <= o <= end - start for o in offsets)):
            raise Rejected("bad_emission_times")
        times = [start + o for o in offsets] or None
    tokens = a.get("phasewatch.emission_tokens")
    if tokens is not None and (not isinstance(tokens, list) or times is None
                               or len(tokens) != len(times)
                               or not all(type(n) is int and n >= 0 for n in tokens)):
        raise Rejected("bad_emission_tokens")
    ttfc = seconds(a, "gen_ai.response.time_to_first_chunk")
    first = times[0] if times else (start + round(ttfc * NS) if ttfc is not None else None)
    choice = a.get("phasewatch.choice") or 0
    if type(choice) is not int or choice < 0:
        raise Rejected("bad_choice")
    engine = text(a, "phasewatch.engine") or ENGINE
    return (*row(ctx.model_for(span, text(a, "gen_ai.request.model")), engine,
                 first_reason(a.get("gen_ai.response.finish_reasons")), "", start, None,
                 first, times[-1] if times else None, end,
                 count(a, "gen_ai.usage.input_tokens"),
                 count(a, "gen_ai.usage.cache_read.input_tokens"),
                 count(a, "gen_ai.usage.output_tokens"), token_times=times),
            tokens or None, join_key(span), choice)
