"""``phasewatch tap``: a streaming reverse proxy in front of an OpenAI-compatible server.

It sits in the server's pod, in front of vLLM, SGLang, TGI's Messages API, llama.cpp's
server or anything that speaks ``/v1/chat/completions`` and ``/v1/completions``, and
changes nothing for the client or the server: every request and response passes
through byte for byte, streamed as it comes. On the way it times what the client
sees:

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

Records go to the exporter through ``PhasewatchClient`` (never blocking: when the
exporter is away they are buffered, then dropped and counted; bearer token and TLS as
the other clients). Nothing the tap does for phasewatch can fail the user's request:
an answer it cannot read is passed on unread and counted; a request body larger than
the tap reads (64 MiB) is streamed to the server as it comes, untimed and counted; an
upstream that cannot be reached is answered 502, one silent for ``timeout_s`` before
answering 504, as any proxy does; one that breaks off or goes silent mid-answer leaves
the client's answer cut off where it stopped (no clean end the server never sent); a
client that hangs up mid-stream closes the upstream request (the server stops
generating). Every request has one outcome in ``Tap.counts``, every cut-short answer
its reason, every record lost its reason (``tallies``), served as Prometheus text on
an optional port of its own and logged when the tap stops.

Other paths (``/v1/models``, ``/health``, ``/metrics`` ...) pass through untimed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import ssl
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from phasewatch.requests.record import (
    SOURCE_TAP,
    TAP_TRACESTATE_KEY,
    RequestBatch,
    RequestRecord,
)

log = logging.getLogger(__name__)

TIMED_PATHS = ("/v1/chat/completions", "/v1/completions")
# RFC 9110 hop-by-hop headers, and those the proxy recomputes (an Expect: 100-continue
# was answered by the tap's own server, which then read the body)
_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                  "te", "trailer", "transfer-encoding", "upgrade", "host",
                  "content-length", "expect"})
# headers aiohttp's client would add to a request that lacks them: the tap adds none
_NO_AUTO_HEADERS = ("User-Agent", "Accept", "Accept-Encoding", "Content-Type")
_MAX_EVENT = 1 << 20  # an SSE event larger than this is not parsed (passed on all the same)


@dataclass
class Choice:
    """What the tap saw of one choice (one sequence) of a request: one, or n with
    ``n > 1`` (vLLM counts each as a request of its own, with the prompt once)."""

    emissions: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # per emission, where the server says
    finish_reason: str = ""
    finish_only: float | None = None  # when a chunk with a finish reason and no text came


@dataclass
class Observed:
    """What the tap saw of one timed request."""

    model: str = ""
    arrival: float = 0.0
    end: float = 0.0
    choices: dict[int, Choice] = field(default_factory=dict)
    prompt_tokens: int | None = None
    cached_prompt_tokens: int | None = None
    output_tokens: int | None = None  # all choices together, as the usage says
    status: int = 0
    aborted: str = ""  # why the request did not complete ("client_disconnected", ...)
    trace_parent: str = ""  # "<trace id>-<span id>" of the traceparent sent upstream
    hide_usage: bool = False  # the tap asked for the usage: keep its chunk from the client

    def choice(self, index: int) -> Choice:
        c = self.choices.get(index)
        if c is None:
            c = self.choices[index] = Choice()
        return c

    def settle(self) -> None:
        """Count a text-less finishing chunk as the end-of-sequence token's emission
        when its choice emitted nothing else, or the usage says a token is unaccounted
        for (as vLLM streams a stop: the last token, the end of sequence, decodes to no
        text). A server whose finishing chunk carries no token and whose chunks carry
        several tokens each cannot be told apart without per-chunk usage."""
        emitted = sum(len(c.emissions) for c in self.choices.values())
        for _, c in sorted(self.choices.items()):
            if c.finish_only is None or (c.emissions and c.finish_only < c.emissions[-1]):
                continue
            if not c.emissions or (self.output_tokens is not None
                                   and emitted < self.output_tokens):
                c.emissions.append(c.finish_only)
                c.tokens.append(1 if c.tokens and all(c.tokens) else 0)
                emitted += 1
            c.finish_only = None

    def records(self) -> list[dict]:
        """``PhasewatchClient.record`` keywords: one record per choice, the prompt
        counted by the first (``choice`` > 0 marks the others)."""
        choices = sorted(self.choices.items()) or [(0, Choice())]
        emitted = sum(len(c.emissions) for _, c in choices)
        # per choice output tokens: the usage's total when there is one choice; with
        # several, each choice's emissions where the usage shows one token per emission
        one_each = self.output_tokens is not None and self.output_tokens == emitted
        out = []
        for index, c in choices:
            counts = (c.tokens if c.emissions and len(c.tokens) == len(c.emissions)
                      and all(t >= 1 for t in c.tokens) else None)
            output = (self.output_tokens if len(choices) == 1 else
                      len(c.emissions) if one_each else None)
            if output is None:  # no usage: the chunks' token ids, else one per chunk
                output = sum(counts) if counts else len(c.emissions) or None
            out.append(dict(
                arrival=self.arrival, first_token=c.emissions[0] if c.emissions else None,
                last_token=c.emissions[-1] if c.emissions else None, finish=self.end,
                prompt_tokens=self.prompt_tokens,
                cached_prompt_tokens=self.cached_prompt_tokens, output_tokens=output,
                finish_reason=c.finish_reason or ("abort" if self.aborted else ""),
                token_times=c.emissions or None, token_counts=counts,
                trace_parent=self.trace_parent, choice=index))
        return out


class EventReader:
    """Server-sent events of an OpenAI-style stream, fed the bytes as they arrive."""

    def __init__(self, seen: Observed, counts: Counter):
        self._seen, self._counts = seen, counts
        self._buf = b""
        self._usage_tokens = 0  # the running completion_tokens, when the server sends it

    def feed(self, data: bytes, t: float) -> None:
        self._buf += data
        while True:
            cut = _event_end(self._buf)
            if cut is None:
                if len(self._buf) > _MAX_EVENT:
                    self._counts["event_too_large"] += 1
                    self._buf = b""
                return
            event, self._buf = self._buf[:cut[0]], self._buf[cut[1]:]
            self._event(event, t)

    def _event(self, event: bytes, t: float) -> None:
        if event.startswith(b"data:") and event.find(b"\n") < 0 and event.find(b"\r") < 0:
            data = event[5:].lstrip()  # one data line: every OpenAI-style server's event
        else:
            data = b"\n".join(line[5:].lstrip() for line in event.splitlines()
                              if line.startswith(b"data:"))
        if not data or data.strip() == b"[DONE]":
            return
        msg = self._parse(data, "unreadable_event")
        if msg is not None:
            self._message(msg, t, streamed=True)

    def _parse(self, data: bytes, reason: str) -> dict | None:
        """A JSON object, or None (counted under ``reason`` when it is not JSON)."""
        try:
            msg = json.loads(data)
        except ValueError:
            self._counts[reason] += 1
            return None
        return msg if isinstance(msg, dict) else None

    def _message(self, msg: dict, t: float, streamed: bool) -> None:
        seen = self._seen
        if msg.get("model"):  # the served name the server answers with (TGI's own id
            seen.model = str(msg["model"])  # where the client asked for "tgi")
        emitted, finishing = {}, []  # emitted: choice -> its tokens (vLLM's token ids)
        for choice in msg.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            index = choice.get("index", 0)
            c = seen.choice(index if isinstance(index, int) and 0 <= index < 1024 else 0)
            delta = choice.get("delta") if streamed else choice.get("message")
            ids = choice.get("token_ids")  # vLLM's return_token_ids: completions, chat
            if ids is None and isinstance(delta, dict):
                ids = delta.get("token_ids")
            ids = len(ids) if isinstance(ids, list) and ids else None
            if ids or (isinstance(delta, dict) and (
                    delta.get("content") or delta.get("tool_calls")
                    or delta.get("reasoning_content"))) or choice.get("text"):
                emitted[id(c)] = (c, ids)
            if choice.get("finish_reason"):
                c.finish_reason = str(choice["finish_reason"])
                finishing.append(c)
        usage = msg.get("usage")
        if isinstance(usage, dict):
            _usage(seen, usage)
        if not streamed:
            return
        done = usage.get("completion_tokens") if isinstance(usage, dict) else None
        grew = isinstance(done, int) and done > self._usage_tokens
        # tokens per emission: the chunk's token ids, else the running usage's growth
        # (it belongs to the chunk's one choice: vLLM sends one choice per chunk; with
        # several in one chunk, their tokens are unknown)
        if not emitted and grew:
            emitted = {id(c): (c, None) for c in finishing}
        for c, ids in emitted.values():
            c.emissions.append(t)
            c.tokens.append(ids or (done - self._usage_tokens if grew and (
                len(emitted) == 1) else 0))  # 0: unknown
        if grew:
            self._usage_tokens = done
        if not emitted:
            # a chunk that only finishes: the end-of-sequence token (no text) where the
            # output holds one more token than the emissions so far; decided at the end
            for c in finishing:
                c.finish_only = t

    def whole(self, body: bytes, t: float) -> None:
        """A non-streamed answer: one emission, when its last byte arrived."""
        msg = self._parse(body, "unreadable_body")
        if msg is not None:
            self._message(msg, t, streamed=False)
            if self._seen.output_tokens:
                for c in self._seen.choices.values():
                    c.emissions.append(t)


class UsageFilter:
    """The bytes of a server-sent event stream to pass on, less the usage-only events
    (no choices, a usage) that the tap asked for and the client did not. Whole events
    are passed as they complete (the server's bytes, separators included)."""

    def __init__(self):
        self._buf = b""

    def feed(self, data: bytes) -> bytes:
        self._buf += data
        out = []
        while (cut := _event_end(self._buf)) is not None:
            event, self._buf = self._buf[:cut[1]], self._buf[cut[1]:]
            if not _usage_only(event[:cut[0]]):
                out.append(event)
        return b"".join(out)

    def rest(self) -> bytes:
        """What is left at the end (an event the server did not close): passed on."""
        rest, self._buf = self._buf, b""
        return rest


def _usage_only(event: bytes) -> bool:
    data = b"\n".join(line[5:].lstrip() for line in event.splitlines()
                      if line.startswith(b"data:"))
    if b'"usage"' not in data:
        return False
    try:
        msg = json.loads(data)
    except ValueError:
        return False
    return isinstance(msg, dict) and not msg.get("choices") and bool(msg.get("usage"))


def _event_end(buf: bytes) -> tuple[int, int] | None:
    """(end of the first event, start of the next), or None while incomplete."""
    i = buf.find(b"\n\n")
    if i >= 0 and buf.find(b"\r", 0, i) < 0:  # LF-separated: no CR before it
        return i, i + 2
    found = [(i, i + len(sep)) for sep in (b"\n\n", b"\r\n\r\n", b"\r\r")
             if (i := buf.find(sep)) >= 0]
    return min(found) if found else None


def _usage(seen: Observed, usage: dict) -> None:
    for key, attr in (("prompt_tokens", "prompt_tokens"),
                      ("completion_tokens", "output_tokens")):
        v = usage.get(key)
        if isinstance(v, int) and v >= 0:
            setattr(seen, attr, v)
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        seen.cached_prompt_tokens = details["cached_tokens"]


TRACESTATE_MEMBER = f"{TAP_TRACESTATE_KEY}=tap"
MAX_TRACESTATE_MEMBERS = 32  # W3C trace context


def trace_headers(incoming: str | None, states: list[str] | None = None) -> tuple[str, str]:
    """The ``traceparent`` and ``tracestate`` sent upstream (W3C trace context).

    traceparent: a new span in the caller's trace, or in a new trace when the caller
    sent none (or one that does not parse: then its tracestate is dropped too).
    tracestate: the tap's member (``phasewatch=tap``) first, then the caller's members
    in their order (an older ``phasewatch`` member removed, at most 32 in all). An
    engine's span inherits its parent's tracestate (vLLM's and SGLang's OpenTelemetry
    SDK do), so the exporter knows, from the span alone, that a tap's record of the
    request is coming and waits for it."""
    parts = (incoming or "").strip().split("-")
    trace = parts[1] if (len(parts) == 4 and len(parts[1]) == 32
                         and _hex(parts[1]) and parts[1] != "0" * 32) else None
    flags = parts[3] if trace and len(parts[3]) == 2 and _hex(parts[3]) else "01"
    parent = f"00-{trace or secrets.token_hex(16)}-{secrets.token_hex(8)}-{flags}"
    members = [m.strip() for h in (states or ()) if trace for m in h.split(",")]
    theirs = [m for m in members if m and m.split("=", 1)[0].strip() != TAP_TRACESTATE_KEY]
    return parent, ",".join([TRACESTATE_MEMBER, *theirs[:MAX_TRACESTATE_MEMBERS - 1]])


def _hex(s: str) -> bool:
    try:
        int(s, 16)
    except ValueError:
        return False
    return True


class Tap:
    """The proxy. ``record`` receives (model, kwargs of ``PhasewatchClient.record``) for
    each timed request; ``counts`` holds what happened (its families: ``tallies``).

    ``max_body_bytes``: a timed request's body up to this is read (and the request
    timed); a larger one is streamed to the upstream as it comes, untimed and counted.
    ``timeout_s``: how long the upstream may stay silent, before its answer (then 504)
    or between two pieces of it (then the client's answer is cut off, as the server
    left it). ``upstream_ca``: PEM file of the CA that signed an https upstream's
    certificate (empty: the system's). ``ask_usage``: a streamed request without
    ``stream_options.include_usage`` is sent with it, for the exact prompt, cached and
    output tokens, and the usage-only chunk it adds (the last, with no choices, as vLLM
    and SGLang send it) is kept from the client, whose stream is then as it asked."""

    def __init__(self, upstream: str, record, *, default_model: str = "",
                 max_body_bytes: int = 64 << 20, timeout_s: float = 3600.0,
                 upstream_ca: str = "", ask_usage: bool = False):
        parts = urlsplit(upstream)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"--upstream must be an http:// or https:// URL, got {upstream!r}")
        if timeout_s <= 0 or max_body_bytes < 0:
            raise ValueError("the tap's timeout must be positive and its body limit >= 0")
        self.upstream = upstream.rstrip("/")
        self._record = record
        self.default_model = default_model
        self.max_body_bytes = max_body_bytes
        self.timeout_s = timeout_s
        self._upstream_ssl: ssl.SSLContext | bool = True  # aiohttp's default: the system's CAs
        if upstream_ca:
            try:
                self._upstream_ssl = ssl.create_default_context(cafile=upstream_ca)
            except (OSError, ssl.SSLError) as e:
                raise ValueError(f"cannot load --upstream-ca {upstream_ca}: {e}") from None
        # ask the server for the final usage (stream_options.include_usage) when a
        # streamed request did not, and keep that usage-only chunk from the client
        self.ask_usage = ask_usage
        self.counts: Counter = Counter()
        self._session: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application()  # bodies are read (or streamed) by _request_body
        app.router.add_route("*", "/{path:.*}", self._handle)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _app) -> None:
        self._session = aiohttp.ClientSession(
            # no cap on connections (aiohttp's default of 100 would queue the 101st
            # concurrent stream), and no cookie jar (one client's cookies are no other's)
            connector=aiohttp.TCPConnector(limit=0, ssl=self._upstream_ssl),
            cookie_jar=aiohttp.DummyCookieJar(), skip_auto_headers=_NO_AUTO_HEADERS,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=min(30.0, self.timeout_s),
                                          sock_read=self.timeout_s),
            auto_decompress=False)

    async def _stop(self, _app) -> None:
        if self._session is not None:
            await self._session.close()

    async def _request_body(self, request: web.Request, timed: bool):
        """(what to send upstream, the body when the tap read all of it, else None).
        A timed request's body is read up to ``max_body_bytes``; past that, and on
        every other path, it is streamed as it comes (never refused for its size)."""
        if not request.body_exists:
            return None, b""
        limit = self.max_body_bytes if timed else 0
        size = request.content_length
        if size is not None and size > limit:
            return _relay_body(b"", request.content), None
        head = bytearray()
        while len(head) <= limit:
            piece = await request.content.readany()
            if not piece:
                return bytes(head), bytes(head)
            head += piece
        return _relay_body(bytes(head), request.content), None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        arrival = time.time()
        timed = request.method == "POST" and request.path in TIMED_PATHS
        # a multidict: a header the client sent twice goes on twice
        headers = CIMultiDict((k, v) for k, v in request.headers.items()
                              if k.lower() not in _HOP)
        try:
            body, whole = await self._request_body(request, timed)
        except (aiohttp.ClientError, OSError):  # the client went away while sending it
            return self._unanswered(timed, "client_disconnected")
        untimed = None if timed else "untimed"  # the outcome, when not timed
        if whole is None:
            if request.content_length is not None:  # framed as the client framed it
                headers["Content-Length"] = str(request.content_length)
            if timed:
                timed, untimed = False, "body_too_large_untimed"
        seen = Observed(arrival=arrival) if timed else None
        streamed = False
        if timed:
            parent, state = trace_headers(request.headers.get("traceparent"),
                                          request.headers.getall("tracestate", []))
            headers["traceparent"], headers["tracestate"] = parent, state  # replaced
            seen.trace_parent = parent[3:-3]  # "<trace id>-<span id>"
            try:
                asked = json.loads(whole) if whole else {}
                streamed = isinstance(asked, dict) and bool(asked.get("stream"))
                if isinstance(asked, dict):
                    seen.model = str(asked.get("model") or "")
            except ValueError:
                self.counts["unreadable_request"] += 1  # passed on as it is
            if streamed and self.ask_usage:
                options = asked.get("stream_options")
                if options is None or (isinstance(options, dict)
                                       and not options.get("include_usage")):
                    asked["stream_options"] = {**(options or {}), "include_usage": True}
                    body = json.dumps(asked).encode()
                    seen.hide_usage = True
        url = self.upstream + request.path_qs
        try:
            upstream = await self._session.request(request.method, url, headers=headers,
                                                   data=body, allow_redirects=False)
        except asyncio.CancelledError:  # the tap is stopping before the server answered
            self._unanswered(timed, "tap_stopped", untimed)
            raise
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            if request.transport is None or request.transport.is_closing():
                return self._unanswered(timed, "client_disconnected", untimed)
            if isinstance(e, TimeoutError):  # no answer within --timeout: 504, as nginx
                self.counts["upstream_timeout"] += 1
                return web.Response(status=504, text=f"phasewatch tap: upstream {url}: no "
                                    f"answer within {self.timeout_s:g}s\n")
            self.counts["upstream_unreachable"] += 1
            return web.Response(status=502, text=f"phasewatch tap: upstream {url}: {e}\n")
        if untimed:
            self.counts[untimed] += 1
        try:
            return await self._relay(request, upstream, seen, streamed,
                                     UsageFilter() if seen is not None and seen.hide_usage
                                     and upstream.content_length is None else None)
        finally:
            upstream.release()

    def _unanswered(self, timed: bool, why: str, untimed: str | None = "untimed"
                    ) -> web.Response:
        """A request that ended before the server answered, for ``why`` (an abort)."""
        self.counts[why] += 1
        self.counts["unanswered" if timed else untimed] += 1
        return web.Response(status=499)  # to nobody: the client is gone

    async def _relay(self, request, upstream, seen: Observed | None, streamed: bool,
                     hide: UsageFilter | None = None) -> web.StreamResponse:
        resp = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        for k, v in upstream.headers.items():
            if k.lower() not in _HOP:
                resp.headers.add(k, v)
        if upstream.content_length is not None:  # framed as the server framed it
            resp.content_length = upstream.content_length
        reader = EventReader(seen, self.counts) if seen is not None else None
        if reader is not None and upstream.headers.get(
                "Content-Encoding", "identity").lower() != "identity":
            self.counts["compressed_answer"] += 1  # passed on, not read
            reader = None
        whole = bytearray()
        aborted, side = "", "client"  # whose fault an exception is
        try:
            await resp.prepare(request)
            while True:
                side = "upstream"
                chunk = await upstream.content.readany()
                if not chunk:
                    break
                t = time.time()
                side = "client"
                passed = hide.feed(chunk) if hide is not None else chunk
                if passed:
                    await resp.write(passed)
                if reader is not None and upstream.status == 200:
                    if streamed:
                        reader.feed(chunk, t)
                    elif len(whole) < _MAX_EVENT:
                        whole += chunk
            side = "client"
            if hide is not None and hide.rest():
                await resp.write(hide.rest())
            await resp.write_eof()
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            # ConnectionResetError: writing to a client that hung up (aiohttp's own too)
            aborted = ("client_disconnected" if side == "client" else
                       "upstream_stalled" if isinstance(e, TimeoutError) else
                       "upstream_broke_off")
            upstream.close()  # the server stops generating
            if side == "upstream" and request.transport is not None:
                # the client sees the answer cut off where the server left it (no
                # final chunk), not a clean end the server never sent
                request.transport.close()
        except asyncio.CancelledError:  # the tap is stopping with this stream open
            aborted = "tap_stopped"
            upstream.close()
            raise
        finally:
            if aborted:
                self.counts[aborted] += 1
            if seen is not None:
                seen.aborted = aborted
                seen.end = time.time()
                seen.status = upstream.status
                if reader is not None and not streamed and whole and not seen.aborted:
                    reader.whole(bytes(whole), seen.end)
                seen.settle()
                self._finish(seen)
        return resp

    def _finish(self, seen: Observed) -> None:
        if seen.status != 200:
            self.counts[f"upstream_status_{seen.status // 100}xx"] += 1
            return  # an error answer is no request the engine served
        self.counts["aborted" if seen.aborted else "completed"] += 1
        model = seen.model or self.default_model
        if not model:
            self.counts["no_model"] += 1
            return
        for kwargs in seen.records():
            try:
                self._record(model, kwargs)
            except Exception:  # never let phasewatch's side fail the user's request
                log.exception("recording a tapped request failed")
                self.counts["record_failed"] += 1


