"""What each ``phasewatch`` command does: serve, simulate, demo, dashboard, roofline,
calibrate and tap. ``phasewatch.cli`` builds the parser and calls these with its
arguments."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from dataclasses import replace

from phasewatch.config import ConfigError, load_serve_config
from phasewatch.options_commands import DEFAULT_TARGETS
from phasewatch.sim.scenarios import SCENARIOS, scenario
from phasewatch.transport.listen import listening, moving_taken_ports, or_free_port

log = logging.getLogger("phasewatch")


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _stop_on_signals(stop: threading.Event) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())


def wait_stopped(stop: threading.Event, timeout: float = float("inf")) -> bool:
    """``stop.wait(timeout)`` in slices of at most half a second: True once ``stop`` is set.

    Python runs a signal's handler in the main thread only when that thread runs Python
    code. A SIGTERM the kernel hands to another thread (gRPC's, the dashboard's) while
    the main thread sleeps in one long lock wait sets nothing until that wait ends: a
    demo stopped by its test hung past the test's 30 s and was killed. In slices, the
    handler runs within half a second whichever thread took the signal."""
    end = time.monotonic() + timeout
    while True:
        left = end - time.monotonic()
        if left <= 0:
            return stop.is_set()
        if stop.wait(min(0.5, left)):
            return True


def _client_tls(args: argparse.Namespace):
    from phasewatch.transport.tls import ClientTls

    return ClientTls(args.exporter_tls_ca, args.exporter_tls_cert, args.exporter_tls_key)


def _start_exporter(args: argparse.Namespace, demo: bool = False):
    """Config from flags/env/file, logging, signal handling, a started exporter.

    For the demo, the simulated model and hardware (the scenario's unless given)
    are what the exporter is configured with, so the roofline has a deployment, and the
    scenario's latency objectives unless --slo (or PHASEWATCH_SLO, a config file's slo)
    gives others (``--slo ""``: none).
    """
    from phasewatch.app import Exporter
    from phasewatch.heap import keep_freed_pages

    given: set[str] = set()
    config = load_serve_config(args, given=given)
    _setup_logging(config.log_level)
    keep_freed_pages()  # each roofline tick's arrays reused by the next (heap.py)
    if demo and (config.tls_cert_file or config.tls_client_ca_file):
        raise ConfigError("the demo's own simulator and dashboard talk to its exporter in "
                          "plain TCP on this machine; run it without --tls-* (use serve, "
                          "simulate and dashboard for TLS)")
    if demo:
        sc = scenario(args.scenario)
        m = config.model_flags
        m = replace(m, model=m.model or sc.model, gpus=m.gpus or sc.gpus,
                    hardware=m.hardware if m.hardware.lower() != "auto" else sc.hardware)
        config = replace(config, model_flags=m)
        # the scenario's objectives, followed on a switch, unless the user gave some
        args.scenario_slo = getattr(args, "slo", None) is None and not config.slo and \
            not any(o.slo for o in config.model_options())
        if args.scenario_slo:
            config = replace(config, slo=sc.slo)
        args.model, args.hardware, args.gpus = m.model, m.hardware, m.gpus
    stop = threading.Event()
    _stop_on_signals(stop)
    if not demo:  # serve's ports are a contract: a taken one fails (ListenError)
        return config, stop, Exporter(config).start()
    # the demo's default ports are its own choice: one taken moves to a free port, said
    # in the demo's lines (args.taken_ports); a port the user gave stays, and fails
    exporter, config, args.taken_ports = moving_taken_ports(
        lambda c: Exporter(c).start(), config,
        {n: "--" + n.replace("_", "-") for n in DEMO_PORTS if n not in given})
    return config, stop, exporter


def cmd_serve(args: argparse.Namespace) -> int:
    config, stop, exporter = _start_exporter(args)
    wait_stopped(stop)
    log.info("shutting down: in-flight calls get %gs", config.shutdown_grace)
    exporter.stop(grace=config.shutdown_grace)
    return 0


def _simulate(args, target: str, stop: threading.Event, duration: float):
    """Run the scenario, sending each finished request over the chosen protocol."""
    sc = scenario(args.scenario)
    engine = sc.build(seed=args.seed, model=args.model, hardware=args.hardware,
                      gpus=args.gpus, rate_scale=args.rate_scale)
    client = _sim_client(args, target, getattr(args, "token", ""))
    try:
        engine.run(duration, on_finish=client.record_request, time_scale=args.time_scale,
                   should_stop=stop.is_set)
    finally:
        client.close()
    return engine, client


def cmd_simulate(args: argparse.Namespace) -> int:
    _setup_logging("info")
    stop = threading.Event()
    _stop_on_signals(stop)
    target = args.target or DEFAULT_TARGETS[args.protocol]
    engine, client = _simulate(args, target, stop, args.duration)
    truth = engine.truth.arrays()
    delivered = (f"{client.stats['accepted']} accepted by {target}, "
                 f"{client.stats['dropped_buffer_full']} dropped"
                 if args.protocol == "phasewatch" else
                 f"{client.stats['sent']} sent as {client.shape} spans over {args.protocol} "
                 f"to {target}")
    print(f"scenario {args.scenario}: {len(engine.finished)} requests finished, "
          f"{delivered}; mean decode batch "
          f"{truth['decode_seqs'].mean() if len(truth['start']) else 0:.1f}")
    if args.protocol != "phasewatch":
        ok = client.stats["exported"] == client.stats["spans"] and not client.stats["failed"]
        print(f"{client.stats['exported']} spans exported, {client.stats['failed']} failed")
        return 0 if ok else 1
    return 0 if client.stats["sent"] == len(engine.finished) else 1


def _summary_line(summary: dict, shares: dict | None = None) -> str:
    """One line per model; its phase shares the verdict's (``shares``, by model: what the
    banner's chips show, over the roofline's range) where it has one, else the window's."""
    parts = []
    for m in summary["models"]:
        def ms(d: dict, q: str) -> str:
            return "-" if d.get(q) is None else f"{d[q] * 1000:.0f}ms"
        sh = (shares or {}).get(m["model"]) or m["phase_time_share"]
        share = " ".join(f"{p} {sh[p]:.0%}" for p in (
            "preprocess", "queue", "prefill", "kv_transfer", "ttft", "decode")
            if sh.get(p) is not None) or "-"
        parts.append(
            f"{m['model']}: {m['request_rate']:.1f} req/s | TTFT p50 {ms(m['ttft_seconds'], 'p50')}"
            f" p99 {ms(m['ttft_seconds'], 'p99')} | ITL p50 {ms(m['itl_seconds'], 'p50')} | "
            f"TPOT p50 {ms(m['tpot_seconds'], 'p50')} | out {m['output_tokens_per_second']:.0f}"
            f" tok/s | {share}{_goodput(m.get('slo'))}")
    return " || ".join(parts) or "no requests finished yet"


