"""Every option, once: name, type, default, help and bounds. ``SERVE_OPTIONS`` are
``phasewatch serve``'s, in the sections ``serve --help`` shows them in (``SERVE_GROUPS``);
``TAP_OPTIONS`` the stream tap's, in ``TAP_GROUPS``: ``phasewatch tap --NAME``, and the
ones a tap inside the exporter can use (``IN_PROCESS_TAP``) also ``serve --tap-NAME``,
both read from ``PHASEWATCH_TAP_NAME`` (``describe``: one help line for both).
``config`` reads serve's from the file, the environment and the flags, ``flags`` builds
every command's flags from them, and the records that hold the settings take their fields
from them (``option_fields``: ``config.ServeConfig``, ``tap.config.TapConfig``,
``roofline.deployments.ModelOptions``), so each default is written here alone. The other
commands' tables (simulate, roofline, calibrate, the clients' flags) are in
``options_commands``, which also writes docs/commands.md's tables.

A table of data that imports only ``requests``: it sits low (the roofline's
``ModelOptions`` reads it), as ``catalog`` does."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from phasewatch.requests.sampling import MIN_PROBABILITY


@dataclass(frozen=True)
class Option:
    name: str
    type: type
    default: Any  # None: not given (no "(default ...)" in --help unless ``shown_as``)
    help: str
    lo: float | None = None
    hi: float | None = None
    metavar: str = ""  # its value in --help; default NAME or {the,choices} (serve's: TYPE)
    choices: tuple[str, ...] = ()  # the only values allowed, when set
    env: str = ""  # its variable, where not the command's prefix + NAME (no prefix: none)
    shown_as: str = ""  # the default in words, where not the value itself
    group: str = ""  # the --help section it is listed in ("": the command's own options)
    one_of: str = ""  # options with the same one_of exclude each other
    required: bool = False  # must be given, by flag or variable (in a one_of: one of them)
    old: str = ""  # a former spelling of the flag, still taken, hidden, with a warning

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def value_name(self) -> str:
        """Its value in --help (argparse's own choice where no ``metavar``)."""
        return self.metavar or ("{" + ",".join(self.choices) + "}" if self.choices
                                else self.name.upper())

    @property
    def shown(self) -> str:
        """The default as ``--help`` says it ("": none to say)."""
        if self.shown_as or self.default is None:
            return self.shown_as
        if isinstance(self.default, bool):
            return str(self.default).lower()
        return "none" if self.default == "" else f"{self.default:g}" \
            if isinstance(self.default, float) else str(self.default)


Record = TypeVar("Record", bound=type)


def option_fields(options: tuple[Option, ...]) -> Callable[[Record], Record]:
    """A class decorator, written under ``@dataclass``: a field ``NAME: type = default``
    for each of ``options``, in the table's order, before the class's own fields. The
    record then holds each option's default as the table writes it, once; its fields are
    ``dataclasses.fields(cls)``, and the class's docstring names its table. A field of the
    class's own with an option's name is an error (one definition)."""
    def add(cls: Record) -> Record:
        own = inspect.get_annotations(cls)
        twice = sorted(set(own) & {o.name for o in options})
        if twice:
            raise TypeError(f"{cls.__name__}: {twice} are options: their fields come from "
                            "the table")
        for o in options:
            setattr(cls, o.name, o.default)
        cls.__annotations__ = {**{o.name: o.type if o.default is not None
                                  else o.type | None for o in options}, **own}
        return cls
    return add


def describe(o: Option, env: str) -> str:
    """``o``'s help line, with its default and its variable: the same wherever it is a
    flag (``phasewatch tap --port`` and ``serve --tap-port`` read alike)."""
    said = [f"default {o.shown}"] if o.shown else []
    said += [f"one of {', '.join(o.choices)}"] if o.choices else []
    said += [f"env {env}"] if env else []
    return (f"{o.help} ({'; '.join(said)})" if said else o.help).replace("%", "%%")


TAP_ENV = "PHASEWATCH_TAP_"  # a tap option NAME's variable: PHASEWATCH_TAP_NAME, either command

# The stream tap's options. A tap inside `phasewatch serve` can use them too
# (``IN_PROCESS_TAP``: serve --tap-NAME), except ``TAP_ONLY``, `phasewatch tap`'s alone:
# inside serve the records go to its trace join (no --target, --otlp-endpoint or token),
# its counts are on serve's /metrics (no --metrics-port), the model is serve's
# --default-model (app.py), and it runs in serve's one process (no --workers).
TAP_OPTIONS = (
    Option("upstream", str, "", "base URL of the OpenAI-compatible server the tap is in "
           "front of, e.g. http://127.0.0.1:8000 (`phasewatch tap` needs it; `serve` runs "
           "no tap without it)", metavar="URL", required=True),
    Option("upstream_ca", str, "", "CA that signed an https:// upstream's certificate "
           "(none: the system's CAs)", metavar="PEM"),
    Option("ask_usage", bool, False, "send streamed requests with "
           "stream_options.include_usage when the client did not ask for it (exact token "
           "counts), keeping the usage-only chunk from the client"),
    Option("host", str, "127.0.0.1", "address the tap listens on, where clients connect "
           "(0.0.0.0 in a pod, for a Service to reach it)", metavar="ADDRESS"),
    Option("port", int, 8001, "port the tap listens on (0: a free one)", 0, 65535,
           metavar="PORT"),
    Option("tls_cert_file", str, "", "the tap's own listener: certificate (chain) it serves "
           "HTTPS with; reloaded when the file changes; none: plain HTTP (its own variable, "
           "not serve's PHASEWATCH_TLS_CERT_FILE: one pod's environment cannot turn HTTPS "
           "on for the clients)", metavar="PEM"),
    Option("tls_key_file", str, "", "the tap's own listener: private key of its "
           "certificate", metavar="PEM"),
    Option("loop", str, "auto", "event loop: uvloop where installed (auto), or asyncio's "
           "own", metavar="LOOP", choices=("auto", "asyncio", "uvloop")),
    Option("engine", str, "tap", "engine label of the tap's records: name the server "
           "(vllm, sglang, tgi) so tap-only and joined requests share it", metavar="NAME"),
    Option("timeout", float, 3600.0, "seconds the upstream may stay silent, before "
           "answering (then 504) or mid-answer (then the client's answer is cut off there); "
           "not a limit on a whole stream", 0.001, 1e9, metavar="SECONDS"),
    Option("max_body_mib", float, 64.0, "a chat or completions request body up to this is "
           "read and the request timed; a larger one is streamed to the upstream untimed "
           "(counted body_too_large_untimed). Other paths are always streamed", 0, 1 << 20,
           metavar="MIB"),
    Option("metrics_port", int, None, "serve the tap's own counts (phasewatch_tap_*: "
           "requests by outcome, aborts, records dropped) as Prometheus text at /metrics on "
           "this port of --host (0 picks a free one; the tap's port passes every path, "
           "/metrics too, to the upstream)", 0, 65535, metavar="PORT", shown_as="off"),
    Option("target", str, "127.0.0.1:50051", "exporter's phasewatch gRPC address",
           metavar="HOST:PORT"),
    Option("otlp_endpoint", str, "", "send the records as OTLP spans instead of to "
           "--target: HOST:PORT (OTLP/gRPC) or an http(s)://.../v1/traces URL (OTLP/HTTP). "
           "For a fleet: the OpenTelemetry Collector, whose load-balancing exporter routes "
           "each record to the replica that holds the engine's spans of its trace "
           "(service.name and the pod from OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES)",
           metavar="ENDPOINT"),
    Option("model", str, "", "model label when a request names none", metavar="NAME"),
    Option("workers", int, 1, "processes serving the port (SO_REUSEPORT), each a whole tap "
           "on a core of its own; their counts summed on --metrics-port and in the stop "
           "line (in Kubernetes the container's CPU request)", 1, None, metavar="N"),
)
TAP_ONLY = ("metrics_port", "target", "otlp_endpoint", "model", "workers")
IN_PROCESS_TAP = tuple(o for o in TAP_OPTIONS if o.name not in TAP_ONLY)  # serve --tap-NAME

# `phasewatch dashboard`'s options beside its source (one of --exporter, --prometheus),
# and `phasewatch demo`'s own (beside serve's and the simulator's); each read from
# PHASEWATCH_DASHBOARD_NAME or PHASEWATCH_DEMO_NAME unless it names its own variable
REFRESH = Option("refresh", float, 2.0, "seconds between dashboard refreshes",
                 metavar="SECONDS")
DASHBOARD_ENV, DEMO_ENV = "PHASEWATCH_DASHBOARD_", "PHASEWATCH_DEMO_"
DASHBOARD_OPTIONS = (
    Option("host", str, "127.0.0.1", "address to serve on (0.0.0.0 in a pod)",
           metavar="HOST"),
    Option("port", int, 8050, "port to serve on", 0, 65535, metavar="PORT"),
    REFRESH,
    Option("range", str, "1m", "Prometheus rate window, e.g. 30s, 1m, 5m", metavar="RANGE"),
    Option("pod_label", str, "pod", "Prometheus label naming the pod", metavar="LABEL"),
    Option("history_seconds", float, 600.0, "span of the time series", metavar="SECONDS"),
    Option("timeout", float, 5.0, "seconds to wait for the source", metavar="SECONDS"),
    Option("basic_auth", str, "", "require HTTP basic auth for the page (the variable keeps "
           "it out of ps; none: no auth)", metavar="USER:PASSWORD",
           env="PHASEWATCH_DASHBOARD_AUTH"),
    Option("log_level", str, "info", "debug, info, warning, error", metavar="LEVEL"),
)
DEMO_OPTIONS = (
    Option("duration", float, 0.0, "stop after this many seconds (0: run until Ctrl-C)",
           metavar="S"),
    Option("summary_every", float, 5.0, "seconds between summary lines", metavar="SECONDS"),
    Option("dashboard_host", str, "127.0.0.1", "address of the Dash dashboard",
           metavar="HOST"),
    Option("dashboard_port", int, None, "port of the Dash dashboard (0 picks a free one)", 0,
           65535, metavar="PORT", shown_as="8050, or a free one when 8050 is taken"),
    REFRESH,
    Option("no_dashboard", bool, False, "exporter and simulated load only"),
)

# ``tap --help`` in sections; every option in exactly one (checked below). "to the
# exporter" also has --token and --exporter-tls-*, the clients' own flags.
TAP_GROUPS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("upstream", "the server the tap is in front of", ("upstream", "upstream_ca",
                                                        "ask_usage")),
    ("listener", "the tap's own port, where clients connect",
     ("host", "port", "tls_cert_file", "tls_key_file", "metrics_port", "loop", "workers")),
    ("to the exporter", "where the tap's records go", ("target", "otlp_endpoint", "engine",
                                                      "model")),
    ("limits", "", ("timeout", "max_body_mib")),
)


