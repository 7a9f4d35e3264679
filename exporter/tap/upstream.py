"""The upstream side of a streamed answer, on asyncio's protocol callbacks: an HTTP/1.1
connection (``Upstream``) that writes a request, reads the answer's head, and hands
each piece of its body, unframed, to a sink from ``data_received`` itself, with no
task woken per piece; and the pool of idle connections kept alive between requests
(``UpstreamPool``).

Only what a streamed ``POST`` needs: a whole request body (the tap has read it), an
answer framed by ``Transfer-Encoding: chunked``, ``Content-Length`` or the connection's
end, informational answers (1xx) skipped. Bytes that are not HTTP/1.x are a
``BadAnswer``, answered 502 as an unreachable upstream is.
"""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from multidict import CIMultiDict

HEAD_LIMIT = 64 << 10  # an answer's head larger than this is refused
SIZE_LINE_LIMIT = 4096  # a chunk's size line (with its extensions)
MAX_IDLE = 256  # idle connections kept for reuse


class BadAnswer(ConnectionError):
    """The upstream's bytes are not an HTTP/1.x answer the tap can relay."""


class Disconnected(ConnectionError):
    """The upstream closed the connection before its answer's head."""


@dataclass
class ResponseHead:
    """What ``relay.response_head`` and ``proxy.Tap._reader`` read of an answer."""
    status: int
    reason: str
    headers: CIMultiDict = field(default_factory=CIMultiDict)
    content_length: int | None = None
    keep_alive: bool = True


def parse_head(raw: bytes) -> ResponseHead:
    """An answer's head (status line and header lines, without the blank line)."""
    lines = raw.split(b"\n")
    status_line = lines[0].rstrip(b"\r")
    parts = status_line.split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or len(parts[1]) != 3 \
            or not parts[1].isdigit():
        raise BadAnswer(f"the upstream's answer began {status_line[:80]!r}, not HTTP/1.x")
    headers: CIMultiDict = CIMultiDict()
    for line in lines[1:]:
        line = line.rstrip(b"\r")
        name, colon, value = line.partition(b":")
        if not colon or not name or name != name.strip() or line[:1] in (b" ", b"\t"):
            raise BadAnswer(f"the upstream sent a header line {line[:80]!r}")
        headers.add(name.decode("latin-1"),
                    value.strip(b" \t").decode("utf-8", "surrogateescape"))
    length = None
    if "Content-Length" in headers:
        values = {v.strip() for v in headers.getall("Content-Length")}
        if len(values) != 1 or not next(iter(values)).isdigit():
            raise BadAnswer(f"the upstream sent Content-Length {sorted(values)}")
        length = int(values.pop())
    # a transfer coding but chunked (gzip, say) is one the tap's request did not offer
    # (no TE header): passed on dechunked, the client would read it as the body
    codings = [c.strip().lower() for v in headers.getall("Transfer-Encoding", ())
               for c in v.split(",") if c.strip()]
    if codings and codings != ["chunked"]:
        raise BadAnswer(f"the upstream sent Transfer-Encoding {', '.join(codings)!r}; the "
                        "tap relays chunked only, the one coding it accepts")
    connection = headers.get("Connection", "").lower()
    keep = parts[0] == b"HTTP/1.1" and "close" not in connection
    return ResponseHead(int(parts[1]), (parts[2] if len(parts) > 2 else b"").decode(
        "latin-1"), headers, length, keep)


