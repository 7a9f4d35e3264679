"""Exporter configuration: defaults, a TOML file, ``PHASEWATCH_*`` variables, then flags.

Later sources win. Every key has one definition here (name, type, default, help);
the CLI builds its flags from the same table, so file keys, environment variables
and flags cannot drift apart. Bad values fail at start with the fix in the message.
"""

from __future__ import annotations

import argparse
import math
import os
import tomllib
from dataclasses import dataclass, field, fields
from typing import Any

from phasewatch.requests.objectives import ObjectivesByModel, parse_objectives
from phasewatch.requests.sampling import MIN_PROBABILITY
from phasewatch.roofline.deployments import ModelOptions
from phasewatch.transport.admission import container_memory_limit


@dataclass(frozen=True)
class Option:
    name: str
    type: type
    default: Any
    help: str
    lo: float | None = None
    hi: float | None = None


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
    Option("tap_upstream", str, "", "run the stream tap in this process in front of this "
           "OpenAI-compatible server (http://127.0.0.1:8000): its records go straight to the "
           "trace join; empty: no tap (or run `phasewatch tap` apart)"),
    Option("tap_host", str, "127.0.0.1", "address the in-process tap listens on (0.0.0.0 "
           "for a Service to reach it)"),
    Option("tap_port", int, 8001, "port of the in-process tap (0: a free one)", 0, 65535),
    Option("tap_engine", str, "tap", "engine label of the in-process tap's records: name "
           "the server (vllm, sglang, tgi) so tap-only and joined requests share it"),
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
    # The served model and its hardware, for the roofline and the verdict. Several
    # models: [[models]] tables in the config file with these keys.
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
    Option("roofline_interval", float, 2.0, "seconds between roofline/verdict updates "
           "and between scrapes of --engine-metrics-url", 0.1, 600),
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
# ModelOptions' fields that are also serve options (their flags fill model_flags); a
# [[models]] table also takes ``slo``, the model's own --slo
MODEL_KEYS = tuple(f.name for f in fields(ModelOptions) if f.name != "slo")
TABLE_KEYS = (*MODEL_KEYS, "slo")


@dataclass(frozen=True)
class ServeConfig:
    grpc_host: str = "127.0.0.1"
    grpc_port: int = 50051
    http_host: str = "0.0.0.0"
    http_port: int = 9464
    otlp_grpc_host: str = "127.0.0.1"
    otlp_grpc_port: int = 4317
    otlp_http_host: str = "127.0.0.1"
    otlp_http_port: int = 4318
    max_in_flight: int = 8
    max_in_flight_mib: float = 256.0
    memory_limit_mib: float = 0.0
    max_connections: int = 256
    auth_token: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_client_ca_file: str = ""
    otlp_export_endpoint: str = ""
    default_model: str = ""
    otlp_model_map: str = ""
    pod_label: bool = False
    max_pods: int = 64
    window_seconds: float = 30.0
    window_capacity: int = 65536
    max_series: int = 256
    prompt_class_label: bool = True
    classic_buckets: str = "full"
    otlp_join_wait: float = 10.0
    trace_join_wait: float = 10.0
    trace_join_max_pending: int = 20_000
    trace_sample_ratio: float = 1.0
    source_label: bool = False
    tap_upstream: str = ""
    tap_host: str = "127.0.0.1"
    tap_port: int = 8001
    tap_engine: str = "tap"
    lifecycle_ttl: float = 600.0
    lifecycle_grace: float = 5.0
    lifecycle_max_pending: int = 100_000
    shutdown_grace: float = 5.0
    grpc_workers: int = 16
    log_level: str = "info"
    roofline_interval: float = 2.0
    engine_metrics_timeout: float = 10.0
    history_points: int = 300
    slo: str = ""
    model_flags: ModelOptions = field(default_factory=ModelOptions)  # --model, ... flags
    models: tuple[ModelOptions, ...] = ()  # [[models]] tables of the config file

    def memory_limit_bytes(self) -> int:
        """--memory-limit-mib, or 0.8 x the container's limit when it is 0 (0: none)."""
        if self.memory_limit_mib:
            return int(self.memory_limit_mib * (1 << 20))
        return int(container_memory_limit() * 0.8)

    def service_models(self) -> dict[str, str]:
        """--otlp-model-map parsed: service.name -> model."""
        out = {}
        for pair in filter(None, (p.strip() for p in self.otlp_model_map.split(","))):
            service, sep, model = pair.partition("=")
            if not sep or not service.strip() or not model.strip():
                raise ConfigError(f"otlp_model_map: {pair!r} is not service.name=model")
            out[service.strip()] = model.strip()
        return out

    def model_options(self) -> list[ModelOptions]:
        """Every configured model: the file's [[models]] and the --model flags."""
        flags = self.model_flags
        return [*self.models, *([flags] if flags.model or flags.hf_config else [])]

    def objectives(self, labels: list[str]) -> ObjectivesByModel:
        """--slo, and each model's own ``slo`` by its label (``labels``: the model label
        of each of ``model_options()``, in order)."""
        return ObjectivesByModel(parse_objectives(self.slo), {
            label: parse_objectives(o.slo)
            for o, label in zip(self.model_options(), labels, strict=True) if o.slo})


