"""``phasewatch tap`` (``serve_forever``): one tap, or with ``--workers N`` N processes
on the tap's one port, each a whole tap (its own event loop, reader and recorder), so
that the tap is not held to one core.

The parent binds the port with SO_REUSEPORT first (a free one for port 0) and never
listens on it; each worker listens on it with SO_REUSEPORT too, and the kernel spreads
new connections over the listening workers. Every second each worker sends its counts
(``Tap.counts`` and its recorder's ``stats``) to the parent over a pipe; the parent
serves their sum on ``--metrics-port`` and logs it when it stops, as one tap would. A
worker that dies is started again (what it had counted stays in the sum); the parent
stops the workers on ``stop`` (SIGTERM, Ctrl-C), each letting its open streams finish
as one tap does, and a worker whose parent is gone stops by itself.

Workers are started with multiprocessing's ``spawn`` (a fresh interpreter: nothing of
the parent's threads or sockets is inherited).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from collections import Counter
from multiprocessing.connection import Connection, wait

from phasewatch.tap.config import TapConfig
from phasewatch.tap.server import announce, listener_ssl, start
from phasewatch.tap.stats import summary
from phasewatch.transport.listen import listening

log = logging.getLogger(__name__)

REPORT_S = 1.0  # how often a worker sends its counts to the parent
START_S = 60.0  # how long a worker may take to listen


def serve_forever(conf: TapConfig, stop: threading.Event | None = None) -> int:
    """Run the tap of ``conf`` until ``stop`` is set (or Ctrl-C), then log what it
    counted. Records go where ``server.recorder`` sends them; ``conf.workers`` > 1: that
    many processes on the one port (``serve_workers``)."""
    if conf.workers > 1:
        return serve_workers(conf, stop or threading.Event())
    tap = server = client = None
    try:
        tap, client, server = start(conf, conf.port, conf.metrics_port)
        announce(conf, server.scheme, server.port, server.metrics_port, f"pid {os.getpid()}")
        stop = stop or threading.Event()
        while not stop.wait(0.5):  # in slices: a signal another thread took still runs
            pass                   # its handler here (phasewatch.commands.wait_stopped)
    except KeyboardInterrupt:
        pass
    finally:
        if server is not None:
            server.stop()
        if client is not None:
            client.close()
        if tap is not None:
            log.info("phasewatch tap stopped: %s", summary(tap.counts, client.stats))
    return 0


class Totals:
    """The workers' counts summed: ``counts`` (a ``Tap``'s) and ``stats`` (a recorder's),
    as ``stats.TapCollector`` and ``stats.summary`` read one tap's. Each worker's latest
    report replaces its last; a worker that ended leaves its last in ``_gone``."""

    def __init__(self):
        self._lock = threading.Lock()
        self._latest: dict[int, tuple[Counter, Counter]] = {}
        self._gone = (Counter(), Counter())

    def report(self, worker: int, counts: dict, stats: dict) -> None:
        with self._lock:
            self._latest[worker] = (Counter(counts), Counter(stats))

    def ended(self, worker: int) -> None:
        with self._lock:
            counts, stats = self._latest.pop(worker, (Counter(), Counter()))
            self._gone[0].update(counts)
            self._gone[1].update(stats)

    def each(self, key: str) -> list[int]:
        """``counts[key]`` of each running worker, by worker index."""
        with self._lock:
            return [self._latest[i][0][key] for i in sorted(self._latest)]

    def _sum(self, i: int) -> Counter:
        with self._lock:
            total = Counter(self._gone[i])
            for entry in self._latest.values():
                total.update(entry[i])
        return total

    @property
    def counts(self) -> Counter:
        return self._sum(0)

    @property
    def stats(self) -> Counter:
        return self._sum(1)


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to ``host``:``port`` with SO_REUSEPORT, not listening: it holds the
    port (a free one for port 0) for the workers, and takes no connection itself."""
    family, kind, proto, _, addr = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(addr)
    except BaseException:
        sock.close()
        raise
    return sock


def worker_main(conf: TapConfig, port: int, conn: Connection) -> None:
    """One worker: a tap on ``port`` (SO_REUSEPORT) until the parent says stop or is
    gone; its counts to the parent every ``REPORT_S`` and once more at the end."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # the parent stops the workers: Ctrl-C in a terminal reaches the whole group. A
    # SIGTERM sent to the whole group (GNU timeout, systemd's control-group kill) or to
    # this worker alone stops it as the parent's word does: its streams finish.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    terminated = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: terminated.set())
    try:
        tap, client, server = start(conf, port, reuse_port=True)
    except Exception as e:  # the parent reports it, then stops
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    conn.send(("up", os.getpid()))
    try:
        while not conn.poll(REPORT_S) and not terminated.is_set():
            conn.send(("counts", dict(tap.counts), dict(client.stats)))
        if not terminated.is_set():
            with contextlib.suppress(EOFError):  # EOF: the parent is gone
                conn.recv()  # "stop"
    finally:
        server.stop()
        client.close()
        try:
            conn.send(("counts", dict(tap.counts), dict(client.stats)))
            conn.send(("stopped", None))
        except OSError:  # the parent is gone: nobody to tell
            pass


class _Worker:
    def __init__(self, ctx, conf: TapConfig, port: int, index: int):
        self.index = index
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker_main, args=(conf, port, child),
                                name=f"phasewatch-tap-{index}", daemon=False)
        self.proc.start()
        child.close()
        self.pid = 0


def serve_workers(conf: TapConfig, stop: threading.Event) -> int:
    """``serve_forever`` with ``conf.workers`` processes (see the module docstring)."""
    ctx = multiprocessing.get_context("spawn")
    workers, metrics_port = conf.workers, conf.metrics_port
    held = listening("the tap", "--port", conf.host, conf.port,
                     lambda: reserve_port(conf.host, conf.port))
    port = held.getsockname()[1]
    totals = Totals()
    running: list[_Worker] = []
    metrics = None
    try:
        context = listener_ssl(conf)  # the workers' own, and the parent's /metrics
        if metrics_port is not None:  # bound before any worker starts: a taken port, one line
            metrics = listening("the tap's counts", "--metrics-port", conf.host,
                                metrics_port, lambda: _MetricsServer(
                                    totals, conf.host, metrics_port, context))
        for i in range(workers):
            running.append(_started(ctx, conf, port, i, totals))
        pids = ", ".join(str(w.pid) for w in running)
        announce(conf, "https" if context is not None else "http", port,
                 metrics.port if metrics is not None else None,
                 f"pid {os.getpid()}, {workers} workers: {pids}")
        _watch(ctx, conf, port, running, totals, stop)
    except KeyboardInterrupt:
        pass
    finally:
        _stop_all(running, totals)
        if metrics is not None:
            metrics.stop()
        held.close()
        if running:
            log.info("phasewatch tap stopped (%d workers, completed by each: %s): %s",
                     workers, ", ".join(map(str, totals.each("completed"))),
                     summary(totals.counts, totals.stats))
    return 0


def _started(ctx, conf: TapConfig, port: int, index: int, totals: Totals) -> _Worker:
    """A worker started and listening, or ValueError with why it could not."""
    w = _Worker(ctx, conf, port, index)
    if not w.conn.poll(START_S):
        w.proc.kill()
        raise ValueError(f"tap worker {index} did not start within {START_S:g}s")
    try:
        what, value = w.conn.recv()
    except EOFError:
        w.proc.join(5)
        raise ValueError(f"tap worker {index} exited at start (code "
                         f"{w.proc.exitcode})") from None
    if what != "up":
        w.proc.join(5)
        raise ValueError(f"tap worker {index} could not start: {value}")
    w.pid = value
    totals.report(index, {}, {})
    return w


def _watch(ctx, conf: TapConfig, port: int, running: list[_Worker], totals: Totals,
           stop: threading.Event) -> None:
    """Read the workers' reports until ``stop``; start again a worker that died."""
    while not stop.is_set():
        for conn in wait([w.conn for w in running], timeout=0.2):
            w = next(w for w in running if w.conn is conn)
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                if stop.is_set():  # it ended with the parent (a SIGTERM to the group)
                    return
                w.proc.join(5)
                log.error("tap worker %d (pid %d) exited (code %s); starting another",
                          w.index, w.pid, w.proc.exitcode)
                totals.ended(w.index)
                running[running.index(w)] = _started(ctx, conf, port, w.index, totals)
                continue
            if msg[0] == "counts":
                totals.report(w.index, msg[1], msg[2])


def _stop_all(running: list[_Worker], totals: Totals) -> None:
    """Tell every worker to stop, read its last counts, wait for it to end (each lets
    its open streams finish, as one tap does)."""
    for w in running:
        with contextlib.suppress(OSError):
            w.conn.send("stop")
    deadline = time.monotonic() + 45.0  # a tap's grace (10 s) and its recorder's close
    for w in running:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not w.conn.poll(left):
                break
            try:
                what, *rest = w.conn.recv()
            except (EOFError, OSError):
                break
            if what == "counts":
                totals.report(w.index, rest[0], rest[1])
            elif what == "stopped":
                break
        w.proc.join(max(deadline - time.monotonic(), 0.1))
        if w.proc.is_alive():
            log.warning("tap worker %d (pid %d) did not stop; killing it", w.index, w.pid)
            w.proc.kill()
            w.proc.join(5)
        w.conn.close()


class _MetricsServer:
    """The workers' summed counts on ``/metrics`` (``stats.metrics_app``), on an event
    loop thread of the parent's own."""

    def __init__(self, totals: Totals, host: str, port: int, context):
        from aiohttp import web

        from phasewatch.tap.stats import metrics_app

        self._ssl = context
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever,
                                        name="pw-tap-metrics", daemon=True)
        self._thread.start()
        self._runner = web.AppRunner(metrics_app(totals, totals), access_log=None)

        async def up() -> int:
            await self._runner.setup()
            site = web.TCPSite(self._runner, host, port, reuse_address=True,
                               ssl_context=self._ssl)
            await site.start()
            return site._server.sockets[0].getsockname()[1]

        try:
            self.port = asyncio.run_coroutine_threadsafe(up(), self._loop).result(30)
        except BaseException:
            self.stop()  # the loop's thread
            raise

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
