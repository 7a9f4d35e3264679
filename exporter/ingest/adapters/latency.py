"""The latency adapter: a request span that carries the ``gen_ai.latency.*`` attributes
(float seconds) and starts at the request's arrival, as vLLM's ``llm_request`` and
SGLang's root do. ``latency_row`` reads one span; ``latency_batch`` a whole export,
column by column, with the same values and the same first rejection reason (tested
against it). An engine whose spans have this shape is ``latency_row`` / ``latency_batch``
under its own span name and engine label (``vllm.py``)."""

from __future__ import annotations

import numpy as np

from phasewatch.ingest.adapters.attributes import (
    MAX_COUNT,
    MAX_LATENCY_S,
    NS,
    after,
    count,
    first_reason,
    seconds,
    text,
)
from phasewatch.ingest.adapters.context import AdapterContext
from phasewatch.ingest.adapters.contract import Rejected
from phasewatch.ingest.adapters.origin import span_columns
from phasewatch.ingest.adapters.rows import ROUNDING_NS, TWO_CLOCK_TOLERANCE_NS, row
from phasewatch.requests.record import UNKNOWN_COUNT, BatchBuilder

SECONDS_KEYS = ("gen_ai.latency.time_to_first_token", "gen_ai.latency.e2e",
                "gen_ai.latency.time_in_queue", "gen_ai.latency.time_in_model_prefill",
                "gen_ai.latency.time_in_model_decode")
# (prompt, cached prompt, output) tokens: each read from the first of its keys present
COUNT_KEYS = (("gen_ai.usage.prompt_tokens", "gen_ai.usage.input_tokens"),
              ("gen_ai.usage.cached_tokens", "gen_ai.usage.cache_read.input_tokens"),
              ("gen_ai.usage.completion_tokens", "gen_ai.usage.output_tokens"))
TOKEN_COLUMNS = ("prompt_tokens", "cached_prompt_tokens", "output_tokens")  # COUNT_KEYS'
TEXT_KEYS = ("gen_ai.response.model", "gen_ai.request.model", "gen_ai.request.id",
             "gen_ai.response.finish_reasons")
# every key latency_batch reads, in order; ``walk`` extracts them for it (``SpanView.values``)
LATENCY_KEYS = (*SECONDS_KEYS, *(k for pair in COUNT_KEYS for k in pair), *TEXT_KEYS)
_PLAIN = frozenset({float, int, type(None)})


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
    ttft, e2e, queue, prefill, decode = (seconds(a, k) for k in SECONDS_KEYS)
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
        *(count(a, *keys) for keys in COUNT_KEYS), queued=queued)


# ---- many latency spans at once ---------------------------------------------------------
# Per span ``latency_batch`` does one attribute read per key in Python; checks and
# arithmetic run in numpy. A span with an unusual value (a string, a NaN sent as a value,
# an int past float range, an out-of-range number) is decided by ``latency_row``.


def latency_batch(spans, ctx: AdapterContext, engine: str):
    """``latency_row`` for every span: a ``RequestBatch`` of the spans it accepts (with
    ``span_columns``), and the reason (``""`` = accepted) of every span, in order."""
    n = len(spans)
    attr = _attribute_columns(spans)
    odd = np.zeros(n, dtype=bool)  # an unusual value: its span is decided by latency_row
    secs = [_number(attr[k], odd) for k in SECONDS_KEYS]
    for a in secs:  # not finite, negative or too long: latency_row's reasons, in its order
        odd |= np.isinf(a) | (a < 0) | (a > MAX_LATENCY_S)
    counts = {}  # token column -> tokens, NaN = absent
    for name, (key, fallback) in zip(TOKEN_COLUMNS, COUNT_KEYS, strict=True):
        a, b = _number(attr[key], odd), _number(attr[fallback], odd)
        c = counts[name] = np.where(np.isnan(a), b, a)
        odd |= (c < 0) | (c != np.floor(c)) & ~np.isnan(c) | (c >= MAX_COUNT)
    ttft, e2e = secs[:2]
    odd |= np.isnan(ttft) & np.isnan(e2e)
    reasons = [""] * n
    for i in np.flatnonzero(odd).tolist():
        reasons[i] = _reason_for(spans[i], ctx, engine)
    ok = np.array([r == "" for r in reasons], dtype=bool) if odd.any() else np.ones(n, bool)

    arrival = np.array([s.start_ns for s in spans], dtype=np.int64)
    times = _timeline(arrival, np.array([s.end_ns for s in spans], dtype=np.int64), *secs)
    _snap_rounding(times)
    shared = _shared_prompts(ctx, attr["gen_ai.request.id"], ok, arrival,
                             counts["prompt_tokens"])
    b = span_columns(BatchBuilder(n), spans, ctx.pods, ctx.sampling)
    b.text(model=_models(spans, attr, ctx),
           finish_reason=("" if v is None else first_reason(v)
                          for v in attr["gen_ai.response.finish_reasons"]),
           request_id=(v if type(v) is str else "" for v in attr["gen_ai.request.id"]))
    b.columns(engine=np.full(n, b.ref(engine)), prompt_shared=shared, **times,
              **{k: np.where(ok & ~np.isnan(c), c, UNKNOWN_COUNT) for k, c in counts.items()})
    return b.tolerance(TWO_CLOCK_TOLERANCE_NS).build().take(ok), reasons


