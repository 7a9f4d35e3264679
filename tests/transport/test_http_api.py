"""HTTP: /metrics gzip, health, readiness and the JSON API."""

import gzip
import json
import urllib.error
import urllib.request

import pytest

from phasewatch.client import PhasewatchClient
from phasewatch.sim.scenarios import scenario


def get(port, path, headers=None):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers or {})
    return urllib.request.urlopen(req, timeout=10)


@pytest.fixture
def loaded(exporter):
    records = scenario("chat").build(seed=4).run(15.0)
    with PhasewatchClient(f"127.0.0.1:{exporter.grpc_port}", engine="vllm") as c:
        for r in records:
            c.record_request(r)
        assert c.flush(20)
    return exporter, records


def test_metrics_gzip_when_asked(loaded):
    exporter, _ = loaded
    with get(exporter.http_port, "/metrics", {"Accept-Encoding": "gzip"}) as r:
        assert r.headers["Content-Encoding"] == "gzip"
        text = gzip.decompress(r.read()).decode()
    assert "gen_ai_server_time_to_first_token_seconds_bucket" in text
    with get(exporter.http_port, "/metrics") as r:
        assert r.headers.get("Content-Encoding") is None


def test_health_and_readiness(exporter):
    assert get(exporter.http_port, "/healthz").status == 200
    assert get(exporter.http_port, "/readyz").status == 200


def test_summary_and_requests(loaded):
    exporter, records = loaded
    with get(exporter.http_port, "/api/v1/summary") as r:
        s = json.load(r)
    (m,) = s["models"]
    assert m["model"] == "Llama-3.1-8B" and m["engine"] == "vllm"
    assert m["requests_in_window"] == len(records)
    assert m["output_tokens_per_second"] > 0
    assert m["ttft_seconds"]["p50"] <= m["ttft_seconds"]["p99"]
    assert 0.004 < m["itl_seconds"]["p50"] < 0.02  # an 8B model on an H100 decodes in ~8 ms
    shares = m["phase_time_share"]
    # null: a phase this server does not report (vLLM is not disaggregated: no transfer)
    assert shares["kv_transfer"] is None and shares["preprocess"] is not None
    assert sum(v for v in shares.values() if v is not None) == pytest.approx(1.0)
    assert shares["decode"] > 0.5
    with get(exporter.http_port, "/api/v1/requests?limit=5") as r:
        rows = json.load(r)["requests"]
    assert len(rows) == 5
    assert {"queue", "prefill", "decode", "ttft", "prompt_tokens"} <= set(rows[0])
    with get(exporter.http_port, "/api/v1/requests?model=nope") as r:
        assert json.load(r)["requests"] == []


@pytest.mark.parametrize("path,code", [("/api/v1/summary?window=abc", 400),
                                       ("/api/v1/requests?limit=0", 400),
                                       ("/api/v1/nothing", 404)])
def test_bad_api_calls_get_a_clear_error(exporter, path, code):
    with pytest.raises(urllib.error.HTTPError) as e:
        get(exporter.http_port, path)
    assert e.value.code == code
    assert "error" in json.load(e.value)


def test_means_and_the_vllm_bench_layout(loaded):
    """The summary has each latency's mean beside p50/p90/p95/p99 (vLLM's benchmark
    prints mean, median and p99); /api/v1/bench lays the window out as `vllm bench
    serve` prints a run, with the same figures, computed here from the records with
    vLLM's own definitions (np.mean / np.percentile over requests; ITL pooled)."""
    import numpy as np

    exporter, records = loaded
    with get(exporter.http_port, "/api/v1/summary") as r:
        (m,) = json.load(r)["models"]
    ttft = [x.first_token - x.arrival for x in records]
    tpot = [(x.last_token - x.first_token) / (x.output_tokens - 1) for x in records
            if x.output_tokens > 1]
    e2e = [x.finish - x.arrival for x in records]
    itl = [float(g) for x in records for g in np.diff(x.token_times)]
    for name, values in (("ttft", ttft), ("tpot", tpot), ("e2e", e2e)):
        got = m[f"{name}_seconds"]
        assert got["count"] == len(values)
        # 1 us: the records' float epoch seconds travel as integer ns
        assert got["mean"] == pytest.approx(np.mean(values), abs=1e-6)
        for q in (50, 90, 99):
            assert got[f"p{q}"] == pytest.approx(np.percentile(values, q), abs=1e-6)
    assert m["itl_seconds"]["count"] == len(itl)
    assert m["itl_seconds"]["mean"] == pytest.approx(np.mean(itl), abs=1e-6)
    assert m["prompt_tokens_in_window"] == sum(x.prompt_tokens for x in records)
    assert m["output_tokens_in_window"] == sum(x.output_tokens for x in records)

    with get(exporter.http_port, "/api/v1/bench") as r:
        (b,) = json.load(r)["models"]
    lines = dict(line.split(":", 1) for line in b["text"].splitlines() if ":" in line)
    assert b["text"].startswith("============ Serving Benchmark Result ============")
    assert int(lines["Successful requests"]) == len(records)
    assert float(lines["Mean TTFT (ms)"]) == pytest.approx(np.mean(ttft) * 1000, abs=0.006)
    assert float(lines["Median TTFT (ms)"]) == pytest.approx(np.median(ttft) * 1000,
                                                             abs=0.006)
    assert float(lines["P99 TPOT (ms)"]) == pytest.approx(np.percentile(tpot, 99) * 1000,
                                                          abs=0.006)
    assert float(lines["Mean E2EL (ms)"]) == pytest.approx(np.mean(e2e) * 1000, abs=0.006)
    assert float(lines["Mean ITL (ms)"]) == pytest.approx(np.mean(itl) * 1000, abs=0.006)
    for row in ("Total input tokens", "Total generated tokens", "Request throughput (req/s)",
                "Output token throughput (tok/s)", "P90 ITL (ms)"):
        assert row in lines


def test_a_client_that_hangs_up_mid_answer_leaves_no_traceback(tmp_path):
    """Issue 37: the demo's terminal showed a BrokenPipeError traceback when the
    dashboard gave up on a slow JSON answer. Clients that send a request and hang up
    before reading its answer (reset, as a timed-out client's close often is, or closed
    plainly), on every kind of page: no traceback on the exporter's stderr, and it
    serves on."""
    import socket
    import struct
    import time

    from tests.support.serve import ServeProcess

    serve = ServeProcess(tmp_path).start()
    try:
        for path in ("/metrics", "/api/v1/summary", "/api/v1/requests?limit=5000",
                     "/api/v1/roofline", "/api/v1/history", "/api/v1/bench"):
            for reset in (True, True, False):
                s = socket.create_connection(("127.0.0.1", serve.http_port), timeout=5)
                if reset:  # close sends RST: the server's read or write fails
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
                s.close()
        time.sleep(1.0)  # the server's threads answer (and meet the hang-ups) meanwhile
        with get(serve.http_port, "/healthz") as r:
            assert r.status == 200
    finally:
        serve.stop()
    log = serve.log_path.read_text()
    assert "Traceback" not in log and "Exception occurred" not in log, log
