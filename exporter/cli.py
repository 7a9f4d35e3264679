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
from phasewatch.flags import (
    DEPRECATED_CLIENT_TLS,
    EnvParser,
    add_client_flags,
    add_options,
    add_tap_flags,
)
from phasewatch.options import DASHBOARD_ENV, DASHBOARD_OPTIONS, DEMO_ENV, DEMO_OPTIONS
from phasewatch.roofline.measure import MATMUL_SECONDS
from phasewatch.sim.scenarios import SCENARIOS

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


def _add_sim_flags(p: argparse.ArgumentParser, deployment: bool = True) -> None:
    p.add_argument("--scenario", default="chat", choices=sorted(SCENARIOS),
                   help="workload to simulate (default chat): " + "; ".join(
                       f"{s.name}: {s.description}" for s in SCENARIOS.values()
                   ).replace("%", "%%"))  # argparse %-formats help ("30% prefix-cache hits")
    if deployment:  # demo takes these from the exporter's flags instead
        p.add_argument("--model", help="served model (catalog name or Hugging Face id); "
                       "default: the scenario's")
        p.add_argument("--hardware", help="accelerator (catalog name); default: the "
                       "scenario's")
        p.add_argument("--gpus", type=int, help="number of GPUs serving the model")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--rate-scale", type=float, default=1.0,
                   help="multiply the scenario's arrival rate or users (default 1)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="engine seconds per wall second (default 1 = real time)")
    p.add_argument("--protocol", choices=("phasewatch", "otlp-grpc", "otlp-http"),
                   default="phasewatch", help="how finished requests travel: the phasewatch "
                   "gRPC client, or spans through the OpenTelemetry SDK's OTLP exporter "
                   "(default phasewatch)")
    p.add_argument("--span-shape", choices=("vllm", "sglang", "tgi"), default="vllm",
                   help="with an OTLP protocol: whose spans to imitate (default vllm)")


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
    simulate.add_argument("--duration", type=float, default=60.0,
                          help="engine seconds to simulate (default 60)")
    to_exporter = simulate.add_argument_group("to the exporter")
    to_exporter.add_argument("--target", help="exporter address: host:port for phasewatch "
                             "(default 127.0.0.1:50051) and otlp-grpc (127.0.0.1:4317), a "
                             "URL for otlp-http (http://127.0.0.1:4318/v1/traces)")
    add_client_flags(to_exporter, "the exporter's receivers require")
    _add_sim_flags(simulate)
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
    _add_sim_flags(demo, deployment=False)
    add_serve_flags(demo)  # the demo's default ports give way to free ones where taken
    demo.set_defaults(func=cmd_demo)


def _add_dashboard(sub) -> None:
    dash_cmd = sub.add_parser(
        "dashboard", help="the live Dash dashboard, reading an exporter or Prometheus",
        description="Serve the Dash dashboard: the verdict, KPIs, roofline, time series, "
        "request waterfall and TTFT against prompt length, from one exporter's JSON API "
        "(--exporter) or a whole cluster through Prometheus (--prometheus).")
    src = dash_cmd.add_mutually_exclusive_group(required=True)
    src.add_argument("--exporter", help="exporter base URL, e.g. http://127.0.0.1:9464")
    src.add_argument("--prometheus", help="Prometheus base URL, e.g. http://prometheus:9090")
    add_options(dash_cmd, DASHBOARD_OPTIONS, DASHBOARD_ENV)  # options.DASHBOARD_OPTIONS
    add_client_flags(dash_cmd.add_argument_group("to the exporter (with --exporter)"),
                     "of the exporter's JSON API")
    dash_cmd.set_defaults(func=cmd_dashboard)


