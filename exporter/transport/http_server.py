"""HTTP on one port: ``/metrics`` (gzip when asked), ``/healthz``, ``/readyz`` and the JSON API.

JSON API (for the dashboard):
* ``GET /api/v1/summary?window=SECONDS``: rolling-window summary per (model, engine);
* ``GET /api/v1/requests?limit=N&model=NAME``: the newest requests with their phases;
* ``GET /api/v1/roofline?model=NAME``: deployment, estimate, verdict and trail per model;
* ``GET /api/v1/history?seconds=S``: the summary's figures sampled on the roofline timer;
* ``GET /api/v1/bench?window=SECONDS``: the window as ``vllm bench serve`` prints a run
  (``phasewatch.publish.benchtext``), its text and figures per (model, engine);
* ``GET /api/v1/status``: ingest totals and the bound ports.

In ``summary`` and ``bench`` alike, ``requests_in_window`` / ``requests`` counts the
requests that finished in the window (weighted 1/p where traces were sampled), and a
quantile's ``count`` those same requests whose figure is known, each once: equal
without sampling, a TTFT-less engine (TGI without its prefill spans) or more requests
than --window-capacity.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import math
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

from phasewatch.transport.auth import BearerAuth

log = logging.getLogger(__name__)
MAX_RECENT = 5000  # most requests one /api/v1/requests call returns


class ApiError(ValueError):
    pass


def query_number(qs: dict, name: str, default: float, lo: float, hi: float) -> float:
    raw = qs.get(name, [None])[0]
    if raw is None:
        return default
    try:
        v = float(raw)
    except ValueError:
        raise ApiError(f"{name} must be a number, got {raw!r}") from None
    if not (lo <= v <= hi) or math.isnan(v):
        raise ApiError(f"{name} must be between {lo:g} and {hi:g}, got {raw!r}")
    return v


def send_body(handler, code: int, body: bytes, ctype: str, headers=(),
              gzipped: bool = False, head: bool = False) -> None:
    """One whole response from a ``BaseHTTPRequestHandler``: status, type, length, extra
    headers, body (gzip-compressed at level 1 when ``gzipped``; not sent for ``head``,
    the answer to a HEAD request)."""
    if gzipped:
        body = gzip.compress(body, compresslevel=1)
    handler.send_response(code)
    if gzipped:
        handler.send_header("Content-Encoding", "gzip")
    handler.send_header("Content-Type", ctype)
    handler.send_header("Content-Length", str(len(body)))
    for k, v in headers:
        handler.send_header(k, v)
    handler.end_headers()
    if not head:
        handler.wfile.write(body)


def make_handler(metrics: Callable[[str], tuple[bytes, str]],
                 api: dict[str, Callable[[dict], object]],
                 ready: Callable[[], bool], auth: BearerAuth | None = None,
                 mutual_tls=None):
    """``auth``: when enabled, ``/api/v1/`` needs the bearer token; /metrics and the
    probes stay open (Prometheus and the kubelet carry no token). ``mutual_tls``: the
    SelfStats to count in when ``/api/v1/`` needs a verified client certificate."""
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "phasewatch"
        timeout = 30  # seconds a connection may stall (slowloris) before it is closed

        def log_message(self, fmt, *args):  # route access logs to logging, at debug
            log.debug("%s " + fmt, self.address_string(), *args)

        def _send(self, code: int, body: bytes, ctype: str, headers=()) -> None:
            gzipped = "gzip" in self.headers.get("Accept-Encoding", "") and len(body) > 1024
            send_body(self, code, body, ctype, headers, gzipped)

        def _json(self, code: int, obj) -> None:
            self._send(code, json.dumps(obj, allow_nan=False).encode(), "application/json")

        def do_GET(self):
            url = urlparse(self.path)
            if url.path == "/metrics":
                body, ctype = metrics(self.headers.get("Accept", ""))
                return self._send(200, body, ctype)
            if url.path == "/healthz":
                return self._send(200, b"ok\n", "text/plain")
            if url.path == "/readyz":
                ok = ready()
                return self._send(200 if ok else 503, b"ready\n" if ok else b"not ready\n",
                                  "text/plain")
            if (mutual_tls is not None and url.path.startswith("/api/")
                    and not getattr(self.connection, "getpeercert", lambda: None)()):
                mutual_tls.inc("phasewatch_auth_refused_total", receiver="api",
                               reason="no_client_certificate")
                return self._send(403, b'{"error": "the JSON API needs a client '
                                  b'certificate signed by --tls-client-ca-file"}',
                                  "application/json")
            if (auth is not None and url.path.startswith("/api/")
                    and not auth.allows("api", self.headers.get("Authorization"))):
                return self._send(
                    401, b'{"error": "the JSON API needs Authorization: Bearer <token>"}',
                    "application/json", (("WWW-Authenticate", 'Bearer realm="phasewatch"'),))
            route = api.get(url.path)
            if route is None:
                endpoints = [*sorted(api), "/metrics", "/healthz", "/readyz"]
                return self._json(404, {"error": f"no such endpoint {url.path}",
                                        "endpoints": endpoints})
            try:
                return self._json(200, route(parse_qs(url.query)))
            except ApiError as e:
                return self._json(400, {"error": str(e)})

    return Handler


# What a connection past the cap gets, before its request is read (clients retry 503).
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Length: 0\r\n"
        b"Connection: close\r\n\r\n")


class _BoundedServer(ThreadingHTTPServer):
    """One thread per connection, at most ``max_connections`` of them: past the cap a
    connection is answered 503 with Retry-After and closed, and ``on_refused`` counts it.
    With ``tls`` (files, receiver, client-certificate policy) each connection's TLS
    handshake is done in its own thread before the request is read."""

    daemon_threads = True

    def __init__(self, address, handler, max_connections: int,
                 on_refused: Callable[[], None], tls: tuple | None = None):
        self._slots = threading.BoundedSemaphore(max_connections)
        self._on_refused = on_refused
        self.tls = tls
        super().__init__(address, handler)

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            self._on_refused()
            with contextlib.suppress(OSError):
                request.sendall(BUSY)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            if self.tls is not None:
                files, receiver, client = self.tls
                request = files.accept(request, receiver, ("http/1.1",), client)
                if request is None:  # refused and counted
                    return
            self.finish_request(request, client_address)
        except ConnectionError as e:
            # the client hung up before its answer was read or written (a dashboard that
            # gave up on a slow answer, a probe's timeout): its business, not an error
            # here; socketserver would print a traceback on stderr
            log.debug("%s:%s hung up: %s", *client_address[:2], e)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            if request is not None:
                self.shutdown_request(request)
            self._slots.release()


class HttpServer:
    def __init__(self, host: str, port: int, handler, max_connections: int = 256,
                 on_refused: Callable[[], None] = lambda: None, tls: tuple | None = None):
        self._server = _BoundedServer((host, port), handler, max_connections, on_refused, tls)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="pw-http",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
