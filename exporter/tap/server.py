"""The tap's listener: TLS from reloaded PEM files, the aiohttp sites on an event loop
thread of their own (``TapServer``), ``tap_of``: the ``Tap`` of a ``TapConfig`` (``phasewatch
tap``'s or ``serve --tap-*``'s), and ``start``: a running tap of ``phasewatch tap``'s settings
(``workers.serve_forever`` runs one, or several processes of them)."""

from __future__ import annotations

import asyncio
import logging
import ssl
import threading

from aiohttp import web

from phasewatch.tap.config import TapConfig
from phasewatch.tap.proxy import Tap
from phasewatch.tap.recorder import client_recorder
from phasewatch.tap.stats import metrics_app
from phasewatch.transport.listen import listening

log = logging.getLogger(__name__)


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


class ServerLog:
    """aiohttp's server logger for the tap's listener. A request its HTTP parser refuses
    (too many headers, a malformed request line: answered 400 by aiohttp before the tap
    sees it) is counted, outcome ``bad_request``, and logged in one line; anything else
    aiohttp reports (an error in the tap's own handler, a bug) is counted ``tap_error``
    and logged with its traceback."""

    def __init__(self, counts):
        self._counts = counts

    def _report(self, level: int, msg: str, *args, exc_info=None, **_kw) -> None:
        from aiohttp.http_exceptions import HttpProcessingError

        remote = args[0] if args else "?"
        if isinstance(exc_info, HttpProcessingError):
            self._counts["bad_request"] += 1
            why = " ".join(str(exc_info.message or exc_info).split())
            log.log(level, "refused a request from %s that could not be read as HTTP "
                    "(answered %s): %s", remote, exc_info.code, why)
        else:
            self._counts["tap_error"] += 1
            log.error(msg, *args, exc_info=exc_info)

    def exception(self, msg: str, *args, **kw) -> None:
        self._report(logging.WARNING, msg, *args, **kw)

    def debug(self, msg: str, *args, exc_info=None, **kw) -> None:
        from aiohttp.http_exceptions import HttpProcessingError

        if isinstance(exc_info, HttpProcessingError):  # non-HTTP bytes as a first request
            self._report(logging.DEBUG, msg, *args, exc_info=exc_info)
        else:  # aiohttp's own debug lines (its loop in debug mode): not an outcome
            logging.getLogger("aiohttp.server").debug(msg, *args, exc_info=exc_info, **kw)

    def __getattr__(self, name: str):
        return getattr(logging.getLogger("aiohttp.server"), name)


LOOPS = ("auto", "asyncio", "uvloop")


def new_loop(kind: str = "auto") -> asyncio.AbstractEventLoop:
    """The tap's event loop: uvloop's (libuv, the faster per chunk; ``make bench`` shows
    both) where it is installed, else asyncio's own; ``kind`` forces one."""
    if kind not in LOOPS:
        raise ValueError(f"--loop must be one of {', '.join(LOOPS)}, got {kind!r}")
    if kind != "asyncio":
        try:
            import uvloop
        except ImportError:
            if kind == "uvloop":
                raise ValueError("--loop uvloop: uvloop is not installed") from None
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