def _add_roofline(sub) -> None:
    roofline = sub.add_parser(
        "roofline", help="offline calculator: model x hardware -> ceilings",
        description="Weights and KV bytes, decode and prefill ceilings, the ridge point and "
        "which ceiling binds, for one operating point; with a measured TPOT/tokens per "
        "second and TTFT, the achieved bandwidth, FLOP/s, MBU and MFU.")
    what = roofline.add_argument_group("model (one of)")
    what.add_argument("--model", help="catalog name or Hugging Face id")
    what.add_argument("--hf-config", help="path to a Hugging Face config.json")
    what.add_argument("--params", help="parameter count only, e.g. 7B (no KV cache)")
    roofline.add_argument("--weight-dtype", help="bf16, fp16, fp8, int8, int4 (with "
                          "scales), mxfp4, 4bit (flat)")
    roofline.add_argument("--kv-dtype", help="KV-cache dtype (default: the model's)")
    where = roofline.add_argument_group("hardware (one of)")
    where.add_argument("--hardware", help="catalog name, e.g. H100-SXM")
    where.add_argument("--hardware-profile", help="profile written by phasewatch calibrate")
    where.add_argument("--bandwidth", type=float, help="custom part: memory GB/s")
    roofline.add_argument("--flops", type=float, help="custom part: dense TFLOP/s")
    roofline.add_argument("--gpus", type=int, default=1, help="GPUs (default 1)")
    roofline.add_argument("--compute-dtype", help="dtype whose peak FLOP/s applies")
    roofline.add_argument("--batch", type=int, default=1, help="decode batch (default 1)")
    roofline.add_argument("--context", type=int, default=1024,
                          help="context tokens per sequence (default 1024)")
    roofline.add_argument("--prompt", type=int, default=512,
                          help="prompt tokens for the prefill rows (default 512)")
    roofline.add_argument("--tpot", type=float, help="measured seconds per output token")
    roofline.add_argument("--tokens-per-second", type=float,
                          help="measured decode tokens/s per sequence (instead of --tpot)")
    roofline.add_argument("--ttft", type=float, help="measured time to first token (s)")
    roofline.add_argument("--json", action="store_true", help="print the rows as JSON")
    roofline.set_defaults(func=cmd_roofline)


def _add_tap(sub) -> None:
    tap = sub.add_parser(
        "tap", help="streaming proxy in front of an OpenAI-compatible server",
        description="Proxy /v1/chat/completions and /v1/completions (and pass every other "
        "path through) to --upstream, byte for byte, streamed; time what the client sees "
        "(arrival, every streamed emission, the end), read the finish reason and usage, "
        "inject a W3C traceparent, and send each request to an exporter.")
    groups = add_tap_flags(tap)  # options.TAP_OPTIONS, as serve's --tap-* are
    add_client_flags(groups["to the exporter"], "the exporter's receivers require")
    tap.set_defaults(func=cmd_tap)


def _add_calibrate(sub) -> None:
    cal = sub.add_parser(
        "calibrate", help="measure this machine's bandwidth and FLOP/s, write a profile",
        description="Measure achievable memory bandwidth (a large streaming copy) and matmul "
        "FLOP/s in bf16, fp16 and fp32 with torch (on the GPU when one is present, else on "
        "the CPU; without torch numpy measures fp32 alone), each dtype within about "
        "--matmul-seconds, saying on stderr what it measures and how long each took, and "
        "write a hardware profile for --hardware-profile.")
    cal.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                     help="where to measure (default auto: the GPU if torch sees one)")
    cal.add_argument("--output", default="phasewatch-hardware.json",
                     help="profile file to write (default phasewatch-hardware.json)")
    cal.add_argument("--size-mib", type=int, default=512,
                     help="copy buffer size in MiB (default 512; larger than any cache)")
    cal.add_argument("--matmul-n", type=int, default=2048,
                     help="matrix size of the matmul (default 2048; 8192 suits a GPU)")
    cal.add_argument("--repeats", type=int, default=5, help="best of this many runs")
    cal.add_argument("--matmul-seconds", type=float, default=MATMUL_SECONDS, metavar="SECONDS",
                     help="each dtype's matmuls stop after about this long: a dtype too "
                     "slow for it is measured on a smaller matrix or fewer times (the "
                     f"profile's matmul_runs says which, and why; default {MATMUL_SECONDS:g})")
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