def _goodput(slo: dict | None) -> str:
    """" | goodput 4.1 req/s (TTFT 99%, TPOT 100%)": good requests per second over the
    window and each objective's attainment; "" without objectives."""
    if not slo:
        return ""
    each = ", ".join(f"{k.upper()} {int(o['attainment'] * 100 + 1e-9)}%"  # 99.7 %: "99%"
                     for k, o in slo["objectives"].items() if o["attainment"] is not None)
    return f" | goodput {slo['goodput']:.1f} req/s" + (f" ({each})" if each else "")


def _sim_client(args, target: str, token: str = ""):
    from phasewatch.transport.tls import ClientTls

    tls = _client_tls(args) if hasattr(args, "exporter_tls_ca") else ClientTls()
    if args.protocol == "phasewatch":
        from phasewatch.client import PhasewatchClient

        return PhasewatchClient(target, engine="sim", token=token, tls_ca=tls.ca,
                                tls_cert=tls.cert, tls_key=tls.key)
    from phasewatch.sim.otlp_shapes import OtlpSink

    return OtlpSink(args.protocol, target, args.span_shape, token=token, tls=tls)


def cmd_demo(args: argparse.Namespace) -> int:
    from phasewatch.sim.live import SwitchableLoad

    dash_socket, dash_taken = (None, None) if args.no_dashboard else _dashboard_socket(args)
    try:
        config, stop, exporter = _start_exporter(args, demo=True)
    except BaseException:
        if dash_socket is not None:
            dash_socket.close()
        raise
    if dash_taken is not None:
        args.taken_ports["dashboard_port"] = dash_taken
    host = "127.0.0.1" if config.http_host in ("0.0.0.0", "") else config.http_host
    base = f"http://{host}:{exporter.http_port}"
    target = {"phasewatch": f"127.0.0.1:{exporter.grpc_port}",
              "otlp-grpc": f"127.0.0.1:{exporter.otlp_grpc_port}",
              "otlp-http": f"http://127.0.0.1:{exporter.otlp_http_port}/v1/traces"}
    client = _sim_client(args, target[args.protocol], config.auth_token)
    duration = args.duration if args.duration else float("inf")
    load = SwitchableLoad(args.scenario, client.record_request, args.time_scale,
                          {"seed": args.seed, "model": args.model, "hardware": args.hardware,
                           "gpus": args.gpus, "rate_scale": args.rate_scale}, duration)
    dashboard = None if dash_socket is None else _demo_dashboard(
        args, dash_socket, base, config.auth_token, _switcher(args, exporter, load))
    _print_demo_lines(args, config, exporter, base, dashboard)
    load.start()
    try:
        _summaries_until_stopped(args, exporter, load, stop, duration)
    finally:
        stop.set()
        log.info("demo: stopping: the simulated load, then its client's last records")
        load.stop()
        client.close()
        _print_summary(exporter, load.current)
        if dashboard is not None:
            dashboard.stop()
        exporter.stop()
    return 0


