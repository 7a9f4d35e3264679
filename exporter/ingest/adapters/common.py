"""What every span adapter shares: typed attribute reads, the model rule, the row shape.

A span that looks like a request but cannot be used raises ``Rejected(reason)``;
the receiver counts it and reports it in ``partial_success``. Rows are
``record.ROW_FIELDS`` tuples with integer Unix nanosecond times; what a row takes from
its span itself (traceparent, tap mark, pod) goes into its batch with
``origin.span_columns``.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from phasewatch.ingest.adapters.origin import span_columns
from phasewatch.requests.record import UNKNOWN_COUNT, BatchBuilder
from phasewatch.requests.sampling import TraceSampling

NS = 1_000_000_000
_MAX_COUNT = 2**53  # token counts exact in float64 (the vectorised path) and int64
MAX_LATENCY_S = 1e8  # ~3 years: longer is not a latency (and could overflow int64 ns)


class Rejected(ValueError):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def seconds(attrs: dict, key: str) -> float | None:
    """A latency attribute in seconds: a finite, non-negative number, or absent."""
    v = attrs.get(key)
    if type(v) is float and 0.0 <= v <= MAX_LATENCY_S:  # the usual case, checked first
        return v
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise Rejected("bad_attribute_type", f"{key} must be a number, got {type(v).__name__}")
    if isinstance(v, int) and abs(v) > 1e300:  # past float range
        raise Rejected("bad_attribute_value", f"{key} is out of range")
    if not math.isfinite(v):
        raise Rejected("bad_attribute_value", f"{key} is {v}")
    if v < 0:
        raise Rejected("negative_duration", f"{key} = {v}")
    if v > MAX_LATENCY_S:
        raise Rejected("bad_attribute_value", f"{key} = {v} s is out of range")
    return float(v)


def count(attrs: dict, *keys: str) -> int | None:
    """A token count from the first of ``keys`` present: a non-negative integer."""
    for key in keys:
        v = attrs.get(key)
        if v is None:
            continue
        if type(v) is int and 0 <= v < _MAX_COUNT:  # the usual case, checked first
            return v
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise Rejected("bad_attribute_type",
                           f"{key} must be an integer, got {type(v).__name__}")
        if v < 0:
            raise Rejected("negative_token_count", f"{key} = {v}")
        if v >= _MAX_COUNT:
            raise Rejected("bad_attribute_value", f"{key} = {v} is out of range")
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
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
            return value
        return str(parsed[0]) if isinstance(parsed, list) and parsed else ""
    return value if isinstance(value, str) else ""


def after(t: int | None, s: float | None) -> int | None:
    """``t`` (ns) plus ``s`` seconds, or None when either is unknown."""
    if t is None or s is None:
        return None
    return t + round(s * NS)


class ParallelSamples:
    """The request spans seen lately, to tell the sequences of one parallel-sampling
    request apart from separate requests. Bounded.

    vLLM answers a request with ``n`` > 1 with n ``llm_request`` spans, one per sequence,
    each in a trace of its own, all with the request's ``gen_ai.request.id``, its
    arrival as start time and the whole prompt's token count, and (vLLM 0.32, measured)
    ``gen_ai.request.n`` = 1 on each: only that shared (id, arrival, prompt) marks them.
    They may arrive in different exports. The first sequence seen carries the prompt;
    the others are marked ``prompt_shared``. The newest ``capacity`` keys are kept: a
    sequence arriving after that many other requests counts its prompt again.
    """

    def __init__(self, capacity: int = 65536):
        self._capacity = capacity
        self._seen: OrderedDict[tuple, None] = OrderedDict()
        self._lock = threading.Lock()

    def shared(self, keys: list[tuple]) -> list[bool]:
        """For each (request id, arrival ns, prompt tokens): was it seen before?"""
        out = []
        with self._lock:
            seen = self._seen
            for key in keys:
                if key in seen:
                    seen.move_to_end(key)
                    out.append(True)
                else:
                    seen[key] = None
                    out.append(False)
            while len(seen) > self._capacity:
                seen.popitem(last=False)
        return out


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
    trace_parts: object = None  # adapters.traces.TraceParts, set by the receiver
    # fill the pod column (``span_columns``): the receiver's sink has a pod label
    pods: bool = False
    samples: ParallelSamples = field(default_factory=ParallelSamples)
    # each request's weight from its trace's sampling (``span_columns``)
    sampling: TraceSampling = field(default_factory=TraceSampling)

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
# vLLM's TTFT and e2e are its API server's wall-clock figures, its queue, prefill and
# decode engine-core monotonic differences (vllm/v1/metrics/stats.py): rebuilt as times,
# the last token can land after the finish (measured -3.6 .. +4.8 ms on an idle CPU
# server; a busy frontend that handles the first output late makes it more). Up to this
# much the request is kept with every duration vLLM's own, and the disagreement is
# counted (phasewatch_clock_skew_seconds); past it the times contradict each other.
TWO_CLOCK_TOLERANCE_NS = 10 * NS


def row(model: str, engine: str, finish_reason: str, request_id: str, arrival, scheduled,
        first_token, last_token, finish, prompt, cached, output, *, queued=None,
        token_times=None) -> tuple:
    """A ``record.ROW_FIELDS`` tuple (times in integer ns, None = unknown)."""
    times = [arrival, queued, scheduled, first_token, last_token, finish]
    latest = None
    for i, t in enumerate(times):
        if t is None:
            continue
        if latest is None or t >= latest:
            latest = t
        elif latest - ROUNDING_NS <= t:
            times[i] = latest
    return (model, engine, finish_reason, request_id, *times, prompt, cached, output,
            token_times)


def latency_row(span, ctx: AdapterContext, engine: str) -> tuple:
    """A row from the ``gen_ai.latency.*`` attributes vLLM and SGLang share (float seconds;
    the span starts at arrival).

    Every duration the server sent is kept exactly: first token = arrival + TTFT and
    finish = arrival + e2e (vLLM's frontend clock); scheduled = first token - prefill,
    queued = scheduled - ``time_in_queue`` and last token = first token + decode (its
    engine core's intervals, hung off the first token). So the engine's queue is vLLM's
    own ``time_in_queue`` (= ``vllm:request_queue_time_seconds``), and what TTFT holds
    beyond queue and prefill (templating, tokenisation, hand-off, the first output's
    trip back) is preprocess. Without a prefill attribute (vLLM V0, whose
    ``time_in_queue`` runs from arrival), scheduled = arrival + ``time_in_queue``."""
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
    engine_chain = first is not None and prefill is not None
    scheduled = first - round(prefill * NS) if engine_chain else after(arrival, queue)
    queued = scheduled - round(queue * NS) if engine_chain and queue is not None else None
    return row(
        ctx.model_for(span, text(a, "gen_ai.response.model", "gen_ai.request.model")), engine,
        first_reason(a.get("gen_ai.response.finish_reasons")), text(a, "gen_ai.request.id"),
        arrival, scheduled, first, after(first, decode),
        after(arrival, e2e) if e2e is not None else span.end_ns or None,
        count(a, "gen_ai.usage.prompt_tokens", "gen_ai.usage.input_tokens"),
        count(a, "gen_ai.usage.cached_tokens", "gen_ai.usage.cache_read.input_tokens"),
        count(a, "gen_ai.usage.completion_tokens", "gen_ai.usage.output_tokens"),
        queued=queued)


# ---- many latency spans at once ---------------------------------------------------------
# ``latency_batch`` is ``latency_row`` over a whole export, column by column: the same
# values, the same rejections with the same first reason, as tested against it. Per span
# it does one attribute read per key in Python; checks and arithmetic run in numpy.
_SECONDS_KEYS = ("gen_ai.latency.time_to_first_token", "gen_ai.latency.e2e",
                 "gen_ai.latency.time_in_queue", "gen_ai.latency.time_in_model_prefill",
                 "gen_ai.latency.time_in_model_decode")
# (prompt, cached prompt, output) tokens: each read from the first of its keys present
COUNT_KEYS = (("gen_ai.usage.prompt_tokens", "gen_ai.usage.input_tokens"),
               ("gen_ai.usage.cached_tokens", "gen_ai.usage.cache_read.input_tokens"),
               ("gen_ai.usage.completion_tokens", "gen_ai.usage.output_tokens"))
TOKEN_COLUMNS = ("prompt_tokens", "cached_prompt_tokens", "output_tokens")  # COUNT_KEYS'
_TEXT_KEYS = ("gen_ai.response.model", "gen_ai.request.model", "gen_ai.request.id",
              "gen_ai.response.finish_reasons")
# every key latency_batch reads, in order; ``walk`` extracts them for it (``SpanView.values``)
LATENCY_KEYS = (*_SECONDS_KEYS, *(k for pair in COUNT_KEYS for k in pair), *_TEXT_KEYS)
_PLAIN = frozenset({float, int, type(None)})


def _reason_for(spans, i: int, engine: str, ctx) -> str:
    """The reason ``latency_row`` gives span ``i`` (the slow path, for odd values)."""
    try:
        latency_row(spans[i], ctx, engine)
    except Rejected as e:
        return e.reason
    return ""


def latency_batch(spans, ctx: AdapterContext, engine: str):
    """``latency_row`` for every span: a ``RequestBatch`` of the spans it accepts (with
    ``span_columns``), and the reason (``""`` = accepted) of every span, in order."""
    n = len(spans)
    rows = [s.values if s.values is not None else [s.attributes.get(k) for k in LATENCY_KEYS]
            for s in spans]
    attr = dict(zip(LATENCY_KEYS, zip(*rows, strict=True) if n else [()] * len(LATENCY_KEYS),
                    strict=True))
    odd = np.zeros(n, dtype=bool)  # an unusual value: its span is decided by latency_row

    def number(key: str) -> np.ndarray:
        """One numeric attribute of every span, NaN = absent; odd values marked."""
        col = attr[key]
        try:
            if not set(map(type, col)) <= _PLAIN:
                raise TypeError
            a = np.array(col, dtype=np.float64)  # None -> NaN
        except (TypeError, OverflowError):  # other types, or ints past float range
            plain = [type(v) in _PLAIN and (type(v) is not int or abs(v) < 1e300) for v in col]
            a = np.array([v if p else np.nan for v, p in zip(col, plain, strict=True)],
                         dtype=np.float64)
            odd[:] |= ~np.array(plain, dtype=bool)
        nan = np.isnan(a)
        if int(nan.sum()) != col.count(None):  # a NaN sent as a value, not an absence
            odd[:] |= nan & np.array([v is not None for v in col], dtype=bool)
        return a

    ttft, e2e, queue, prefill, decode = secs = [number(k) for k in _SECONDS_KEYS]
    for a in secs:  # not finite, negative or too long: latency_row's reasons, in its order
        odd |= np.isinf(a) | (a < 0) | (a > MAX_LATENCY_S)
    counts = {}  # token column -> tokens, NaN = absent
    for name, (key, fallback) in zip(TOKEN_COLUMNS, COUNT_KEYS, strict=True):
        a, b = number(key), number(fallback)
        c = counts[name] = np.where(np.isnan(a), b, a)
        odd |= (c < 0) | (c != np.floor(c)) & ~np.isnan(c) | (c >= _MAX_COUNT)
    odd |= np.isnan(ttft) & np.isnan(e2e)
    reasons = [""] * n
    for i in np.flatnonzero(odd).tolist():
        reasons[i] = _reason_for(spans, i, engine, ctx)
    ok = np.array([r == "" for r in reasons], dtype=bool) if odd.any() else np.ones(n, bool)

    arrival = np.array([s.start_ns for s in spans], dtype=np.int64)
    end = np.array([s.end_ns for s in spans], dtype=np.int64)

    def after_ns(t: np.ndarray, s: np.ndarray) -> np.ndarray:  # 0 = unknown, as ``after``
        known = (t != 0) & ~np.isnan(s)
        return np.where(known, t + np.round(np.where(known, s, 0) * NS).astype(np.int64), 0)

    def before_ns(t: np.ndarray, s: np.ndarray) -> np.ndarray:  # t - s, 0 = unknown
        known = (t != 0) & ~np.isnan(s)
        return np.where(known, t - np.round(np.where(known, s, 0) * NS).astype(np.int64), 0)

    with np.errstate(over="ignore", invalid="ignore"):  # only in rows refused above
        first = after_ns(arrival, ttft)
        engine_chain = (first != 0) & ~np.isnan(prefill)  # as ``latency_row``
        scheduled = np.where(engine_chain, before_ns(first, prefill), after_ns(arrival, queue))
        times = {"arrival": arrival,  # in the order of the request's life
                 "queued": np.where(engine_chain, before_ns(scheduled, queue), 0),
                 "scheduled": scheduled, "first_token": first,
                 "last_token": after_ns(first, decode),
                 "finish": np.where(~np.isnan(e2e), after_ns(arrival, e2e), end)}
    latest = np.zeros(n, dtype=np.int64)  # as ``row``: rounding-level disorder is one instant
    seen = np.zeros(n, dtype=bool)
    for t in times.values():
        known = t != 0
        snap = known & seen & (t < latest) & (t >= latest - ROUNDING_NS)
        t[snap] = latest[snap]
        newer = known & (~seen | (t > latest))
        latest = np.where(newer, t, latest)
        seen |= known

    rid = attr["gen_ai.request.id"]
    with_id = [i for i in np.flatnonzero(ok).tolist() if type(rid[i]) is str and rid[i]]
    shared = np.zeros(n, dtype=bool)
    if with_id:  # parallel sampling's sequences: one request id, arrival and prompt
        starts, prompts = arrival.tolist(), np.nan_to_num(counts["prompt_tokens"],
                                                          nan=-1).tolist()
        shared[with_id] = ctx.samples.shared([(rid[i], starts[i], prompts[i])
                                              for i in with_id])
    models: dict[tuple[int, str], str] = {}  # the model rule, once per resource and name

    def model_of(span, resp, req) -> str:
        named = resp if type(resp) is str and resp else req if type(req) is str and req else ""
        key = (id(span.resource), named)
        model = models.get(key)
        if model is None:
            model = models[key] = ctx.model_for(span, named)
        return model

    b = span_columns(BatchBuilder(n), spans, ctx.pods, ctx.sampling)
    b.text(model=map(model_of, spans, attr["gen_ai.response.model"],
                     attr["gen_ai.request.model"]),
           finish_reason=("" if v is None else first_reason(v)
                          for v in attr["gen_ai.response.finish_reasons"]),
           request_id=(v if type(v) is str else "" for v in rid))
    b.columns(engine=np.full(n, b.ref(engine)), prompt_shared=shared, **times,
              **{k: np.where(ok & ~np.isnan(c), c, UNKNOWN_COUNT) for k, c in counts.items()})
    return b.tolerance(TWO_CLOCK_TOLERANCE_NS).build().take(ok), reasons
