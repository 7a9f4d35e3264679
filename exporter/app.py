"""The exporter process: aggregation state plus its receivers and sinks, wired together."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time

from prometheus_client import CollectorRegistry
from prometheus_client.process_collector import ProcessCollector

from phasewatch import catalog
from phasewatch import tap as tapmod
from phasewatch.aggregation.aggregate import Aggregator
from phasewatch.aggregation.history import SummaryHistory
from phasewatch.aggregation.tracejoin import TraceJoin
from phasewatch.aggregation.window import RollingWindow
from phasewatch.config import ServeConfig
from phasewatch.ingest.adapters import AdapterContext
from phasewatch.ingest.grpc_server import PhasewatchService, start_grpc_server
from phasewatch.ingest.lifecycle import LifecycleJoiner
from phasewatch.ingest.otlp.grpc_receiver import OtlpGrpcService, start_otlp_grpc_server
from phasewatch.ingest.otlp.http_receiver import make_otlp_handler
from phasewatch.ingest.otlp.ingest import OtlpIngest
from phasewatch.publish.api import JsonApi
from phasewatch.publish.exposition import HotProto
from phasewatch.publish.families import Exposure
from phasewatch.publish.guard import GuardedRegistry
from phasewatch.publish.metrics import HotCollector, HotText, MetricsPage, SelfCollector
from phasewatch.publish.roofline_metrics import RooflineCollector
from phasewatch.publish.slo_metrics import SloCollector
from phasewatch.requests.sampling import TraceSampling
from phasewatch.roofline.bottleneck import ANY_MODEL, BottleneckMonitor
from phasewatch.roofline.deployments import Deployments, ModelNames, resolve
from phasewatch.roofline.engine_metrics import EngineMetricsSource
from phasewatch.roofline.verdict import achievable_source
from phasewatch.selfstats import SelfStats
from phasewatch.transport.admission import Admission
from phasewatch.transport.auth import BearerAuth
from phasewatch.transport.http_server import HttpServer, make_handler
from phasewatch.transport.listen import ListenError, listening
from phasewatch.transport.tls import TlsFiles, TlsFront

log = logging.getLogger("phasewatch")
# a tick of a loop this late, or an update this long, is logged (see _roofline_loop)
STALL_NOTICE = 2.0


def _log_long_update(took: float, cpu: float, notice: float, interval: float) -> None:
    """Log an update that took ``notice`` seconds or more. Where the whole process had
    the CPU for under half of it, the process was not scheduled (stopped, a frozen VM, a
    starved host) for the rest, which is said as a late tick is; otherwise the update
    itself was slow."""
    if took < notice:
        return
    if took - cpu >= max(notice, took / 2):
        log.warning("phasewatch ran %.1f s late (a %g s roofline tick): this process was "
                    "not scheduled during the roofline update, so the figures average "
                    "over that gap", took - cpu, interval)
    else:
        log.warning("the roofline update took %.1f s (%.1f s of CPU; --roofline-interval "
                    "%g s)", took, cpu, interval)


def deployment_line(d, engine_metrics_url: str = "") -> str:
    """The resolved roofline of one deployment, in one log line."""
    h = d.hardware
    return (f"roofline for {d.served_name!r}: model {d.model.name} ({d.model_source}), "
            f"{h.name} x {h.gpus} ({d.hardware_source}), compute {d.compute_dtype}; "
            f"peak {d.peak_bandwidth / 1e12:.3g} TB/s, {d.peak_flops / 1e12:.4g} TFLOP/s; "
            f"achievable {h.achievable_bandwidth / 1e12:.3g} TB/s, "
            f"{h.achievable_flops(d.compute_dtype) / 1e12:.4g} TFLOP/s "
            f"({achievable_source(d).replace('_', ' ')}); "
            f"engine metrics {engine_metrics_url or 'none (--engine-metrics-url)'}")


class _Everything:
    """A registry's collectors, as one collector of another registry."""

    def __init__(self, registry: CollectorRegistry):
        self._registry = registry

    def collect(self):
        return self._registry.collect()