def _switcher(args, exporter, load):
    """The dashboard's scenario switch: the load, and the scenario's objectives (unless
    the user gave objectives of their own)."""
    from phasewatch.requests.objectives import ObjectivesByModel

    def switch(name: str) -> None:
        if args.scenario_slo and exporter.aggregator.slo is not None:
            exporter.aggregator.slo.retarget(ObjectivesByModel(scenario(name).objectives))
        load.switch(name)
    return switch


def _demo_dashboard(args, sock, base: str, token: str, switch):
    """The Dash dashboard on ``sock``, reading the demo's exporter (its JSON API at
    ``base``), with the scenario menu that calls ``switch``; started."""
    from phasewatch.dashboard.app import DashboardServer, ScenarioControl, create_app
    from phasewatch.dashboard.exporter_source import ExporterSource

    control = ScenarioControl(tuple(sorted(SCENARIOS)), args.scenario, switch)
    app = create_app(ExporterSource(base, token=token), refresh=args.refresh,
                     scenario=control)
    return DashboardServer(app, args.dashboard_host, sock=sock).start()


def _print_demo_lines(args, config, exporter, base: str, dashboard) -> None:
    """The demo's opening lines: the scenario, its objectives and every URL, each port
    that gave way to a free one said beside it."""
    taken = args.taken_ports

    def was(name: str, before: str = " (", after: str = ")") -> str:
        """" (9464 was taken)": a default port another program held, so another was used."""
        return f"{before}{taken[name]} was taken{after}" if name in taken else ""

    print(f"phasewatch demo: scenario {args.scenario}", flush=True)
    if dashboard is not None:
        print(f"  dashboard: {dashboard.url}{was('dashboard_port')}   (switch the workload "
              f"with {SCENARIO_MENU})", flush=True)
    print(f"  objectives: {config.slo or 'none'} ("
          + ("the scenario's, " if args.scenario_slo else "")
          + "for goodput and the verdict; --slo to set them)", flush=True)
    print(f"  metrics:   {base}/metrics{was('http_port')}", flush=True)
    print(f"  JSON API:  {base}/api/v1/summary, roofline, history, requests", flush=True)
    print(f"  gRPC:      {config.grpc_host}:{exporter.grpc_port}{was('grpc_port')}", flush=True)
    print(f"  OTLP:      {config.otlp_grpc_host}:{exporter.otlp_grpc_port} (gRPC"
          f"{was('otlp_grpc_port', '; ', '')}), "
          f"http://{config.otlp_http_host}:{exporter.otlp_http_port}/v1/traces"
          f"{was('otlp_http_port')}", flush=True)
    print(f"  sending:   {args.protocol}"
          + (f" ({args.span_shape} spans)" if args.protocol != "phasewatch" else ""), flush=True)


def _summaries_until_stopped(args, exporter, load, stop: threading.Event,
                             duration: float) -> None:
    """A summary line every --summary-every seconds until a signal or --duration."""
    end = time.monotonic() + duration
    while not wait_stopped(stop, min(args.summary_every, max(0.0, end - time.monotonic()))):
        if time.monotonic() >= end:
            break
        _print_summary(exporter, load.current)


# the demo's listeners whose default port, when taken, gives way to a free one
DEMO_PORTS = ("http_port", "grpc_port", "otlp_grpc_port", "otlp_http_port")
DEMO_DASHBOARD_PORT = 8050
# where the page switches the demo's workload (dashboard/app.py's header), as the demo
# and the README say it
SCENARIO_MENU = "the scenario menu in the dashboard's top bar"


def _dashboard_socket(args):
    """The demo's dashboard socket, bound before the exporter starts (a taken
    --dashboard-port fails alone, in one line): on --dashboard-port, or on a free port
    where its default is taken. Returns it and the port that was taken (or None)."""
    from phasewatch.dashboard.app import dashboard_socket

    given = args.dashboard_port is not None
    return or_free_port("the dashboard", "--dashboard-port", args.dashboard_host,
                        args.dashboard_port if given else DEMO_DASHBOARD_PORT,
                        lambda p: dashboard_socket(args.dashboard_host, p), movable=not given)


