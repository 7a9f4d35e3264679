"""The other commands' options, once, as ``options`` has serve's, the tap's, the
dashboard's and the demo's: ``phasewatch simulate`` (``SIMULATE_OPTIONS``, the simulator's
own ``SIM_OPTIONS`` also the demo's), ``roofline`` (``ROOFLINE_OPTIONS``), ``calibrate``
(``CALIBRATE_OPTIONS``), the dashboard's source (``DASHBOARD_SOURCE``), and the clients'
``--token`` and ``--exporter-tls-*`` (``client_options``), which ``tap``, ``simulate`` and
``dashboard`` share. ``flags.add_options`` builds each command's parser from its table.
None of these reads a variable unless its ``env`` names one (the clients' flags do).

And docs/commands.md's tables of every command (``commands_markdown``):
``python -m phasewatch.options_commands`` prints them; a test holds the page to them.
Apart from ``options`` because these tables name the simulator's scenarios and the
roofline's calibration, stages above the floor ``options`` sits on."""

from __future__ import annotations

from phasewatch.options import (
    DASHBOARD_ENV,
    DASHBOARD_OPTIONS,
    DEMO_ENV,
    DEMO_OPTIONS,
    IN_PROCESS_TAP,
    SERVE_GROUPS,
    SERVE_OPTIONS,
    SERVE_TAP,
    TAP_ENV,
    TAP_OPTIONS,
    Option,
)
from phasewatch.roofline.measure import MATMUL_SECONDS
from phasewatch.sim.scenarios import SCENARIOS

TO_EXPORTER = "to the exporter"  # also a title of options.TAP_GROUPS: the tap's go in it


def client_options(what: str, group: str = TO_EXPORTER) -> tuple[Option, ...]:
    """``--token`` (``what``: who requires it) and TLS to the exporter, listed in
    ``group``. TLS to the exporter is spelt --exporter-tls-*; --tls-cert-file and
    --tls-key-file are always a listener's own (serve's, the tap's). The old client
    spellings (``old``) stay as hidden aliases for manifests that use them (issue 26)."""
    return (
        Option("token", str, "", f"bearer token {what}: the exporter's --auth-token",
               env="PHASEWATCH_AUTH_TOKEN", group=group),
        Option("exporter_tls_ca", str, "", "TLS to the exporter: the CA that signed the "
               "exporter's certificate", metavar="PEM", env="PHASEWATCH_CLIENT_TLS_CA",
               shown_as="the system's", group=group, old="--tls-ca"),
        Option("exporter_tls_cert", str, "", "TLS to the exporter: the client certificate, "
               "when the exporter requires one", metavar="PEM",
               env="PHASEWATCH_CLIENT_TLS_CERT", group=group, old="--tls-cert"),
        Option("exporter_tls_key", str, "", "TLS to the exporter: the key of "
               "--exporter-tls-cert", metavar="PEM", env="PHASEWATCH_CLIENT_TLS_KEY",
               group=group, old="--tls-key"),
    )


RECEIVERS = "the exporter's receivers require"  # what the tap's and simulate's token is for
TAP_CLIENT = client_options(RECEIVERS)  # `phasewatch tap`'s, beside options.TAP_OPTIONS
# the old client spellings and the flags that replaced them
DEPRECATED_CLIENT_TLS = {o.old: o.flag for o in client_options("") if o.old}

# where simulate sends by --protocol, unless --target says
DEFAULT_TARGETS = {"phasewatch": "127.0.0.1:50051", "otlp-grpc": "127.0.0.1:4317",
                   "otlp-http": "http://127.0.0.1:4318/v1/traces"}