class Exporter:
    """Start with ``start()``; ports are read back from ``grpc_port`` / ``http_port``."""

    def __init__(self, config: ServeConfig, clock=time.time):
        self.config = config
        self._clock = clock
        self.stats = SelfStats()
        options = config.model_options()
        resolved = [(o, resolve(o)) for o in options]  # bad configuration raises here
        self._resolved = [(o, d) for o, d in resolved if d is not None]  # logged by start()
        self._configured = bool(options)  # a model without its hardware: resolve() said so
        deployments = Deployments([d for _, d in resolved if d is not None])
        timeout = config.engine_metrics_timeout
        engines = {d.served_name: EngineMetricsSource(o.engine_metrics_url, d.served_name,
                                                      self.stats, timeout)
                   for o, d in resolved if d is not None and o.engine_metrics_url}
        flags = config.model_flags
        if flags.engine_metrics_url and not (flags.model or flags.hf_config):
            # the engine's state without a roofline: the cause of queueing still counts
            engines[ANY_MODEL] = EngineMetricsSource(flags.engine_metrics_url, None, self.stats,
                                                     timeout)
        window = RollingWindow(config.window_seconds, config.window_capacity, clock=clock)
        # one model, one label: every name of a configured model -> its served name
        names = self.model_names = ModelNames(options)
        self.aggregator = Aggregator(self.stats, max_series=config.max_series, window=window,
                                     model_names=names,
                                     objectives=config.objectives(names.labels),
                                     pod_label=config.pod_label, max_pods=config.max_pods,
                                     source_label=config.source_label)
        # every receiver's batches pass the join of tap records with engine spans
        self.trace_join = TraceJoin(self.aggregator, wait=config.trace_join_wait,
                                    max_pending=config.trace_join_max_pending)
        self.history = SummaryHistory(config.history_points)
        self.monitor = BottleneckMonitor(window, self.aggregator.labels, deployments, engines,
                                         window_seconds=config.window_seconds, clock=clock)
        single = names.single  # configured, whether or not its hardware resolved
        emitter = None
        if config.otlp_export_endpoint:
            from phasewatch.ingest.otlp.reemit import PhaseSpanEmitter

            emitter = PhaseSpanEmitter(config.otlp_export_endpoint)
        self.otlp = OtlpIngest(self.trace_join, AdapterContext(
            default_model=config.default_model or single,
            service_models=config.service_models(),
            sampling=TraceSampling(config.trace_sample_ratio)), emitter=emitter,
            join_wait=config.otlp_join_wait)
        self.joiner = LifecycleJoiner(self.trace_join, ttl=config.lifecycle_ttl,
                                      grace=config.lifecycle_grace,
                                      max_pending=config.lifecycle_max_pending)
        self.admission = Admission(self.stats, config.max_in_flight,
                                   int(config.max_in_flight_mib * (1 << 20)),
                                   config.memory_limit_bytes())
        # /metrics: the hot families rendered directly (HotText), then this registry's
        # collectors; full_registry holds them all, for formats HotText does not write
        self.registry = GuardedRegistry()  # each collector guarded (publish.guard)
        self.registry.register(SelfCollector(self.aggregator, gauges={
            catalog.LIFECYCLE_PENDING: self.joiner.pending_count,
            catalog.OTLP_JOIN_PENDING: lambda: len(self.otlp.pending),
            catalog.TRACE_JOIN_PENDING: self.trace_join.pending_count,
            catalog.IN_FLIGHT: self.admission.in_flight,
            catalog.IN_FLIGHT_BYTES: self.admission.in_flight_bytes,
            catalog.MEMORY_LIMIT: lambda: self.admission.memory_limit,
            catalog.ROOFLINE_LAST_SUCCESS: lambda: self.roofline_ok_at,
        }))
        self.registry.register(RooflineCollector(self.monitor, self.aggregator))
        self.registry.register(SloCollector(self.aggregator))  # nothing without --slo
        self.tap = self._tap_server = self._tap_records = None
        self._tap_conf = tapmod.TapConfig.read(config.tap,  # serve's --tap-* options
                                               model=config.default_model or single)
        if config.tap.upstream:  # the stream tap in this process (else `phasewatch tap`)
            self._tap_records = tapmod.BatchRecorder(self.trace_join, config.tap.engine)
            self.tap = tapmod.tap_of(self._tap_conf, self._tap_records)
            self.registry.register(tapmod.TapCollector(self.tap, self._tap_records))
        ProcessCollector(registry=self.registry)
        self.full_registry = CollectorRegistry()
        exposure = Exposure(config.prompt_class_label, config.classic_buckets)
        self.full_registry.register(HotCollector(self.aggregator, exposure))
        self.full_registry.register(_Everything(self.registry))
        self.metrics_page = MetricsPage(HotText(self.aggregator, exposure), self.registry,
                                        self.full_registry, HotProto(self.aggregator, exposure))
        self.api = JsonApi(self.aggregator, self.model_names, self.monitor, self.history,
                           config, self._status, clock)
        self._grpc = self._otlp_grpc = None
        self._http: HttpServer | None = None
        self._otlp_http: HttpServer | None = None
        self._stop = threading.Event()
        self.roofline_ok_at = 0.0  # the last roofline update that succeeded (Unix time)
        self._fronts: list[TlsFront] = []
        self._socket_dir = ""
        self._sweeper = threading.Thread(target=self._sweep_loop, name="pw-sweep", daemon=True)
        self._roofline = threading.Thread(target=self._roofline_loop, name="pw-roofline",
                                          daemon=True)
        # one scraper per engine URL, apart from the verdict's updates: a saturated
        # engine answers its /metrics slowly (seconds, on a loaded host), which must
        # neither hold the verdict back nor, with a short timeout, lose exactly the
        # scrapes that show the full KV cache
        self._scrapers = [threading.Thread(target=self._scrape_loop, args=(source,),
                                           name=f"pw-engine-{i}", daemon=True)
                          for i, source in enumerate(self.monitor.engine_sources())]
        self.grpc_port = self.http_port = self.otlp_grpc_port = self.otlp_http_port = 0
        self.tap_port = 0

    def _status(self) -> dict:
        """/api/v1/status: what only the running exporter knows."""
        return {"grpc_port": self.grpc_port, "http_port": self.http_port,
                "otlp_grpc_port": self.otlp_grpc_port, "otlp_http_port": self.otlp_http_port,
                **({"tap_port": self.tap_port} if self.tap is not None else {}),
                "label_sets": len(self.aggregator.labels),
                "lifecycle_pending": self.joiner.pending_count(),
                "ingest": {f"{n}{{{','.join(lv)}}}": v
                           for (n, lv), v in sorted(self.stats.snapshot().items())}}

    # ---- lifecycle -------------------------------------------------------------
    def start(self) -> Exporter:
        try:
            return self._start()
        except ListenError:
            self._close_listeners()  # those already up: the process is about to exit
            raise

    def _close_listeners(self) -> None:
        for front in self._fronts:
            front.stop()
        for name in ("_grpc", "_otlp_grpc"):
            if getattr(self, name) is not None:
                getattr(self, name).stop(0)
                setattr(self, name, None)
        for name in ("_otlp_http", "_http"):
            if getattr(self, name) is not None:
                getattr(self, name).stop()
                setattr(self, name, None)
        if self._socket_dir:
            shutil.rmtree(self._socket_dir, ignore_errors=True)

    def _start(self) -> Exporter:
        c = self.config
        tls = None
        if c.tls_cert_file or c.tls_key_file or c.tls_client_ca_file:
            tls = TlsFiles(c.tls_cert_file, c.tls_key_file, c.tls_client_ca_file, self.stats)
            self._socket_dir = tempfile.mkdtemp(prefix="phasewatch-")  # 0700: ours only
        service = PhasewatchService(self.trace_join, self.joiner, self.admission)
        auth = BearerAuth(c.auth_token, self.stats)
        self._grpc, self.grpc_port = listening(
            "the phasewatch gRPC receiver", "--grpc-port", c.grpc_host, c.grpc_port,
            lambda: self._grpc_server(start_grpc_server, service, c.grpc_host, c.grpc_port,
                                      auth, "phasewatch", tls))
        handler = make_handler(self.metrics_page.render, self.api.routes(), auth=auth,
                               ready=lambda: self._grpc is not None and not self._stop.is_set(),
                               mutual_tls=self.stats if tls and tls.mutual else None)
        self._http = listening(
            "/metrics and the JSON API", "--http-port", c.http_host, c.http_port,
            lambda: HttpServer(c.http_host, c.http_port, handler, c.max_connections,
                               self._refused_connection("http"),
                               tls and (tls, "http", "optional")))
        self.http_port = self._http.port
        self._http.start()
        self._otlp_grpc, self.otlp_grpc_port = listening(
            "OTLP/gRPC", "--otlp-grpc-port", c.otlp_grpc_host, c.otlp_grpc_port,
            lambda: self._grpc_server(start_otlp_grpc_server,
                                      OtlpGrpcService(self.otlp, self.admission),
                                      c.otlp_grpc_host, c.otlp_grpc_port, auth, "otlp_grpc",
                                      tls))
        self._otlp_http = listening(
            "OTLP/HTTP", "--otlp-http-port", c.otlp_http_host, c.otlp_http_port,
            lambda: HttpServer(c.otlp_http_host, c.otlp_http_port,
                               make_otlp_handler(self.otlp, self.admission, auth=auth),
                               c.max_connections, self._refused_connection("otlp_http"),
                               tls and (tls, "otlp_http",
                                        "require" if tls.mutual else "none")))
        self.otlp_http_port = self._otlp_http.port
        self._otlp_http.start()
        if self.tap is not None:
            t = self._tap_conf
            self._tap_server = tapmod.TapServer(  # a taken port names --tap-port
                self.tap, t.host, t.port, ssl_context=tapmod.listener_ssl(t), loop=t.loop,
                grace=c.shutdown_grace, listener=("the stream tap", "--tap-port")).start()
            self.tap_port = self._tap_server.port
            log.info("stream tap on %s://%s:%d -> %s", self._tap_server.scheme, t.host,
                     self.tap_port, t.upstream)
        self._sweeper.start()
        self._roofline.start()
        for scraper in self._scrapers:
            scraper.start()
        scheme = "https" if tls else "http"
        security = ("plain TCP" if not tls else "TLS" + (" with client certificates"
                                                          if tls.mutual else ""))
        log.info("phasewatch gRPC receiver on %s:%d (%s)", c.grpc_host, self.grpc_port,
                 security)
        log.info("metrics on %s://%s:%d/metrics, JSON API under /api/v1/",
                 scheme, c.http_host, self.http_port)
        log.info("OTLP/gRPC receiver on %s:%d, OTLP/HTTP on %s://%s:%d/v1/traces",
                 c.otlp_grpc_host, self.otlp_grpc_port, scheme, c.otlp_http_host,
                 self.otlp_http_port)
        for o, d in self._resolved:
            log.info("%s", deployment_line(d, o.engine_metrics_url))
        if not self._configured:
            log.info("roofline: no model configured (--model or --hf-config, with --hardware):"
                     " latency and phases only")
        return self

    def _grpc_server(self, start, service, host: str, port: int, auth: BearerAuth,
                     receiver: str, tls: TlsFiles | None):
        """A gRPC receiver on host:port; with TLS, the server listens on a private Unix
        socket and a TlsFront on host:port does (and counts) the handshakes."""
        c = self.config
        if tls is None:
            return start(service, host, port, c.grpc_workers, auth.interceptors(receiver))
        path = os.path.join(self._socket_dir, f"{receiver}.sock")
        server, _ = start(service, f"unix:{path}", None, c.grpc_workers,
                          auth.interceptors(receiver))
        front = TlsFront(tls, host, port, path, receiver, c.max_connections,
                         self._refused_connection(receiver)).start()
        self._fronts.append(front)
        return server, front.port

    def _refused_connection(self, protocol: str):
        return lambda: self.stats.inc("phasewatch_ingest_refused_total", protocol=protocol,
                                      reason="connections")

    def _sweep_loop(self) -> None:
        """Every second, each join's waiting room lets go of what waited long enough."""
        while not self._stop.wait(1.0):
            for join, part in (("lifecycle", self.joiner), ("OTLP join", self.otlp),
                               ("trace join", self.trace_join)):
                try:
                    part.sweep()
                except Exception:  # a bug here must not kill the sweeper silently
                    log.exception("%s sweep failed", join)

    def _scrape_loop(self, source: EngineMetricsSource) -> None:
        """Scrape ``source`` every --roofline-interval; a scrape that takes longer delays
        the next, as Prometheus does (never two at once against one engine)."""
        interval = self.config.roofline_interval
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                source.poll()
            except Exception:  # a bug here must not stop the scrapes silently
                log.exception("engine metrics scrape of %s failed", source.url)
            self._stop.wait(max(interval - (time.monotonic() - began), 0.0))

    def _roofline_loop(self) -> None:
        """Update the roofline and verdict every --roofline-interval. A tick that comes
        STALL_NOTICE seconds or more late (the process was not scheduled: a paused or
        starved host, or a thread holding the interpreter) is logged, and so is an
        update that took that long: rates and the verdict average over such a gap, and
        exports and engine scrapes waited through it."""
        interval = self.config.roofline_interval
        notice = max(STALL_NOTICE, interval)
        due = time.monotonic() + interval
        while not self._stop.wait(max(due - time.monotonic(), 0.0)):
            late = time.monotonic() - due
            if late >= notice:
                log.warning("phasewatch ran %.1f s late (a %g s roofline tick): this process "
                            "was not scheduled, so the figures average over that gap",
                            late, interval)
            began, cpu = time.monotonic(), time.process_time()
            try:
                self.monitor.update()
                window = self.aggregator.window
                labels = self.aggregator.labels
                self.history.record(window.summary(labels.pairs(), names=labels.names))
            except Exception:  # keep estimating on the next tick; never kill the loop
                log.exception("roofline update failed")
                self.stats.inc(catalog.ROOFLINE_UPDATES.name, outcome="error")
            else:
                self.stats.inc(catalog.ROOFLINE_UPDATES.name, outcome="ok")
                self.roofline_ok_at = self._clock()
            _log_long_update(time.monotonic() - began, time.process_time() - cpu,
                             notice, interval)
            due = time.monotonic() + interval

    def stop(self, grace: float = 5.0) -> None:
        """Stop accepting, let in-flight calls finish within ``grace`` seconds, then close.
        /readyz answers 503 from the start; the last counts are logged at the end."""
        self._stop.set()
        if self._tap_server is not None:  # open streams get the grace, then are cut
            self._tap_server.stop()
            self._tap_server = None
        if self._tap_records is not None:
            self._tap_records.close()  # its last records into the aggregator
        for front in self._fronts:  # no new TLS connections; open ones drain below
            front.stop()
        stopped = []
        for name in ("_grpc", "_otlp_grpc"):  # both drain at once: one grace in all
            server = getattr(self, name)
            if server is not None:
                stopped.append(server.stop(grace))
                setattr(self, name, None)
        for event in stopped:
            event.wait(grace + 1)
        for name in ("_otlp_http", "_http"):
            server = getattr(self, name)
            if server is not None:
                server.stop()
                setattr(self, name, None)
        self._join_threads(grace + 1)
        self.trace_join.flush()  # rows still waiting for their other side: counted alone
        if self.otlp.emitter is not None:
            self.otlp.emitter.shutdown(grace)
        if self._socket_dir:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
        totals = {}
        for (name, _labels), v in self.stats.snapshot().items():
            short = name.removeprefix("phasewatch_ingest_").removesuffix("_total")
            if short in ("accepted", "rejected", "refused", "dropped"):
                totals[short] = totals.get(short, 0) + v
        log.info("stopped; ingest totals: %s", ", ".join(
            f"{k} {int(totals.get(k, 0))}" for k in ("accepted", "rejected", "refused",
                                                       "dropped")))

    def _join_threads(self, timeout: float) -> None:
        """Join the background loops this exporter started (they saw ``_stop``), all
        within ``timeout`` seconds; one still running past it is logged."""
        deadline = time.monotonic() + timeout
        for thread in (self._sweeper, self._roofline, *self._scrapers):
            if thread.ident is not None:  # started
                thread.join(max(deadline - time.monotonic(), 0.0))
                if thread.is_alive():
                    log.warning("%s did not stop within %g s", thread.name, timeout)

    def __enter__(self) -> Exporter:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