async def _relay_body(head: bytes, rest: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """A request body streamed to the upstream: what was read of it, then the rest."""
    if head:
        yield head
    while piece := await rest.readany():
        yield piece


# What ``Tap.counts`` holds, by family: the outcome of every request (one each);
# streams cut short, by why; records lost, by why (with the client's own drops);
# answers or requests passed on without being read.
OUTCOMES = ("completed", "aborted", "unanswered", "untimed", "body_too_large_untimed",
            "upstream_unreachable", "upstream_timeout")  # and upstream_status_<N>xx
ABORTS = ("client_disconnected", "upstream_broke_off", "upstream_stalled", "tap_stopped")
TAP_DROPS = ("no_model", "record_failed", "body_too_large_untimed")
UNREAD = ("unreadable_request", "compressed_answer", "event_too_large", "unreadable_event",
          "unreadable_body")
CLIENT_DROPS = ("buffer_full", "refused", "shutdown", "invalid", "closed")


def tallies(counts: Mapping[str, int], client_stats: Mapping[str, int] | None = None
            ) -> dict[str, dict[str, int]]:
    """The counts by family: requests (by outcome), aborts, records_dropped (the tap's
    and the client's, ``rejected`` by the exporter among them) and unread; and, with
    the client's stats, records_accepted."""
    stats = client_stats or {}
    outcomes = {k: counts.get(k, 0) for k in OUTCOMES}
    outcomes.update({k: v for k, v in counts.items() if k.startswith("upstream_status_")})
    dropped = {k: counts.get(k, 0) for k in TAP_DROPS}
    if client_stats is not None:
        dropped.update({k: stats.get(f"dropped_{k}", 0) for k in CLIENT_DROPS})
        dropped["rejected"] = stats.get("rejected", 0)
    out = {"requests": outcomes, "aborts": {k: counts.get(k, 0) for k in ABORTS},
           "records_dropped": dropped, "unread": {k: counts.get(k, 0) for k in UNREAD}}
    if client_stats is not None:
        out["records_accepted"] = {"": stats.get("accepted", 0)}
    return out


# One sentence each (the label values are listed in docs/metrics.md).
_HELP = {"requests": ("outcome", "Requests through the tap, one outcome each."),
         "aborts": ("reason", "Requests cut short on any path, by reason."),
         "records_dropped": ("reason", "Records of timed requests lost, by reason."),
         "unread": ("reason", "Requests or answers passed on without being read, by reason."),
         "records_accepted": ("", "Records the exporter accepted.")}


class TapCollector:
    """The tap's counts as Prometheus counters (``phasewatch_tap_*``), read at scrape."""

    def __init__(self, tap: Tap, client=None):
        self._tap, self._client = tap, client

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        stats = dict(self._client.stats) if self._client is not None else None
        for family, values in tallies(self._tap.counts, stats).items():
            label, text = _HELP[family]
            m = CounterMetricFamily(f"phasewatch_tap_{family}", text,
                                    labels=[label] if label else None)
            for value, n in sorted(values.items()):
                m.add_metric([value] if label else [], n)
            yield m


def metrics_app(tap: Tap, client=None) -> web.Application:
    """``GET /metrics``: the tap's counts in Prometheus text, on a port of its own (the
    tap's port passes every path to the upstream)."""
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(TapCollector(tap, client))

    async def metrics(_request):
        return web.Response(body=generate_latest(registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    return app


def server_ssl(cert_file: str, key_file: str) -> ssl.SSLContext:
    """The tap's HTTPS listener, from PEM files checked at most once a second as
    ``phasewatch serve``'s are: new connections get renewed certificates."""
    from phasewatch.transport.tls import TlsFiles

    files = TlsFiles(cert_file, key_file)
    ctx = files.context(("http/1.1",), "none")

    def current(conn: ssl.SSLObject, _name, _ctx) -> None:  # called on every handshake
        conn.context = files.context(("http/1.1",), "none")

    ctx.sni_callback = current
    return ctx


class TapServer:
    """The tap on its own event loop thread: ``start()``, ``port``, ``stop()``; with
    ``metrics_port`` (0: a free one) its counts (and ``client``'s) on ``/metrics``
    there; with ``ssl_context``, both over HTTPS. ``stop()`` lets open streams finish
    for ``grace`` seconds, then cuts them (counted ``tap_stopped``)."""

    def __init__(self, tap: Tap, host: str = "127.0.0.1", port: int = 0, *,
                 ssl_context: ssl.SSLContext | None = None, metrics_port: int | None = None,
                 client=None, grace: float = 10.0):
        self.tap, self.host, self.port = tap, host, port
        self.metrics_port, self._client = metrics_port, client
        self._ssl, self._grace = ssl_context, grace
        self._loop = asyncio.new_event_loop()
        self._runners: list[web.AppRunner] = []
        self._thread = threading.Thread(target=self._loop.run_forever, name="pw-tap",
                                        daemon=True)

    @property
    def scheme(self) -> str:
        return "https" if self._ssl is not None else "http"

    def start(self) -> TapServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._up(), self._loop).result(30)
        return self

    async def _site(self, app: web.Application, port: int) -> int:
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=self._grace)
        await runner.setup()
        self._runners.append(runner)
        site = web.TCPSite(runner, self.host, port, reuse_address=True,
                           ssl_context=self._ssl)
        await site.start()
        return site._server.sockets[0].getsockname()[1]

    async def _up(self) -> None:
        self.port = await self._site(self.tap.app(), self.port)
        if self.metrics_port is not None:
            self.metrics_port = await self._site(metrics_app(self.tap, self._client),
                                                 self.metrics_port)

    def stop(self) -> None:
        """Idempotent."""
        if not self._thread.is_alive():
            return
        runners, self._runners = self._runners, []
        for runner in reversed(runners):
            asyncio.run_coroutine_threadsafe(runner.cleanup(), self._loop).result(
                self._grace + 30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def client_recorder(client):
    """``Tap``'s record callback over a ``PhasewatchClient``."""
    def record(model: str, kwargs: dict) -> None:
        client.record(model, **kwargs)
    return record


class BatchRecorder:
    """``Tap``'s record callback inside ``phasewatch serve`` (``--tap-upstream``): records
    gather here and go to ``sink`` (the exporter's trace join: ``ingest(batch,
    protocol)``) as one batch every ``interval`` seconds, from a thread of their own,
    never from the tap's event loop. Past ``max_buffer`` waiting records, or after
    ``close()``, a record is dropped and counted; ``stats`` has the client's keys
    (accepted, rejected, dropped_<reason>), so ``tallies`` reads either."""

    def __init__(self, sink, engine: str, interval: float = 0.25,
                 max_buffer: int = 100_000):
        self._sink, self._engine = sink, engine
        self._interval, self._max = interval, max_buffer
        self._rows: list[tuple] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.stats: Counter = Counter()
        self._thread = threading.Thread(target=self._run, name="pw-tap-records",
                                        daemon=True)
        self._thread.start()

    def __call__(self, model: str, kwargs: dict) -> None:
        row = RequestRecord(model, **kwargs).row(self._engine)
        with self._lock:
            if self._closed.is_set() or len(self._rows) >= self._max:
                self.stats["dropped_closed" if self._closed.is_set()
                           else "dropped_buffer_full"] += 1
                return
            self._rows.append(row)

    def _run(self) -> None:
        while not self._closed.wait(self._interval):
            self.flush()
        self.flush()

    def flush(self) -> None:
        with self._lock:
            rows, self._rows = self._rows, []
        if not rows:
            return
        try:
            batch = RequestBatch.from_rows(rows)
            batch.source[:] = SOURCE_TAP
            result = self._sink(batch, "tap")
        except Exception:  # a bug here must not stop the tap: the records are counted
            log.exception("handing the tap's records to the exporter failed")
            self.stats["dropped_invalid"] += len(rows)
            return
        self.stats["sent"] += len(rows)
        self.stats["accepted"] += result.accepted
        self.stats["rejected"] += len(rows) - result.accepted

    def close(self) -> None:
        """Hand over what is waiting, then drop (and count) what comes after."""
        self._closed.set()
        self._thread.join(10)


def summary(counts: Mapping[str, int], client_stats: Mapping[str, int] | None = None) -> str:
    """One line: each family's counts that are not zero."""
    parts = []
    for family, values in tallies(counts, client_stats).items():
        if family == "records_accepted":
            parts.append(f"records_accepted {values['']}")
            continue
        shown = ", ".join(f"{k} {v}" for k, v in sorted(values.items()) if v)
        parts.append(f"{family}: {shown or 'none'}")
    return "; ".join(parts)


def serve_forever(upstream: str, target: str, host: str, port: int, engine: str,
                  default_model: str, *, token: str = "", client_tls=None,
                  tls_cert_file: str = "", tls_key_file: str = "", upstream_ca: str = "",
                  timeout_s: float = 3600.0, max_body_bytes: int = 64 << 20,
                  metrics_port: int | None = None, ask_usage: bool = False,
                  stop: threading.Event | None = None) -> int:
    """Run the tap until ``stop`` is set (or Ctrl-C), then log what it counted.
    ``token`` / ``client_tls`` (an ``phasewatch.transport.tls.ClientTls``): to the exporter;
    ``tls_cert_file`` / ``tls_key_file``: the tap's own HTTPS listener."""
    from phasewatch.client import PhasewatchClient
    from phasewatch.transport.tls import ClientTls

    tls = client_tls or ClientTls()
    client = PhasewatchClient(target, engine=engine, source="tap", token=token,
                              tls_ca=tls.ca, tls_cert=tls.cert, tls_key=tls.key)
    tap = server = None
    try:
        tap = Tap(upstream, client_recorder(client), default_model=default_model,
                  max_body_bytes=max_body_bytes, timeout_s=timeout_s, upstream_ca=upstream_ca,
                  ask_usage=ask_usage)
        listener = (server_ssl(tls_cert_file, tls_key_file)
                    if tls_cert_file or tls_key_file else None)
        server = TapServer(tap, host, port, ssl_context=listener, metrics_port=metrics_port,
                           client=client).start()
        print(f"phasewatch tap on {server.scheme}://{host}:{server.port} -> {upstream}; "
              f"records to {target} (pid {os.getpid()})", flush=True)
        if server.metrics_port is not None:
            print(f"phasewatch tap counts on {server.scheme}://{host}:{server.metrics_port}"
                  "/metrics", flush=True)
        (stop or threading.Event()).wait()
    except KeyboardInterrupt:
        pass
    finally:
        if server is not None:
            server.stop()
        client.close()
        if tap is not None:
            log.info("phasewatch tap stopped: %s", summary(tap.counts, client.stats))
    return 0
