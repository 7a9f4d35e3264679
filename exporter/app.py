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
from phasewatch.aggregation.running_clock import RunningClock
from phasewatch.aggregation.tracejoin import TraceJoin
from phasewatch.aggregation.window import RollingWindow
from phasewatch.app_loops import Loops
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
from phasewatch.publish.gpu_metrics import GpuCollector
from phasewatch.publish.guard import GuardedRegistry
from phasewatch.publish.metrics import HotCollector, HotText, MetricsPage, SelfCollector
from phasewatch.publish.roofline_metrics import RooflineCollector
from phasewatch.publish.slo_metrics import SloCollector
from phasewatch.requests.sampling import TraceSampling
from phasewatch.roofline.bottleneck import ANY_MODEL, BottleneckMonitor
from phasewatch.roofline.dcgm_exporter import DcgmExporterSource
from phasewatch.roofline.deployments import Deployments, ModelNames, resolve
from phasewatch.roofline.engine_metrics import EngineMetricsSource
from phasewatch.roofline.gpu_watch import GpuSelector, GpuWatch
from phasewatch.roofline.nvml_gpm import NvmlGpmSource
from phasewatch.roofline.verdict_text import achievable_source
from phasewatch.selfstats import SelfStats
from phasewatch.transport.admission import Admission
from phasewatch.transport.auth import BearerAuth
from phasewatch.transport.http_server import HttpServer, make_handler
from phasewatch.transport.listen import ListenError, listening
from phasewatch.transport.tls import TlsFiles, TlsFront

