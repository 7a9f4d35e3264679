"""The stream tap: ``phasewatch tap``, a streaming reverse proxy in front of an
OpenAI-compatible server, timing what the client sees.

It sits in the server's pod, in front of vLLM, SGLang, TGI's Messages API, llama.cpp's
server or anything that speaks ``/v1/chat/completions`` and ``/v1/completions``, and
changes nothing for the client or the server. On the way it times:

* arrival: the request's headers and body have reached the tap;
* every emission: each server-sent event carrying output (a content or text delta,
  a tool call), timed when the bytes ending it arrived from the server: the first is
  the first token, their gaps the ITL per emission (vLLM's benchmark ``itl``);
* tokens per emission where the server says (the running ``usage.completion_tokens``
  of vLLM's ``continuous_usage_stats``): then ITL per token too;
* the finish reason, and the final usage (prompt, cached prompt and output tokens)
  when the server sends it (``stream_options.include_usage``, or the body of a
  non-streamed answer);
* the end: the last byte of the response.

A W3C ``traceparent`` is injected (a new span of the caller's trace when the request
carries one), so an engine that traces from the header (vLLM, SGLang) puts its spans
in the same trace as the tap's record, and a ``tracestate`` member
``phasewatch=tap`` (before the caller's members), which the engine's span inherits: the
exporter knows from the span that the tap's record is coming.

In: a client's HTTP requests and the upstream server's answers. ``proxy`` (``Tap``,
the aiohttp handler: pass through, time, count), ``sse`` (the server-sent events read
as they arrive, and the usage-only chunk kept from the client), ``observed`` (what was
seen of one request, per choice), ``tracecontext`` (the W3C headers sent upstream),
``config`` (``TapConfig``: every setting of one tap, ``phasewatch tap``'s flags or
``serve --tap-*``), ``server`` (the listener: TLS from reloaded PEM files, the event
loop thread),
``workers`` (``serve_forever`` for ``phasewatch tap``: one process, or ``--workers N``
on one port).

Out: one record per choice (``PhasewatchClient.record`` keywords), handed on by
``recorder``: through a ``PhasewatchClient`` to an exporter's gRPC port (never
blocking: when the exporter is away they are buffered, then dropped and counted;
bearer token and TLS as the other clients), or, inside ``phasewatch serve
--tap-upstream``, as ``requests.record.RequestBatch`` batches to the exporter's trace
join. ``stats``: every request's outcome, every cut-short answer and every lost record
by reason, as ``phasewatch_tap_*`` counters on an optional port of its own and one
line logged when the tap stops.
"""

from __future__ import annotations

import importlib

# Each name from its module, imported when first asked for: ``phasewatch serve``
# imports ``tap.config`` for its flags, and the proxy's aiohttp (9 MiB resident, 0.1 s)
# is only wanted where a tap runs (issue 41: the exporter's idle RSS).
_FROM = {"TapConfig": "config", "Choice": "observed", "Observed": "observed",
         "TIMED_PATHS": "proxy", "Tap": "proxy", "BatchRecorder": "recorder",
         "client_recorder": "recorder", "TapServer": "server", "listener_ssl": "server",
         "server_ssl": "server", "tap_of": "server", "EventReader": "sse",
         "UsageFilter": "sse", "TapCollector": "stats", "metrics_app": "stats",
         "summary": "stats", "tallies": "stats", "trace_headers": "tracecontext",
         "serve_forever": "workers"}

__all__ = sorted(_FROM)


def __getattr__(name: str):
    if name not in _FROM:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_FROM[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_FROM})