# The simulator's: `simulate`'s and the demo's (the demo takes the model, the hardware
# and the GPUs from serve's flags instead: SIM_DEPLOYMENT)
SIM_OPTIONS = (
    Option("scenario", str, "chat", "workload to simulate: " + "; ".join(
        f"{s.name}: {s.description}" for s in SCENARIOS.values()), metavar="NAME",
        choices=tuple(sorted(SCENARIOS))),
    Option("model", str, None, "served model: catalog name or Hugging Face id",
           shown_as="the scenario's"),
    Option("hardware", str, None, "accelerator: catalog name", shown_as="the scenario's"),
    Option("gpus", int, None, "number of GPUs serving the model", shown_as="the scenario's"),
    Option("seed", int, 0, "random seed"),
    Option("rate_scale", float, 1.0, "multiply the scenario's arrival rate or users"),
    Option("time_scale", float, 1.0, "engine seconds per wall second",
           shown_as="1 = real time"),
    Option("protocol", str, "phasewatch", "how finished requests travel: the phasewatch "
           "gRPC client, or spans through the OpenTelemetry SDK's OTLP exporter",
           choices=tuple(DEFAULT_TARGETS)),
    Option("span_shape", str, "vllm", "with an OTLP protocol: whose spans to imitate",
           choices=("vllm", "sglang", "tgi")),
)
SIM_DEPLOYMENT = ("model", "hardware", "gpus")
DEMO_SIM_OPTIONS = tuple(o for o in SIM_OPTIONS if o.name not in SIM_DEPLOYMENT)

SIMULATE_OPTIONS = (
    Option("duration", float, 60.0, "engine seconds to simulate"),
    Option("target", str, None, "exporter address: host:port for phasewatch and otlp-grpc, "
           "a URL for otlp-http", group=TO_EXPORTER, shown_as=", ".join(
               f"{t} for {p}" for p, t in DEFAULT_TARGETS.items())),
    *client_options(RECEIVERS),
    *SIM_OPTIONS,
)

# `phasewatch dashboard`'s source, one of two, beside options.DASHBOARD_OPTIONS
DASHBOARD_SOURCE = (
    Option("exporter", str, None, "exporter base URL, e.g. http://127.0.0.1:9464",
           one_of="source", required=True),
    Option("prometheus", str, None, "Prometheus base URL, e.g. http://prometheus:9090",
           one_of="source", required=True),
)
DASHBOARD_CLIENT = client_options("of the exporter's JSON API",
                                  "to the exporter (with --exporter)")

MODEL_ONE_OF, HARDWARE_ONE_OF = "model (one of)", "hardware (one of)"
ROOFLINE_OPTIONS = (
    Option("model", str, None, "catalog name or Hugging Face id", group=MODEL_ONE_OF),
    Option("hf_config", str, None, "path to a Hugging Face config.json", group=MODEL_ONE_OF),
    Option("params", str, None, "parameter count only, e.g. 7B (no KV cache)",
           group=MODEL_ONE_OF),
    Option("weight_dtype", str, None, "bf16, fp16, fp8, int8, int4 (with scales), mxfp4, "
           "4bit (flat)"),
    Option("kv_dtype", str, None, "KV-cache dtype", shown_as="the model's"),
    Option("hardware", str, None, "catalog name, e.g. H100-SXM", group=HARDWARE_ONE_OF),
    Option("hardware_profile", str, None, "profile written by phasewatch calibrate",
           group=HARDWARE_ONE_OF),
    Option("bandwidth", float, None, "custom part: memory GB/s", group=HARDWARE_ONE_OF),
    Option("flops", float, None, "custom part: dense TFLOP/s"),
    Option("gpus", int, 1, "GPUs"),
    Option("compute_dtype", str, None, "dtype whose peak FLOP/s applies"),
    Option("batch", int, 1, "decode batch"),
    Option("context", int, 1024, "context tokens per sequence"),
    Option("prompt", int, 512, "prompt tokens for the prefill rows"),
    Option("tpot", float, None, "measured seconds per output token"),
    Option("tokens_per_second", float, None, "measured decode tokens/s per sequence "
           "(instead of --tpot)"),
    Option("ttft", float, None, "measured time to first token (s)"),
    Option("json", bool, False, "print the rows as JSON"),
)