class TapServer:
    """The tap on its own event loop thread: ``start()``, ``port``, ``stop()``; with
    ``metrics_port`` (0: a free one) its counts (and ``client``'s) on ``/metrics``
    there; with ``ssl_context``, both over HTTPS. ``stop()`` lets open streams finish
    for ``grace`` seconds, then cuts them (counted ``tap_stopped``). ``listener``: what
    a port that cannot be bound is called and the flag that moves it (``ListenError``;
    the metrics port's flag is ``--metrics-port``)."""

    def __init__(self, tap: Tap, host: str = "127.0.0.1", port: int = 0, *,
                 ssl_context: ssl.SSLContext | None = None, metrics_port: int | None = None,
                 client=None, grace: float = 10.0, loop: str = "auto",
                 reuse_port: bool = False, listener: tuple[str, str] = ("the tap", "--port")):
        self.tap, self.host, self.port, self._listener = tap, host, port, listener
        self.metrics_port, self._client = metrics_port, client
        self._ssl, self._grace = ssl_context, grace
        self._reuse_port = reuse_port  # one of several processes on the tap's port
        self._loop = new_loop(loop)
        self._runners: list[web.AppRunner] = []
        self._thread = threading.Thread(target=self._loop.run_forever, name="pw-tap",
                                        daemon=True)

    @property
    def scheme(self) -> str:
        return "https" if self._ssl is not None else "http"

    def start(self) -> TapServer:
        self._thread.start()

        def up(app: web.Application, port: int, reuse_port: bool = False) -> int:
            return asyncio.run_coroutine_threadsafe(self._site(app, port, reuse_port),
                                                    self._loop).result(30)

        what, flag = self._listener
        try:
            self.port = listening(what, flag, self.host, self.port,
                                  lambda: up(self.tap.app(), self.port, self._reuse_port))
            if self.metrics_port is not None:
                self.metrics_port = listening(
                    "the tap's counts", "--metrics-port", self.host, self.metrics_port,
                    lambda: up(metrics_app(self.tap, self._client), self.metrics_port))
        except BaseException:
            self.stop()  # the loop's thread, and a site already up
            raise
        return self

    async def _site(self, app: web.Application, port: int, reuse_port: bool = False) -> int:
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=self._grace,
                               logger=ServerLog(self.tap.counts))
        await runner.setup()
        self._runners.append(runner)
        site = web.TCPSite(runner, self.host, port, reuse_address=True,
                           reuse_port=reuse_port or None, ssl_context=self._ssl)
        await site.start()
        return site._server.sockets[0].getsockname()[1]

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


def recorder(conf: TapConfig):
    """(what counts the records sent: ``stats``, ``close()``; the ``Tap``'s record
    callback): to ``conf.target`` (an exporter's phasewatch gRPC port) or, with
    ``conf.otlp_endpoint``, as OTLP spans there (an OpenTelemetry Collector in front of
    a fleet: ``otlp_out``)."""
    from phasewatch.client import PhasewatchClient

    tls = conf.client_tls
    if conf.otlp_endpoint:
        from phasewatch.tap.otlp_out import OtlpRecorder, span_exporter

        client = OtlpRecorder(span_exporter(conf.otlp_endpoint, token=conf.token, tls=tls),
                              conf.engine)
        return client, client
    client = PhasewatchClient(conf.target, engine=conf.engine, source="tap",
                              token=conf.token, tls_ca=tls.ca, tls_cert=tls.cert,
                              tls_key=tls.key)
    return client, client_recorder(client)


def tap_of(conf: TapConfig, record) -> Tap:
    """The ``Tap`` of ``conf`` (its upstream, limits, CA, ask-usage), its records to
    ``record``: ``phasewatch tap``'s and ``serve --tap-upstream``'s alike."""
    return Tap(conf.upstream, record, default_model=conf.model,
               max_body_bytes=conf.max_body_bytes, timeout_s=conf.timeout,
               upstream_ca=conf.upstream_ca, ask_usage=conf.ask_usage)


def listener_ssl(conf: TapConfig) -> ssl.SSLContext | None:
    """The tap's own HTTPS context from ``conf``'s PEM files; None for plain HTTP."""
    cert, key = conf.tls_cert_file, conf.tls_key_file
    return server_ssl(cert, key) if cert or key else None


def announce(conf: TapConfig, scheme: str, port: int, metrics_port: int | None,
             processes: str) -> None:
    """The lines ``phasewatch tap`` prints once it listens (``processes``: its pids)."""
    print(f"phasewatch tap on {scheme}://{conf.host}:{port} -> {conf.upstream}; "
          f"records to {conf.destination} ({processes})", flush=True)
    if metrics_port is not None:
        print(f"phasewatch tap counts on {scheme}://{conf.host}:{metrics_port}/metrics",
              flush=True)


def start(conf: TapConfig, port: int, metrics_port: int | None = None,
          reuse_port: bool = False) -> tuple[Tap, object, TapServer]:
    """A running tap of ``conf`` on ``port``: (the ``Tap``, what counts its records, its
    ``TapServer``)."""
    client, record = recorder(conf)
    try:
        tap = tap_of(conf, record)
        server = TapServer(tap, conf.host, port, ssl_context=listener_ssl(conf),
                           metrics_port=metrics_port, client=client, loop=conf.loop,
                           reuse_port=reuse_port).start()
    except BaseException:
        client.close()
        raise
    return tap, client, server