# The served model and its hardware, for the roofline and the verdict: serve's --model ...
# flags, and the keys of each [[models]] table of its config file (``ModelOptions``).
MODEL_OPTIONS = (
    Option("model", str, "", "served model for the roofline: catalog name or Hugging Face "
           "id (e.g. meta-llama/Llama-3.1-8B-Instruct)"),
    Option("hf_config", str, "", "path to the model's Hugging Face config.json (instead of "
           "a catalog name)"),
    Option("served_model_name", str, "", "model name requests carry, when it differs from "
           "--model; every name of this model (--model, its catalog aliases and Hugging Face "
           "ids) is labelled with it"),
    Option("hardware", str, "auto", "accelerator: catalog name (e.g. H100-SXM) or auto "
           "(detect through NVML)"),
    Option("hardware_profile", str, "", "hardware profile written by `phasewatch calibrate`"),
    Option("gpus", int, 0, "GPUs serving one replica (0 = tensor parallel degree, else "
           "the GPUs NVML sees)", 0, 4096),
    Option("tensor_parallel", int, 0, "tensor-parallel degree (0 = --gpus)", 0, 4096),
    Option("weight_dtype", str, "", "stored weight dtype (bf16, fp16, fp8, int8, int4, "
           "mxfp4); default: the model's"),
    Option("kv_dtype", str, "", "KV-cache dtype (as vLLM's --kv-cache-dtype); default: the "
           "model's"),
    Option("compute_dtype", str, "", "tensor-core dtype whose peak FLOP/s applies (default "
           "fp8 for fp8 weights, else bf16)"),
    Option("max_batched_tokens", int, 8192, "the engine's prefill chunk (vLLM "
           "--max-num-batched-tokens)", 1, 10_000_000),
    Option("engine_metrics_url", str, "", "the engine's own /metrics URL (e.g. "
           "http://localhost:8000/metrics in the pod): its state (running, waiting, KV-cache "
           "usage, preemptions) names the verdict's cause, and its FLOP/byte counters "
           "(vLLM/SGLang --enable-mfu-metrics) replace the inferred ones; without --model it "
           "serves every model"),
    Option("gpu_select", str, "", "which GPUs of --gpu-metrics-url's page (or NVML's) are "
           "this model's: pod=NAME (dcgm-exporter's pod mapping), uuid=GPU-...[|GPU-...], "
           "gpu=INDEX[|INDEX...], joined by ',' (all must hold); empty: every GPU there, "
           "which is right beside one engine (with several models each needs its own)",
           metavar="SELECTOR"),
)