class Dechunker:
    """A chunked body's data, as it arrives: ``feed`` returns the data pieces in the
    bytes given; ``done`` once the last chunk and its trailers have come (what came
    after them is in ``extra``)."""

    def __init__(self):
        self._buf = b""
        self._left = 0  # bytes of the current chunk's data still to come
        self._crlf = False  # the CRLF after a chunk's data is next
        self._trailers = False  # past the last chunk: trailer lines until a blank one
        self.done = False
        self.extra = b""

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._buf + data if self._buf else data
        self._buf = b""
        out: list[bytes] = []
        pos, n = 0, len(buf)
        while pos < n and not self.done:
            if self._left:
                take = min(self._left, n - pos)
                out.append(buf[pos:pos + take] if take < n or pos else buf)
                pos += take
                self._left -= take
                self._crlf = not self._left
                continue
            if self._crlf:
                if n - pos < 2:
                    break
                if buf[pos:pos + 2] != b"\r\n":
                    raise BadAnswer("a chunk's data did not end in CRLF")
                pos += 2
                self._crlf = False
                continue
            i = buf.find(b"\r\n", pos)
            if i < 0:
                if n - pos > SIZE_LINE_LIMIT:
                    raise BadAnswer("a chunk's size line ran past 4 KiB")
                break
            line, pos = buf[pos:i], i + 2
            if self._trailers:
                self.done = not line  # a trailer line is dropped; a blank one ends it
                continue
            size = line.split(b";", 1)[0].strip()
            if not size or size.strip(b"0123456789abcdefABCDEF"):
                raise BadAnswer(f"a chunk's size line read {line[:40]!r}")
            self._left = int(size, 16)
            self._trailers = not self._left
        if self.done:
            self.extra = buf[pos:]
        elif pos < n:
            self._buf = buf[pos:]
        return out


class Counted:
    """A body framed by its ``Content-Length``."""

    def __init__(self, length: int):
        self._left = length
        self.done = not length
        self.extra = b""

    def feed(self, data: bytes) -> list[bytes]:
        if len(data) >= self._left:
            data, self.extra = data[:self._left], data[self._left:]
            self._left, self.done = 0, True
        else:
            self._left -= len(data)
        return [data] if data else []


class UntilClose:
    """A body that ends with the connection (no length, not chunked)."""
    done = False
    extra = b""

    def feed(self, data: bytes) -> list[bytes]:
        return [data] if data else []  # (an empty piece would end a chunked answer)


