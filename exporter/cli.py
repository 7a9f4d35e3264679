"""The ``phasewatch`` command: its parser (flags, help) and ``main``, which runs the chosen
command (``phasewatch.commands``)."""

from __future__ import annotations

import argparse
import sys

from phasewatch.commands import (
    cmd_calibrate,
    cmd_dashboard,
    cmd_demo,
    cmd_roofline,
    cmd_serve,
    cmd_simulate,
    cmd_tap,
)
from phasewatch.config import ConfigError, ListenError, add_serve_flags
from phasewatch.flags import EnvParser, add_options, add_tap_flags
from phasewatch.options import DASHBOARD_ENV, DASHBOARD_OPTIONS, DEMO_ENV, DEMO_OPTIONS
from phasewatch.options_commands import (
    CALIBRATE_OPTIONS,
    DASHBOARD_CLIENT,
    DASHBOARD_SOURCE,
    DEMO_SIM_OPTIONS,
    DEPRECATED_CLIENT_TLS,
    ROOFLINE_OPTIONS,
    SIMULATE_OPTIONS,
    TAP_CLIENT,
)

DESCRIPTION = """\
phasewatch splits every LLM request into its phases (preprocess, queue, prefill
and decode; KV transfer where prefill and decode are disaggregated), and exports
TTFT, ITL, TPOT, tokens/s per phase to Prometheus.

  phasewatch serve                     run the exporter (gRPC :50051, /metrics :9464)
  phasewatch simulate --scenario chat  send simulated engine traffic to an exporter
  phasewatch demo                      exporter + simulated load + dashboard, on this machine
  phasewatch dashboard --exporter URL  the live dashboard (or --prometheus URL for a cluster)
  phasewatch roofline --model M --hardware H   offline ceilings for a model on a part
  phasewatch calibrate                 measure this machine's bandwidth and FLOP/s
"""


def deprecation_line(command: str, used: list[str]) -> str:
    """The one line printed when old client TLS spellings were used."""
    old = ", ".join(dict.fromkeys(used))
    new = ", ".join(DEPRECATED_CLIENT_TLS[u] for u in dict.fromkeys(used))
    return (f"phasewatch {command}: warning: {old} deprecated: use {new} (TLS to the "
            "exporter; --tls-cert-file/--tls-key-file are a listener's own)")


def _add_serve(sub) -> None:
    serve = sub.add_parser("serve", help="run the exporter",
                           usage="phasewatch serve [-h] [--config FILE] [--FLAG VALUE ...]",
                           description="Run the exporter: the phasewatch gRPC receiver and "
                           "HTTP /metrics, /healthz, /readyz and /api/v1. Settings come from "
                           "flags, PHASEWATCH_* variables, then --config FILE (TOML), in "
                           "that order of precedence.")
    add_serve_flags(serve)
    serve.set_defaults(func=cmd_serve)


def _add_simulate(sub) -> None:
    simulate = sub.add_parser("simulate", help="drive an exporter with simulated traffic",
                              description="Simulate a continuous-batching engine and send "
                              "every finished request to an exporter over gRPC.")
    add_options(simulate, SIMULATE_OPTIONS)  # options_commands.SIMULATE_OPTIONS
    simulate.set_defaults(func=cmd_simulate)


def _add_demo(sub) -> None:
    demo = sub.add_parser("demo", help="exporter + simulated load + dashboard",
                          usage="phasewatch demo [-h] [--scenario NAME] [--duration S] "
                          "[--no-dashboard] [--FLAG VALUE ...]",
                          description="Start an exporter, a simulated engine feeding it and "
                          "the Dash dashboard reading it; print the URLs and a one-line "
                          "summary every few seconds. The dashboard switches the scenario. "
                          "A default port another program holds gives way to a free one (the "
                          "demo prints which); a port given by flag, variable or --config "
                          "does not.")
    add_options(demo, DEMO_OPTIONS, DEMO_ENV)  # options.DEMO_OPTIONS
    add_options(demo, DEMO_SIM_OPTIONS)  # the simulator's, but the model's (serve's)
    add_serve_flags(demo)  # the demo's default ports give way to free ones where taken
    demo.set_defaults(func=cmd_demo)


def _add_dashboard(sub) -> None:
    dash_cmd = sub.add_parser(
        "dashboard", help="the live Dash dashboard, reading an exporter or Prometheus",
        description="Serve the Dash dashboard: the verdict, KPIs, roofline, time series, "
        "request waterfall and TTFT against prompt length, from one exporter's JSON API "
        "(--exporter) or a whole cluster through Prometheus (--prometheus).")
    add_options(dash_cmd, DASHBOARD_SOURCE)  # one of --exporter, --prometheus
    add_options(dash_cmd, DASHBOARD_OPTIONS, DASHBOARD_ENV)  # options.DASHBOARD_OPTIONS
    add_options(dash_cmd, DASHBOARD_CLIENT)
    dash_cmd.set_defaults(func=cmd_dashboard)


def _add_roofline(sub) -> None:
    roofline = sub.add_parser(
        "roofline", help="offline calculator: model x hardware -> ceilings",
        description="Weights and KV bytes, decode and prefill ceilings, the ridge point and "
        "which ceiling binds, for one operating point; with a measured TPOT/tokens per "
        "second and TTFT, the achieved bandwidth, FLOP/s, MBU and MFU.")
    add_options(roofline, ROOFLINE_OPTIONS)  # options_commands.ROOFLINE_OPTIONS
    roofline.set_defaults(func=cmd_roofline)


def _add_tap(sub) -> None:
    tap = sub.add_parser(
        "tap", help="streaming proxy in front of an OpenAI-compatible server",
        description="Proxy /v1/chat/completions and /v1/completions (and pass every other "
        "path through) to --upstream, byte for byte, streamed; time what the client sees "
        "(arrival, every streamed emission, the end), read the finish reason and usage, "
        "inject a W3C traceparent, and send each request to an exporter.")
    groups = add_tap_flags(tap)  # options.TAP_OPTIONS, as serve's --tap-* are
    add_options(tap, TAP_CLIENT, groups=groups)  # in its group "to the exporter"
    tap.set_defaults(func=cmd_tap)


def _add_calibrate(sub) -> None:
    cal = sub.add_parser(
        "calibrate", help="measure this machine's bandwidth and FLOP/s, write a profile",
        description="Measure achievable memory bandwidth (a large streaming copy) and matmul "
        "FLOP/s in bf16, fp16 and fp32 with torch (on the GPU when one is present, else on "
        "the CPU; without torch numpy measures fp32 alone), each dtype within about "
        "--matmul-seconds, saying on stderr what it measures and how long each took, and "
        "write a hardware profile for --hardware-profile.")
    add_options(cal, CALIBRATE_OPTIONS)  # options_commands.CALIBRATE_OPTIONS
    cal.set_defaults(func=cmd_calibrate)


def build_parser() -> argparse.ArgumentParser:
    parser = EnvParser(prog="phasewatch", description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_serve, _add_simulate, _add_demo, _add_dashboard, _add_roofline,
                _add_tap, _add_calibrate):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "deprecated_flags", None):
        print(deprecation_line(args.command, args.deprecated_flags), file=sys.stderr)
    try:
        return args.func(args)
    except ListenError as e:  # a port taken: which listener, address and flag, one line
        print(f"phasewatch {args.command}: {e}", file=sys.stderr)
        return 2
    except (ConfigError, ValueError, OSError) as e:
        print(f"phasewatch: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

