"""TGI v3.3.7's span chain, as its source builds it, against the fed ground truth.

TGI cannot run here (Rust, a GPU, no wheel): ``tests/engines/tgi_spans.py`` emits the
spans its code would, per its README (file and line for each shape fact). Each export
goes to a real exporter over OTLP/gRPC or OTLP/HTTP, as TGI's router would send it
(gRPC only, in fact: HTTP shows the same bytes read the same way).
"""

from __future__ import annotations

import json
import urllib.request

import grpc
import numpy as np
import pytest

from phasewatch.roofline import catalog
from phasewatch.roofline.estimate import Deployment
from phasewatch.roofline.inputs import InputSource
from tests.conftest import scrape
from tests.support import FIXTURES

FIXTURE = FIXTURES / "otlp" / "engines" / "tgi-3.3.7-from-source"
EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
NS = 1e9
US = 1e-6


def _send(exporter, transport: str, data: bytes) -> None:
    if transport == "grpc":
        with grpc.insecure_channel(f"127.0.0.1:{exporter.otlp_grpc_port}") as ch:
            ch.unary_unary(EXPORT)(data, timeout=10)
        return
    req = urllib.request.Request(f"http://127.0.0.1:{exporter.otlp_http_port}/v1/traces",
                                 data=data, method="POST",
                                 headers={"Content-Type": "application/x-protobuf"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200


@pytest.mark.parametrize("transport", ["grpc", "http"])
@pytest.mark.parametrize("scenario", ["chunking", "no_chunking"])
def test_every_request_with_its_first_token_and_token_times(exporter, scenario, transport):
    truth = json.loads((FIXTURE / "truth.json").read_text())["scenarios"][scenario]
    for path in sorted(FIXTURE.glob(f"{scenario}-export-*.pb")):
        _send(exporter, transport, path.read_bytes())
    want = truth["requests"].values()
    n = len(want)
    s = scrape(exporter.http_port)
    assert s.total("phasewatch_requests_total", engine="tgi") == n
    assert s.value("phasewatch_otlp_spans_total", protocol=f"otlp_{transport}",
                   outcome="rejected") is None
    assert s.value("phasewatch_ingest_dropped_total", reason="child_spans_unclaimed") is None

    def hist(name: str, **labels) -> tuple[float, float]:
        return (s.total(f"{name}_count", engine="tgi", **labels),
                s.total(f"{name}_sum", engine="tgi", **labels))

    ttft = sum(r["first_token_ns"] - r["arrival_ns"] for r in want) / NS
    assert hist("gen_ai_server_time_to_first_token_seconds") == pytest.approx((n, ttft),
                                                                              abs=n * US)
    # finish from TGI's own total_time, which starts after chat templating (exact to its
    # Duration string's microseconds)
    e2e = sum(r["finish_ns"] - r["arrival_ns"] for r in want) / NS
    assert hist("gen_ai_server_request_duration_seconds") == pytest.approx((n, e2e),
                                                                           abs=n * 2 * US)
    decode = sum(r["last_token_ns"] - r["first_token_ns"] for r in want) / NS
    assert hist("phasewatch_phase_duration_seconds", phase="decode") == pytest.approx(
        (n, decode), abs=n * US)
    # scheduled is the ``queued`` span's end: it closes a microsecond after the batch
    # takes the request (the model of TGI's span lifetimes in tgi_spans.py)
    prefill = sum(r["first_token_ns"] - r["scheduled_ns"] for r in want) / NS
    assert hist("phasewatch_phase_duration_seconds", phase="prefill") == pytest.approx(
        (n, prefill), abs=n * 2 * US)
    # arrival -> scheduled splits into preprocess (templating, validation) and the queue
    pre_n, pre = hist("phasewatch_phase_duration_seconds", phase="preprocess")
    queue_n, queue = hist("phasewatch_phase_duration_seconds", phase="queue")
    assert pre_n == queue_n == n
    assert pre + queue == pytest.approx(
        sum(r["scheduled_ns"] - r["arrival_ns"] for r in want) / NS, abs=n * 2 * US)
    assert queue == pytest.approx(sum(float(r["queue_s"]) for r in want), abs=n * 20 * US)
    gaps = sum(len(r["token_times_ns"]) - 1 for r in want)
    gap_sum = sum(r["token_times_ns"][-1] - r["token_times_ns"][0] for r in want) / NS
    assert hist("phasewatch_inter_token_latency_seconds") == pytest.approx(
        (gaps, gap_sum), abs=gaps * US)
    assert s.total("phasewatch_tokens_total", engine="tgi", kind="output") == sum(
        r["generated_tokens"] for r in want)


def test_generated_text_is_never_kept(exporter):
    """``send_generation`` carries every token's text (and the prompt on some routes):
    nothing of it may reach /metrics or the JSON API."""
    truth = json.loads((FIXTURE / "truth.json").read_text())
    for path in sorted(FIXTURE.glob("*-export-*.pb")):
        _send(exporter, "grpc", path.read_bytes())
    base = f"http://127.0.0.1:{exporter.http_port}"
    pages = [urllib.request.urlopen(f"{base}{p}", timeout=10).read().decode()
             for p in ("/metrics", "/api/v1/requests?limit=100", "/api/v1/summary",
                       "/api/v1/status")]
    for canary in truth["canaries_never_to_store"]:
        assert all(canary not in page for page in pages), canary


@pytest.mark.parametrize("scenario", ["chunking", "no_chunking"])
def test_decode_steps_give_the_roofline_a_real_batch(scenario):
    """Each decode step's sharded-client ``decode{size}`` span is the engine's own batch:
    phasewatch keeps one step per decode step of the truth with its forward's size, and
    the roofline takes its decode batch from them (not from overlapping requests)."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    from phasewatch.aggregation.aggregate import Aggregator
    from phasewatch.ingest.otlp.ingest import OtlpIngest
    from phasewatch.roofline.estimate import estimate

    truth = json.loads((FIXTURE / "truth.json").read_text())["scenarios"][scenario]
    agg = Aggregator()
    ingest = OtlpIngest(agg)
    for path in sorted(FIXTURE.glob(f"{scenario}-export-*.pb")):
        ingest.export(ExportTraceServiceRequest.FromString(path.read_bytes()), "otlp_grpc")
    steps = agg.window.steps()
    want = [st for st in truth["steps"] if st["kind"] == "decode"]
    assert want and len(steps.size) == len(want)
    order = np.argsort(steps.start)
    assert steps.size[order].tolist() == [len(st["forward_requests"]) for st in want]
    for got_start, got_end, st in zip(steps.start[order], steps.end[order], want,
                                      strict=True):
        assert st["start_ns"] / NS <= got_start < got_end <= st["forward_end_ns"] / NS + US
    dep = Deployment("Llama-3.1-8B", catalog.model("Llama-3.1-8B"),
                     catalog.hardware("H100-SXM"))
    est = estimate(agg.window.columns(), dep, 30.0, "m", "tgi", steps)
    assert est.inputs["decode_batch"] == InputSource("engine_decode_steps")
    # TGI sends no prompt tokens, so no decode bytes, but the batch is the engine's own
    # over the estimator's range: each step weighted by its share inside it
    lo, hi = est.range_start, est.range_end
    w = [max(0.0, min(hi, st["forward_end_ns"] / NS) - max(lo, st["start_ns"] / NS))
         / ((st["forward_end_ns"] - st["start_ns"]) / NS) for st in want]
    assert sum(w) > 0
    mean = sum(wi * len(st["forward_requests"]) for wi, st in zip(w, want, strict=True)) / sum(w)
    assert est.decode_batch_size == pytest.approx(mean, rel=0.02)