def _in_serve(o: Option) -> Option:
    """A tap option as ``serve --tap-NAME``: its variable stays PHASEWATCH_TAP_NAME."""
    return Option("tap_" + o.name, o.type, o.default, o.help, o.lo, o.hi, o.metavar,
                  o.choices, shown_as=o.shown_as)


SERVE_TAP = tuple(_in_serve(o) for o in IN_PROCESS_TAP)  # ServeConfig.tap's, as tap_NAME


SERVE_OPTIONS = (
    Option("grpc_host", str, "127.0.0.1",
           "address for the phasewatch gRPC receiver (a sidecar shares the pod's network)"),
    Option("grpc_port", int, 50051, "phasewatch gRPC port (0 = pick a free one)", 0, 65535),
    Option("http_host", str, "0.0.0.0", "address for /metrics, health and the JSON API"),
    Option("http_port", int, 9464, "HTTP port for /metrics, /healthz, /readyz, /api/v1 "
           "(0 = pick a free one)", 0, 65535),
    Option("otlp_grpc_host", str, "127.0.0.1", "address for the OTLP/gRPC receiver"),
    Option("otlp_grpc_port", int, 4317, "OTLP/gRPC port (0 = pick a free one)", 0, 65535),
    Option("otlp_http_host", str, "127.0.0.1", "address for the OTLP/HTTP receiver"),
    Option("otlp_http_port", int, 4318, "OTLP/HTTP port, POST /v1/traces (0 = pick a free "
           "one)", 0, 65535),
    Option("max_in_flight", int, 8, "ingest calls decoded at once across all receivers; "
           "past it clients are told to retry (gRPC UNAVAILABLE with RetryInfo, HTTP 503 "
           "with Retry-After)", 1, 1024),
    Option("max_in_flight_mib", float, 256.0, "payload MiB being decoded at once across all "
           "receivers before clients are told to retry", 1, 65536),
    Option("memory_limit_mib", float, 0.0, "resident memory limit: above 0.8 x this every "
           "receiver refuses with its retryable error until memory drops; 0 = 0.8 x the "
           "container's cgroup memory limit when there is one, else none", 0, 1 << 20),
    Option("max_connections", int, 256, "open connections per HTTP port (OTLP/HTTP and "
           "/metrics each); past it a connection gets 503 with Retry-After", 1, 100_000),
    Option("auth_token", str, "", "bearer token every ingest call and /api/v1 request must "
           "carry (Authorization: Bearer TOKEN); /metrics and the probes stay open. Prefer "
           "the PHASEWATCH_AUTH_TOKEN variable from a Secret to the flag (visible in ps); "
           "empty: no authentication"),
    Option("tls_cert_file", str, "", "PEM certificate (chain) every port serves TLS with; "
           "reloaded when the file changes. Empty: plain TCP"),
    Option("tls_key_file", str, "", "PEM private key of --tls-cert-file"),
    Option("tls_client_ca_file", str, "", "PEM CA bundle for mutual TLS: ingest then needs a "
           "client certificate it signed, and so does /api/v1 (/metrics and the probes do "
           "not)"),
    Option("otlp_export_endpoint", str, "", "re-emit each OTLP request as queue/prefill/decode "
           "child spans to this OTLP endpoint (host:port for gRPC, http://.../v1/traces)"),
    Option("default_model", str, "", "model name for spans and tap records that carry none "
           "(vLLM V1); default: the one configured model's label (--served-model-name, else "
           "--model)"),
    Option("otlp_model_map", str, "", "service.name=model pairs, comma-separated, naming "
           "the model of spans by their resource"),
    Option("pod_label", bool, False, "central (gateway) exporter: label series with the pod "
           "each span's resource names (k8s.pod.name, else service.instance.id)"),
    Option("max_pods", int, 64, "cap on distinct pod label values; the rest go to "
           "pod=\"__overflow__\"", 1, 100_000),
    Option("window_seconds", float, 30.0, "rolling window of the JSON API summary", 1, 3600),
    Option("window_capacity", int, 65536,
           "most recent requests kept for window quantiles and the waterfall", 1, 10_000_000),
    Option("max_series", int, 256, "cap on distinct (model, engine) label sets; the rest "
           "go to model=\"__overflow__\"", 2, 100_000),
    Option("prompt_class_label", bool, True, "split TTFT by prompt-length class "
           "(prompt_class, 7 values); false: one TTFT histogram per label set, about 190 "
           "series fewer each (the JSON API and the exporter-source dashboard keep the "
           "classes)"),
    Option("classic_buckets", str, "full", "classic histogram buckets: full, or coarse (only "
           "the 1-2-5 bounds of each family and its top one, about half the bucket series; "
           "percentiles then come from the native histograms, and a TTFT SLO must sit on a "
           "1-2-5 bound)"),
    Option("otlp_join_wait", float, 10.0, "seconds an SGLang request span waits for its "
           "scheduler's stage spans (another process) and its other disaggregated role "
           "before it is counted with what came", 0, 3600),
    Option("trace_join_wait", float, 10.0, "seconds a stream tap's record and the engine's "
           "span of the same request (same traceparent) wait for each other before each "
           "is counted alone; a side waits only while the other is sending (a tap with no "
           "tracing engine behind it is counted at once); 0: no join", 0, 3600),
    Option("trace_join_max_pending", int, 20_000, "cap on rows waiting for their other "
           "side; past it the oldest is counted alone", 1, 10_000_000),
    Option("trace_sample_ratio", float, 1.0, "probability traces were sampled with where the "
           "sampler writes no ot=th in tracestate (a span's own wins): request and token "
           "counters count each request 1/R times, histograms once", MIN_PROBABILITY, 1),
    Option("source_label", bool, False, "label series with source: tap, engine or joined "
           "(who saw the request: the stream tap in front of the engine, the engine, both)"),
    # the stream tap in this process (its records straight to the trace join), or none
    *SERVE_TAP,
    Option("lifecycle_ttl", float, 600.0,
           "seconds before an unfinished streamed request is evicted (counted)", 1, 86400),
    Option("lifecycle_grace", float, 5.0, "seconds a finished streamed request waits for "
           "missing events before it is completed as is", 0, 3600),
    Option("lifecycle_max_pending", int, 100_000, "cap on requests being joined", 1, 10_000_000),
    Option("shutdown_grace", float, 5.0, "seconds in-flight calls get to finish after "
           "SIGTERM before the exporter closes (keep under the pod's "
           "terminationGracePeriodSeconds)", 0, 600),
    Option("grpc_workers", int, 16, "gRPC worker threads per gRPC port (more than "
           "--max-in-flight, so a refusal never waits behind ingest)", 1, 256),
    Option("log_level", str, "info", "debug, info, warning or error"),
    Option("stall_dump", float, 0.0, "seconds the roofline loop may go without coming "
           "round, or an ingest call stay in flight, before every thread's stack is "
           "written to stderr, once per stall (Python's faulthandler, whose watchdog runs "
           "while a thread holds the interpreter): what held a frozen exporter; 0: never",
           0, 3600),
    *MODEL_OPTIONS,
    Option("roofline_interval", float, 2.0, "seconds between roofline/verdict updates "
           "and, on average, between scrapes of --engine-metrics-url and the GPU counters "
           "(each gap drawn within +-50 %: fixed gaps alias with an engine in lock step)",
           0.1, 600),
    # the GPU's own counters beside the estimate
    Option("gpu_metrics_url", str, "", "a dcgm-exporter's /metrics URL (e.g. "
           "http://dcgm-exporter.gpu-operator:9400/metrics): the GPUs' DRAM, tensor and SM "
           "activity over the window, beside the estimate and in the verdict", metavar="URL"),
    Option("gpu_nvml", bool, False, "read the GPU counters through NVML's GPU Performance "
           "Monitoring for the GPUs this process sees (Hopper or newer; needs nvidia-ml-py: "
           "the nvml extra); no GPU, no permission or no support is said once and counted"),
    Option("engine_metrics_timeout", float, 10.0, "seconds an engine /metrics scrape may "
           "take (Prometheus's default scrape_timeout): a saturated engine answers slowly, "
           "and those are the scrapes the cause needs", 0.1, 600),
    Option("history_points", int, 300, "window summaries kept per label set for the "
           "dashboard's time series (one per roofline update)", 2, 100_000),
    Option("slo", str, "", "latency objectives for goodput, as vllm bench serve --goodput "
           "takes them: KEY:VALUE pairs in milliseconds, comma- or space-separated, KEY "
           "ttft, tpot, itl (every token gap) or e2el (e.g. ttft:500,tpot:50); KEY@CLASS:VALUE "
           "replaces one for prompts of a prompt_class (0-256, 257-1k, 1k-4k, 4k-16k, "
           "16k-64k, 64k+ tokens), e.g. ttft:500,ttft@4k-16k:3000; a [[models]] table's slo "
           "replaces it for its model. Empty: no objectives, no goodput"),
)


