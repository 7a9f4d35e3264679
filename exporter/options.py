"""Every ``phasewatch serve`` option, once: name, type, default, help and bounds
(``SERVE_OPTIONS``), and the sections ``serve --help`` shows them in (``SERVE_GROUPS``).
``config`` reads them from the file, the environment and the flags; the CLI builds its
flags from them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from phasewatch.requests.sampling import MIN_PROBABILITY


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

if sorted(n for _, _, names in SERVE_GROUPS for n in names) != sorted(
        o.name for o in SERVE_OPTIONS):
    raise RuntimeError("every serve option belongs in exactly one of SERVE_GROUPS")