# Every option is a ServeConfig field, except the model keys, which fill model_flags;
# their defaults are ModelOptions' own.
assert [f.name for f in fields(ServeConfig)][:-2] == [
    o.name for o in SERVE_OPTIONS if o.name not in MODEL_KEYS]
assert all(o.default == getattr(ModelOptions(), o.name) for o in SERVE_OPTIONS
           if o.name in MODEL_KEYS)
_BY_NAME = {o.name: o for o in SERVE_OPTIONS}
CLASSIC_BUCKETS = ("full", "coarse")


class ConfigError(ValueError):
    pass


class ListenError(OSError):
    """A listener could not bind its address; the message names the listener, the
    address and the flag that moves it."""


def _coerce(option: Option, value: Any, source: str) -> Any:
    try:
        if option.type is int and isinstance(value, float) and not value.is_integer():
            raise ValueError
        v = _boolean(value) if option.type is bool else option.type(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: {option.name} must be {option.type.__name__}, "
                          f"got {value!r}") from None
    if option.type in (int, float) and (
            not math.isfinite(v) or
            (option.lo is not None and v < option.lo) or (option.hi is not None and v > option.hi)):
        raise ConfigError(f"{source}: {option.name} must be between {option.lo:g} and "
                          f"{option.hi:g}, got {v!r}")
    if option.name == "log_level" and v.lower() not in ("debug", "info", "warning", "error"):
        raise ConfigError(f"{source}: log_level must be debug, info, warning or error, "
                          f"got {value!r}")
    return v


def _boolean(value: Any) -> bool:
    text = str(value).strip().lower()  # True and False too ("true", "false")
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError


# ``serve --help`` in sections, the ones a first run sets first. Every option is in
# exactly one (checked below), so a new option cannot be left out of the help.
SERVE_GROUPS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("model and hardware", "what the roofline and the verdict are computed for; several "
     "models: [[models]] tables in --config",
     ("model", "hf_config", "served_model_name", "hardware", "hardware_profile", "gpus",
      "tensor_parallel", "weight_dtype", "kv_dtype", "compute_dtype", "max_batched_tokens",
      "engine_metrics_url", "engine_metrics_timeout", "roofline_interval")),
    ("listeners", "where the exporter receives and serves (0 picks a free port)",
     ("grpc_host", "grpc_port", "otlp_grpc_host", "otlp_grpc_port", "otlp_http_host",
      "otlp_http_port", "http_host", "http_port")),
    ("the stream tap in this process", "time what clients see, in front of the server",
     ("tap_upstream", "tap_host", "tap_port", "tap_engine")),
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
    ("output and logging", "", ("otlp_export_endpoint", "log_level")),
)

