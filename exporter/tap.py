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
in the same trace as the tap's record.

Records go to the exporter through ``PhasewatchClient`` (never blocking: when the
exporter is away they are buffered, then dropped and counted). Nothing the tap does
for phasewatch can fail the user's request: an answer it cannot read is passed on
unread and counted; an upstream that cannot be reached is answered 502, as any proxy
does; a client that hangs up mid-stream closes the upstream request (the server stops
generating) and is counted with its reason.

Other paths (``/v1/models``, ``/health``, ``/metrics`` ...) pass through untimed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

log = logging.getLogger(__name__)

TIMED_PATHS = ("/v1/chat/completions", "/v1/completions")
# RFC 9110 hop-by-hop headers, and those the proxy recomputes
_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                  "te", "trailer", "transfer-encoding", "upgrade", "host",
                  "content-length"})
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

    def choice(self, index: int) -> Choice:
        c = self.choices.get(index)
        if c is None:
            c = self.choices[index] = Choice()
        return c

    @property
    def emissions(self) -> list[float]:
        """Every choice's emissions, in time order."""
        return sorted(t for c in self.choices.values() for t in c.emissions)

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
            if output is None and counts:
                output = sum(counts)
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
        seen.model = seen.model or str(msg.get("model") or "")
        emitted, finishing = [], []
        for choice in msg.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            index = choice.get("index", 0)
            c = seen.choice(index if isinstance(index, int) and 0 <= index < 1024 else 0)
            delta = choice.get("delta") if streamed else choice.get("message")
            if (isinstance(delta, dict) and (delta.get("content") or delta.get("tool_calls")
                                             or delta.get("reasoning_content"))
                    ) or choice.get("text"):
                emitted.append(c)
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
        # the running usage's growth belongs to the chunk's one choice (vLLM sends one
        # choice per chunk); with several in one chunk, their tokens are unknown
        for c in emitted or (finishing if grew else ()):
            c.emissions.append(t)
            c.tokens.append(done - self._usage_tokens if grew and (
                len(emitted or finishing) == 1) else 0)  # 0: unknown
        if grew:
            self._usage_tokens = done
        if not emitted and not grew:
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


def _event_end(buf: bytes) -> tuple[int, int] | None:
    """(end of the first event, start of the next), or None while incomplete."""
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


def traceparent(incoming: str | None) -> str:
    """A new span in the caller's trace (W3C trace context), or in a new trace."""
    parts = (incoming or "").strip().split("-")
    trace = parts[1] if (len(parts) == 4 and len(parts[1]) == 32
                         and _hex(parts[1]) and parts[1] != "0" * 32) else None
    flags = parts[3] if trace and len(parts[3]) == 2 and _hex(parts[3]) else "01"
    return f"00-{trace or secrets.token_hex(16)}-{secrets.token_hex(8)}-{flags}"


def _hex(s: str) -> bool:
    try:
        int(s, 16)
    except ValueError:
        return False
    return True


class Tap:
    """The proxy. ``record`` receives (model, kwargs of ``PhasewatchClient.record``) for
    each timed request; ``counts`` holds what happened, by outcome."""

    def __init__(self, upstream: str, record, *, default_model: str = "",
                 max_body_bytes: int = 64 << 20, timeout_s: float = 3600.0):
        self.upstream = upstream.rstrip("/")
        self._record = record
        self.default_model = default_model
        self.max_body_bytes = max_body_bytes
        self.timeout_s = timeout_s
        self.counts: Counter = Counter()
        self._session: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes)
        app.router.add_route("*", "/{path:.*}", self._handle)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _app) -> None:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=30,
                                          sock_read=self.timeout_s),
            auto_decompress=False)

    async def _stop(self, _app) -> None:
        if self._session is not None:
            await self._session.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        arrival = time.time()
        timed = request.method == "POST" and request.path in TIMED_PATHS
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            self.counts["body_too_large"] += 1
            raise
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        seen = Observed(arrival=arrival) if timed else None
        streamed = False
        if timed:
            headers = {k: v for k, v in headers.items() if k.lower() != "traceparent"}
            headers["traceparent"] = traceparent(request.headers.get("traceparent"))
            seen.trace_parent = headers["traceparent"][3:-3]  # "<trace id>-<span id>"
            try:
                asked = json.loads(body) if body else {}
                streamed = isinstance(asked, dict) and bool(asked.get("stream"))
                if isinstance(asked, dict):
                    seen.model = str(asked.get("model") or "")
            except ValueError:
                self.counts["unreadable_request"] += 1  # passed on as it is
        url = self.upstream + request.path_qs
        try:
            upstream = await self._session.request(request.method, url, headers=headers,
                                                   data=body, allow_redirects=False)
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            self.counts["upstream_unreachable"] += 1
            return web.Response(status=502, text=f"phasewatch tap: upstream {url}: {e}\n")
        try:
            return await self._relay(request, upstream, seen, streamed)
        finally:
            upstream.release()

    async def _relay(self, request, upstream, seen: Observed | None,
                     streamed: bool) -> web.StreamResponse:
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
        try:
            await resp.prepare(request)
            async for chunk in upstream.content.iter_any():
                t = time.time()
                await resp.write(chunk)
                if reader is not None and upstream.status == 200:
                    if streamed:
                        reader.feed(chunk, t)
                    elif len(whole) < _MAX_EVENT:
                        whole += chunk
            await resp.write_eof()
        except ConnectionResetError:  # writing to a client that hung up (aiohttp's own too)
            if seen is not None:
                seen.aborted = "client_disconnected"
            self.counts["client_disconnected"] += 1
        except (TimeoutError, aiohttp.ClientError):
            if seen is not None:
                seen.aborted = "upstream_broke_off"
            self.counts["upstream_broke_off"] += 1
        if seen is not None:
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


class TapServer:
    """The tap on its own event loop thread: ``start()``, ``port``, ``stop()``."""

    def __init__(self, tap: Tap, host: str = "127.0.0.1", port: int = 0):
        self.tap, self.host, self.port = tap, host, port
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="pw-tap",
                                        daemon=True)

    def start(self) -> TapServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._up(), self._loop).result(30)
        return self

    async def _up(self) -> None:
        self._runner = web.AppRunner(self.tap.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def client_recorder(client):
    """``Tap``'s record callback over a ``PhasewatchClient``."""
    def record(model: str, kwargs: dict) -> None:
        client.record(model, **kwargs)
    return record


def serve_forever(upstream: str, target: str, host: str, port: int, engine: str,
                  default_model: str) -> int:
    from exporter.client import PhasewatchClient

    client = PhasewatchClient(target, engine=engine, source="tap")
    server = TapServer(Tap(upstream, client_recorder(client), default_model=default_model),
                       host, port).start()
    print(f"phasewatch tap on http://{host}:{server.port} -> {upstream}; records to "
          f"{target} (pid {os.getpid()})", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
        client.close()
    return 0
