"""Dashboard refresh: server time per refresh with 10,000 requests in the window.

A real exporter (in this process) holds 10,000 simulated requests in its window,
with its roofline and history up to date. One refresh is what the Dash callback
does: the exporter source's four API calls, the frames, the banner, the cards and
every figure, serialised as Dash sends them. The reference, measured in the same
run, is the bare fetch of the same four JSON answers (bytes, no frames). Prints
the table and writes the rows to bench/results.json under "dashboard".
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path

import plotly.utils

from dashboard.app import page_outputs
from dashboard.exporter_source import PROMPT_POINTS, ExporterSource
from exporter.app import Exporter
from exporter.client import PhasewatchClient
from exporter.config import ServeConfig
from exporter.deployments import ModelOptions
from exporter.sim.scenarios import scenario

ROOT = Path(__file__).resolve().parents[1]
TARGET_MS = 200.0
REQUESTS = 10_000
REPEATS = 20


def fill(ex: Exporter) -> int:
    """Simulated chat traffic until the window holds REQUESTS requests."""
    engine = scenario("chat").build(seed=7, rate_scale=4.0)  # ~24 req/s, below saturation
    records = engine.run(480.0, epoch=time.time() - 480.0)[-REQUESTS:]
    with PhasewatchClient(f"127.0.0.1:{ex.grpc_port}", engine="vllm") as client:
        for r in records:
            client.record_request(r)
        assert client.flush(30)
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


def main() -> int:
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
    p50, p95 = statistics.median(full), sorted(full)[int(0.95 * len(full)) - 1]
    ref = statistics.median(bare)
    row = {"path": f"dashboard refresh, {in_window:,} requests in the window",
           "refresh_ms_p50": p50, "refresh_ms_p95": p95, "target_ms": TARGET_MS,
           "bare_fetch_ms_p50": ref, "ratio_to_bare_fetch": p50 / ref,
           "payload_bytes": size, "requests_sent": n,
           "status": "pass" if p95 <= TARGET_MS else "short"}
    print(f"{'path':46s} {'p50 ms':>7s} {'p95 ms':>7s} {'target':>7s} {'bare fetch ms':>13s} "
          f"{'ratio':>6s}  status")
    print(f"{row['path']:46s} {p50:7.1f} {p95:7.1f} {TARGET_MS:7.0f} {ref:13.1f} "
          f"{row['ratio_to_bare_fetch']:6.2f}  {row['status']}")
    out = ROOT / "bench" / "results.json"
    results = json.loads(out.read_text()) if out.exists() else {}
    results["dashboard"] = [row]
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