if sorted(n for _, _, names in SERVE_GROUPS for n in names) != sorted(_BY_NAME):
    raise RuntimeError("every serve option belongs in exactly one of SERVE_GROUPS")


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE",
                        help="TOML file with any of the keys below (env: PHASEWATCH_CONFIG)")
    for title, description, names in SERVE_GROUPS:
        group = parser.add_argument_group(title, description or None)
        for name in names:
            o = _BY_NAME[name]
            flag = "--" + o.name.replace("_", "-")
            default = "none" if o.default == "" else str(o.default).lower() \
                if isinstance(o.default, bool) else o.default
            group.add_argument(flag, dest=o.name, default=None, metavar=o.type.__name__.upper(),
                               help=f"{o.help} (default {default}; "
                                    f"env PHASEWATCH_{o.name.upper()})")


def load_serve_config(args: argparse.Namespace | None = None,
                      environ: dict[str, str] | None = None) -> ServeConfig:
    """Merge defaults < config file < PHASEWATCH_* environment < command-line flags."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {o.name: o.default for o in SERVE_OPTIONS}
    slo_source = "slo"  # where the value checked last came from, for its error
    path = getattr(args, "config", None) or environ.get("PHASEWATCH_CONFIG")
    models: tuple[ModelOptions, ...] = ()
    if path:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
        top = data
        if not isinstance(top.get("serve", top), dict):
            raise ConfigError(f"config file {path}: `serve` must be a table ([serve])")
        data = dict(top.get("serve", top))
        tables = data.pop("models", None)
        if tables is None and "serve" in top:
            tables = top.get("models")  # [[models]] beside a [serve] table
        models = _model_tables(tables or [], path)
        unknown = sorted(set(data) - set(_BY_NAME))
        if unknown:
            raise ConfigError(f"config file {path}: unknown keys {unknown}; known keys: "
                              f"{', '.join(_BY_NAME)}")
        for k, v in data.items():
            values[k] = _coerce(_BY_NAME[k], v, path)
        if "slo" in data:
            slo_source = f"config file {path}: slo"
    for o in SERVE_OPTIONS:
        env = environ.get(f"PHASEWATCH_{o.name.upper()}")
        if env is not None:
            values[o.name] = _coerce(o, env, f"PHASEWATCH_{o.name.upper()}")
            slo_source = "PHASEWATCH_SLO" if o.name == "slo" else slo_source
        flag = getattr(args, o.name, None) if args is not None else None
        if flag is not None:
            values[o.name] = _coerce(o, flag, "--" + o.name.replace("_", "-"))
            slo_source = "--slo" if o.name == "slo" else slo_source
    if values["classic_buckets"] not in CLASSIC_BUCKETS:
        raise ConfigError(f"classic_buckets must be one of {', '.join(CLASSIC_BUCKETS)}, not "
                          f"{values['classic_buckets']!r}")
    if values["lifecycle_grace"] > values["lifecycle_ttl"]:
        raise ConfigError("lifecycle_grace must not exceed lifecycle_ttl")
    _check_slo(values["slo"], slo_source)
    flags = ModelOptions(**{k: values.pop(k) for k in MODEL_KEYS})
    return ServeConfig(**values, model_flags=flags, models=models)


def _model_tables(tables: Any, path: str) -> tuple[ModelOptions, ...]:
    """The config file's [[models]] array of tables, each with MODEL_KEYS."""
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise ConfigError(f"config file {path}: `models` must be an array of tables "
                          "([[models]])")
    out = []
    for i, table in enumerate(tables):
        unknown = sorted(set(table) - set(TABLE_KEYS))
        if unknown:
            raise ConfigError(f"config file {path}: [[models]] #{i + 1}: unknown keys "
                              f"{unknown}; known keys: {', '.join(TABLE_KEYS)}")
        where = f"{path} [[models]] #{i + 1}"
        if "slo" in table:
            if not isinstance(table["slo"], str):
                raise ConfigError(f"config file {where}: slo must be a string of KEY:VALUE "
                                  f"pairs (\"ttft:500,tpot:50\"), got {table['slo']!r}")
            _check_slo(table["slo"], f"config file {where}: slo")
        out.append(ModelOptions(**{k: _coerce(_BY_NAME[k], v, where)
                                   for k, v in table.items()}))
    return tuple(out)


def _check_slo(text: str, source: str) -> None:
    """Objectives parsed at start: the first bad pair, named with where it came from."""
    try:
        parse_objectives(text)
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None
