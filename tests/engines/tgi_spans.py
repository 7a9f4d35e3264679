"""OTLP spans shaped exactly as Hugging Face TGI v3.3.7 emits them, with known ground truth.

TGI cannot run here (a Rust router plus a Python/CUDA shard, no wheel, no GPU), so this
reproduces, from a reading of TGI's own source at the v3.3.7 tag (commit
``dfb3fbe78e0d1d69251bd33065591c61bafdfaa8``), the spans its router and its shard export
for a small scripted workload, and writes them as the raw ``ExportTraceServiceRequest``
bytes the exporters would send. The facts it relies on, each with file:line, are in
``tests/fixtures/otlp/engines/tgi-3.3.7-from-source/README.md``; the code cites them too.

Run with the main virtualenv (it has ``opentelemetry-sdk`` and the OTLP encoder)::

    .venv/bin/python tests/engines/tgi_spans.py            # rewrite the fixture
    .venv/bin/python tests/engines/tgi_spans.py --check    # fail if the fixture differs

Everything is deterministic: fixed times (from ``T0``), ids from SHA-256 of a counter.

How the spans are produced (so that span ends are right, not guessed): a small model of
``tracing``'s registry. A span closes when its last handle is dropped *and* all its
children are closed (tracing-subscriber 0.3.19 registry/sharded.rs:237-243 takes a
reference on the parent for every child, :505-516 releases it when the child closes);
``tracing-opentelemetry`` 0.21 (layer.rs:671-727, :902-929) then starts the OTel span at
the tracing span's creation time and ends it at that close. The workload is replayed
through TGI's batching loop (backends/v3/src/backend.rs:129-294, queue.rs:237-504) in
its two modes: ``chunking`` (``support_chunking``: flashinfer/flashdecoding with
PREFILL_CHUNKING=1, the CUDA default) and ``no_chunking`` (paged attention, speculation,
or PREFILL_CHUNKING=0): six requests in the first, the first four in the second.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

TGI_TAG = "v3.3.7"
TGI_COMMIT = "dfb3fbe78e0d1d69251bd33065591c61bafdfaa8"
OUT = Path(__file__).resolve().parents[1] / "fixtures/otlp/engines/tgi-3.3.7-from-source"

# The launcher's default --otlp-service-name, passed to the router *and* the shards
# (launcher/src/main.rs:842-843, :1029-1031, :1936-1938).
SERVICE_NAME = "text-generation-inference.router"
# opentelemetry-otlp 0.13.0 span.rs:197-202: versioned_tracer("opentelemetry-otlp",
# CARGO_PKG_VERSION, SCHEMA_URL) with opentelemetry-semantic-conventions 0.12.0's URL.
RUST_SCOPE = InstrumentationScope(
    "opentelemetry-otlp", "0.13.0", "https://opentelemetry.io/schemas/1.21.0")
# router/src/logging.rs:100-103: Resource::new([service.name]) replaces the SDK default
# resource (opentelemetry_sdk 0.20 trace/config.rs:83-84): nothing else is sent.
RUST_RESOURCE = Resource({"service.name": SERVICE_NAME})
# server/text_generation_server/tracing.py:57: Resource.create(service.name) merges the
# Python SDK's telemetry.sdk.* (server/requirements_cuda.txt pins opentelemetry-sdk 1.33.0).
PY_RESOURCE = Resource({
    "telemetry.sdk.language": "python",
    "telemetry.sdk.name": "opentelemetry",
    "telemetry.sdk.version": "1.33.0",
    "service.name": SERVICE_NAME,
})
PY_SCOPE_SERVER = InstrumentationScope("text_generation_server.tracing")
PY_SCOPE_MODEL = InstrumentationScope("text_generation_server.models.flash_causal_lm")

T0 = 1_763_683_200_000_000_000  # 2025-11-21T00:00:00Z, the workload's time origin
US = 1_000
MS = 1_000_000

# Router settings of the scripted server (launcher defaults where they matter:
# waiting_served_ratio 0.3, max_waiting_tokens 20, launcher/src/main.rs:707-708, :754-755).
MAX_BATCH_PREFILL_TOKENS = 4096
MAX_BATCH_TOTAL_TOKENS = 2048  # small, so that R5 waits for KV blocks
WAITING_SERVED_RATIO = 0.3
MAX_WAITING_TOKENS = 20

# The two BatchSpanProcessors' 5 s timers (Rust: opentelemetry_sdk 0.20
# span_processor.rs:57; Python: OTEL_BSP_SCHEDULE_DELAY 5000 ms) are phased so that a tick
# falls inside the workload: spans of one request arrive in two exports.
RUST_TICK = T0 + 60 * MS
PY_TICK = T0 + 90 * MS
TICK_PERIOD = 5_000 * MS

CANARY_OUTPUT = "PWGEN"  # in every generated token text; phasewatch must store none
CANARY_PROMPT = "PWPROMPT"  # in prompt tokens echoed by send_generation (decoder_input_details)


# --------------------------------------------------------------------------------------
# Rust formatting


def rust_duration(ns: int) -> str:
    """``format!("{:?}", Duration)`` (core::time::Duration's Debug, no precision given).

    Seconds when >= 1 s, else ms when >= 1 ms, else µs (U+00B5) when >= 1 µs, else ns; the
    fraction is printed in full with trailing zeros dropped ("1.5s", "1.234567ms", "850µs").
    """
    if ns < 0:
        raise ValueError("Duration is unsigned")
    for unit, scale in (("s", 1_000_000_000), ("ms", 1_000_000), ("µs", 1_000)):
        if ns >= scale:
            whole, frac = divmod(ns, scale)
            digits = len(str(scale)) - 1
            frac_s = f"{frac:0{digits}d}".rstrip("0")
            return f"{whole}.{frac_s}{unit}" if frac_s else f"{whole}{unit}"
    return f"{ns}ns"


def rust_str(s: str) -> str:
    """``{:?}`` of a Rust &str (quotes, backslash escapes; printable non-ASCII kept)."""
    out = ['"']
    for ch in s:
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif ord(ch) < 0x20:
            out.append(f"\\u{{{ord(ch):x}}}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def rust_f32(x: float) -> str:
    """``{:?}`` of an f32 holding a short dyadic value (the only kind used here)."""
    if x != x:
        return "NaN"
    if x == int(x):
        return f"{int(x)}.0"
    return repr(x)


def rust_opt(v) -> str:
    return "None" if v is None else f"Some({v})"


def generate_parameters_debug(*, do_sample: bool, max_new_tokens: int | None, details: bool,
                              decoder_input_details: bool = False, temperature=None,
                              seed=None) -> str:
    """``{:?}`` of router/src/lib.rs:303 ``GenerateParameters`` (field order as declared)."""
    fields = [
        ("best_of", "None"), ("temperature", rust_opt(temperature)),
        ("repetition_penalty", "None"), ("frequency_penalty", "None"), ("top_k", "None"),
        ("top_p", "None"), ("typical_p", "None"), ("do_sample", str(do_sample).lower()),
        ("max_new_tokens", rust_opt(max_new_tokens)), ("return_full_text", "None"),
        ("stop", "[]"), ("truncate", "None"), ("watermark", "false"),
        ("details", str(details).lower()),
        ("decoder_input_details", str(decoder_input_details).lower()),
        ("seed", rust_opt(seed)), ("top_n_tokens", "None"), ("grammar", "None"),
        ("adapter_id", "None"),
    ]
    return "GenerateParameters { " + ", ".join(f"{k}: {v}" for k, v in fields) + " }"


def tokens_debug(ids, logprobs, texts, is_special) -> str:
    """``{:?}`` of prost ``Tokens`` (proto/v3/generate.proto)."""
    return ("Tokens { ids: [" + ", ".join(str(i) for i in ids) + "], logprobs: ["
            + ", ".join(rust_f32(x) for x in logprobs) + "], texts: ["
            + ", ".join(rust_str(t) for t in texts) + "], is_special: ["
            + ", ".join(str(b).lower() for b in is_special) + "] }")


FINISH_DEBUG = {"length": "Length", "eos_token": "EosToken", "stop_sequence": "StopSequence"}


# --------------------------------------------------------------------------------------
# A model of tracing's registry + tracing-opentelemetry 0.21's layer


@dataclass(frozen=True)
class Site:
    """A span's callsite: tracing-opentelemetry adds code.* from it (layer.rs:696-710)."""

    module: str
    file: str
    line: int


SERVER = "text_generation_router::server"
INFER = "text_generation_router::infer"
VALIDATION = "text_generation_router::validation"
BACKEND = "text_generation_router_v3::backend"
QUEUE = "text_generation_router_v3::queue"
SHARDED = "text_generation_router_v3::client::sharded_client"
GRPC = "text_generation_router_v3::client::grpc_client"

# #[instrument] spans carry the attribute's line (tracing-attributes 0.1.28 expand.rs:226
# builds span! with quote!, i.e. the call site); info_span! spans the macro's line.
SITES = {
    "generate": Site(SERVER, "router/src/server.rs", 261),
    "generate_stream": Site(SERVER, "router/src/server.rs", 464),
    "completions": Site(SERVER, "router/src/server.rs", 703),
    "chat_completions": Site(SERVER, "router/src/server.rs", 1156),
    "async_stream": Site(SERVER, "router/src/server.rs", 555),
    "infer.generate_stream": Site(INFER, "router/src/infer/mod.rs", 99),
    "infer.generate": Site(INFER, "router/src/infer/mod.rs", 244),
    "apply_chat_template": Site(INFER, "router/src/infer/mod.rs", 226),
    "validate": Site(VALIDATION, "router/src/validation.rs", 203),
    "validate_input": Site(VALIDATION, "router/src/validation.rs", 132),
    "tokenize": Site(VALIDATION, "router/src/validation.rs", 104),
    "schedule": Site(BACKEND, "backends/v3/src/backend.rs", 78),
    "append": Site(QUEUE, "backends/v3/src/queue.rs", 75),
    "queued": Site(QUEUE, "backends/v3/src/queue.rs", 228),
    "next_batch": Site(QUEUE, "backends/v3/src/queue.rs", 85),
    "batch.queue": Site(QUEUE, "backends/v3/src/queue.rs", 268),
    "infer.queue": Site(QUEUE, "backends/v3/src/queue.rs", 427),
    "waiting": Site(BACKEND, "backends/v3/src/backend.rs", 243),
    "batch.decode": Site(BACKEND, "backends/v3/src/backend.rs", 274),
    "infer.decode": Site(BACKEND, "backends/v3/src/backend.rs", 277),
    "prefill": Site(BACKEND, "backends/v3/src/backend.rs", 296),
    "decode": Site(BACKEND, "backends/v3/src/backend.rs", 341),
    "filter_batch": Site(BACKEND, "backends/v3/src/backend.rs", 388),
    "filter_send_generations": Site(BACKEND, "backends/v3/src/backend.rs", 422),
    "send_generation": Site(BACKEND, "backends/v3/src/backend.rs", 433),
    "sharded.prefill": Site(SHARDED, "backends/v3/src/client/sharded_client.rs", 141),
    "sharded.decode": Site(SHARDED, "backends/v3/src/client/sharded_client.rs", 175),
    "sharded.filter_batch": Site(SHARDED, "backends/v3/src/client/sharded_client.rs", 84),
    "sharded.clear_cache": Site(SHARDED, "backends/v3/src/client/sharded_client.rs", 73),
    "grpc.prefill": Site(GRPC, "backends/v3/src/client/grpc_client.rs", 229),
    "grpc.decode": Site(GRPC, "backends/v3/src/client/grpc_client.rs", 257),
    "grpc.filter_batch": Site(GRPC, "backends/v3/src/client/grpc_client.rs", 90),
    "grpc.clear_cache": Site(GRPC, "backends/v3/src/client/grpc_client.rs", 82),
}
SUCCESS_SITE = Site(SERVER, "router/src/server.rs", 432)  # tracing::info!("Success")

# tokio worker threads ("tokio-runtime-worker"); ids as ThreadId's integer (layer.rs:712-720)
BATCHING_THREAD = 9
QUEUE_THREAD = 11


@dataclass(eq=False)
class TSpan:
    """One tracing span as the OTel layer sees it."""

    name: str
    site: Site
    parent: TSpan | None
    start: int
    thread: int
    span_id: int
    trace_id: int
    attrs: dict = field(default_factory=dict)
    links: list = field(default_factory=list)
    events: list = field(default_factory=list)
    refs: int = 1  # handles + live children (registry)
    last: int = 0  # time of the latest reference drop
    handles_end: int = 0  # time of the latest handle (not child) drop
    end: int | None = None
    entered: str = "async"  # "async": polled inside; "sync": entered for its life; "never"
    busy: int | None = None
    seq: int = 0


class Registry:
    """Spans, refcounts and closes; ids derived from the scenario name and a counter."""

    def __init__(self, scenario: str):
        self.scenario = scenario
        self.n = 0
        self.spans: list[TSpan] = []

    def _id(self, kind: str, nbytes: int) -> int:
        self.n += 1
        digest = hashlib.sha256(f"tgi-3.3.7:{self.scenario}:{kind}:{self.n}".encode()).digest()
        return int.from_bytes(digest[:nbytes], "big") or 1

    def new(self, name: str, site_key: str, t: int, parent: TSpan | None, thread: int,
            fields: dict | None = None, entered: str = "async") -> TSpan:
        if parent is not None:
            if parent.end is not None:
                raise AssertionError(f"{name}: parent {parent.name} already closed")
            parent.refs += 1
            trace_id = parent.trace_id
        else:
            trace_id = self._id("trace", 16)  # layer.rs:688-691: a root gets a new trace id
        site = SITES[site_key]
        attrs = {
            "code.filepath": site.file,
            "code.namespace": site.module,
            "code.lineno": site.line,
            "thread.id": thread,
            "thread.name": "tokio-runtime-worker",
        }
        attrs.update(fields or {})
        span = TSpan(name, site, parent, t, thread, self._id("span", 8), trace_id, attrs,
                     entered=entered, last=t, seq=len(self.spans))
        self.spans.append(span)
        return span

    @staticmethod
    def record(span: TSpan, key: str, value) -> None:
        if span.end is not None:
            raise AssertionError(f"record on closed {span.name}")
        span.attrs[key] = value

    @staticmethod
    def follows_from(span: TSpan, other: TSpan) -> None:
        """``span.follows_from(other)``: a link ON span pointing TO other (layer.rs:774-800)."""
        span.links.append(other)

    @staticmethod
    def event(span: TSpan, t: int, message: str, site: Site, level: str = "INFO") -> None:
        """An event inside ``span`` (layer.rs:811-899): name = message, level/target/code.*."""
        span.events.append((t, message, {
            "level": level,
            "target": site.module,
            "code.filepath": site.file,
            "code.namespace": site.module,
            "code.lineno": site.line,
        }))

    def drop(self, span: TSpan, t: int, child: bool = False) -> None:
        """Drop one handle (or one child) at ``t``; close when nothing holds the span."""
        if span.end is not None or span.refs <= 0:
            raise AssertionError(f"drop of closed {span.name}")
        span.refs -= 1
        span.last = max(span.last, t)
        if not child:
            span.handles_end = max(span.handles_end, t)
        if span.refs == 0:
            span.end = span.last
            if span.parent is not None:  # the close cascades upwards
                self.drop(span.parent, span.end + 1 * US, child=True)

    def check_closed(self) -> None:
        left = [s.name for s in self.spans if s.end is None]
        if left:
            raise AssertionError(f"spans never closed: {left}")


# --------------------------------------------------------------------------------------
# The workload


@dataclass
class Req:
    label: str
    path: str
    handler: str  # the handler span's name
    stream: bool
    arrival_ms: float
    prompt_tokens: int
    max_new_tokens: int
    output_tokens: int
    finish: str  # length | eos_token
    seed: int | None  # None: greedy (Python sends seed only when do_sample)
    thread: int
    note: str
    # filled by the simulation
    spans: dict = field(default_factory=dict)
    queue_id: int = -1
    start_time: int = 0  # TGI's start_time Instant
    queued: int = 0  # entry.queue_time
    queued_cmd: int = 0  # when the queue task has appended it
    batch_time: int | None = None
    tokens: list = field(default_factory=list)
    end_fields: int = 0
    temp: TSpan | None = None
    done: bool = False
    fields: dict = field(default_factory=dict)

    @property
    def chat(self) -> bool:
        return self.handler == "chat_completions"

    @property
    def alloc(self) -> int:
        # block_allocator tokens = input + max_new_tokens + speculate - 1 (queue.rs:315-318)
        return self.prompt_tokens + self.max_new_tokens - 1


def workload(scenario: str) -> list[Req]:
    """Six requests; ``no_chunking`` keeps R0-R3 (enough for its `waiting` spans)."""
    reqs = [
        Req("R0", "/generate", "generate", False, 0.0, 48, 4, 4, "length", None, 2,
            "non-streaming /generate; alone in the first prefill"),
        Req("R1", "/v1/chat/completions", "chat_completions", True, 2.0, 120, 64, 5,
            "eos_token", 4242, 3, "streaming chat; shares a prefill with R2 and R3"),
        Req("R2", "/generate_stream", "generate_stream", True, 2.5, 30, 1, 1, "length", None,
            4, "streaming /generate_stream with max_new_tokens=1: one output token"),
        Req("R3", "/v1/chat/completions", "chat_completions", False, 3.0, 200, 16, 4,
            "eos_token", 777, 5, "non-streaming chat"),
        Req("R4", "/v1/completions", "completions", False, 20.0, 60, 3, 3, "length", None, 6,
            "non-streaming /v1/completions (temperature 0): decoder_input_details=true, "
            "so its first send_generation echoes the prompt tokens"),
        Req("R5", "/generate", "generate", False, 12.0, 1600, 3, 3, "length", None, 7,
            "long prompt; waits in the queue until enough KV blocks are free"),
    ]
    return reqs if scenario == "chunking" else reqs[:4]


def token_text(req: Req, k: int) -> str:
    return f" {CANARY_OUTPUT}_{req.label.lower()}_{k}"


def frontend(reg: Registry, req: Req) -> None:
    """Handler -> validation -> schedule -> queue append, on the request's own trace."""
    t = T0 + int(req.arrival_ms * MS)
    fields = {}
    if req.handler in ("generate", "generate_stream"):
        # #[instrument(skip_all, fields(parameters = ?req.parameters, total_time, ...))]
        # (server.rs:261-272, :464-475): parameters is recorded at creation.
        fields["parameters"] = generate_parameters_debug(
            do_sample=False, max_new_tokens=req.max_new_tokens, details=False)
    h = reg.new(req.handler, req.handler, t, None, req.thread, fields)
    h.refs += 1  # `span` handed to generate_internal / the SSE stream (server.rs:279-285)
    req.spans["handler"] = h
    t += 15 * US
    if req.chat:
        # chat.try_into_generate -> infer.apply_chat_template (router/src/lib.rs:985-1018,
        # infer/mod.rs:226); then span.record("parameters", ...) (server.rs:1193).
        tmpl = reg.new("apply_chat_template", "apply_chat_template", t, h, req.thread,
                       entered="sync")
        t += 120 * US
        reg.drop(tmpl, t)
        t += 5 * US
        reg.record(h, "parameters", generate_parameters_debug(
            do_sample=True, max_new_tokens=req.max_new_tokens, details=True))
        req.spans["apply_chat_template"] = tmpl
    t += 10 * US
    req.start_time = t  # generate_internal / generate_stream_internal: Instant::now()
    if req.stream:
        # The SSE stream is lazy: Infer::generate_stream runs when hyper first polls the
        # body, inside info_span!(parent: &span, "async_stream") (server.rs:555).
        t += 60 * US
        outer = reg.new("async_stream", "async_stream", t, h, req.thread)
        req.spans["async_stream"] = outer
    else:
        t += 5 * US
        outer = reg.new("generate", "infer.generate", t, h, req.thread)  # infer/mod.rs:244
        req.spans["infer.generate"] = outer
    t += 2 * US
    igs = reg.new("generate_stream", "infer.generate_stream", t, outer, req.thread)
    req.spans["infer.generate_stream"] = igs
    t += 3 * US
    v = reg.new("validate", "validate", t, igs, req.thread)
    t += 2 * US
    add_special = not req.chat  # chat: add_special_tokens false (lib.rs:1006)
    vi = reg.new("validate_input", "validate_input", t, v, req.thread, {
        "add_special_tokens": add_special, "truncate": "None",
        "max_new_tokens": rust_opt(req.max_new_tokens)})
    t += 2 * US
    tk = reg.new("tokenize", "tokenize", t, vi, req.thread, {
        "add_special_tokens": add_special, "truncate": "None"})
    tk.refs += 1  # Span::current() sent to the tokenizer worker (validation.rs:116-122)
    t += 150 * US + 2 * US * req.prompt_tokens  # the tokenizer worker, in the span's scope
    reg.drop(tk, t + 3 * US)  # the worker drops its clone
    reg.drop(tk, t + 4 * US)
    t += 8 * US
    reg.drop(vi, t)
    t += 15 * US
    reg.drop(v, t)
    t += 3 * US
    s = reg.new("schedule", "schedule", t, igs, req.thread)  # backend.rs:78
    s.busy = 8 * US  # entered only while the sync fn runs
    req.spans["schedule"] = s
    req.queued = t + 2 * US  # Entry.queue_time (backend.rs:92)
    s.refs += 1  # Entry.span = Span::current() (backend.rs:90)
    a = reg.new("append", "append", t + 3 * US, s, req.thread)  # queue.rs:75
    a.busy = 3 * US
    a.refs += 1  # QueueCommand::Append(entry, Span::current()) (queue.rs:80)
    reg.drop(a, t + 5 * US)
    reg.drop(s, t + 8 * US)  # schedule() returns: its own handle goes
    reg.drop(igs, t + 12 * US)  # Infer::generate_stream returns the stream
    if req.stream:
        reg.drop(outer, t + 14 * US)  # .instrument(async_stream) future resolved
    # queue task: span.in_scope(|| state.append(entry)) (queue.rs:141-143)
    tq = t + 15 * US
    req.queued_cmd = tq
    q = reg.new("queued", "queued", tq, s, QUEUE_THREAD, entered="never")  # queue.rs:228
    req.spans["queued"] = q
    req.temp = q
    reg.drop(a, tq + 2 * US)


def finish_request(reg: Registry, req: Req, t_last: int) -> None:
    """The handler receives InferStreamResponse::End and records its fields."""
    h = req.spans["handler"]
    t_a = t_last + 45 * US  # the handler's task wakes
    if not req.stream:
        reg.drop(req.spans["infer.generate"], t_a - 5 * US)  # Infer::generate returns
    t_b = t_a + 250  # total_time and inference_time read Instant::now() separately
    total = t_a - req.start_time
    validation = req.queued - req.start_time
    queue = req.batch_time - req.queued
    inference = t_b - req.batch_time
    tpt = inference // req.output_tokens  # Duration / u32 truncates
    seed = rust_opt(req.seed)
    # server.rs:370-375 (generate_internal) / :612-617 (generate_stream_internal)
    req.fields = {
        "total_time": rust_duration(total),
        "validation_time": rust_duration(validation),
        "queue_time": rust_duration(queue),
        "inference_time": rust_duration(inference),
        "time_per_token": rust_duration(tpt),
        "seed": seed,
    }
    for k, v in req.fields.items():
        reg.record(h, k, v)
    req.end_fields = t_a
    if req.stream:
        # tracing::info!(parent: &span, "Success") (server.rs:637) is dropped: the layer
        # attaches events to the *current* span (layer.rs:813), and nothing is entered
        # while hyper polls the SSE body.
        reg.drop(h, t_a + 60 * US)  # the SSE stream (holding `span`) ends and is dropped
        reg.drop(h, t_a + 61 * US)  # the handler future's handle went at handler return
    else:
        reg.event(h, t_a + 8 * US, "Success", SUCCESS_SITE)  # server.rs:432, inside the span
        reg.drop(h, t_a + 90 * US)  # generate_internal's clone
        reg.drop(h, t_a + 95 * US)  # the handler returns


# --------------------------------------------------------------------------------------
# The shard (Python) spans


@dataclass(eq=False)
class PySpan:
    name: str
    scope: InstrumentationScope
    kind: SpanKind
    trace_id: int
    span_id: int
    parent_id: int
    parent_remote: bool
    start: int
    end: int
    attrs: dict


class Shard:
    """/generate.v3.TextGenerationService/* server spans (tracing.py:16-53) and model spans."""

    def __init__(self, reg: Registry):
        self.reg = reg
        self.spans: list[PySpan] = []

    def rpc(self, method: str, client: TSpan, t: int, work: list[tuple[str, int]]) -> int:
        """One RPC: server span (SERVER, remote parent = the Rust client span), children
        run in sequence; returns the server span's end."""
        sid = self.reg._id("py", 8)
        start = t
        t += 250 * US  # from_pb / cache.pop
        children = []
        for name, dur in work:
            children.append((name, t, t + dur))
            t += dur + 20 * US
        end = t + 150 * US  # to_pb
        self.spans.append(PySpan(
            f"/generate.v3.TextGenerationService/{method}", PY_SCOPE_SERVER, SpanKind.SERVER,
            client.trace_id, sid, client.span_id, True, start, end, {
                "rpc.system": "grpc",
                "rpc.grpc.status_code": 0,
                "rpc.method": method,
                "rpc.service": "generate.v3.TextGenerationService",
                "rpc.user_agent": "tonic/0.10.2",
                "net.transport": "unix",
            }))
        for name, cs, ce in children:
            self.spans.append(PySpan(name, PY_SCOPE_MODEL, SpanKind.INTERNAL, client.trace_id,
                                     self.reg._id("py", 8), sid, False, cs, ce, {}))
        return end


# --------------------------------------------------------------------------------------
# The batching loop


class Sim:
    def __init__(self, scenario: str):
        self.scenario = scenario
        self.chunking = scenario == "chunking"
        self.reg = Registry(scenario)
        self.shard = Shard(self.reg)
        self.reqs = workload(scenario)
        self.queue: list[Req] = []  # appended, not yet batched
        self.pending = sorted(self.reqs, key=lambda r: r.arrival_ms)
        self.next_queue_id = 0
        self.next_batch_id = 0
        self.steps: list[dict] = []
        self.allocated = 0

    # -- queue side ------------------------------------------------------------------

    def _arrivals_until(self, t: int) -> None:
        """Queue-task appends that happened before ``t`` (they also notify the batcher)."""
        for r in list(self.pending):
            if r.queued_cmd <= t:
                self.pending.remove(r)
                r.queue_id = self.next_queue_id  # State.next_id (queue.rs:232-233)
                self.next_queue_id += 1
                self.queue.append(r)

    def next_batch(self, t: int, min_size, max_size, prefill_budget: int, token_budget: int):
        """Queue::next_batch (queue.rs:85-114) + State::next_batch (queue.rs:237-504)."""
        reg = self.reg
        # #[instrument(skip(self))]: the batching task has no current span, so every
        # next_batch span is a new root; its arguments are its fields, integers as
        # Debug strings (tracing-core 0.1.33 field.rs:287-289: record_u64 -> record_debug,
        # which tracing-opentelemetry 0.21 does not override).
        nb = reg.new("next_batch", "next_batch", t, None, BATCHING_THREAD, {
            "min_size": rust_opt(min_size), "max_size": rust_opt(max_size),
            "prefill_token_budget": str(prefill_budget), "token_budget": str(token_budget)})
        if prefill_budget == 0 or token_budget == 0:  # queue.rs:93-95
            reg.drop(nb, t + 2 * US)
            return None
        tq = t + 8 * US  # the queue task receives the command
        self._arrivals_until(tq)
        if not self.queue:  # queue.rs:244-247
            reg.drop(nb, tq + 6 * US)
            return None
        if min_size is not None and len(self.queue) < min_size:  # queue.rs:250-255
            reg.drop(nb, tq + 6 * US)
            return None
        tq += 3 * US
        # info_span!(parent: None, "batch", batch_size = Empty); follows_from(current)
        b = reg.new("batch", "batch.queue", tq, None, QUEUE_THREAD)  # queue.rs:268-269
        reg.follows_from(b, nb)
        taken = []
        free = MAX_BATCH_TOTAL_TOKENS - self.allocated
        budget = prefill_budget
        for r in list(self.queue):
            tq += 4 * US
            if r.alloc > free:  # "Over budget: not enough free blocks" (queue.rs:321-327)
                break
            if r.prompt_tokens > budget:  # (the scripted prompts always fit)
                break
            free -= r.alloc
            budget -= r.prompt_tokens
            taken.append(r)
            if max_size is not None and len(taken) == max_size:
                break
        if not taken:  # queue.rs:403-406: the batch span goes without batch_size or children
            reg.drop(b, tq + 3 * US)
            reg.drop(nb, tq + 8 * US)
            return None
        for r in taken:
            self.queue.remove(r)
            self.allocated += r.alloc
            tq += 3 * US
            # queue.rs:427-432: infer under the entry's span, linked both ways
            inf = reg.new("infer", "infer.queue", tq, r.spans["schedule"], QUEUE_THREAD,
                          entered="never")
            reg.follows_from(b, inf)
            reg.follows_from(inf, b)
            reg.drop(r.temp, tq + 1 * US)  # the `queued` span ends: scheduled
            r.temp = inf
            r.spans.setdefault("infer", []).append(inf)
            r.batch_time = tq + 2 * US  # entry.batch_time (queue.rs:482)
        tq += 5 * US
        reg.record(b, "batch_size", str(len(taken)))  # queue.rs:488-489 (u32 -> Debug string)
        batch_id = self.next_batch_id
        self.next_batch_id += 1
        reg.drop(nb, tq + 10 * US)  # both clones: the command's and the awaiting future's
        return taken, b, batch_id, tq + 12 * US

    # -- steps -----------------------------------------------------------------------

    def _send(self, t: int, in_forward: list[Req], new: list[Req], step: dict) -> tuple[int, list]:
        """filter_send_generations (backend.rs:423-445): one send_generation per request."""
        reg = self.reg
        finished = []
        for r in in_forward:
            k = len(r.tokens) + 1
            last = k == r.output_tokens
            logprob = -0.25 * (1 + (k % 4))
            toks = "Some(" + tokens_debug([1000 + k], [logprob], [token_text(r, k)],
                                          [False]) + ")"
            prefill = "None"
            if r.handler == "completions" and k == 1:
                # decoder_input_details = !stream (server.rs:797): the prompt comes back
                ids = list(range(1, 7))
                lps = [float("nan")] + [-1.5] * 5
                texts = [f"{CANARY_PROMPT}_{i}" for i in ids]
                prefill = "Some(" + tokens_debug(ids, lps, texts, []) + ")"
            gen_text = "None"
            if last:
                text = "".join(token_text(r, i) for i in range(1, k + 1))
                gen_text = (f"Some(GeneratedText {{ text: {rust_str(text)}, generated_tokens: "
                            f"{k}, finish_reason: {FINISH_DEBUG[r.finish]}, seed: "
                            f"{rust_opt(r.seed)} }})")
            gen = (f"Generation {{ request_id: {r.queue_id}, prefill_tokens: {prefill}, "
                   f"tokens: {toks}, generated_text: {gen_text}, top_tokens: [] }}")
            # info_span!(parent: entry.temp_span, "send_generation", generation = ?generation)
            sg = reg.new("send_generation", "send_generation", t, r.temp, BATCHING_THREAD,
                         {"generation": gen}, entered="sync")
            r.tokens.append({
                "index": k, "time_ns": t, "step": step["index"],
                "send_generation_span_id": f"{sg.span_id:016x}",
                "infer_span_id": f"{r.temp.span_id:016x}",  # its parent (always an infer)
                "infer_links_to": f"{r.temp.links[0].span_id:016x}",  # that infer's batch
            })
            if last:
                # entries.remove(&id) inside the span (backend.rs:441-443): the Entry's
                # span and temp_span handles go; the block allocation is freed
                reg.drop(r.temp, t + 3 * US)
                reg.drop(r.spans["schedule"], t + 3 * US)
                self.allocated -= r.alloc
                r.done = True
                finished.append(r)
            reg.drop(sg, t + 6 * US)
            t += 8 * US
        return t, finished

    def _filter(self, t: int, parent: TSpan, batch_id: int, remaining: list[Req],
                changed: bool) -> int:
        """filter_batch (backend.rs:388-418): FilterBatch, or ClearCache when empty."""
        reg = self.reg
        fb = reg.new("filter_batch", "filter_batch", t, parent, BATCHING_THREAD)
        t += 3 * US
        if changed and remaining:
            ids = "[" + ", ".join(str(r.queue_id) for r in remaining) + "]"
            args = {"batch_id": str(batch_id), "request_ids": ids}
            s = reg.new("filter_batch", "sharded.filter_batch", t, fb, BATCHING_THREAD, args)
            g = reg.new("filter_batch", "grpc.filter_batch", t + 3 * US, s, BATCHING_THREAD,
                        args)
            end = self.shard.rpc("FilterBatch", g, t + 40 * US, [("filter", 300 * US)])
            t = end + 40 * US
            reg.drop(g, t)
            reg.drop(s, t + 3 * US)
            t += 5 * US
        elif not remaining:
            args = {"batch_id": f"Some({batch_id})"}
            s = reg.new("clear_cache", "sharded.clear_cache", t, fb, BATCHING_THREAD, args)
            g = reg.new("clear_cache", "grpc.clear_cache", t + 3 * US, s, BATCHING_THREAD,
                        args)
            end = self.shard.rpc("ClearCache", g, t + 40 * US, [])
            t = end + 40 * US
            reg.drop(g, t)
            reg.drop(s, t + 3 * US)
            t += 5 * US
        reg.drop(fb, t)
        return t + 2 * US

    def prefill(self, t: int, b: TSpan, batch_id: int, new: list[Req], cached: list[Req],
                cached_id: int | None) -> tuple[int, int | None]:
        """prefill (backend.rs:296-339) under the queue's batch span."""
        reg = self.reg
        in_forward = cached + new
        step = {"index": len(self.steps), "kind": "prefill",
                "batch_trace_id": f"{b.trace_id:032x}", "batch_span_id": f"{b.span_id:016x}",
                "batch_size_attribute": b.attrs.get("batch_size"),
                "new_requests": [r.label for r in new],
                "forward_requests": [r.label for r in in_forward],
                "start_ns": t}
        self.steps.append(step)
        p = reg.new("prefill", "prefill", t, b, BATCHING_THREAD)
        args = {"id": str(batch_id), "size": str(len(new))}  # the NEW batch only
        s = reg.new("prefill", "sharded.prefill", t + 3 * US, p, BATCHING_THREAD, args)
        g = reg.new("prefill", "grpc.prefill", t + 6 * US, s, BATCHING_THREAD, args)
        tokens = sum(r.prompt_tokens for r in new)
        work = []
        if cached:
            work.append(("concatenate", 300 * US))  # server.py Prefill: concat with cached
        work.append(("generate_token", 8 * MS + 20 * US * tokens + 250 * US * len(cached)))
        end = self.shard.rpc("Prefill", g, t + 50 * US, work)
        t = end + 50 * US
        reg.drop(g, t)
        reg.drop(s, t + 4 * US)
        step["forward_end_ns"] = t + 4 * US
        t += 10 * US
        fsg = reg.new("filter_send_generations", "filter_send_generations", t, p,
                      BATCHING_THREAD, entered="sync")
        t, finished = self._send(t + 3 * US, in_forward, new, step)
        reg.drop(fsg, t)
        remaining = [r for r in in_forward if not r.done]
        result_id = cached_id if cached_id is not None else batch_id  # concatenate keeps [0]
        t = self._filter(t + 5 * US, p, result_id, remaining, bool(finished))
        reg.drop(p, t)
        reg.drop(b, t + 3 * US)  # .instrument(span) future completes
        step["end_ns"] = t + 3 * US
        step["finished"] = [r.label for r in finished]
        return t + 10 * US, (result_id if remaining else None)

    def decode(self, t: int, entries: list[Req], batch_ids: list[int]) -> tuple[int, int | None]:
        """The decode step (backend.rs:271-288, decode at :341-385) under a new root batch."""
        reg = self.reg
        # info_span!(parent: None, "batch", batch_size = next_batch_size): usize -> "3"
        d = reg.new("batch", "batch.decode", t, None, BATCHING_THREAD,
                    {"batch_size": str(len(entries))}, entered="async")
        step = {"index": len(self.steps), "kind": "decode",
                "batch_trace_id": f"{d.trace_id:032x}", "batch_span_id": f"{d.span_id:016x}",
                "batch_size_attribute": str(len(entries)), "new_requests": [],
                "forward_requests": [r.label for r in entries], "start_ns": t}
        self.steps.append(step)
        for r in entries:
            t += 2 * US
            inf = reg.new("infer", "infer.decode", t, r.spans["schedule"], BATCHING_THREAD,
                          entered="never")
            reg.follows_from(d, inf)  # backend.rs:279
            reg.follows_from(inf, d)  # backend.rs:280
            reg.drop(r.temp, t)  # the previous infer / waiting span ends here
            r.temp = inf
            r.spans.setdefault("infer", []).append(inf)
        t += 5 * US
        dc = reg.new("decode", "decode", t, d, BATCHING_THREAD)
        size = {"size": str(len(entries))}  # sum of the cached batches' sizes
        s = reg.new("decode", "sharded.decode", t + 3 * US, dc, BATCHING_THREAD, size)
        g = reg.new("decode", "grpc.decode", t + 6 * US, s, BATCHING_THREAD, size)
        work = []
        if len(batch_ids) > 1:
            work.append(("concatenate", 250 * US))  # server.py Decode with >1 batches
        work.append(("generate_token", 12 * MS + 500 * US * len(entries)))
        end = self.shard.rpc("Decode", g, t + 50 * US, work)
        t = end + 50 * US
        reg.drop(g, t)
        reg.drop(s, t + 4 * US)
        step["forward_end_ns"] = t + 4 * US
        t += 10 * US
        fsg = reg.new("filter_send_generations", "filter_send_generations", t, dc,
                      BATCHING_THREAD, entered="sync")
        t, finished = self._send(t + 3 * US, entries, [], step)
        reg.drop(fsg, t)
        remaining = [r for r in entries if not r.done]
        t = self._filter(t + 5 * US, dc, batch_ids[0], remaining, bool(finished))
        reg.drop(dc, t)
        reg.drop(d, t + 3 * US)
        step["end_ns"] = t + 3 * US
        step["finished"] = [r.label for r in finished]
        return t + 10 * US, (batch_ids[0] if remaining else None)

    # -- the loop ----------------------------------------------------------------------

    def run(self) -> None:
        for r in self.reqs:
            frontend(self.reg, r)
        # notifier.notified().await (backend.rs:143) wakes on the first notify_one
        # (backend.rs:99); notifies while the task is busy leave one stored permit.
        woke = min(r.queued for r in self.reqs)
        t = min(r.queued_cmd for r in self.reqs) + 20 * US
        while True:
            got = self.next_batch(t, None, None, MAX_BATCH_PREFILL_TOKENS,
                                  MAX_BATCH_TOTAL_TOKENS)
            if got is None:
                t += 30 * US
                if any(woke < r.queued <= t for r in self.reqs):  # a stored permit
                    woke = t
                    continue
                if not self.pending:
                    break
                nxt = min(self.pending, key=lambda r: r.queued_cmd)
                woke = nxt.queued
                t = max(t, nxt.queued_cmd + 20 * US)
                continue
            new, b, bid, t = got
            t, cached_id = self.prefill(t, b, bid, new, [], None)
            entries = [r for r in new if not r.done]
            batch_ids = [cached_id] if cached_id is not None else []
            waiting_tokens = 1
            while batch_ids:
                live = [r for r in entries if not r.done]
                current_tokens = sum(r.prompt_tokens + len(r.tokens) for r in live)
                max_tokens = sum(r.prompt_tokens + r.max_new_tokens for r in live)
                token_budget = max(MAX_BATCH_TOTAL_TOKENS - max_tokens, 0)
                if self.chunking:  # backend.rs:175-184
                    min_size, max_size = None, None
                    prefill_budget = max(MAX_BATCH_PREFILL_TOKENS - current_tokens, 0)
                else:  # backend.rs:185-201
                    min_size = (None if waiting_tokens >= MAX_WAITING_TOKENS
                                else int(len(live) * WAITING_SERVED_RATIO))
                    max_size = None
                    prefill_budget = MAX_BATCH_PREFILL_TOKENS
                got = self.next_batch(t + 15 * US, min_size, max_size, prefill_budget,
                                      token_budget)
                t += 40 * US
                if got is not None:
                    new, b, bid, t = got
                    if self.chunking:  # backend.rs:221-236
                        t, cached_id = self.prefill(t, b, bid, new, live, batch_ids[0])
                        entries = [r for r in live + new if not r.done]
                        if cached_id is None:
                            break
                        batch_ids = [cached_id]
                    else:  # backend.rs:237-261
                        for r in live:
                            # info_span!(parent: &entry.span, "waiting"), linked both ways
                            w = self.reg.new("waiting", "waiting", t, r.spans["schedule"],
                                             BATCHING_THREAD, entered="never")
                            self.reg.follows_from(b, w)
                            self.reg.follows_from(w, b)
                            self.reg.drop(r.temp, t)
                            r.temp = w
                            r.spans.setdefault("waiting", []).append(w)
                            t += 2 * US
                        t, new_id = self.prefill(t, b, bid, new, [], None)
                        if new_id is not None:
                            entries = live + [r for r in new if not r.done]
                            batch_ids.append(new_id)
                    waiting_tokens = 1
                live = [r for r in entries if not r.done]
                t, cached_id = self.decode(t, live, batch_ids)
                batch_ids = [cached_id] if cached_id is not None else []
                entries = [r for r in live if not r.done]
                waiting_tokens += 1
            t += 20 * US
        for r in self.reqs:
            if not r.done or len(r.tokens) != r.output_tokens:
                raise AssertionError(f"{r.label} did not finish")
        # the handlers process End after the batching task sent it
        for r in self.reqs:
            finish_request(self.reg, r, r.tokens[-1]["time_ns"])
        self.reg.check_closed()


# --------------------------------------------------------------------------------------
# OTLP


def _busy_idle(s: TSpan) -> tuple[int, int]:
    """busy_ns / idle_ns (layer.rs:731-757, :911-922): modelled, not measured. A span that
    is never entered (infer, queued, waiting) reports 0 and 0."""
    if s.entered == "never":
        return 0, 0
    if s.entered == "sync":
        return s.end - s.start, 0
    active = max(s.handles_end, s.start) - s.start  # no idle time counts after the last exit
    busy = s.busy if s.busy is not None else min(active, 20 * US + active // 50)
    return busy, max(active - busy, 0)


def rust_readable(s: TSpan) -> ReadableSpan:
    attrs = dict(s.attrs)
    busy, idle = _busy_idle(s)
    attrs["busy_ns"] = busy  # appended at close (layer.rs:911-922)
    attrs["idle_ns"] = idle
    ctx = SpanContext(s.trace_id, s.span_id, False, TraceFlags(TraceFlags.SAMPLED))
    parent = (SpanContext(s.parent.trace_id, s.parent.span_id, False,
                          TraceFlags(TraceFlags.SAMPLED)) if s.parent else None)
    links = [Link(SpanContext(o.trace_id, o.span_id, False, TraceFlags(TraceFlags.SAMPLED)))
             for o in s.links]
    events = [Event(name, a, timestamp=t) for t, name, a in s.events]
    return ReadableSpan(
        name=s.name, context=ctx, parent=parent, resource=RUST_RESOURCE, attributes=attrs,
        events=events, links=links, kind=SpanKind.INTERNAL,  # no otel.kind field anywhere
        instrumentation_scope=RUST_SCOPE, status=Status(StatusCode.UNSET),
        start_time=s.start, end_time=s.end)


def py_readable(p: PySpan) -> ReadableSpan:
    ctx = SpanContext(p.trace_id, p.span_id, False, TraceFlags(TraceFlags.SAMPLED))
    parent = SpanContext(p.trace_id, p.parent_id, p.parent_remote,
                         TraceFlags(TraceFlags.SAMPLED))
    return ReadableSpan(
        name=p.name, context=ctx, parent=parent, resource=PY_RESOURCE, attributes=p.attrs,
        events=(), links=(), kind=p.kind, instrumentation_scope=p.scope,
        status=Status(StatusCode.UNSET), start_time=p.start, end_time=p.end)


def rust_export(spans: list[TSpan]) -> ExportTraceServiceRequest:
    """opentelemetry-proto 0.3 transform/traces.rs:46-103: ONE ResourceSpans (one
    ScopeSpans, one span) per span, status always present, no span/link ``flags`` (the
    field is newer than that proto)."""
    req = ExportTraceServiceRequest()
    for s in spans:
        one = encode_spans([rust_readable(s)]).resource_spans[0]
        for ss in one.scope_spans:
            ss.schema_url = RUST_SCOPE.schema_url
            for sp in ss.spans:
                sp.ClearField("flags")
                for ln in sp.links:
                    ln.ClearField("flags")
        one.schema_url = ""
        req.resource_spans.append(one)
    return req


def batches_by_tick(items: list, end_of, first_tick: int) -> list[list]:
    """A BatchSpanProcessor: everything ended before a tick goes out at that tick
    (at most 512 per export)."""
    out: list[list] = []
    tick = first_tick
    items = sorted(items, key=lambda x: (end_of(x), getattr(x, "seq", 0)))
    while items:
        due = [x for x in items if end_of(x) <= tick]
        items = items[len(due):]
        for i in range(0, len(due), 512):
            out.append(due[i:i + 512])
        tick += TICK_PERIOD
    return out


# --------------------------------------------------------------------------------------
# Ground truth


def truth_for(sim: Sim) -> dict:
    reqs = {}
    for r in sim.reqs:
        h = r.spans["handler"]
        times = [tok["time_ns"] for tok in r.tokens]
        step_sizes = []
        for tok in r.tokens:
            st = sim.steps[tok["step"]]
            tok["step_kind"] = st["kind"]
            tok["step_batch_span_id"] = st["batch_span_id"]
            tok["step_forward_size"] = len(st["forward_requests"])
            tok["step_forward_end_ns"] = st["forward_end_ns"]
            step_sizes.append(len(st["forward_requests"]))
        reqs[r.label] = {
            "note": r.note,
            "path": r.path,
            "handler_span": r.handler,
            "stream": r.stream,
            "trace_id": f"{h.trace_id:032x}",
            "handler_span_id": f"{h.span_id:016x}",
            "prompt_tokens": r.prompt_tokens,
            "max_new_tokens": r.max_new_tokens,
            "generated_tokens": r.output_tokens,
            "finish_reason": r.finish,
            "arrival_ns": h.start,
            "tgi_start_time_ns": r.start_time,
            "validation_end_ns": r.queued,
            "scheduled_ns": r.batch_time,
            "first_token_ns": times[0],
            "token_times_ns": times,
            "last_token_ns": times[-1],
            "finish_ns": r.end_fields,
            "handler_end_ns": h.end,
            "ttft_s": (times[0] - h.start) / 1e9,
            "ttft_from_tgi_start_s": (times[0] - r.start_time) / 1e9,
            "queue_s": (r.batch_time - r.queued) / 1e9,
            "validation_s": (r.queued - r.start_time) / 1e9,
            "e2e_s": (times[-1] - h.start) / 1e9,
            "tpot_s": ((times[-1] - times[0]) / (len(times) - 1) / 1e9) if len(times) > 1
            else None,
            "forward_batch_size_per_token": step_sizes,
            "handler_fields": r.fields,
            "tokens": r.tokens,
        }
    return {
        "requests": reqs,
        "steps": sim.steps,
        "settings": {
            "support_chunking": sim.chunking,
            "max_batch_prefill_tokens": MAX_BATCH_PREFILL_TOKENS,
            "max_batch_total_tokens": MAX_BATCH_TOTAL_TOKENS,
            "waiting_served_ratio": WAITING_SERVED_RATIO,
            "max_waiting_tokens": MAX_WAITING_TOKENS,
            "num_shard": 1,
            "block_size": 1,
            "speculate": 0,
        },
    }


# --------------------------------------------------------------------------------------


def build() -> dict[str, bytes]:
    """File name -> bytes for the whole fixture directory except README.md."""
    files: dict[str, bytes] = {}
    truth: dict = {
        "generated_by": "tests/engines/tgi_spans.py",
        "tgi_tag": TGI_TAG,
        "tgi_commit": TGI_COMMIT,
        "service_name": SERVICE_NAME,
        "time_origin_ns": T0,
        "canaries_never_to_store": [CANARY_OUTPUT, CANARY_PROMPT],
        "token_time": "send_generation span start: when the router hands the token to the "
                      "request's channel (backends/v3/src/backend.rs:433-437)",
        "scenarios": {},
    }
    for scenario in ("chunking", "no_chunking"):
        sim = Sim(scenario)
        sim.run()
        rust = batches_by_tick(sim.reg.spans, lambda s: s.end, RUST_TICK)
        py = batches_by_tick(sim.shard.spans, lambda p: p.end, PY_TICK)
        exports = []  # (arrival time, kind, payload)
        for i, group in enumerate(rust):
            exports.append((RUST_TICK + i * TICK_PERIOD, 0, rust_export(group)))
        for i, group in enumerate(py):
            exports.append((PY_TICK + i * TICK_PERIOD, 1,
                            encode_spans([py_readable(p) for p in group])))
        exports.sort(key=lambda e: (e[0], e[1]))
        names = []
        for n, (_, kind, req) in enumerate(exports):
            name = f"{scenario}-export-{n:04d}.pb"
            files[name] = req.SerializeToString(deterministic=True)
            names.append({"file": name, "from": "router (Rust)" if kind == 0 else "shard (Python)",
                          "spans": sum(len(ss.spans) for rs in req.resource_spans
                                       for ss in rs.scope_spans)})
        t = truth_for(sim)
        t["exports"] = names
        t["span_counts"] = _counts(sim)
        truth["scenarios"][scenario] = t
    files["truth.json"] = (_json(truth) + "\n").encode()
    return files


def _json(o, indent: str = "") -> str:
    """JSON with one line per scalar list and per token/export entry (compact, readable)."""
    def flat(x) -> bool:
        if isinstance(x, list):
            return all(not isinstance(i, dict | list) for i in x)
        if isinstance(x, dict):
            return "time_ns" in x or "file" in x
        return True

    if flat(o):
        return json.dumps(o, ensure_ascii=False)
    inner = indent + " "
    if isinstance(o, list):
        return "[\n" + ",\n".join(inner + _json(v, inner) for v in o) + "\n" + indent + "]"
    return "{\n" + ",\n".join(f"{inner}{json.dumps(k)}: {_json(v, inner)}"
                                for k, v in o.items()) + "\n" + indent + "}"


def _counts(sim: Sim) -> dict:
    counts: dict[str, int] = {}
    for s in sim.reg.spans:
        counts[s.name] = counts.get(s.name, 0) + 1
    for p in sim.shard.spans:
        counts[p.name] = counts.get(p.name, 0) + 1
    return dict(sorted(counts.items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--check", action="store_true",
                    help="compare with the files in --out instead of writing them")
    args = ap.parse_args(argv)
    files = build()
    if args.check:
        bad = [n for n, b in files.items()
               if not (args.out / n).exists() or (args.out / n).read_bytes() != b]
        extra = sorted(p.name for p in args.out.glob("*.pb") if p.name not in files)
        if bad or extra:
            print(f"differs: {bad}; unexpected: {extra}", file=sys.stderr)
            return 1
        print(f"{len(files)} files match")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    for old in args.out.glob("*.pb"):
        if old.name not in files:
            old.unlink()
    total = 0
    for n, b in files.items():
        (args.out / n).write_bytes(b)
        total += len(b)
    print(f"wrote {len(files)} files, {total} bytes, to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