class Upstream(asyncio.Protocol):
    """One connection to the upstream. ``send`` writes a request and returns the future
    of its answer's head; ``attach`` then gives the body's pieces to a sink, which has
    ``body(pieces)``, ``end()`` and ``broke(why)`` (``why``: ``upstream_broke_off``)."""

    def __init__(self):
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.requests = 0  # requests sent on this connection
        self.head: ResponseHead | None = None
        self._head_buf = b""
        self._head_future: asyncio.Future | None = None
        self._body = None
        self._sink = None
        self._held: list[bytes] = []  # body pieces read before a sink was attached
        self._ended = False
        self.received = 0  # bytes of the current answer read

    # ---- asyncio.Protocol -----------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self._head_future is not None and not self._head_future.done():
            self._head_future.set_exception(Disconnected(
                f"the upstream closed the connection before answering ({exc or 'EOF'})"))
        elif self._body is not None and not self._ended:
            if isinstance(self._body, UntilClose):
                self._finish()
            else:
                self._broke("upstream_broke_off")

    def data_received(self, data: bytes) -> None:
        self.received += len(data)
        if self._body is None:
            if self._head_future is None or self._head_future.done():
                self.close()  # bytes nobody asked for: the connection is not reused
                return
            data = self._read_head(data)
            if self._body is None:
                return
        if self._ended:  # bytes past the answer's end, before the next request
            self.close()
            return
        try:
            pieces = self._body.feed(data)
        except BadAnswer:
            self._broke("upstream_broke_off")
            return
        if self._sink is not None:
            if pieces:
                self._sink.body(pieces)
        else:
            self._held += pieces
        if self._body.done:
            if self._body.extra:
                self.head.keep_alive = False
            self._finish()

    def eof_received(self):
        return False  # close the transport (connection_lost follows)

    # ---- the request ---------------------------------------------------------------
    def send(self, request: bytes) -> asyncio.Future:
        self.requests += 1
        self.head, self._head_buf, self._body, self._sink = None, b"", None, None
        self._held, self._ended, self.received = [], False, 0
        self._head_future = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self._head_future

    def _read_head(self, data: bytes) -> bytes:
        buf = self._head_buf + data
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > HEAD_LIMIT:
                    self._head_future.set_exception(BadAnswer("the answer's head ran past 64 KiB"))
                    self.close()
                self._head_buf = buf
                return b""
            try:
                head = parse_head(buf[:end])
            except BadAnswer as e:
                self._head_future.set_exception(e)
                self.close()
                return b""
            buf = buf[end + 4:]
            if 100 <= head.status < 200:
                continue  # informational: the answer follows
            break
        self.head, self._head_buf = head, b""
        if "Transfer-Encoding" in head.headers:  # (chunked: parse_head refuses others)
            self._body = Dechunker()
            head.content_length = None
        elif head.content_length is not None or head.status in (204, 304):
            self._body = Counted(head.content_length or 0)
        else:
            self._body = UntilClose()
        if isinstance(self._body, UntilClose):
            head.keep_alive = False
        self._head_future.set_result(head)
        return buf

    def attach(self, sink) -> None:
        """From now on the body's pieces go to ``sink`` as they come; what came before
        goes to it now."""
        self._sink = sink
        held, self._held = self._held, []
        if held:
            sink.body(held)
        if self._ended:
            sink.end()

    def _finish(self) -> None:
        self._ended = True
        if self._sink is not None:
            self._sink.end()

    def _broke(self, why: str) -> None:
        self._ended = True
        if self.head is not None:
            self.head.keep_alive = False
        self.close()
        if self._sink is not None:
            self._sink.broke(why)

    @property
    def reusable(self) -> bool:
        return (not self.closed and self._ended and self.head is not None
                and self.head.keep_alive)

    def pause(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def close(self) -> None:
        """Closed at once (the server sees the connection go and stops generating)."""
        if self.transport is not None and not self.closed:
            self.transport.abort()
        self.closed = True


class UpstreamPool:
    """Connections to one upstream (``http://`` or ``https://``), kept alive between
    requests."""

    def __init__(self, upstream: str, ssl_context: ssl.SSLContext | bool, connect_s: float):
        parts = urlsplit(upstream)
        self._https = parts.scheme == "https"
        self._host = parts.hostname or ""
        self._port = parts.port or (443 if self._https else 80)
        self._host_header = parts.netloc.rsplit("@", 1)[-1]
        self._prefix = parts.path.rstrip("/")
        if self._https:
            self._ssl = ssl_context if isinstance(ssl_context, ssl.SSLContext) \
                else ssl.create_default_context()
        else:
            self._ssl = None
        self._connect_s = connect_s
        self._idle: list[Upstream] = []

    def request_bytes(self, method: str, path_qs: str, headers, body: bytes) -> bytes:
        lines = [f"{method} {self._prefix}{path_qs} HTTP/1.1", f"Host: {self._host_header}"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        lines.append(f"Content-Length: {len(body)}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape") + body

    async def _connect(self) -> Upstream:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self._connect_s):
            _, conn = await loop.create_connection(
                Upstream, self._host, self._port, ssl=self._ssl,
                server_hostname=self._host if self._ssl else None)
        return conn

    async def open(self, request: bytes) -> Upstream:
        """A connection whose answer's head to ``request`` has come. A connection reused
        from the pool that the server closed before reading the request is retried once
        on a fresh one (the request never reached the server)."""
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and not conn.transport.is_closing():
                break
        else:
            conn = await self._connect()
        try:
            try:
                await conn.send(request)
            except Disconnected:
                if conn.requests == 1 or conn.received:
                    raise
                conn = await self._connect()
                await conn.send(request)
            return conn
        except BaseException:
            conn.close()
            raise

    def release(self, conn: Upstream) -> None:
        if conn.reusable and len(self._idle) < MAX_IDLE:
            conn._sink = None
            self._idle.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()
