"""Dashboard refresh: server time per refresh with 10,000 requests in the window.

A real exporter (in this process) holds 10,000 simulated requests in its window,
with its roofline and history up to date. One refresh is what the Dash callback
does: the exporter source's four API calls, the frames, the banner, the cards and
every figure, serialised as Dash sends them. The reference, measured in the same
run, is the bare fetch of the same four JSON answers (bytes, no frames).
"""

from __future__ import annotations

import json
import statistics
import time
import urllib.request

import plotly.utils

from bench.common import Row
from phasewatch.app import Exporter
from phasewatch.client import PhasewatchClient
from phasewatch.config import ServeConfig
from phasewatch.dashboard.app import page_outputs
from phasewatch.dashboard.exporter_source import PROMPT_POINTS, ExporterSource
from phasewatch.roofline.deployments import ModelOptions
from phasewatch.sim.scenarios import scenario

TARGET_MS = 200.0
REQUESTS = 10_000
REPEATS = 20


def fill(ex: Exporter) -> int:
    """Simulated chat traffic until the window holds REQUESTS requests."""
    engine = scenario("chat").build(seed=7, rate_scale=4.0)  # ~24 req/s, below saturation
    records = engine.run(480.0, epoch=time.time() - 480.0)[-REQUESTS:]
    # all at once: buffer room for every request and its token times
    with PhasewatchClient(f"127.0.0.1:{ex.grpc_port}", engine="vllm",
                          max_buffer_tokens=10**8) as client:
        for r in records:
            client.record_request(r)
        assert client.flush(30)
        assert client.stats["accepted"] == len(records), client.stats
    ex.monitor.update()
    for _ in range(150):  # a full history, as after five minutes of running
        ex.history.record(ex.aggregator.window.summary(ex.aggregator.labels.pairs()))
    return len(records)


def bare_fetch(base: str) -> None:
    for path in ("/api/v1/summary", "/api/v1/roofline", "/api/v1/history?seconds=600",
                 f"/api/v1/requests?limit={PROMPT_POINTS}"):
        with urllib.request.urlopen(base + path, timeout=10) as r:
            r.read()


def refresh(source: ExporterSource) -> int:
    started = time.perf_counter()
    snap = source.fetch()
    assert snap.error is None, snap.error
    outputs = page_outputs(snap, started=started)
    return len(json.dumps(outputs, cls=plotly.utils.PlotlyJSONEncoder))


def timed(fn, *args) -> list[float]:
    fn(*args)  # warm up
    out = []
    for _ in range(REPEATS):
        t = time.perf_counter()
        fn(*args)
        out.append((time.perf_counter() - t) * 1000)
    return out


def dashboard_row() -> Row:
    config = ServeConfig(grpc_port=0, http_port=0, otlp_grpc_port=0, otlp_http_port=0,
                         http_host="127.0.0.1", window_seconds=300, roofline_interval=600,
                         model_flags=ModelOptions(model="Llama-3.1-8B", hardware="H100-SXM"))
    with Exporter(config) as ex:
        n = fill(ex)
        base = f"http://127.0.0.1:{ex.http_port}"
        in_window = ex.aggregator.window.summary(ex.aggregator.labels.pairs())["models"][0][
            "requests_in_window"]
        source = ExporterSource(base)
        full = timed(refresh, source)
        bare = timed(bare_fetch, base)
        size = refresh(source)
    return Row("dashboard", f"dashboard refresh server time, {in_window:,} requests, p95",
               sorted(full)[int(0.95 * len(full)) - 1], "ms", TARGET_MS, "lower",
               statistics.median(bare), "bare fetch of the same four JSON answers",
               extra={"p50_ms": statistics.median(full), "payload_bytes": size,
                      "requests_sent": n})


if __name__ == "__main__":
    print(dashboard_row().as_json())
