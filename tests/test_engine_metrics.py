"""The engine's own MFU counters: real vLLM/SGLang exposition text, served over HTTP."""

from __future__ import annotations

import http.server
import threading
from pathlib import Path

import pytest

from exporter import catalog
from exporter.bottleneck import with_engine_counters
from exporter.engine_metrics import EngineMetricsSource, EngineRates, parse_page
from exporter.roofline import Deployment, RooflineEstimate, phase_estimate
from exporter.selfstats import SelfStats

FIX = Path(__file__).parent / "fixtures" / "engine"
LLAMA = "meta-llama/Llama-3.1-8B-Instruct"


class Pages:
    """A real HTTP server answering /metrics with the next page of a list."""

    def __init__(self, pages: list[str]):
        self.pages = list(pages)
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                body = owner.pages.pop(0).encode() if owner.pages else b""
                self.send_response(200 if body else 500)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_vllm_page_parses():
    s = parse_page((FIX / "vllm_metrics_t0.txt").read_text(), LLAMA)
    assert (s.flops, s.read_bytes, s.write_bytes, s.running) == (5.8e16, 2.9e15, 1.2e13, 12.0)
    assert parse_page((FIX / "vllm_metrics_t0.txt").read_text(), "other-model").flops is None


def test_sglang_ranks_are_averaged_not_added():
    text = (FIX / "sglang_metrics.txt").read_text()
    two_ranks = text + "\n".join(
        line.replace('tp_rank="0"', 'tp_rank="1"') for line in text.splitlines()
        if line.startswith("sglang:")) + "\n"
    for page in (text, two_ranks):
        s = parse_page(page)
        assert (s.flops, s.read_bytes, s.running) == (1.25e15, 4.5e14, 7.0)


def test_rates_from_two_real_scrapes():
    pages = Pages([(FIX / f"vllm_metrics_t{i}.txt").read_text() for i in (0, 1)])
    now = [1000.0]
    stats = SelfStats()
    src = EngineMetricsSource(pages.url, LLAMA, stats, clock=lambda: now[0])
    try:
        assert src.poll() is not None
        now[0] += 15.0
        assert src.poll() is not None
        assert src.poll() is None  # the server now answers 500: counted, not raised
    finally:
        pages.close()
    r = src.rates(30.0)
    assert r.flops_per_gpu == pytest.approx(3.0e13)
    assert r.bytes_per_gpu == pytest.approx(2.2e12 + 1.0e10)
    assert r.mean_running == pytest.approx(13.0)
    assert stats.get("phasewatch_engine_scrapes_total", url=pages.url, result="ok") == 2
    assert stats.get("phasewatch_engine_scrapes_total", url=pages.url,
                     result="http_error") == 1
    now[0] += 100
    assert src.rates(30.0) is None  # stale samples: back to inference


def test_unreachable_engine_is_counted():
    stats = SelfStats()
    src = EngineMetricsSource("http://127.0.0.1:9/metrics", None, stats, timeout=0.5)
    assert src.poll() is None
    assert stats.get("phasewatch_engine_scrapes_total", url=src.url, result="unreachable") == 1
    with pytest.raises(ValueError, match="http"):
        EngineMetricsSource("localhost:8000/metrics", None, stats)


def test_engine_counters_replace_the_inference_split_by_phase():
    dep = Deployment(LLAMA, catalog.model(LLAMA), catalog.hardware("H100", 2),
                     tensor_parallel=2)
    pre = phase_estimate(dep, 2.0, 3e15, 1e12, 10)
    dec = phase_estimate(dep, 30.0, 1e15, 9e13, 10)
    est = RooflineEstimate("m", "e", 0.0, 30.0, 1.0, 10, pre, dec, 10.0, 0.008,
                           {"queue": 0.0, "prefill": 0.1, "decode": 0.9},
                           {"decode_steps": "token_gaps"})
    rates = EngineRates(seconds=30.0, flops_per_gpu=1e14, bytes_per_gpu=2e12, mean_running=12)
    out = with_engine_counters(est, dep, rates)
    total_flops = 1e14 * 2 * 30.0  # per GPU x tensor-parallel GPUs x range
    assert out.prefill.flops == pytest.approx(total_flops * 0.75)
    assert out.decode.flops == pytest.approx(total_flops * 0.25)
    assert out.decode.bytes == pytest.approx(2e12 * 2 * 30.0 * 9e13 / (9e13 + 1e12))
    assert out.decode.source == out.prefill.source == "engine_counters"
    assert out.decode.flops_utilization == pytest.approx(
        out.decode.flops / 30.0 / dep.peak_flops)
    assert out.decode_batch_size == pytest.approx(12.0)
    assert out.inputs["flops"] == out.inputs["bytes"] == "engine_counters"
    assert out.inputs["decode_batch"] == "engine_num_requests_running"
