"""A timed streamed answer passed from the upstream's connection to the client's as
each piece is read: ``Relay`` is the sink an ``upstream.Upstream`` calls from its
``data_received``; it reads the piece (``sse.EventReader``), drops the usage-only chunk
the tap asked for (``sse.UsageFilter``) and writes the rest to the client's transport,
framed as aiohttp began the client's answer, all in that callback. The handler's task
wakes only to begin, when the client's side must be waited on (its write buffer past
``HIGH_WATER``: the upstream is paused meanwhile), and at the end. A bare aiohttp relay
wakes a task, and copies through a stream reader, for every piece (issue 41)."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from phasewatch.tap.sse import EventReader, UsageFilter
from phasewatch.tap.upstream import Upstream

# RFC 9110 hop-by-hop headers, and those the proxy recomputes (an Expect: 100-continue
# was answered by the tap's own server, which then read the body)
HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                 "te", "trailer", "transfer-encoding", "upgrade", "host",
                 "content-length", "expect"})
HIGH_WATER = 1 << 16  # bytes waiting in the client's transport before the upstream pauses


class Relay:
    """One answer's body, upstream to client. ``outcome`` is set when it is over: ""
    (the whole answer passed), ``client_disconnected``, ``upstream_broke_off`` or
    ``upstream_stalled``."""

    def __init__(self, conn: Upstream, client: asyncio.Transport, chunked: bool,
                 reader: EventReader | None, hide: UsageFilter | None, watched: list):
        self._conn = conn
        self._client = client
        self._chunked = chunked
        self._reader = reader
        self._hide = hide
        self._watched = watched  # [when last read from the server, on silence]
        self._loop = asyncio.get_running_loop()
        self._waiter: asyncio.Future | None = None
        self.paused = False
        self.outcome: str | None = None

    # ---- called by the upstream's connection ----------------------------------------
    def body(self, pieces: list[bytes]) -> None:
        if self.outcome is not None:
            return
        t = time.time()
        self._watched[0] = self._loop.time()
        data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        if self._client.is_closing():
            self._over("client_disconnected")
            return
        passed = self._hide.feed(data) if self._hide is not None else data
        if passed:
            self._write(passed)
        if self._reader is not None:
            self._reader.feed(data, t)
        if self._client.get_write_buffer_size() > HIGH_WATER and not self.paused:
            self.paused = True
            self._watched[0] = float("inf")  # the client's pace is not the server's silence
            self._conn.pause()
            self._wake()

    def end(self) -> None:
        if self.outcome is None:
            self.outcome = ""
            self._wake()

    def broke(self, why: str) -> None:
        self._over(why)

    # ---- the handler's side ---------------------------------------------------------
    def stalled(self) -> None:
        """The server sent nothing for the tap's timeout (``Tap._watch``)."""
        self._over("upstream_stalled")

    async def run(self, drain) -> str:
        """Until the answer is over: waits on the client (``drain``, aiohttp's writer's)
        whenever the upstream was paused for it. The outcome."""
        while self.outcome is None:
            if self.paused:
                while self._client.get_write_buffer_size() > HIGH_WATER \
                        and not self._client.is_closing():
                    await drain()  # until aiohttp's side of the client resumes writing
                    if self._client.get_write_buffer_size() > HIGH_WATER:
                        await asyncio.sleep(0.005)  # its transport pauses it later
                if self._client.is_closing():
                    self._over("client_disconnected")
                    break
                self.paused = False
                self._watched[0] = self._loop.time()
                self._conn.resume()
                continue
            self._waiter = self._loop.create_future()
            await self._waiter
        return self.outcome

    def rest(self) -> None:
        """At a clean end: what the usage filter still holds (an event the server did
        not close), passed on as it came."""
        rest = self._hide.rest() if self._hide is not None else b""
        if rest:
            self._write(rest)

    def _write(self, data: bytes) -> None:
        if self._chunked:
            self._client.writelines((b"%x\r\n" % len(data), data, b"\r\n"))
        else:
            self._client.write(data)

    def _over(self, why: str) -> None:
        if self.outcome is None:
            self.outcome = why
            self._conn.close()  # the server stops generating
            self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


async def relay_answer(request: web.Request, resp: web.StreamResponse, conn: Upstream,
                       reader: EventReader | None, hide: UsageFilter | None,
                       watched: list) -> str:
    """``conn``'s answer to the client of ``request`` (``resp``: its head) through a
    ``Relay``, which ``watched[1]`` then stalls; the outcome. A stream cut short by the
    server is cut off at the client too (no clean end the server never sent). Raises
    what aiohttp raises for a client gone before the head was written."""
    writer = await resp.prepare(request)
    send_headers = getattr(writer, "send_headers", None)
    if send_headers is not None:  # aiohttp >= 3.12 holds the head back
        send_headers()  # for the first write; the body goes past it
    client = request.transport
    if client is None or client.is_closing():
        raise ConnectionResetError("the client went away")
    relay = Relay(conn, client, bool(getattr(writer, "chunked", False)), reader, hide, watched)
    watched[1] = relay.stalled
    conn.attach(relay)
    aborted = await relay.run(writer.drain)
    if not aborted:
        relay.rest()
        await resp.write_eof()
    elif aborted != "client_disconnected":
        client.close()
    return aborted


def response_head(upstream) -> web.StreamResponse:
    """The client's answer as the server began it: status, headers (not the hop-by-hop
    ones) and its framing."""
    resp = web.StreamResponse(status=upstream.status, reason=upstream.reason)
    for k, v in upstream.headers.items():
        if k.lower() not in HOP:
            resp.headers.add(k, v)
    if upstream.content_length is not None:  # framed as the server framed it
        resp.content_length = upstream.content_length
    return resp
