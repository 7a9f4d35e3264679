"""Hugging Face TGI router request spans (references.md section 1, TGI 3.x).

Request spans are named ``generate``, ``generate_stream``, ``chat_completions``,
``completions`` or ``compat_generate``; their timing fields are Rust ``Duration``
debug strings (``"1.234567ms"``, ``"2.5s"``, ``"850µs"``, ``"12ns"``):
``validation_time``, ``queue_time``, ``inference_time`` (scheduled -> last token,
prefill included), ``total_time``, ``time_per_token`` (= inference_time /
generated tokens, so output tokens = inference / time per token).

TGI has no TTFT field. The first token is known only through the trace: the
request span's ``infer`` child is linked (follows-from) to the ``batch`` span whose
``prefill`` child ran the request's prefill; that prefill's end is the first
token. ``TgiLinks`` remembers recent ``infer`` and ``prefill`` spans (bounded) to
follow the link; without it TTFT, prefill and decode are left out and counted as
unavailable, never approximated.
"""

from __future__ import annotations

import math
import re
import threading
from collections import OrderedDict

from exporter.adapters.common import Rejected, after, row

ENGINE = "tgi"
REQUEST_SPANS = frozenset({"generate", "generate_stream", "chat_completions", "completions",
                           "compat_generate"})
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


class TgiLinks:
    """Recent ``infer`` links and ``prefill`` ends, bounded, to find a request's first token."""

    def __init__(self, capacity: int = 65536):
        self._capacity = capacity
        self._infer: OrderedDict[tuple, list] = OrderedDict()  # request span -> batch spans
        self._prefill: OrderedDict[tuple, int] = OrderedDict()  # batch span -> prefill end
        self._lock = threading.Lock()

    def _put(self, d: OrderedDict, key, value) -> None:
        d[key] = value
        if len(d) > self._capacity:
            d.popitem(last=False)

    def observe(self, span) -> bool:
        """Remember an ``infer`` or ``prefill`` span; True if it was one."""
        if span.name == "infer" and span.parent_span_id and span.links:
            with self._lock:
                self._put(self._infer, (span.trace_id, span.parent_span_id), span.links)
            return True
        if span.name == "prefill" and span.parent_span_id:
            with self._lock:
                self._put(self._prefill, (span.trace_id, span.parent_span_id), span.end_ns)
            return True
        return False

    def first_token(self, span) -> int | None:
        with self._lock:
            batches = self._infer.get((span.trace_id, span.span_id), ())
            ends = [self._prefill[b] for b in batches if b in self._prefill]
        return min(ends) if ends else None


def matches(span) -> bool:
    if span.name not in REQUEST_SPANS:
        return False
    service = span.resource.get("service.name")
    return any(f in span.attributes for f in FIELDS) or (
        isinstance(service, str) and service.startswith("text-generation-inference"))


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
    queued = after(arrival, validation)  # validation (tokenisation) is TGI's preprocess
    scheduled = after(queued or arrival, queue)
    output = round(inference / per_token) if per_token else None
    first = ctx.tgi_links.first_token(span) if ctx.tgi_links else None
    last = after(scheduled, inference)
    if first is not None and (scheduled is None or not scheduled <= first <= (last or first)):
        first = None  # a link to the wrong batch: leave TTFT out rather than invent it
    return row(ctx.model_for(span), ENGINE, "", "", arrival, scheduled, first,
               last, after(arrival, total), None, None,
               output, queued=queued)