def _attribute_columns(spans) -> dict[str, tuple]:
    """Each of ``LATENCY_KEYS`` -> its value on every span (None = absent): the values
    ``walk`` extracted, else read from the attributes."""
    rows = [s.values if s.values is not None else [s.attributes.get(k) for k in LATENCY_KEYS]
            for s in spans]
    columns = zip(*rows, strict=True) if rows else [()] * len(LATENCY_KEYS)
    return dict(zip(LATENCY_KEYS, columns, strict=True))


def _number(col: tuple, odd: np.ndarray) -> np.ndarray:
    """One numeric attribute of every span, NaN = absent; spans with an odd value (another
    type, an int past float range, a NaN sent as a value) marked in ``odd``."""
    try:
        if not set(map(type, col)) <= _PLAIN:
            raise TypeError
        a = np.array(col, dtype=np.float64)  # None -> NaN
    except (TypeError, OverflowError):  # other types, or ints past float range
        plain = [type(v) in _PLAIN and (type(v) is not int or abs(v) < 1e300) for v in col]
        a = np.array([v if p else np.nan for v, p in zip(col, plain, strict=True)],
                     dtype=np.float64)
        odd |= ~np.array(plain, dtype=bool)
    nan = np.isnan(a)
    if int(nan.sum()) != col.count(None):  # a NaN sent as a value, not an absence
        odd |= nan & np.array([v is not None for v in col], dtype=bool)
    return a


def _reason_for(span, ctx, engine: str) -> str:
    """The reason ``latency_row`` gives ``span`` (the slow path, for odd values)."""
    try:
        latency_row(span, ctx, engine)
    except Rejected as e:
        return e.reason
    return ""


def _after_ns(t: np.ndarray, s: np.ndarray) -> np.ndarray:
    """t + s seconds, 0 = unknown (as ``after``)."""
    known = (t != 0) & ~np.isnan(s)
    return np.where(known, t + np.round(np.where(known, s, 0) * NS).astype(np.int64), 0)


def _before_ns(t: np.ndarray, s: np.ndarray) -> np.ndarray:
    """t - s seconds, 0 = unknown."""
    known = (t != 0) & ~np.isnan(s)
    return np.where(known, t - np.round(np.where(known, s, 0) * NS).astype(np.int64), 0)


def _timeline(arrival, end, ttft, e2e, queue, prefill, decode) -> dict[str, np.ndarray]:
    """``latency_row``'s times for every span, in the order of the request's life (ns,
    0 = unknown)."""
    with np.errstate(over="ignore", invalid="ignore"):  # only in rows refused already
        first = _after_ns(arrival, ttft)
        engine_chain = (first != 0) & ~np.isnan(prefill)  # as ``latency_row``
        scheduled = np.where(engine_chain, _before_ns(first, prefill),
                             _after_ns(arrival, queue))
        return {"arrival": arrival,
                "queued": np.where(engine_chain, _before_ns(scheduled, queue), 0),
                "scheduled": scheduled, "first_token": first,
                "last_token": _after_ns(first, decode),
                "finish": np.where(~np.isnan(e2e), _after_ns(arrival, e2e), end)}


def _snap_rounding(times: dict[str, np.ndarray]) -> None:
    """As ``row``: a time a rounding's width before an earlier one is that instant."""
    latest = np.zeros(len(times["arrival"]), dtype=np.int64)
    seen = np.zeros(len(latest), dtype=bool)
    for t in times.values():
        known = t != 0
        snap = known & seen & (t < latest) & (t >= latest - ROUNDING_NS)
        t[snap] = latest[snap]
        newer = known & (~seen | (t > latest))
        latest = np.where(newer, t, latest)
        seen |= known


def _shared_prompts(ctx, rid: tuple, ok, arrival, prompts) -> np.ndarray:
    """Parallel sampling's later sequences (one request id, arrival and prompt):
    ``context.ParallelSamples``."""
    shared = np.zeros(len(rid), dtype=bool)
    with_id = [i for i in np.flatnonzero(ok).tolist() if type(rid[i]) is str and rid[i]]
    if with_id:
        starts, prompt = arrival.tolist(), np.nan_to_num(prompts, nan=-1).tolist()
        shared[with_id] = ctx.samples.shared([(rid[i], starts[i], prompt[i])
                                              for i in with_id])
    return shared


def _models(spans, attr: dict, ctx):
    """The model of every span (the model rule, once per resource and attribute name)."""
    models: dict[tuple[int, str], str] = {}

    def model_of(span, resp, req) -> str:
        named = resp if type(resp) is str and resp else req if type(req) is str and req else ""
        key = (id(span.resource), named)
        model = models.get(key)
        if model is None:
            model = models[key] = ctx.model_for(span, named)
        return model

    return map(model_of, spans, attr["gen_ai.response.model"], attr["gen_ai.request.model"])