CALIBRATE_OPTIONS = (
    Option("device", str, "auto", "where to measure", choices=("auto", "cpu", "cuda"),
           shown_as="auto: the GPU if torch sees one"),
    Option("output", str, "phasewatch-hardware.json", "profile file to write"),
    Option("size_mib", int, 512, "copy buffer size in MiB, larger than any cache"),
    Option("matmul_n", int, 2048, "matrix size of the matmul; 8192 suits a GPU"),
    Option("repeats", int, 5, "best of this many runs"),
    Option("matmul_seconds", float, MATMUL_SECONDS, "each dtype's matmuls stop after about "
           "this long: a dtype too slow for it is measured on a smaller matrix or fewer "
           "times, which the profile's matmul_runs says, and why", metavar="SECONDS"),
)


def _value(o: Option) -> str:
    return "" if o.type is bool else f" {o.value_name}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|") or "-"


def tap_options_markdown() -> str:
    """docs/commands.md's table of the tap's options, under both commands."""
    rows = ["| `phasewatch tap` | `phasewatch serve` | variable | default | what |",
            "|---|---|---|---|---|"]
    for o in TAP_OPTIONS:
        serve = f"`--tap-{o.flag[2:]}{_value(o) or ' BOOL'}`" if o in IN_PROCESS_TAP else "-"
        rows.append(f"| `{o.flag}{_value(o)}` | {serve} | `{TAP_ENV}{o.name.upper()}` | "
                    f"{_cell(o.shown)} | {_cell(o.help)} |")
    return "\n".join(rows) + "\n"


def serve_options_markdown() -> str:
    """docs/commands.md's table of serve's options (its --tap-* ones: the tap's table),
    in ``serve --help``'s sections."""
    by_name = {o.name: o for o in SERVE_OPTIONS}
    tap = {o.name for o in SERVE_TAP}
    rows = ["| `phasewatch serve` | variable | file key | default | what |",
            "|---|---|---|---|---|"]
    for title, _, names in SERVE_GROUPS:
        if not set(names) <= tap:
            rows.append(f"| **{title}** | | | | |")
        for o in (by_name[n] for n in names if n not in tap):
            value = f" {o.metavar or o.type.__name__.upper()}"  # as add_serve_flags has it
            rows.append(f"| `{o.flag}{value}` | `PHASEWATCH_{o.name.upper()}` | `{o.name}` | "
                        f"{_cell(o.shown)} | {_cell(o.help)} |")
    return "\n".join(rows) + "\n"


def options_markdown(command: str, *parts: tuple[tuple[Option, ...], str]) -> str:
    """docs/commands.md's table of ``command``'s options from its tables, each part
    ``(options, prefix)`` as the command adds it: a variable where one is read (an
    option's own ``env``, else ``prefix`` + NAME where the part has a prefix)."""
    rows = [f"| `phasewatch {command}` | variable | default | what |", "|---|---|---|---|"]
    for options, prefix in parts:
        for o in options:
            env = o.env or (prefix + o.name.upper() if prefix else "")
            alias = f" (or `{o.old}`, deprecated)" if o.old else ""
            rows.append(f"| `{o.flag}{_value(o)}`{alias} | {f'`{env}`' if env else '-'} | "
                        f"{_cell(o.shown)} | {_cell(o.help)} |")
    return "\n".join(rows) + "\n"


def commands_markdown() -> str:
    """Every table docs/commands.md shows of the option tables, in its order."""
    return "\n".join((
        serve_options_markdown(), tap_options_markdown(),
        options_markdown("dashboard", (DASHBOARD_SOURCE, ""),
                         (DASHBOARD_OPTIONS, DASHBOARD_ENV), (DASHBOARD_CLIENT, "")),
        options_markdown("demo", (DEMO_OPTIONS, DEMO_ENV), (DEMO_SIM_OPTIONS, "")),
        options_markdown("simulate", (SIMULATE_OPTIONS, "")),
        options_markdown("roofline", (ROOFLINE_OPTIONS, "")),
        options_markdown("calibrate", (CALIBRATE_OPTIONS, ""))))


if __name__ == "__main__":
    print(commands_markdown(), end="")
