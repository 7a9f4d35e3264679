"""``phasewatch serve`` on free ports, and the log lines that say which it bound: read by
``tests/support/serve.py`` and by ``tests/engines/gpu_tap_check.py``, which runs in a model's
Python that may lack pytest (so nothing here imports it)."""

PATTERNS = {
    "grpc_port": r"phasewatch gRPC receiver on [^:]+:(\d+)",
    "http_port": r"metrics on https?://[^:]+:(\d+)/metrics",
    "otlp_grpc_port": r"OTLP/gRPC receiver on [^:]+:(\d+)",
    "otlp_http_port": r"OTLP/HTTP on https?://[^:]+:(\d+)/v1/traces",
}
TAP_PATTERN = r"stream tap on http://[^:]+:(\d+)"
FREE = ("--grpc-port", "0", "--http-port", "0", "--otlp-grpc-port", "0",
        "--otlp-http-port", "0", "--http-host", "127.0.0.1")