log = logging.getLogger("phasewatch")


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
        # one model, one label: every name of a configured model -> its served name
        self.model_names = ModelNames(options)
        self.gpus = self._gpu_watch()
        self._aggregation(Deployments([d for _, d in self._resolved]), self._engines())
        self._receivers()
        self._publishing()
        self._grpc = self._otlp_grpc = None
        self._http: HttpServer | None = None
        self._otlp_http: HttpServer | None = None
        self._stop = threading.Event()
        self._fronts: list[TlsFront] = []
        self._socket_dir = ""
        self.loops = Loops(self._stop, self.stats, clock, config.roofline_interval,
                           self._update_roofline,
                           (("lifecycle", "lifecycle", self.joiner),
                            ("otlp", "OTLP join", self.otlp),
                            ("trace", "trace join", self.trace_join)),
                           [*self.monitor.engine_sources(),
                            *([self.gpus] if self.gpus is not None else [])],
                           beat=self.running_clock, stall_dump=config.stall_dump,
                           oldest_call=self.admission.oldest_call_seconds)
        self.grpc_port = self.http_port = self.otlp_grpc_port = self.otlp_http_port = 0
        self.tap_port = 0

    def _engines(self) -> dict[str, EngineMetricsSource]:
        """Each configured model's engine /metrics, by served name (``ANY_MODEL``: the
        engine's state without a roofline)."""
        config = self.config
        timeout = config.engine_metrics_timeout
        engines = {d.served_name: EngineMetricsSource(o.engine_metrics_url, d.served_name,
                                                      self.stats, timeout)
                   for o, d in self._resolved if o.engine_metrics_url}
        flags = config.model_flags
        if flags.engine_metrics_url and not (flags.model or flags.hf_config):
            # the engine's state without a roofline: the cause of queueing still counts
            engines[ANY_MODEL] = EngineMetricsSource(flags.engine_metrics_url, None, self.stats,
                                                     timeout)
        return engines

    def _gpu_watch(self) -> GpuWatch | None:
        """The GPU counters' sources (--gpu-metrics-url, --gpu-nvml) and each configured
        model's GPUs (its gpu_select, by its label); None without a source."""
        config = self.config
        sources: list = []
        if config.gpu_metrics_url:
            sources.append(DcgmExporterSource(config.gpu_metrics_url,
                                              timeout=config.engine_metrics_timeout))
        if config.gpu_nvml:
            sources.append(NvmlGpmSource())
        if not sources:
            return None
        options = config.model_options()
        labels = self.model_names.labels
        selectors = {label: GpuSelector.parse(o.gpu_select)  # a bad one raises at start
                     for o, label in zip(options, labels, strict=True)}
        return GpuWatch(sources, selectors, models=max(len(options), 1))

    def _aggregation(self, deployments: Deployments,
                     engines: dict[str, EngineMetricsSource]) -> None:
        """The state the receivers feed: the aggregator and its window, the trace join in
        front of it, the history and the roofline's monitor."""
        config, clock, names = self.config, self._clock, self.model_names
        window = RollingWindow(config.window_seconds, config.window_capacity, clock=clock)
        self.aggregator = Aggregator(self.stats, max_series=config.max_series, window=window,
                                     model_names=names,
                                     objectives=config.objectives(names.labels),
                                     pod_label=config.pod_label, max_pods=config.max_pods,
                                     source_label=config.source_label)
        # every receiver's batches pass the tap/engine join (its clock: ``running_clock``)
        self.running_clock = RunningClock()
        self.trace_join = TraceJoin(self.aggregator, wait=config.trace_join_wait,
                                    max_pending=config.trace_join_max_pending,
                                    clock=self.running_clock)
        self.history = SummaryHistory(config.history_points)
        self.monitor = BottleneckMonitor(window, self.aggregator.labels, deployments, engines,
                                         window_seconds=config.window_seconds, clock=clock,
                                         gpus=self.gpus)

    def _receivers(self) -> None:
        """What the listeners hand their calls to: the OTLP ingest, the lifecycle join,
        the admission gate, and the stream tap where this process runs one."""
        config = self.config
        single = self.model_names.single  # configured, whether or not its hardware resolved
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
                                      max_pending=config.lifecycle_max_pending,
                                      clock=self.running_clock)
        self.admission = Admission(self.stats, config.max_in_flight,
                                   int(config.max_in_flight_mib * (1 << 20)),
                                   config.memory_limit_bytes())
        self.tap = self._tap_server = self._tap_records = None
        self._tap_conf = tapmod.TapConfig.read(config.tap,  # serve's --tap-* options
                                               model=config.default_model or single)
        if config.tap.upstream:  # the stream tap in this process (else `phasewatch tap`)
            self._tap_records = tapmod.BatchRecorder(self.trace_join, config.tap.engine)
            self.tap = tapmod.tap_of(self._tap_conf, self._tap_records)

    def _publishing(self) -> None:
        """/metrics (the hot families rendered directly by HotText, then the guarded
        registry's collectors; ``full_registry``: all, for other formats); the JSON API."""
        config = self.config
        self.registry = GuardedRegistry()  # each collector guarded (publish.guard)
        self.registry.register(SelfCollector(self.aggregator, gauges={
            catalog.LIFECYCLE_PENDING: self.joiner.pending_count,
            catalog.OTLP_JOIN_PENDING: lambda: len(self.otlp.pending),
            catalog.TRACE_JOIN_PENDING: self.trace_join.pending_count,
            catalog.IN_FLIGHT: self.admission.in_flight,
            catalog.IN_FLIGHT_BYTES: self.admission.in_flight_bytes,
            catalog.MEMORY_LIMIT: lambda: self.admission.memory_limit,
            catalog.ROOFLINE_LAST_SUCCESS: lambda: self.loops.roofline_ok_at,
            catalog.SWEEP_LAST_SUCCESS: lambda: {
                (join,): t for join, t in self.loops.sweep_ok_at.items()},
        }))
        self.registry.register(RooflineCollector(self.monitor, self.aggregator))
        self.registry.register(SloCollector(self.aggregator))  # nothing without --slo
        if self.gpus is not None:
            self.registry.register(GpuCollector(self.gpus, self.monitor.results,
                                                lambda: self.aggregator.labels.names))
        if self.tap is not None:
            self.registry.register(tapmod.TapCollector(self.tap, self._tap_records))
        ProcessCollector(registry=self.registry)
        self.full_registry = CollectorRegistry()
        exposure = Exposure(config.prompt_class_label, config.classic_buckets)
        self.full_registry.register(HotCollector(self.aggregator, exposure))
        self.full_registry.register(_Everything(self.registry))
        self.metrics_page = MetricsPage(HotText(self.aggregator, exposure), self.registry,
                                        self.full_registry, HotProto(self.aggregator, exposure))
        self.api = JsonApi(self.aggregator, self.model_names, self.monitor, self.history,
                           config, self._status, self._clock)

    @property
    def roofline_ok_at(self) -> float:
        """Unix time of the last roofline update that succeeded (0: none yet)."""
        return self.loops.roofline_ok_at

    def _update_roofline(self) -> None:
        """One roofline tick: the verdict, and the window's summary into the history."""
        self.monitor.update()
        labels = self.aggregator.labels
        self.history.record(self.aggregator.window.summary(labels.pairs(), names=labels.names))

    def _status(self) -> dict:
        """/api/v1/status: what only the running exporter knows."""
        return {"grpc_port": self.grpc_port, "http_port": self.http_port,
                "otlp_grpc_port": self.otlp_grpc_port, "otlp_http_port": self.otlp_http_port,
                **({"tap_port": self.tap_port} if self.tap is not None else {}),
                "label_sets": len(self.aggregator.labels),
                "lifecycle_pending": self.joiner.pending_count(),
                **({"gpu_counters": self.gpus.status()} if self.gpus is not None else {}),
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
        auth = BearerAuth(c.auth_token, self.stats)
        self._listen_phasewatch(auth, tls)
        self._listen_otlp(auth, tls)
        if self.tap is not None:
            self._start_tap()
        self.loops.start()
        self._log_started(tls)
        return self

    def _listen_phasewatch(self, auth: BearerAuth, tls: TlsFiles | None) -> None:
        """The phasewatch gRPC receiver, then /metrics and the JSON API (ready once the
        receiver is up, until stop)."""
        c = self.config
        service = PhasewatchService(self.trace_join, self.joiner, self.admission)
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

    def _listen_otlp(self, auth: BearerAuth, tls: TlsFiles | None) -> None:
        """The OTLP receivers, gRPC and HTTP."""
        c = self.config
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

    def _start_tap(self) -> None:
        """The stream tap's listener, in this process (serve --tap-upstream)."""
        t = self._tap_conf
        self._tap_server = tapmod.TapServer(  # a taken port names --tap-port
            self.tap, t.host, t.port, ssl_context=tapmod.listener_ssl(t), loop=t.loop,
            grace=self.config.shutdown_grace, listener=("the stream tap", "--tap-port")).start()
        self.tap_port = self._tap_server.port
        log.info("stream tap on %s://%s:%d -> %s", self._tap_server.scheme, t.host,
                 self.tap_port, t.upstream)

    def _log_started(self, tls: TlsFiles | None) -> None:
        """What listens where, and each model's roofline, in the log."""
        c = self.config
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
        self.loops.join(grace + 1)
        if self.gpus is not None:
            self.gpus.close()
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

    def __enter__(self) -> Exporter:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