def cmd_dashboard(args: argparse.Namespace) -> int:
    from phasewatch.dashboard.app import DashboardServer, create_app
    from phasewatch.dashboard.exporter_source import ExporterSource
    from phasewatch.dashboard.prometheus_source import PrometheusSource

    _setup_logging(args.log_level)
    if bool(args.exporter) == bool(args.prometheus):
        raise ValueError("give exactly one of --exporter URL or --prometheus URL")
    if args.exporter:
        source = ExporterSource(args.exporter, timeout=args.timeout,
                                history_seconds=args.history_seconds, token=args.token,
                                tls=_client_tls(args))
    else:
        source = PrometheusSource(args.prometheus, rate_range=args.range, timeout=args.timeout,
                                  history_seconds=args.history_seconds,
                                  pod_label=args.pod_label)
    stop = threading.Event()
    _stop_on_signals(stop)
    app = create_app(source, refresh=args.refresh, basic_auth=args.basic_auth)
    server = listening("the dashboard", "--port", args.host, args.port,
                       lambda: DashboardServer(app, args.host, args.port).start())
    print(f"phasewatch dashboard on {server.url} reading {source.name} {source.url}",
          flush=True)
    wait_stopped(stop)
    server.stop()
    return 0


def _print_summary(exporter, current: str) -> None:
    summary = exporter.aggregator.window.summary(exporter.aggregator.labels.pairs())
    results = [r for r in exporter.monitor.results() if r.verdict is not None]
    shares = {r.model: r.verdict.evidence.phase_time_share for r in results}
    print(f"[{current}] {_summary_line(summary, shares)}", flush=True)
    for r in results:
        v = r.verdict
        if v.lead:  # the objectives' sentence on a line of its own
            print(f"  objectives {r.model}: {v.lead}", flush=True)
        text = v.text[len(v.lead):].lstrip() if v.text.startswith(v.lead) else v.text
        levers = f" Levers: {', '.join(v.levers)}." if v.levers else ""
        print(f"  verdict {r.model}: {text}{levers}", flush=True)


def cmd_roofline(args: argparse.Namespace) -> int:
    from phasewatch.roofline import calculator, catalog
    from phasewatch.roofline.deployments import ModelOptions, compute_dtype_for, load_profile
    from phasewatch.roofline.hf_config import load_model_config

    sources = [bool(args.model), bool(args.hf_config), bool(args.params)]
    if sum(sources) != 1:
        raise ValueError("give exactly one of --model, --hf-config or --params")
    if args.params:
        m = calculator.generic_model(calculator.parse_params(args.params),
                                     args.weight_dtype or "bf16")
    else:
        m = load_model_config(args.hf_config) if args.hf_config else catalog.model(args.model)
        m = replace(m, weight_dtype=args.weight_dtype or m.weight_dtype,
                    kv_dtype=args.kv_dtype or m.kv_dtype)
        for dtype in (m.weight_dtype, m.kv_dtype):
            catalog.dtype_bytes(dtype)  # raises, listing the known dtypes
    if args.bandwidth:
        hw = catalog.HardwareSpec(name="custom", bandwidth=args.bandwidth * 1e9,
                                  flops={"bf16": args.flops * 1e12} if args.flops else {})
        hw = hw.times(args.gpus)
    elif args.hardware_profile:
        hw = load_profile(args.hardware_profile, args.gpus)
    elif args.hardware:
        hw = catalog.hardware(args.hardware, args.gpus)
    else:
        raise ValueError("give --hardware NAME, --hardware-profile FILE or --bandwidth GBPS")
    compute = args.compute_dtype or (compute_dtype_for(ModelOptions(), m, hw) if hw.flops
                                     else "bf16")
    if hw.flops and not hw.peak_flops(compute):  # a ceiling holds only for its own dtype
        raise ValueError(f"{hw.name} has no {compute} FLOP/s figure (it has: "
                         f"{', '.join(sorted(hw.flops))}): measure it with `phasewatch "
                         "calibrate` where torch is importable, or pass --compute-dtype")
    tpot = args.tpot if args.tpot else (1.0 / args.tokens_per_second
                                        if args.tokens_per_second else None)
    rows = calculator.table(m, hw, batch=args.batch, context=args.context, prompt=args.prompt,
                            compute_dtype=compute, tpot=tpot, ttft=args.ttft)
    print(calculator.as_json(rows) if args.json else calculator.render(rows))
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from phasewatch.roofline import calibrate

    profile = calibrate.calibrate(args.device, args.size_mib, args.matmul_n, args.repeats,
                                  progress=calibrate.stderr_progress,
                                  matmul_seconds=args.matmul_seconds)
    calibrate.write(profile, args.output)
    print(calibrate.report(profile))
    print(f"profile written to {args.output}; use it with --hardware-profile {args.output}")
    return 0


def cmd_tap(args) -> int:
    from phasewatch import tap

    _setup_logging("info")
    stop = threading.Event()
    _stop_on_signals(stop)  # SIGTERM too: open streams get their grace, counts are logged
    conf = tap.TapConfig.read(args, client_tls=_client_tls(args))  # options.TAP_OPTIONS
    return tap.serve_forever(conf, stop)
