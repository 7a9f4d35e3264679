"""The proxying handler, ``Tap``: every request and answer passed on byte for byte,
streamed as it comes; a timed request (``POST /v1/chat/completions``,
``/v1/completions``) read for its model, sent with the tap's trace context (and
``stream_options.include_usage`` with ``ask_usage``), its answer read as it streams
(``sse``) into an ``Observed``, and its records handed to the ``record`` callback.

Nothing the tap does for phasewatch can fail the user's request: an answer it cannot
read is passed on unread and counted; a request body larger than the tap reads
(64 MiB) is streamed to the server as it comes, untimed and counted; an upstream that
cannot be reached is answered 502, one silent for ``timeout_s`` before answering 504,
as any proxy does; one that breaks off or goes silent mid-answer leaves the client's
answer cut off where it stopped (no clean end the server never sent); a client that
hangs up mid-stream closes the upstream request (the server stops generating). Every
request has one outcome in ``Tap.counts``, every cut-short answer its reason, every
record lost its reason (``stats.tallies``).

Other paths (``/v1/models``, ``/health``, ``/metrics`` ...) pass through untimed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
from collections import Counter
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from phasewatch.tap.observed import Observed
from phasewatch.tap.relay import HOP, relay_answer, response_head
from phasewatch.tap.sse import MAX_EVENT, EventReader, UsageFilter
from phasewatch.tap.tracecontext import caller_span, trace_headers
from phasewatch.tap.upstream import UpstreamPool

log = logging.getLogger(__name__)

TIMED_PATHS = ("/v1/chat/completions", "/v1/completions")
# headers aiohttp's client would add to a request that lacks them: the tap adds none
_NO_AUTO_HEADERS = ("User-Agent", "Accept", "Accept-Encoding", "Content-Type")


class Tap:
    """The proxy. ``record`` receives (model, kwargs of ``PhasewatchClient.record``, the
    ``Observed`` they came from) for each timed request; ``counts`` holds what happened
    (its families: ``tallies``).

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
        self._pool: UpstreamPool | None = None  # a timed streamed answer's connections
        self._watchdog: asyncio.Task | None = None
        # open answers: key -> [when the tap last read from the server or finished
        # writing to the client (loop time; inf while a write waits on the client),
        # what ends the answer as stalled]
        self._open: dict[int, list] = {}

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
            # no sock_read: aiohttp would move a timer on every read; the silence of an
            # answer is watched once a tick for all streams (_watch), and the wait for
            # an answer's head bounded per request (_handle)
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=min(30.0, self.timeout_s)),
            auto_decompress=False)
        self._pool = UpstreamPool(self.upstream, self._upstream_ssl, min(30.0, self.timeout_s))
        self._watchdog = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        """An answer silent for ``timeout_s`` (nothing read from the server, while the tap
        was not waiting on the client) is ended as aiohttp's sock_read timeout would end
        it: its reader raises a TimeoutError (counted ``upstream_stalled``). One check a
        tick for every open stream, instead of a timer moved on every read."""
        loop = asyncio.get_running_loop()
        tick = min(1.0, self.timeout_s / 4)
        while True:
            await asyncio.sleep(tick)
            now = loop.time()
            for entry in list(self._open.values()):
                if now - entry[0] > self.timeout_s:
                    entry[0] = float("inf")  # ended once
                    entry[1]()

    async def _stop(self, _app) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._session is not None:
            await self._session.close()
        if self._pool is not None:
            self._pool.close()

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
                              if k.lower() not in HOP)
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
        if seen is not None:
            streamed, body = self._timed(request, headers, seen, whole, body)
            if streamed:
                return await self._stream(request, headers, seen, body)
        url = self.upstream + request.path_qs
        try:
            async with asyncio.timeout(self.timeout_s):  # until the answer's head
                upstream = await self._session.request(request.method, url, headers=headers,
                                                       data=body, allow_redirects=False)
        except asyncio.CancelledError:  # the tap is stopping before the server answered
            self._unanswered(timed, "tap_stopped", untimed)
            raise
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            return self._no_answer(request, url, e, timed, untimed)
        if untimed:
            self.counts[untimed] += 1
        try:
            return await self._relay(request, upstream, seen, streamed,
                                     UsageFilter() if seen is not None and seen.hide_usage
                                     and upstream.content_length is None else None)
        finally:
            upstream.release()

    def _timed(self, request: web.Request, headers: CIMultiDict, seen: Observed,
               whole: bytes, body) -> tuple[bool, object]:
        """A timed request: sent with the tap's trace context (the caller's parent, if
        any, is ``seen``'s caller span), read for its model and whether it streams; with
        ``ask_usage`` a streamed one that did not ask for the usage asks for it. (whether
        it streams, the body to send)."""
        parent, state = trace_headers(request.headers.get("traceparent"),
                                      request.headers.getall("tracestate", []))
        headers["traceparent"], headers["tracestate"] = parent, state  # replaced
        seen.trace_parent = parent[3:-3]  # "<trace id>-<span id>"
        seen.path = request.path
        seen.caller_span = caller_span(request.headers.get("traceparent"), parent)
        streamed = False
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
        return streamed, body

    def _no_answer(self, request: web.Request, url: str, e: Exception, timed: bool,
                   untimed: str | None) -> web.Response:
        """The upstream did not answer (``e``): nothing to a client that went away, else
        504 for no answer within ``timeout_s`` (as nginx), 502 for one unreachable."""
        if request.transport is None or request.transport.is_closing():
            return self._unanswered(timed, "client_disconnected", untimed)
        if isinstance(e, TimeoutError):
            self.counts["upstream_timeout"] += 1
            return web.Response(status=504, text=f"phasewatch tap: upstream {url}: no "
                                f"answer within {self.timeout_s:g}s\n")
        self.counts["upstream_unreachable"] += 1
        return web.Response(status=502, text=f"phasewatch tap: upstream {url}: {e}\n")

    def _unanswered(self, timed: bool, why: str, untimed: str | None = "untimed"
                    ) -> web.Response:
        """A request that ended before the server answered, for ``why`` (an abort)."""
        self.counts[why] += 1
        self.counts["unanswered" if timed else untimed] += 1
        return web.Response(status=499)  # to nobody: the client is gone

    def _reader(self, seen: Observed | None, upstream) -> EventReader | None:
        """What reads a timed answer into ``seen``; none for an untimed or a compressed
        one (passed on, not read)."""
        if seen is None:
            return None
        if upstream.headers.get("Content-Encoding", "identity").lower() != "identity":
            self.counts["compressed_answer"] += 1
            return None
        return EventReader(seen, self.counts)

    async def _relay(self, request, upstream, seen: Observed | None, streamed: bool,
                     hide: UsageFilter | None = None) -> web.StreamResponse:
        resp = response_head(upstream)
        reader = self._reader(seen, upstream)
        whole = bytearray()
        aborted, side = "", "client"  # whose fault an exception is
        loop = asyncio.get_running_loop()
        watched = [loop.time(), lambda: self._stall(upstream)]  # for _watch
        self._open[id(watched)] = watched
        inf = float("inf")
        try:
            await resp.prepare(request)
            while True:
                side = "upstream"
                watched[0] = loop.time()
                chunk = await upstream.content.readany()
                if not chunk:
                    break
                t = time.time()
                side = "client"
                passed = hide.feed(chunk) if hide is not None else chunk
                if passed:
                    watched[0] = inf  # the client's pace is not the server's silence
                    await resp.write(passed)
                if reader is not None and upstream.status == 200:
                    if streamed:
                        reader.feed(chunk, t)
                    elif len(whole) < MAX_EVENT:
                        whole += chunk
            side = "client"
            rest = hide.rest() if hide is not None else b""
            if rest:  # an event the server did not close: passed on as it came
                await resp.write(rest)
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
            del self._open[id(watched)]
            if aborted:
                self.counts[aborted] += 1
            if seen is not None:
                self._settle(seen, upstream.status, aborted, reader, streamed, bytes(whole))
        return resp

    def _stall(self, upstream) -> None:
        """An aiohttp answer silent past the timeout: its reader raises."""
        if not upstream.content.is_eof():
            upstream.content.set_exception(TimeoutError(
                f"the upstream sent nothing for {self.timeout_s:g}s"))

    async def _stream(self, request: web.Request, headers: CIMultiDict, seen: Observed,
                      body: bytes) -> web.StreamResponse:
        """A timed streamed request: sent on a connection of the tap's own pool, its
        answer relayed by ``relay.Relay`` from the connection's callbacks."""
        url = self.upstream + request.path_qs
        raw = self._pool.request_bytes(request.method, request.path_qs, headers, body)
        try:
            async with asyncio.timeout(self.timeout_s):  # until the answer's head
                conn = await self._pool.open(raw)
        except asyncio.CancelledError:
            self._unanswered(True, "tap_stopped", None)
            raise
        except (TimeoutError, OSError) as e:
            return self._no_answer(request, url, e, True, None)
        head = conn.head
        resp = response_head(head)
        reader = self._reader(seen, head)
        hide = UsageFilter() if seen.hide_usage and head.content_length is None else None
        watched = [asyncio.get_running_loop().time(), conn.close]
        self._open[id(watched)] = watched
        aborted = ""
        try:
            aborted = await relay_answer(request, resp, conn,
                                         reader if head.status == 200 else None, hide, watched)
        except (aiohttp.ClientError, OSError):  # the client hung up
            aborted = "client_disconnected"
        except asyncio.CancelledError:  # the tap is stopping with this stream open
            aborted = "tap_stopped"
            raise
        finally:
            del self._open[id(watched)]
            if aborted:
                self.counts[aborted] += 1
                conn.close()
            else:
                self._pool.release(conn)
            self._settle(seen, head.status, aborted, reader, True, b"")
        return resp

    def _settle(self, seen: Observed, status: int, aborted: str, reader: EventReader | None,
                streamed: bool, whole: bytes) -> None:
        """The answer is over (``aborted``: why it was cut short, "" if not): what
        ``reader`` holds goes into ``seen``, and its records are handed on."""
        seen.aborted = aborted
        seen.end = time.time()
        seen.status = status
        if reader is not None and streamed:
            reader.flush()  # what it holds unread (each event keeps its time)
        if reader is not None and not streamed and whole and not seen.aborted:
            reader.whole(whole, seen.end)
        seen.settle()
        self._finish(seen)

    def _finish(self, seen: Observed) -> None:
        if seen.status != 200:
            self.counts[f"upstream_status_{seen.status // 100}xx"] += 1
            return  # an error answer is no request the engine served
        self.counts["aborted" if seen.aborted else "completed"] += 1
        model = seen.model or self.default_model
        if not model:
            self.counts["no_model"] += 1
            return
        for kwargs in seen.records(self.counts):
            try:
                self._record(model, kwargs, seen)
            except Exception:  # never let phasewatch's side fail the user's request
                log.exception("recording a tapped request failed")
                self.counts["record_failed"] += 1


async def _relay_body(head: bytes, rest: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """A request body streamed to the upstream: what was read of it, then the rest."""
    if head:
        yield head
    while piece := await rest.readany():
        yield piece
