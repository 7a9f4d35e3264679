"""Hugging Face TGI router request spans, as TGI v3.3.7's own code builds them.

Read from TGI's source at v3.3.7 (huggingface/text-generation-inference; the spans of
``tests/fixtures/otlp/engines/tgi-3.3.7-from-source`` follow it, with file and line):

* The handler span (``generate``, ``generate_stream``, ``chat_completions``,
  ``completions``, ``vertex_compatibility``) is the request. It alone carries the
  timing fields, Rust ``Duration`` debug strings (``"1.234567ms"``, ``"850µs"``):
  ``validation_time``, ``queue_time``, ``inference_time`` (scheduled -> last token),
  ``total_time``, ``time_per_token`` (= inference / generated tokens). Same-named
  spans inside it (``infer/mod.rs``) and wrappers (``compat_generate``) carry none and
  are not requests.
* In the request's own trace: ``queued`` (the request waiting in the batching queue,
  enqueue -> scheduled) and one ``send_generation`` per emitted token (its start is
  when the router hands the token to the request's stream). The first of those is
  the first token: TGI sends no TTFT field, but its trace has it. A span closes after
  its children, so they reach the exporter no later than the handler span, and
  ``TraceParts`` holds them until it does.
* Each engine step is a new root ``batch`` trace (``prefill``/``decode`` children),
  linked to the requests' ``infer`` spans. Of a decode step phasewatch reads the
  sharded client's ``decode`` span (``decode_step``): its ``size`` is the requests in
  the forward, its interval the forward, a real decode batch for the roofline.

``send_generation`` carries the generated text (``generation``): it is never read.
Without the child spans (a collector that drops them) TTFT and the token times are
left out and counted as unavailable, never approximated; queue and validation then
come from the fields.
"""

from __future__ import annotations

import math
import re

from phasewatch.ingest.adapters.attributes import after
from phasewatch.ingest.adapters.contract import Capabilities, Rejected
from phasewatch.ingest.adapters.rows import row

ENGINE = "tgi"
# its timeline's child spans (``remember``) and the engine's decode forwards (``decode_step``)
CAPABILITIES = Capabilities(remembers=True, decode_steps=True)
REQUEST_SPANS = frozenset({"generate", "generate_stream", "chat_completions", "completions",
                           "vertex_compatibility"})
FIELDS = ("total_time", "validation_time", "queue_time", "inference_time", "time_per_token")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ns|µs|μs|us|ms|s)\s*$")
_UNIT = {"ns": 1e-9, "µs": 1e-6, "μs": 1e-6, "us": 1e-6, "ms": 1e-3, "s": 1.0}


def parse_duration(value: str) -> float:
    """Seconds from a Rust ``Duration`` debug string; ValueError when it is not one."""
    if not isinstance(value, str):
        raise ValueError(f"a Duration string was expected, got {type(value).__name__}")
    m = _DURATION.match(value)
    if not m:
        raise ValueError(f"not a Rust Duration: {value[:40]!r}")
    seconds = float(m.group(1)) * _UNIT[m.group(2)]
    if not math.isfinite(seconds):
        raise ValueError(f"Duration out of range: {value[:40]!r}")
    return seconds


# child spans remembered for the handler span (``TraceParts`` kinds)
CHILD_SPANS = {"queued": "tgi_queued", "send_generation": "tgi_generation"}


def remember(span, parts) -> bool:
    """Keep the times a request needs from a child span of TGI's router (every router
    span names its Rust module in ``code.namespace``); True if it was one."""
    kind = CHILD_SPANS.get(span.name)
    namespace = span.attributes.get("code.namespace") if kind else None
    if not (isinstance(namespace, str) and namespace.startswith("text_generation_router")):
        return False
    value = (span.start_ns, span.end_ns) if kind == "tgi_queued" else span.start_ns
    parts.add(span.trace_id, kind, span.span_id, value)
    return True


def decode_step(span) -> tuple[int, int, int] | None:
    """(start ns, end ns, requests) of a TGI decode forward (the sharded client's
    ``decode{size}``, one per step whatever the shard count), else None."""
    if span.name != "decode":
        return None
    a = span.attributes
    namespace = a.get("code.namespace")
    if not (isinstance(namespace, str) and namespace.startswith("text_generation_router")
            and namespace.endswith("::sharded_client")):
        return None
    try:
        size = int(a.get("size"))
    except (TypeError, ValueError):
        return None
    if size <= 0 or span.end_ns <= span.start_ns:
        return None
    return span.start_ns, span.end_ns, size


def matches(span) -> bool:
    """A handler span with its fields (the inner same-named spans have none)."""
    return span.name in REQUEST_SPANS and any(f in span.attributes for f in FIELDS)


def _duration(attrs: dict, key: str) -> float | None:
    v = attrs.get(key)
    if v is None:
        return None
    try:
        return parse_duration(v)
    except ValueError as e:
        raise Rejected("bad_duration", f"{key}: {e}") from None


def convert(span, ctx) -> tuple:
    a = span.attributes
    total, inference = _duration(a, "total_time"), _duration(a, "inference_time")
    if total is None or inference is None:
        raise Rejected("no_timing_fields", f"{span.name} span without total/inference time")
    validation = _duration(a, "validation_time")
    queue = _duration(a, "queue_time")
    per_token = _duration(a, "time_per_token")
    arrival = span.start_ns or None
    parts = ctx.trace_parts.take(span.trace_id) if ctx.trace_parts is not None else {}
    waits = parts.get("tgi_queued", [])
    tokens = sorted(parts.get("tgi_generation", []))
    # TGI's own clock starts after chat templating (``start_time``): validation + queue =
    # scheduled - start_time and total = finish - start_time (server.rs)
    if len(waits) == 1:  # the batching queue's own span: exact
        queued, scheduled = waits[0]
        start = (after(scheduled, -(validation + queue)) if None not in (validation, queue)
                 else arrival)
    else:  # validation (tokenisation) is TGI's preprocess; the queue follows it
        queued = after(arrival, validation)
        scheduled = after(queued or arrival, queue)
        start = arrival
    output = round(inference / per_token) if per_token else None
    last = after(scheduled, inference)
    if tokens and (scheduled is None or tokens[0] < scheduled
                   or (output is not None and len(tokens) > output)):
        tokens = []  # emissions that do not fit this request: left out, not guessed
    first = tokens[0] if tokens else None
    if tokens:
        last = tokens[-1]
    return row(ctx.model_for(span), ENGINE, "", "", arrival, scheduled, first,
               last, after(max(start, arrival), total), None, None,
               output, queued=queued, token_times=tokens or None)
