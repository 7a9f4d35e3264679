"""/metrics: the directly rendered hot families equal prometheus_client's, in both formats."""

from __future__ import annotations

import urllib.request

import numpy as np
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as parse_openmetrics,
)
from prometheus_client.parser import text_string_to_metric_families as parse_text

from phasewatch.aggregation.aggregate import Aggregator
from phasewatch.publish.metrics import HotCollector, HotText
from phasewatch.requests.record import BatchBuilder, RequestRecord

T = 1_700_000_000.0
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-"
                     "text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


def _aggregator(pod_label: bool) -> Aggregator:
    agg = Aggregator(pod_label=pod_label)
    rng = np.random.default_rng(1)
    for engine in ("vllm", 'odd "engine"\\'):
        recs = []
        for i in range(300):
            t0 = T + i
            first = t0 + float(rng.uniform(0.01, 3))
            times = [first + 0.01 * k * float(rng.uniform(0.5, 2)) for k in range(i % 7)]
            recs.append(RequestRecord(
                ["Llama-3.1-8B", "model\nwith newline", "m"][i % 3], arrival=t0,
                scheduled=t0 + 0.005, first_token=first, last_token=times[-1] if times else
                first, finish=(times[-1] if times else first) + 0.01,
                prompt_tokens=[10, 900, 5000, 70_000, None][i % 5], cached_prompt_tokens=i % 4,
                output_tokens=len(times) or 1, finish_reason=["stop", "length", "abort"][i % 3],
                token_times=times or None))
        batch = BatchBuilder.from_rows([r.row(engine) for r in recs])
        if pod_label:
            batch.text(pod=[f"pod-{i % 2}" for i in range(len(recs))])
        agg.ingest(batch.build(), "test")
    return agg


def _samples(families) -> dict:
    out = {}
    for fam in families:
        out[(fam.name, fam.type, fam.documentation)] = sorted(
            (s.name, tuple(sorted(s.labels.items())), s.value) for s in fam.samples)
    return out


@pytest.mark.parametrize("pod_label", [False, True])
def test_hot_text_equals_prometheus_client_in_both_formats(pod_label):
    agg = _aggregator(pod_label)
    registry = CollectorRegistry()
    registry.register(HotCollector(agg))
    hot = HotText(agg)
    want = _samples(parse_text(generate_latest(registry).decode()))
    got = _samples(parse_text(hot.render(False).decode()))
    assert got == want
    assert sum(len(v) for v in got.values()) > 1000
    want = _samples(parse_openmetrics(openmetrics.generate_latest(registry).decode()))
    got = _samples(parse_openmetrics(hot.render(True).decode() + "# EOF\n"))
    assert got == want
    assert hot.render(False) == hot.render(False)  # cached label parts reused


def test_metrics_page_serves_the_hot_families_in_every_format(exporter):
    """What Prometheus asks for (OpenMetrics), plain text, and a format HotText does not
    write (through prometheus_client over everything) carry the same samples."""
    from phasewatch.client import PhasewatchClient

    with PhasewatchClient(f"127.0.0.1:{exporter.grpc_port}", engine="vllm") as client:
        for i in range(20):
            client.record("m", arrival=T + i, scheduled=T + i + 0.01, first_token=T + i + 0.1,
                          last_token=T + i + 0.3, finish=T + i + 0.31, output_tokens=3,
                          prompt_tokens=100, token_times=[T + i + 0.1, T + i + 0.2,
                                                          T + i + 0.3])
        assert client.flush(10)
    pages = {}
    for accept in (PROMETHEUS_ACCEPT, "text/plain;version=0.0.4", "",
                   "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8"):
        req = urllib.request.Request(f"http://127.0.0.1:{exporter.http_port}/metrics",
                                     headers={"Accept": accept})
        with urllib.request.urlopen(req, timeout=10) as r:
            ctype, body = r.headers["Content-Type"], r.read().decode()
        parse = parse_openmetrics if ctype.startswith("application/openmetrics") else parse_text
        assert body.count("# EOF") == (1 if parse is parse_openmetrics else 0)
        pages[accept] = _samples(parse(body))
    for accept, samples in pages.items():
        itl = [v for k, v in samples.items() if k[0] == "phasewatch_inter_token_latency_seconds"]
        assert itl and itl[0] == next(v for k, v in pages[""].items()
                                  if k[0] == "phasewatch_inter_token_latency_seconds"), accept
        assert any(k[0] == "process_resident_memory_bytes" for k in samples), accept