# ``serve --help`` in sections, the ones a first run sets first. Every option is in
# exactly one (checked below), so a new option cannot be left out of the help.
SERVE_GROUPS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("model and hardware", "what the roofline and the verdict are computed for; several "
     "models: [[models]] tables in --config",
     ("model", "hf_config", "served_model_name", "hardware", "hardware_profile", "gpus",
      "tensor_parallel", "weight_dtype", "kv_dtype", "compute_dtype", "max_batched_tokens",
      "engine_metrics_url", "engine_metrics_timeout", "gpu_select", "roofline_interval")),
    ("the GPU's own counters", "activity the GPUs count themselves, beside the estimate of "
     "what the work needs (docs/verdict.md, \"The GPU's own counters\")",
     ("gpu_metrics_url", "gpu_nvml")),
    ("listeners", "where the exporter receives and serves (0 picks a free port)",
     ("grpc_host", "grpc_port", "otlp_grpc_host", "otlp_grpc_port", "otlp_http_host",
      "otlp_http_port", "http_host", "http_port")),
    ("the stream tap in this process", "time what clients see, in front of the server: "
     "`phasewatch tap`'s options, its records straight to the trace join (--tap-upstream: "
     "none without it)", tuple(o.name for o in SERVE_TAP)),
    ("model names and joins", "how spans are named and joined into requests",
     ("default_model", "otlp_model_map", "otlp_join_wait", "trace_join_wait",
      "trace_join_max_pending", "trace_sample_ratio", "lifecycle_ttl", "lifecycle_grace",
      "lifecycle_max_pending")),
    ("labels and series", "what /metrics carries, and its bounds",
     ("pod_label", "max_pods", "source_label", "max_series", "prompt_class_label",
      "classic_buckets")),
    ("window and history", "what the JSON API and the dashboard read",
     ("window_seconds", "window_capacity", "history_points")),
    ("security", "", ("auth_token", "tls_cert_file", "tls_key_file", "tls_client_ca_file")),
    ("overload", "bounds that keep the exporter up under any load",
     ("max_in_flight", "max_in_flight_mib", "memory_limit_mib", "max_connections",
      "grpc_workers", "shutdown_grace")),
    ("objectives", "latency SLOs, per model and prompt-length class where set: requests "
     "met/missed per objective and goodput, in /metrics and the JSON API", ("slo",)),
    ("output and logging", "", ("otlp_export_endpoint", "log_level", "stall_dump")),
)

if sorted(n for _, _, names in SERVE_GROUPS for n in names) != sorted(
        o.name for o in SERVE_OPTIONS):
    raise RuntimeError("every serve option belongs in exactly one of SERVE_GROUPS")
if sorted(n for _, _, names in TAP_GROUPS for n in names) != sorted(
        o.name for o in TAP_OPTIONS):
    raise RuntimeError("every tap option belongs in exactly one of TAP_GROUPS")

